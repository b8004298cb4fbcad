"""W-REAL (benchmarks/w_real.py) at its tiny size on the tests' tiny Llama instead of SmolLM2 (``--model-dir``), with
a stand-in ``llama-batched-bench`` that prints jsonl rows the way the real one does: the run covers every engine
and batch size, its figures are consistent, and what cannot run is skipped with a reason. Speed is never asserted."""

from __future__ import annotations

import json
import stat
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ lives at the repository root, beside asyncllm/
    sys.path.insert(0, str(ROOT))

from benchmarks import w_real  # noqa: E402

FAKE_BENCH = '''#!{python}
"""Stands in for llama.cpp's llama-batched-bench: log lines and one jsonl row per -npl value."""
import json, sys
args = sys.argv[1:]
if "--version" in args:
    print("version: 0.0.0-test (build 1, commit abc1234)", file=sys.stderr)
    sys.exit(0)
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
get = lambda flag: args[args.index(flag) + 1]
pp, tg = int(get("-npp")), int(get("-ntg"))
print("llama_model_loader: loaded meta data", file=sys.stderr)
print("main: n_kv_max = " + get("-c"))
for pl in map(int, get("-npl").split(",")):
    t_pp, t_tg = 1e-4 * pl * pp, 2e-4 * pl * tg
    print(json.dumps({{"n_kv_max": int(get("-c")), "n_batch": int(get("-b")), "n_ubatch": int(get("-ub")),
                      "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": int(get("-t")),
                      "n_threads_batch": int(get("-t")), "pp": pp, "tg": tg, "pl": pl, "n_kv": pl * (pp + tg),
                      "t_pp": t_pp, "speed_pp": pl * pp / t_pp, "t_tg": t_tg, "speed_tg": pl * tg / t_tg,
                      "t": t_pp + t_tg, "speed": pl * (pp + tg) / (t_pp + t_tg)}}))
'''


def _fake_llamacpp(root: Path) -> Path:
    """A llama.cpp tree in ``root`` whose only build output is the stand-in; returns the file of its calls."""
    tree = root / "llama_cpp_python-0.0.1" / "vendor" / "llama.cpp"
    (tree / "build" / "bin").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("raise SystemExit('not used')\n")
    calls = root / "calls.jsonl"
    exe = tree / "build" / "bin" / "llama-batched-bench"
    exe.write_text(FAKE_BENCH.format(python=sys.executable, calls=str(calls)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return calls


def test_tiny_run_covers_every_engine_and_batch(llama_dir, tmp_path):
    calls = _fake_llamacpp(tmp_path / "llamacpp")
    gguf = tmp_path / "model-f32.gguf"
    gguf.write_bytes(b"GGUF")  # only the stand-in reads it
    out = tmp_path / "w_real.json"
    tiny = [a for a in w_real.SIZES["tiny"] if a != "--skip-transformers"]  # transformers too: the greedy check
    code = w_real.main([*tiny, "--model-dir", str(llama_dir), "--threads", "1", "--work-dir", str(tmp_path / "work"),
                        "--llamacpp-dir", str(tmp_path / "llamacpp"), "--gguf-f32", str(gguf), "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "W-REAL" and r["workload"]["batches"] == [1, 2]
    # no machine paths in a report meant to be committed: folders outside the checkout and home by name only
    assert r["args"]["llamacpp_dir"] == ".../llamacpp" and str(tmp_path) not in json.dumps(r)
    prompt_len, gen_len = r["workload"]["prompt_len"], r["workload"]["gen_len"]
    assert (prompt_len, gen_len) == (16, 8)
    res = r["results"]
    assert list(res) == list(w_real.ENGINES)
    for name in (w_real.ASYNCLLM_F32, w_real.ASYNCLLM_INT8, w_real.LLAMACPP_F32, w_real.TRANSFORMERS):
        e = res[name]
        assert e["status"] == "ok", (name, e["error"] or e["reason"])
        assert sorted(e["batches"]) == ["1", "2"]
        if not name.startswith("llamacpp"):
            assert e["memory"]["peak_rss_delta_mb"] is not None
        for key, f in e["batches"].items():
            b = int(key)
            assert f["batch"] == b and f["seconds"] > 0 and len(f["wall_s"]) == 1
            assert f["tokens_per_s"] == pytest.approx(b * gen_len / f["seconds"])
            assert f["total_tokens_per_s"] == pytest.approx(b * (prompt_len + gen_len) / f["seconds"])
            assert f["prefill_s"] is not None and 0 < f["prefill_s"] <= f["seconds"]
            if not name.startswith("llamacpp"):
                assert f["length_mismatches"] == 0
    assert res[w_real.ASYNCLLM_INT8]["llm_kwargs"]["quantization"] == "int8"
    assert res[w_real.ASYNCLLM_BF16]["llm_kwargs"]["dtype"] == "bfloat16"
    for name in (w_real.ASYNCLLM_Q8, w_real.ASYNCLLM_Q8_BF16, w_real.LLAMACPP_Q8):  # no Q8_0 file with --model-dir
        assert res[name]["status"] == "skipped" and "--gguf-q8_0" in res[name]["reason"]

    llama = res[w_real.LLAMACPP_F32]
    assert llama["batches"]["2"]["seconds"] == pytest.approx(llama["batches"]["2"]["jsonl"][0]["t"])
    assert llama["batches"]["2"]["decode_s"] == pytest.approx(llama["batches"]["2"]["jsonl"][0]["t_tg"])
    assert llama["settings"]["n_threads"] == 1 and r["versions"]["llama_cpp"].endswith("commit abc1234)")
    assert llama["command"][0] == "llama-batched-bench"  # no machine path
    assert r["versions"]["llama_cpp_source"] == "llama_cpp_python-0.0.1 (vendor/llama.cpp)"
    f32_b2, llama_b2 = res[w_real.ASYNCLLM_F32]["batches"]["2"], llama["batches"]["2"]
    assert f32_b2["decode_tokens_per_s"] == pytest.approx(2 * (gen_len - 1) / f32_b2["decode_s"])
    assert llama_b2["decode_tokens_per_s"] == pytest.approx(2 * gen_len / llama_b2["decode_s"])
    assert llama_b2["prefill_tokens_per_s"] == pytest.approx(2 * prompt_len / llama_b2["prefill_s"])
    invocations = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(invocations) == 2  # the warm-up and one timed run
    timed = invocations[-1]
    for flag, value in (("-npl", "1,2"), ("-npp", "16"), ("-ntg", "8"), ("-t", "1"), ("-b", "2048"),
                        ("-ub", "512"), ("--output-format", "jsonl"), ("-m", str(gguf))):
        assert timed[timed.index(flag) + 1] == value
    assert int(timed[timed.index("-c") + 1]) >= 2 * (16 + 8)

    comps = {(c["engine"], c["peer"], c["batch"]): c for c in r["comparisons"]}
    f32, peer = res[w_real.ASYNCLLM_F32]["batches"], llama["batches"]
    for b in ("1", "2"):
        c = comps[(w_real.ASYNCLLM_F32, w_real.LLAMACPP_F32, int(b))]
        assert c["time_ratio"] == pytest.approx(f32[b]["seconds"] / peer[b]["seconds"])
        assert c["throughput_ratio"] == pytest.approx(f32[b]["tokens_per_s"] / peer[b]["tokens_per_s"])
    target = r["targets"]["asyncllm-f32 vs llamacpp-f32"]
    assert target["time_ratio_B1"] == pytest.approx(comps[("asyncllm-f32", "llamacpp-f32", 1)]["time_ratio"])
    assert r["targets"]["asyncllm-q8_0 vs llamacpp-q8_0"] == {"time_ratio_B1": None, "throughput_ratio_B2": None}
    assert isinstance(r["greedy_equal"], bool)
    assert set(r["greedy_check"]["common_prefix_with_asyncllm_f32"]) == {"asyncllm-bf16", "asyncllm-int8",
                                                                         "transformers"}
    assert r["machine"]["loadavg_start"] is not None and r["machine"]["threads"] == 1
    assert r["command"][:3] == ["python", "-m", "benchmarks.w_real"]


def test_rounds_take_turns_and_pool_each_engines_runs(llama_dir, tmp_path):
    calls = _fake_llamacpp(tmp_path / "llamacpp")
    gguf = tmp_path / "model-f32.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "w_real.json"
    code = w_real.main([*w_real.SIZES["tiny"], "--engines", "asyncllm-f32,llamacpp-f32", "--rounds", "2",
                        "--repeats", "2", "--model-dir", str(llama_dir), "--threads", "1",
                        "--work-dir", str(tmp_path / "work"), "--llamacpp-dir", str(tmp_path / "llamacpp"),
                        "--gguf-f32", str(gguf), "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["workload"]["rounds"] == 2
    invocations = [json.loads(line) for line in calls.read_text().splitlines()]
    # per round and batch size (the round's passes): the warm-up and two timed runs, at that size only
    assert [args[args.index("-npl") + 1] for args in invocations] == ["1"] * 3 + ["2"] * 3 + ["1"] * 3 + ["2"] * 3
    for name in ("asyncllm-f32", "llamacpp-f32"):
        e = r["results"][name]
        assert e["status"] == "ok" and e["rounds"] == 2
        for f in e["batches"].values():
            assert len(f["wall_s"]) == 4 and f["seconds"] == pytest.approx(statistics.median(f["wall_s"]))
            assert 0 < f["prefill_s"] <= max(f["wall_s"])
    llama = r["results"]["llamacpp-f32"]["batches"]["2"]
    assert len(llama["t_pp"]) == 4 and llama["decode_s"] == pytest.approx(statistics.median(llama["t_tg"]))
    assert len(r["results"]["asyncllm-f32"]["batches"]["1"]["prefill_runs"]) == 4


def test_without_llamacpp_its_engines_are_skipped_with_a_reason(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = w_real.main(["--engines", "llamacpp-f32,llamacpp-q8_0", "--model-dir", str(llama_dir),
                        "--llamacpp-dir", str(tmp_path / "none"), "--batches", "1", "--json", str(out)])
    assert code == 1  # nothing measured
    res = json.loads(out.read_text())["results"]
    for e in res.values():
        assert e["status"] == "skipped" and "--build-llamacpp" in e["reason"]
    assert "SKIPPED" in capsys.readouterr().out


def test_building_llamacpp_needs_cmake_and_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(w_real.shutil, "which", lambda name: None)
    with pytest.raises(w_real.Unavailable, match="cmake"):
        w_real.build_llamacpp(tmp_path, 2)
    assert not any(tmp_path.iterdir())  # nothing downloaded


def test_prompts_and_batched_bench_helpers():
    a = w_real.make_prompts(8, 128, 49152)
    assert a == w_real.make_prompts(8, 128, 49152) and len({tuple(p) for p in a}) == 8
    assert all(len(p) == 128 and min(p) >= 17 and max(p) < 49152 for p in a)
    assert a[0] != w_real.make_prompts(1, 128, 49152)[0]  # batch sizes do not share prompts
    assert w_real.batched_bench_ctx([1, 8, 32], 128, 128) == 8192
    text = 'log line\n{"pl": 1, "t": 0.5, "t_pp": 0.1}\n{not json}\n{"other": 1}\n  {"pl": 8, "t": 1.0}  \n'
    assert [r["pl"] for r in w_real.parse_jsonl(text)] == [1, 8]
    tree = Path("/nonexistent-w-real")
    assert w_real.find_llamacpp_tree(tree) is None


def test_the_suite_runner_can_drive_it(tmp_path):
    """Shaped like the suite's workloads: ``SIZES``, ``main(argv)``, ``--json`` and ``--model-dir``."""
    from benchmarks import __main__ as runner

    for size in ("full", "quick", "tiny"):
        args = w_real.parse_args(runner.workload_argv("w_real", w_real, size, tmp_path, "/some/model"))
        assert args.json == str(tmp_path / "w_real.json") and args.model_dir == "/some/model"
    tiny = w_real.parse_args(w_real.SIZES["tiny"])
    assert tiny.batches == [1, 2] and w_real.TRANSFORMERS not in tiny.engines and not tiny.build_llamacpp
    full = w_real.parse_args([])
    assert (full.batches, full.prompt_len, full.gen_len, full.repeats) == ([1, 8, 32], 128, 128, 1)


def test_llamacpp_is_built_for_the_cpus_instruction_sets_with_amx_off():
    """Native detection would turn AMX on where cpuinfo lists it, and llama.cpp then dies with SIGILL
    where the kernel did not grant the tile state: the build names each instruction set instead."""
    from benchmarks.w_real import llamacpp_isa_flags

    cpuinfo = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8\n"
    flags = llamacpp_isa_flags(cpuinfo)
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags
    assert "-DGGML_AVX512_BF16=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags
