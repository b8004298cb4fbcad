"""The worker processes of tensor parallelism, and rank 0's handle on them.

Rank 0 is the engine's own process: it keeps the scheduler, the sampler and the streams, and
before every model step broadcasts the step record (``engine/step_input.py``) to the other ranks,
which run the same step on their shard; the model's collectives keep them in lockstep. Transport
and rendezvous are torch.distributed's (gloo on CPU, NCCL on CUDA; ``tcp://`` on loopback for one
machine, ``env://`` with ``MASTER_ADDR``/``MASTER_PORT`` across machines).

Workers are started as fresh interpreters (``python -m asyncllm.distributed.workers``), not with
multiprocessing: that would re-run the user's main module in every worker. They end with the
engine: on a stop message, when a collective with rank 0 fails (its socket closed), or when their
parent process disappears. A worker that dies makes rank 0's next collective fail; the engine then
reports EngineDeadError to every open stream and does not restart (``healthy`` is False).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import EngineConfig
from ..errors import ConfigError, ModelLoadError
from .parallel import TensorParallel

logger = logging.getLogger(__name__)

# A collective waits at most this long; idle ranks exchange a keep-alive well within it.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
KEEPALIVE_S = 300.0
_STOP_GRACE_S = 10.0
_active_group: "WorkerGroup | None" = None  # torch.distributed has one default group per process


def distributed_backend(config: EngineConfig) -> str:
    """The platform's choice (``asyncllm/platform.py``) for the engine's device."""
    from ..platform import distributed_backend as backend_for, resolve_device

    return backend_for(resolve_device(config.device))


def ranks_on_node(config: EngineConfig, node_rank: int) -> range:
    """The global ranks one node runs (node 0 holds rank 0, the engine)."""
    per_node = config.tensor_parallel_size // config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rendezvous(config: EngineConfig) -> str:
    """The init method: a free loopback port on one machine, ``env://`` across machines."""
    if config.nnodes == 1:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ConfigError(f"nnodes={config.nnodes}: set {name} (rank 0's address and a free port) on every "
                              "node before starting it (docs/scaling.md)")
    return "env://"


def _threads_per_rank(config: EngineConfig) -> int | None:
    """CPU ranks on one machine share its cores: each gets its part (busy-waiting OpenMP threads
    of several processes on the same cores would slow every step down)."""
    if distributed_backend(config) != "gloo":
        return None
    per_node = config.tensor_parallel_size // config.nnodes
    return max(1, (os.cpu_count() or 1) // per_node)


def spawn_worker(config: EngineConfig, rank: int, init_method: str) -> subprocess.Popen:
    """Start global rank ``rank`` as a fresh interpreter; its arguments travel on stdin."""
    payload = base64.b64encode(pickle.dumps({
        "config": config, "rank": rank, "init_method": init_method,
        "backend": distributed_backend(config), "threads": _threads_per_rank(config)}))
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # importable even from a source checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen([sys.executable, "-m", "asyncllm.distributed.workers"], stdin=subprocess.PIPE,
                               env=env)
    process.stdin.write(payload)
    process.stdin.close()
    return process


def _init_group(backend: str, init_method: str, rank: int, size: int,
                watch: list[subprocess.Popen] = ()) -> None:
    """``init_process_group``, failing early when a local worker exits before joining."""
    import torch.distributed as dist

    failure: list[BaseException] = []
    joined = threading.Event()

    def join() -> None:
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=COLLECTIVE_TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)
        finally:
            joined.set()

    threading.Thread(target=join, name="asyncllm-tp-join", daemon=True).start()
    while not joined.wait(0.2):
        for process in watch:
            if process.poll() is not None:
                raise ModelLoadError(f"a tensor-parallel worker exited with status {process.returncode} before "
                                     "joining the process group (its log is above)")
    if failure:
        raise ModelLoadError(f"tensor-parallel rendezvous at {init_method} failed: {failure[0]}") from failure[0]


class WorkerGroup:
    """Rank 0's side: starts the local workers, broadcasts steps, stops them."""

    def __init__(self, config: EngineConfig, hf_config, max_model_len: int) -> None:
        """``hf_config``/``max_model_len``: the model's configuration as rank 0 resolved it, handed to
        every rank (none reads it again)."""
        global _active_group
        import torch.distributed as dist

        if _active_group is not None or dist.is_initialized():
            raise ConfigError("tensor_parallel_size > 1: one tensor-parallel engine per process at a time "
                              "(close the other engine first)")
        self.size = config.tensor_parallel_size
        self.tp = TensorParallel(0, self.size, config.enable_expert_parallel)
        self._lock = threading.Lock()  # one broadcast (and the step's collectives) at a time
        self._sent_adapters: dict[int, Any] = {}
        self._last_message = time.monotonic()
        self._closed = False
        self.failure: str | None = None
        init_method = rendezvous(config)
        threads = _threads_per_rank(config)
        self._host_threads = torch.get_num_threads()  # given back on close
        if threads is not None:
            torch.set_num_threads(threads)
        self.processes = [spawn_worker(config, rank, init_method) for rank in ranks_on_node(config, 0)[1:]]
        try:
            logger.info("tensor parallelism: waiting for %d ranks at %s", self.size, init_method)
            _init_group(distributed_backend(config), init_method, 0, self.size, self.processes)
            _active_group = self
            self._broadcast(("config", (config, hf_config, max_model_len)))
        except BaseException:
            self._kill()
            torch.set_num_threads(self._host_threads)
            raise
        self._keepalive = threading.Thread(target=self._keep_alive, name="asyncllm-tp-keepalive", daemon=True)
        self._keepalive.start()

    # ---- messages ----------------------------------------------------------------------------------------
    def _broadcast(self, message) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0)
        self._last_message = time.monotonic()

    def share(self, value):
        """Send ``value`` to every worker (the KV block count, decided by rank 0)."""
        with self._lock:
            self._broadcast(("value", value))
        return value

    @contextlib.contextmanager
    def step(self, step) -> Iterator[None]:
        """Broadcast a step record, then hold the group while rank 0 runs the step (its collectives
        must not interleave with a keep-alive). Adapter weights travel once per adapter, then by id.
        Any failure inside a step leaves the ranks out of lockstep: the group is then broken for good."""
        self.check()
        with self._lock:
            try:
                new_adapters = {}
                ids = []
                for lora in step.loras:
                    if lora is not None and self._sent_adapters.get(lora.adapter_id) is not lora:
                        new_adapters[lora.adapter_id] = self._sent_adapters[lora.adapter_id] = lora
                    ids.append(None if lora is None else lora.adapter_id)
                self._broadcast(("step", dataclasses.replace(step, loras=ids), new_adapters))
                yield
            except BaseException as exc:
                self.failure = f"tensor-parallel step failed, the ranks are out of step ({exc!r})"
                self.check_processes()
                raise RuntimeError(self.failure) from exc

    def check(self) -> None:
        """Raise if the group is broken or a local worker has exited (its exit status named)."""
        self.check_processes()
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def check_processes(self) -> None:
        """Name a local worker that has exited in ``failure``."""
        for rank, process in zip(range(1, self.size), self.processes):
            if process.poll() is not None:
                self.failure = f"tensor-parallel worker rank {rank} exited with status {process.returncode}"
                return

    @property
    def healthy(self) -> bool:
        try:
            self.check()
        except RuntimeError:
            return False
        return True

    def _keep_alive(self) -> None:
        """Idle workers wait inside a collective, which times out: send them a no-op now and then."""
        while not self._closed:
            time.sleep(min(KEEPALIVE_S, 5.0))
            if self._closed or time.monotonic() - self._last_message < KEEPALIVE_S or self.failure:
                continue
            if self._lock.acquire(timeout=1.0):
                try:
                    self._broadcast(("noop",))
                except BaseException as exc:  # noqa: BLE001 - the next step reports it
                    self.failure = f"a tensor-parallel worker is gone ({exc})"
                finally:
                    self._lock.release()

    # ---- shutdown ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after a grace period) and leave the group."""
        global _active_group
        if self._closed:
            return
        self._closed = True
        if self.failure is None and self._lock.acquire(timeout=_STOP_GRACE_S):
            try:
                self._broadcast(("stop",))
            except BaseException:  # noqa: BLE001 - workers already gone: killed below
                pass
            finally:
                self._lock.release()
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        _leave_group()
        _active_group = None
        torch.set_num_threads(self._host_threads)

    def _kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - a broken group: nothing more to release
            logger.debug("destroy_process_group failed", exc_info=True)


# ---- the worker side --------------------------------------------------------------------------------------
def _exit_with_parent() -> None:
    """End this worker when the process that started it is gone (killed without a stop message)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="asyncllm-tp-parent", daemon=True).start()


def _receive():
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _receive_expected(kind: str):
    """The payload of rank 0's next message, which must be of ``kind``."""
    message = _receive()
    if message[0] != kind:
        raise RuntimeError(f"tensor-parallel worker expected {kind!r} from rank 0, got {message[0]!r}")
    return message[1]


def receive_value():
    """A worker's side of :meth:`WorkerGroup.share`."""
    return _receive_expected("value")


def run_worker(rank: int, size: int, local_rank: int, init_method: str, backend: str, threads: int | None) -> None:
    """One worker rank: join the group, take rank 0's engine arguments, load the shard, then run
    every step rank 0 broadcasts until told to stop."""
    from ..model.runner import ModelRunner
    from ..model.source import resolve_model_source

    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":  # NCCL binds a rank to the current device: make it this rank's GPU first
        torch.cuda.set_device(local_rank)
    _init_group(backend, init_method, rank, size)
    # rank 0's engine arguments and its resolved model configuration: every rank runs the same engine
    config, hf_config, max_model_len = _receive_expected("config")
    if backend == "nccl":
        config = dataclasses.replace(config, device=f"cuda:{local_rank}")
    source = resolve_model_source(config.model, config.revision, config.hf_token)
    runner = ModelRunner(config, hf_config, source, max_model_len,
                         tp=TensorParallel(rank, config.tensor_parallel_size, config.enable_expert_parallel),
                         agree_num_blocks=lambda _own_count: receive_value())  # rank 0 decides
    adapters: dict[int, Any] = {}
    while True:
        message = _receive()
        if message[0] == "stop":
            break
        if message[0] == "step":
            _, step, new_adapters = message
            adapters.update(new_adapters)
            step.loras = [None if i is None else adapters[i] for i in step.loras]
            runner.execute(step)
    _leave_group()


def main() -> None:
    """``python -m asyncllm.distributed.workers`` (started by rank 0 or by ``run_worker_node``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(levelname)s %(name)s: %(message)s")
    payload = pickle.loads(base64.b64decode(sys.stdin.buffer.read()))
    _exit_with_parent()
    config: EngineConfig = payload["config"]
    try:
        local_rank = payload["rank"] % (config.tensor_parallel_size // config.nnodes)
        run_worker(payload["rank"], config.tensor_parallel_size, local_rank, payload["init_method"],
                   payload["backend"], payload["threads"])
    except BaseException as exc:  # noqa: BLE001 - rank 0 sees the closed connection; say why here
        logger.error("tensor-parallel worker rank %d ends: %r", payload["rank"], exc)
        os._exit(1)
    # skip the interpreter's teardown: collective backends' native threads can abort the process
    # there ("terminate called without an active exception"), turning a clean stop into a crash status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker_node(config: EngineConfig) -> int:
    """A node other than 0 of a multi-node engine (``asyncllm serve ... --node-rank K``): start this
    node's ranks, wait for them to end, return the exit status (0 when every rank ended cleanly)."""
    if not 0 < config.node_rank < config.nnodes:
        raise ConfigError(f"node_rank must be in 1..{config.nnodes - 1} for a worker node, got {config.node_rank}")
    init_method = rendezvous(config)
    processes = [spawn_worker(config, rank, init_method) for rank in ranks_on_node(config, config.node_rank)]
    statuses = [process.wait() for process in processes]
    return max(statuses, key=abs)


if __name__ == "__main__":
    main()
