"""Run the benchmark suite (the workloads of docs/benchmarks.md) in one go.

    python -m benchmarks [--quick] [--only w_cpu,w_prefix,...] [--out benchmarks/results] [--plots docs/img]
    asyncllm bench ...        (the same, from a source checkout)

Runs each workload module's ``main(argv)`` in this process, one after the other, with ``--json <out>/<name>.json``
(and ``--model-dir`` when given) plus the module's arguments for the chosen size (its ``SIZES`` dict: ``full``,
``quick`` or ``tiny``); then writes ``<out>/summary.json`` and ``<out>/summary.md`` (the markdown tables) and one PNG
per workload into ``--plots``. A workload that fails is reported and the suite carries on.
Modules written elsewhere are picked up when present: ``w_json`` (W-JSON), and ``w_gpu`` (W-GPU) on CUDA only,
which takes ``--out <folder>`` instead of ``--json`` and writes ``<folder>/w_gpu.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.measure import write_report

HERE = Path(__file__).resolve().parent
WORKLOADS = ("w_cpu", "w_prefix", "w_latency", "w_lora", "w_scale", "w_stream", "w_json", "w_gpu")
OPTIONAL = ("w_json", "w_gpu")       # written by others: run when the module exists
# Sizes for modules without a SIZES dict of their own.
DEFAULT_SIZES = {
    "w_gpu": {"full": [], "quick": ["--scale", "0.25"], "tiny": ["--smoke"]},
    "w_json": {"full": [], "quick": ["--requests", "8", "--repeats", "1"],
               "tiny": ["--requests", "2", "--repeats", "1", "--max-tokens", "16"]},
}


def skip_reason(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if importlib.util.find_spec(f"benchmarks.{name}") is None:
        return "module not present" if name in OPTIONAL else "module missing"
    if name == "w_gpu":
        import torch

        if not torch.cuda.is_available():
            return "needs CUDA"
    return None


def workload_argv(name: str, module: Any, size: str, out_dir: Path, model_dir: str | None) -> list[str]:
    sizes = getattr(module, "SIZES", None) or DEFAULT_SIZES.get(name, {})
    extra = list(sizes.get(size, []))
    if name == "w_gpu":  # its own interface: a folder, and its own model
        return ["--out", str(out_dir), *extra]
    return ["--json", str(out_dir / f"{name}.json"), *extra, *(["--model-dir", model_dir] if model_dir else [])]


def run_one(name: str, size: str, out_dir: Path, model_dir: str | None) -> dict[str, Any]:
    """Run one workload's ``main``; never raises."""
    entry: dict[str, Any] = {"status": "ok"}
    json_path = out_dir / f"{name}.json"
    json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's result
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        entry["argv"] = workload_argv(name, module, size, out_dir, model_dir)
        ret = module.main(entry["argv"])
        if isinstance(ret, int) and ret != 0:
            entry["status"] = f"exit {ret}"
    except SystemExit as e:  # argparse errors and explicit exits
        if e.code not in (0, None):
            entry["status"] = f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 - report and carry on with the next workload
        traceback.print_exc()
        entry["status"] = f"error: {type(e).__name__}: {e}"
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    entry["json"] = json_path.name if json_path.is_file() else None  # beside summary.json
    gc.collect()  # drop the workload's engines before the next one
    return entry


def git_state() -> dict[str, Any]:
    """The checkout's commit and whether its working tree had changes (the figures belong to that code)."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True, timeout=10).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip() or None,
                "dirty_files": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty_files": None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_const", const="quick", dest="size",
                   help="smaller workloads (a few minutes in all); the same as --size quick")
    p.add_argument("--size", choices=["full", "quick", "tiny"],
                   help="full (BENCHMARKS.md sizes), quick, or tiny (a smoke test, e.g. with a test checkpoint)")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON results (default: %(default)s)")
    p.add_argument("--plots", default=str(HERE.parent / "docs" / "img"),
                   help="folder for the PNG plots, '' for none (default: %(default)s)")
    p.add_argument("--model-dir", help="checkpoint for the CPU workloads instead of the cached cpu-llama")
    args = p.parse_args(argv)
    args.size = args.size or "full"
    names = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.names = [n for n in WORKLOADS if n in names]
    return args


def print_summary(summary: dict[str, Any]) -> None:
    print("\n== benchmark suite summary ==")
    for name, entry in summary["workloads"].items():
        detail = entry.get("reason") or (entry.get("json") or "no JSON written")
        print(f"  {name:<10} {entry['status']:<12} {entry.get('seconds', 0):>7.1f}s  {detail}")
    load = summary["machine"]
    print(f"  load average: start {load['loadavg_start']}, end {load['loadavg_end']}")
    for path in summary["plots"]:
        print(f"  plot: {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.common import machine_info
    from benchmarks.measure import loadavg, utc_now

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"date": utc_now(), "size": args.size, "git": git_state(), "workloads": {},
                               "plots": [], "machine": {**machine_info(), "loadavg_start": loadavg()}}
    runnable = [(n, skip_reason(n)) for n in args.names]
    todo = [n for n, why in runnable if why is None]
    for name, why in runnable:
        summary["workloads"][name] = {"status": "skipped", "reason": why} if why else {"status": "not run"}
    for i, name in enumerate(todo, 1):
        print(f"\n== [{i}/{len(todo)}] {name} ({args.size}) ==", flush=True)
        entry = {"date": utc_now(), "size": args.size, "loadavg_start": loadavg()}
        entry.update(run_one(name, args.size, out, args.model_dir), loadavg_end=loadavg())
        summary["workloads"][name] = entry
        print(f"== [{i}/{len(todo)}] {name}: {entry['status']} in {entry['seconds']:.0f}s ==", flush=True)
    summary["workloads"] = _merged(out, summary["workloads"])
    summary["machine"]["loadavg_end"] = loadavg()
    _write_outputs(args, out, summary)
    print_summary(summary)
    failed = [n for n in args.names if summary["workloads"][n]["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


def _merged(out: Path, current: dict[str, Any]) -> dict[str, Any]:
    """This run's entries, plus those of earlier runs into the same folder whose JSON is still there (a run with
    --only keeps the others' record), in suite order."""
    try:
        previous = json.loads((out / "summary.json").read_text()).get("workloads", {})
    except (OSError, ValueError):
        previous = {}
    kept = {n: e for n, e in previous.items() if n not in current and e.get("json") and (out / e["json"]).is_file()}
    both = {**kept, **current}
    return {n: both[n] for n in WORKLOADS if n in both}


def _write_outputs(args: argparse.Namespace, out: Path, summary: dict[str, Any]) -> None:
    """Plots and markdown tables of every workload JSON in ``out`` (not only this run's), then summary.json."""
    from benchmarks.tables import markdown

    if args.plots:
        try:
            from benchmarks.plots import make_plots

            summary["plots"] = [str(p.resolve()) for p in make_plots(out, args.plots, names=list(WORKLOADS))]
        except Exception as e:  # noqa: BLE001 - matplotlib missing, say: the figures are in the JSON anyway
            print(f"plots: not made ({type(e).__name__}: {e})", file=sys.stderr)
    (out / "summary.md").write_text(markdown(out))
    write_report(out / "summary.json", summary)  # checkout paths made relative (the file is committed)


if __name__ == "__main__":
    sys.exit(main())
