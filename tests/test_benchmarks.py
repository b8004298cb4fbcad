"""The benchmark suite (benchmarks/) at a tiny size on the tests' tiny llama: it runs, its numbers are consistent
with each other and with the workloads, its JSON has the fields, its plots and tables are written.
Speed is never asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ lives at the repository root, beside asyncllm/
    sys.path.insert(0, str(ROOT))

from benchmarks import __main__ as runner  # noqa: E402
from benchmarks import tables, w_lora  # noqa: E402
from benchmarks.common import w_cpu_workload  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    kv_utilization_summary, latency_report, reset_prefix_cache, summarize_ms,
)
from benchmarks.w_prefix import prefix_workload  # noqa: E402

MINE = ("w_cpu", "w_prefix", "w_latency", "w_lora", "w_scale", "w_stream")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def suite(llama_dir, tmp_path_factory) -> dict:
    """One tiny run of the whole suite through the runner (python -m benchmarks --size tiny)."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(w_lora, "DEFAULT_CACHE_DIR", out / "cache")  # adapters of the tiny model stay in tmp
        code = runner.main(["--size", "tiny", "--only", ",".join(MINE), "--model-dir", str(llama_dir),
                            "--out", str(out / "results"), "--plots", str(out / "img")])
    reports = {name: json.loads((out / "results" / f"{name}.json").read_text()) for name in MINE}
    return {"code": code, "out": out, "reports": reports, "model_dir": llama_dir}


def _vocab(model_dir: Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_runner_summary_tables_and_plots(suite):
    assert suite["code"] == 0
    results = suite["out"] / "results"
    summary = json.loads((results / "summary.json").read_text())
    assert summary["size"] == "tiny"
    assert [n for n in summary["workloads"]] == list(MINE)
    assert all(summary["workloads"][n]["status"] == "ok" for n in MINE)
    assert len(summary["machine"]["loadavg_start"]) == 3 and "cpu_model" in summary["machine"]
    for name in MINE:
        png = suite["out"] / "img" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert str(png) in summary["plots"]  # outside the checkout: as given
        assert summary["workloads"][name]["json"] == f"{name}.json"
    tables = (results / "summary.md").read_text()
    for title in ("W-CPU", "W-PREFIX", "W-LATENCY", "W-LORA", "W-SCALE", "W-STREAM"):
        assert f"### {title}\n" in tables


def test_a_partial_rerun_keeps_the_other_workloads_in_the_summary(suite, tmp_path):
    import shutil

    results = tmp_path / "results"
    shutil.copytree(suite["out"] / "results", results)
    before = json.loads((results / "summary.json").read_text())["workloads"]
    assert runner.main(["--size", "tiny", "--only", "w_latency", "--model-dir", str(suite["model_dir"]),
                        "--out", str(results), "--plots", ""]) == 0
    after = json.loads((results / "summary.json").read_text())
    assert list(after["workloads"]) == list(MINE)
    assert after["workloads"]["w_cpu"] == before["w_cpu"]
    assert after["workloads"]["w_latency"]["date"] >= before["w_latency"]["date"]
    assert after["git"]["commit"]


def test_tables_fill_the_marked_sections_of_a_doc(suite, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# x\n<!-- results:machine -->\nold\n<!-- /results:machine -->\ntext\n"
                   "<!-- results:w_prefix -->\n<!-- /results:w_prefix -->\n<!-- results:w_json -->\nkept\n"
                   "<!-- /results:w_json -->\n")
    assert tables.update_doc(doc, suite["out"] / "results") == ["machine", "w_prefix"]
    text = doc.read_text()
    assert "old" not in text and "load average" in text and "| prefix-cache |" in text
    assert "<!-- results:w_json -->\nkept\n" in text  # no JSON for it: left alone


def test_w_cpu_counts_ratios_and_latency(suite):
    r = suite["reports"]["w_cpu"]
    workload = w_cpu_workload(_vocab(suite["model_dir"]), scale=0.06)
    assert r["workload"]["output_tokens"] == workload.output_tokens
    assert r["workload"]["num_requests"] == len(workload.requests)
    res = r["results"]
    assert set(res) == {"asyncllm", "hf-static", "hf-continuous"}
    roof = r["roofline"]["roofline_tokens_per_s"]
    for name, e in res.items():
        assert e["status"] == "ok", e["error"]
        assert e["generated_tokens"] == workload.output_tokens and e["length_mismatches"] == 0
        assert e["timed_tokens"] == workload.output_tokens
        assert e["tokens_per_s"] == pytest.approx(workload.output_tokens / e["median_wall_s"])
        assert e["roofline_share"] == pytest.approx(e["tokens_per_s"] / roof)
        assert e["ratio_to_hf_static"] == pytest.approx(e["tokens_per_s"] / res["hf-static"]["tokens_per_s"])
        assert e["ratio_to_hf_continuous"] == pytest.approx(e["tokens_per_s"] / res["hf-continuous"]["tokens_per_s"])
        assert e["ttft_ms"]["count"] == len(workload.requests)
        assert e["itl_ms"]["count"] == workload.output_tokens - len(workload.requests)
        assert 0 < e["ttft_ms"]["p50"] <= e["ttft_ms"]["p99"] <= 1000 * e["median_wall_s"]
        assert e["memory"]["peak_rss_delta_mb"] is not None and e["memory"]["method"]
    assert all(run["prefix_cache_reset"] for run in res["asyncllm"]["runs"])
    assert 0 < res["asyncllm"]["kv_utilization"]["weighted"] <= 1
    assert set(r["latency_measurement"]) >= {"asyncllm", "hf-static", "hf-continuous", "definition"}
    assert r["roofline"]["matmul_gflops"] == 100  # pinned by the tiny size
    assert r["machine"]["loadavg_start"] is not None


def test_w_prefix_modes_hits_and_ratios(suite):
    r = suite["reports"]["w_prefix"]
    workload = prefix_workload(_vocab(suite["model_dir"]), scale=0.2)
    n = len(workload.requests)
    prefix_len = r["workload"]["prefix_len"]
    assert all(req.prompt_token_ids[:prefix_len] == workload.requests[0].prompt_token_ids[:prefix_len]
               for req in workload.requests)
    assert len({tuple(req.prompt_token_ids) for req in workload.requests}) == n  # distinct suffixes
    cached, uncached = r["results"]["prefix-cache"], r["results"]["no-cache"]
    for e in (cached, uncached):
        assert e["generated_tokens"] == workload.output_tokens
        assert e["ttft_ms"]["count"] == n * len(e["wall_s"])
        assert e["tokens_per_s"] == pytest.approx(workload.output_tokens / e["median_wall_s"])
    assert cached["prefix_cache_hit_tokens"] > 0 and uncached["prefix_cache_hit_tokens"] == 0
    assert r["ttft_p50_ratio"] == pytest.approx(uncached["ttft_ms"]["p50"] / cached["ttft_ms"]["p50"])
    assert r["throughput_ratio"] == pytest.approx(cached["tokens_per_s"] / uncached["tokens_per_s"])
    assert "shared prefix" in r["warmup"]


def test_w_latency_counts(suite):
    r = suite["reports"]["w_latency"]
    w = r["workload"]
    assert r["tokens_received"] == w["requests"] * w["output_len"]
    assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0 and r["engine_decode_step_ms"]["p50"] > 0
    assert r["delivery_overhead_ms_p50"] == pytest.approx(r["itl_ms"]["p50"] - r["engine_decode_step_ms"]["p50"],
                                                          abs=2e-3)


def test_w_lora_ratio_and_latency(suite):
    r = suite["reports"]["w_lora"]
    assert r["lora_vs_base"] == pytest.approx(r["lora_tokens_per_s"] / r["base_tokens_per_s"], abs=2e-3)
    out_tokens = r["workload"]["output_tokens"]
    for mode in ("base", "lora"):
        assert r["latency"][mode]["timed_tokens"] == out_tokens
        assert r["latency"][mode]["ttft_ms"]["count"] == r["workload"]["num_requests"] * len(r["runs"][mode])
    assert list((suite["out"] / "cache" / "lora").glob("*/r4-0/adapter_model.safetensors"))


def test_w_scale_levels(suite):
    r = suite["reports"]["w_scale"]
    assert [x["concurrency"] for x in r["levels"]] == [1, 4]
    mix = w_cpu_workload(_vocab(suite["model_dir"]), scale=0.1)
    for level in r["levels"]:
        expected = min(len(mix.requests), max(2, 4 * level["concurrency"]))
        assert level["requests"] == expected
        assert level["generated_tokens"] == level["output_tokens"]
        assert level["output_tokens"] == sum(req.max_tokens for req in mix.requests[:expected])
        assert level["tokens_per_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])
        kv = level["kv_utilization"]
        assert kv["samples"] > 0 and 0 < kv["min"] <= kv["mean"] <= 1 and 0 < kv["weighted"] <= 1


def test_w_stream_levels(suite):
    from benchmarks.w_stream import stream_workload

    r = suite["reports"]["w_stream"]
    assert [x["concurrency"] for x in r["levels"]] == [2, 4]
    for level in r["levels"]:
        workload = stream_workload(_vocab(suite["model_dir"]), level["concurrency"], 0.05, seed=level["concurrency"])
        assert level["requests"] == len(workload.requests) == level["concurrency"]
        lo, hi = level["workload"]["prompt_len_range"]
        assert all(lo <= req.prompt_len <= hi for req in workload.requests)
        runs = level["runs"]
        assert set(runs) == {"throughput", "stall-free"}
        for mode, x in runs.items():
            assert x["runs"] == 2 and x["requests"] == 2 * len(workload.requests)
            assert x["generated_tokens"] == 2 * workload.output_tokens  # ignore_eos: every token arrives
            assert x["tokens_per_s"] == pytest.approx(x["generated_tokens"] / x["wall_s"], rel=1e-3)
            assert x["ttft_ms"]["count"] == x["requests"]
            assert x["itl_ms"]["p50"] <= x["itl_ms"]["p99"] <= x["itl_ms"]["max"]
        # only the policy's engine learns from its steps
        assert runs["throughput"]["step_time_model"] == {"steps": 0}
        assert runs["stall-free"]["step_time_model"]["steps"] > 0
        c = level["comparison"]
        assert c["throughput_ratio"] == pytest.approx(runs["stall-free"]["tokens_per_s"] /
                                                      runs["throughput"]["tokens_per_s"], abs=1e-3)
    assert "per token" in r["step_time_model"]


def test_measure_helpers():
    report = latency_report(10.0, [[10.5, 10.7, 11.0], [], [12.0]])
    assert report["ttft_ms"] == {"p50": 500.0, "p99": 2000.0, "mean": 1250.0, "count": 2}
    assert report["itl_ms"]["count"] == 2 and report["itl_ms"]["p50"] == pytest.approx(200.0)
    assert summarize_ms([])["p50"] is None
    assert kv_utilization_summary([(30, 32), (10, 16)]) == {"mean": 0.7812, "min": 0.625, "weighted": 0.8333,
                                                             "samples": 2}


def test_reset_prefix_cache_makes_a_repeat_start_cold(llama_dir):
    from asyncllm import LLM, SamplingParams

    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    prompt, params = [list(range(10, 60))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt, params)
    assert reset_prefix_cache(llm.engine)
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate(prompt, params)
    assert llm.stats()["prefix_cache_hits"] == hits
    llm.generate(prompt, params)  # without a reset the same prompt is served from the cache
    assert llm.stats()["prefix_cache_hits"] > hits


def test_runner_skips_what_cannot_run_and_rejects_unknown_names():
    import torch

    if not torch.cuda.is_available():
        assert runner.skip_reason("w_gpu") in ("needs CUDA", "module not present")
    with pytest.raises(SystemExit):
        runner.parse_args(["--only", "w_nothing"])
    assert runner.parse_args(["--quick"]).size == "quick" and runner.parse_args([]).size == "full"


def test_cli_bench_forwards_and_explains_when_missing(llama_dir, tmp_path, monkeypatch, capsys):
    from asyncllm import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--size", "tiny", "--only", "w_latency", "--model-dir", str(llama_dir),
                  "--out", str(tmp_path), "--plots", ""])
    assert done.value.code == 0
    assert json.loads((tmp_path / "w_latency.json").read_text())["benchmark"] == "W-LATENCY"
    monkeypatch.setitem(sys.modules, "benchmarks.__main__", None)  # as if installed from a wheel
    assert cli.bench(["--help"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_cpu_kernel_microbenchmarks_run_and_are_consistent(tmp_path):
    from benchmarks import cpu_kernels

    out = tmp_path / "cpu_kernels.json"
    report = cpu_kernels.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [(r["shape"], r["rows"]) for r in report["linear"]] == [("qkv", 1), ("qkv", 8)]
    for r in report["linear"]:
        assert r["f_linear_ms"] > 0 and r["packed_ms"] > 0
        assert r["speedup"] == pytest.approx(r["f_linear_ms"] / r["packed_ms"])
    decode = report["paged_decode"]
    assert decode["num_seqs"] == 8 and decode["speedup"] == pytest.approx(decode["torch_ms"] / decode["c_kernel_ms"])


def test_w_soak_tiny_run(llama_dir, tmp_path):
    """W-SOAK against a real ``asyncllm serve`` child process: every request answered as expected."""
    from benchmarks import w_soak

    out = tmp_path / "w_soak.json"
    report = w_soak.main(["--requests", "60", "--concurrency", "4", "--no-probe", "--model-dir", str(llama_dir),
                          "--json", str(out)])
    soak = report["soak"]
    assert soak["requests"] == 60 and sum(soak["by_kind"].values()) == 60
    assert soak["errors"] == 0, soak["error_samples"]
    assert soak["health_after"] == 200 and soak["running_after"] == 0 and soak["kv_usage_after"] == 0
    assert len(soak["rss_mib"]) >= 3 and all(mib > 0 for _, mib in soak["rss_mib"])
    assert json.loads(out.read_text())["benchmark"] == "W-SOAK"


def test_reports_carry_no_machine_paths(tmp_path, monkeypatch):
    """Committed reports are read on other machines: checkout paths relative, interpreter "python", home "~"."""
    import os

    from benchmarks.measure import REPO_ROOT, write_report

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    report = {"argv": ["--json", str(REPO_ROOT / "benchmarks" / "results" / "x.json")],
              "command": [sys.executable, "-m", "benchmarks.w_cpu"],
              "model": {"dir": os.path.join(str(tmp_path / "home"), ".cache", "m")}}
    write_report(tmp_path / "r.json", report)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == {"argv": ["--json", "benchmarks/results/x.json"], "command": ["python", "-m", "benchmarks.w_cpu"],
                       "model": {"dir": "~/.cache/m"}}


def test_committed_results_carry_no_machine_paths():
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        text = path.read_text()
        assert str(ROOT) not in text and "/root/" not in text and "/home/" not in text, path


def test_w_spec_tiny(model_dirs, tmp_path):
    """W-SPEC at its tiny size on the tests' Llama: figures consistent, greedy outputs equal."""
    from benchmarks import w_spec

    out = tmp_path / "w_spec.json"
    report = w_spec.main(["--model", str(model_dirs["llama"]), *w_spec.SIZES["tiny"], "--json", str(out)])
    for name in ("copy", "free", "free-sampled"):
        r = report["workloads"][name]
        assert r["plain"]["tokens"] > 0 and r["spec"]["tokens"] > 0
        assert r["speedup"] == pytest.approx(r["spec"]["tokens_per_s"] / r["plain"]["tokens_per_s"])
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
    assert report["workloads"]["copy"]["identical_outputs"] is True
    assert report["workloads"]["free-sampled"]["identical_outputs"] is None
    saved = json.loads(out.read_text())
    assert saved["workload"] == "W-SPEC" and saved["config"]["k"] == 4


def test_w_scale_out_tiny(model_dirs, tmp_path):
    """W-SCALE-OUT's TP part at its tiny size on the tests' Llama: TP=2 gives TP=1's tokens
    (the DP part runs Ray Serve: tests/test_data_parallel.py covers it)."""
    from benchmarks import w_scale_out

    out = tmp_path / "w_scale_out.json"
    report = w_scale_out.main(["--model", str(model_dirs["llama"]), *w_scale_out.SIZES["tiny"], "--json", str(out)])
    for size in ("1", "2"):
        row = report["tp"][size]["batches"]["2"]
        assert row["tokens"] == 2 * 6 and row["tokens_per_s"] > 0 and row["decode_step_ms"] > 0
        assert row["same_as_tp1"] is True
    assert json.loads(out.read_text())["workload"] == "W-SCALE-OUT"


def test_w_gpu_smoke_runs_asyncllm_and_the_transformers_peer(tmp_path):
    """W-GPU's driver end to end on CPU (tiny model, 8 requests): both engines produce tokens with
    this transformers (5.24 here; the GPU-image rehearsal runs it on 5.17), and the report is saved."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "benchmarks.w_gpu", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "w_gpu.json").read_text())
    assert "errors" not in report
    assert report["asyncllm"]["tokens_per_s"] > 0 and report["asyncllm"]["length_mismatches"] == 0
    peer = report["hf_continuous_batching"]
    assert peer["tokens"] > 0 and peer["config_fields_missing"] == []  # 5.24 has every field asked for


def test_w_impl_tiny(model_dirs, tmp_path):
    """W-IMPL at its tiny size: both implementations run the same checkpoint to the same tokens."""
    from benchmarks import w_impl

    out = tmp_path / "w_impl.json"
    report = w_impl.main(["--model", str(model_dirs["llama"]), *w_impl.SIZES["tiny"], "--json", str(out)])
    assert report["identical_outputs"] is True
    assert report["native"]["tokens"] == report["transformers"]["tokens"] == 2 * 4
    assert report["throughput_ratio"] == pytest.approx(
        report["transformers"]["tokens_per_s"] / report["native"]["tokens_per_s"], rel=1e-2)
    assert json.loads(out.read_text())["benchmark"] == "W-IMPL"


def test_w_hostile_tiny_run(llama_dir, tmp_path):
    """W-HOSTILE's measurement on the toy model: statuses, the loop's worst wait recorded, nothing held."""
    from benchmarks import w_hostile

    out = tmp_path / "w_hostile.json"
    report = w_hostile.main(["--kinds", "batched_prompts,stop_strings,deep_guided_json,prompt_logprobs",
                             "--background", "1", "--model-dir", str(llama_dir), "--json", str(out)])
    by_kind = {r["kind"]: r for r in report["results"]}
    assert [by_kind[k]["status"] for k in ("batched_prompts", "stop_strings", "deep_guided_json")] == [400] * 3
    assert by_kind["prompt_logprobs"]["status"] == 200
    for result in report["results"]:
        assert result["next_request_status"] == 200 and result["blocks_held_after"] == 0
        assert result["ticker_worst_gap_ms"] >= 0 and result["other_streams_itl_ms"]["count"] > 0
    assert json.loads(out.read_text())["workload"] == "W-HOSTILE"


def test_w_int4_counts_checkpoint_and_model_bytes(model_dir_factory, tmp_path, capsys):
    """W-INT4's memory figures: a checkpoint's tensor bytes, and what the loaded model holds (4-bit: less)."""
    from asyncllm import LLM
    from asyncllm.toy import quantized
    from benchmarks import w_int4

    source = model_dir_factory("llama")
    model = quantized.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=True)
    from safetensors.torch import load_file

    tensors = load_file(str(model / "model.safetensors"))
    assert w_int4.checkpoint_bytes(model) == sum(t.numel() * t.element_size() for t in tensors.values())
    with LLM(str(model), dtype="float32") as llm:
        held = w_int4.model_bytes(llm)
    with LLM(str(source), dtype="float32") as llm:
        assert held < w_int4.model_bytes(llm)  # the projections' 4 bits against float32's 32
    w_int4.print_table({"asyncllm-gptq4": {"status": "ok", "batches": {"1": {"tokens_per_s": 10.0}},
                                           "model_bytes": held, "checkpoint_bytes": 1 << 20, "memory_ratio": 1.0}},
                       [1], {"asyncllm-gptq4/llamacpp-q4_0@1": 0.5})
    assert "asyncllm-gptq4/llamacpp-q4_0@1: 0.50x" in capsys.readouterr().out


def test_bf16_agreement_tiny_run(model_dir_factory, tmp_path, capsys):
    """The bf16 agreement report at toy size: asyncllm float32 equals transformers float32 on every prompt (the
    exact path), each pair's figures are consistent, and the report is written."""
    from benchmarks import bf16_agreement

    out = tmp_path / "bf16_agreement.json"
    assert bf16_agreement.main(["--model-dir", str(model_dir_factory("llama")), "--prompts", "3", "--prompt-len", "8",
                                "--new-tokens", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    exact = report["pairs"]["asyncllm-f32 / transformers-f32"]
    assert exact["prompts_identical"] == 3 and exact["same_tokens_before_first_difference"] == 1.0
    for figures in report["pairs"].values():
        assert figures["prompts"] == 3 and all(0 <= n <= 5 for n in figures["common_prefixes"])
        assert figures["prompts_identical"] == sum(n == 5 for n in figures["common_prefixes"])
    assert all(len(o) == 3 and all(len(t) == 5 for t in o) for o in report["outputs"].values())
    assert "asyncllm-bf16 / transformers-bf16" in capsys.readouterr().out


def test_w_moe_tiny_run(tmp_path, capsys):
    """W-MOE end to end at toy size: asyncllm and transformers on the MoE model, the dense model's step."""
    from benchmarks import w_moe

    out = tmp_path / "w_moe.json"
    assert w_moe.main(["--tiny", "--batches", "1,4", "--prompt-len", "8", "--gen-len", "4",
                       "--work-dir", str(tmp_path / "models"), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results["asyncllm"]["moe"]) == {"1", "4"} and set(results["transformers"]) == {"1", "4"}
    assert all(v > 0 for v in results["asyncllm"]["moe"].values())
    assert results["vs_transformers"]["4"] == pytest.approx(
        results["asyncllm"]["moe"]["4"] / results["transformers"]["4"], rel=0.01)
    assert results["step_ms_batch"]["moe"] > 0 and results["step_ms_batch"]["dense"] > 0
    assert "decode step at B=4" in capsys.readouterr().out


def test_moe_quantized_tiny_run(tmp_path, capsys):
    """The quantized-experts benchmark at toy size: each format written, loaded quantized and timed."""
    from benchmarks import moe_quantized

    out = tmp_path / "moe_quantized.json"
    assert moe_quantized.main(["--tiny", "--batches", "1,2", "--prompt-len", "8", "--gen-len", "4", "--repeats", "1",
                               "--work-dir", str(tmp_path / "models"), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(moe_quantized.FORMATS)
    assert all(v > 0 for row in results.values() for v in row["tok_s"].values())
    # float32 experts: 4 bytes a weight; GPTQ 4-bit about half a byte, 8-bit and FP8 about one
    assert results["gptq4"]["expert_mib_per_layer"] < results["gptq8"]["expert_mib_per_layer"] < \
        results["float"]["expert_mib_per_layer"] / 2
    assert "MiB of experts a layer" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        moe_quantized.parse_args(["--formats", "float,int3"])


def test_w_vllm_tiny_run(tmp_path, monkeypatch):
    """W-VLLM at its tiny size: asyncllm's server and offline run on the toy Llama; the vLLM engines skipped
    with the reason (their venv is pointed at a folder that does not exist: nothing is installed)."""
    from benchmarks import w_vllm

    monkeypatch.setenv("ASYNCLLM_VLLM_VENV", str(tmp_path / "no-vllm-venv"))
    out = tmp_path / "w_vllm.json"
    report = w_vllm.main(["--tiny", "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    engines = report["engines"]
    assert set(engines) == {"asyncllm-f32", "vllm-f32", "vllm-bf16"}
    for name in ("vllm-f32", "vllm-bf16"):
        assert engines[name]["status"] == "skipped" and "not installed" in engines[name]["reason"]
    mine = engines["asyncllm-f32"]
    assert mine["status"] == "ok", mine.get("error")
    assert mine["startup_s"] > 0 and len(mine["startup_s_runs"]) == 1
    for c in report["settings"]["concurrency"]:
        level = mine["levels"][str(c)]
        assert level["requests"] == w_vllm.level_requests(c) and level["wrong_lengths"] == 0
        assert level["generated_tokens"] == level["requests"] * report["settings"]["gen_len"]
        assert level["tokens_per_s"] > 0 and level["ttft_ms"]["count"] == level["requests"]
        assert level["ttft_ms"]["p99"] >= level["ttft_ms"]["p50"] > 0
    assert len(mine["greedy_texts"]) == report["greedy_check"]["prompts"] == 8
    offline = mine["offline"]
    assert offline["generated_tokens"] == offline["prompts"] * offline["gen_len"] and offline["wrong_lengths"] == 0
    assert report["comparisons"] == []  # no peer ran
    assert report["vllm"]["skipped"] and report["machine"]["loadavg_start"] is not None
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "W-VLLM" and saved["engines"]["vllm-bf16"]["status"] == "skipped"


def test_w_host_tiny_run(tmp_path, capsys):
    """W-HOST end to end at toy size: the host's route and the engine's streams in one uvicorn server, driven from
    other processes, alone and together; the report's ratios are its figures' ratios."""
    from benchmarks import w_host

    out = tmp_path / "w_host.json"
    w_host.main(["--tiny", "--seconds", "1", "--work-dir", str(tmp_path / "models"), "--json", str(out)])
    report = json.loads(out.read_text())
    host, engine, ratios = report["host"], report["engine"], report["comparison"]
    assert set(host) == {"alone", "with_engine"} and set(engine) == {"alone", "with_host"}
    assert report["calibration"]["iterations"] > 0 and report["server"]["loop"]
    for figures in host.values():
        assert figures["runs"] == 1 and figures["requests"] > 0 and figures["errors"] == 0
        assert 0 < figures["latency_ms"]["p50"] <= figures["latency_ms"]["p99"] <= figures["latency_ms"]["max"]
        assert figures["work_ms"]["count"] > 0 and figures["server_ms"]["count"] > 0
        assert figures["loop_lag_ms"]["count"] > 0 and figures["driver_late_ms"]["count"] > 0
        # every answered request split into the way in, the app and the way back (the route's own timestamps)
        parts = [figures[k] for k in ("inbound_ms", "in_app_ms", "outbound_ms")]
        assert all(p["count"] == figures["requests"] and p["p50"] >= 0 for p in parts)
        assert sum(p["mean"] for p in parts) <= figures["latency_ms"]["mean"] + 0.01
    for figures in engine.values():
        assert figures["requests"] >= 4 and figures["errors"] == 0  # 4 streams, one request each at least
        assert figures["generated_tokens"] == 16 * figures["requests"]  # --gen-len 16, ignore_eos
        assert figures["tokens_per_s"] == pytest.approx(figures["generated_tokens"] / figures["wall_s"], rel=0.01)
        assert 0 < figures["itl_ms"]["count"] <= 15 * figures["requests"]  # a chunk carries one token or more
    assert ratios["host_p50_ratio"] == pytest.approx(
        host["with_engine"]["latency_ms"]["p50"] / host["alone"]["latency_ms"]["p50"], rel=0.01, abs=0.001)
    assert ratios["host_p99_ratio"] == pytest.approx(
        host["with_engine"]["latency_ms"]["p99"] / host["alone"]["latency_ms"]["p99"], rel=0.01, abs=0.001)
    assert ratios["engine_tokens_per_s_ratio"] == pytest.approx(
        engine["with_host"]["tokens_per_s"] / engine["alone"]["tokens_per_s"], rel=0.01)
    assert ratios["met"] == {"host_p99": ratios["host_p99_ratio"] <= 2.0,
                             "engine_tokens_per_s": ratios["engine_tokens_per_s_ratio"] >= 0.85}
    assert set(report["server_cpu"]) >= {"host_alone", "engine_alone", "both"}
    assert "W-HOST: host p50 x" in capsys.readouterr().out


def test_image_stall_tiny_run(capsys):
    """benchmarks/image_stall.py on the toy tower: with the default budget the image is encoded whole or, where
    its measured time does not fit the step's target, a layer a step; a budget of 1 row always a layer a step."""
    from benchmarks import image_stall

    whole, ahead = image_stall.main(["--layers", "3", "--width", "32", "--image-size", "28", "--patch", "7",
                                     "--tokens", "120", "--join-after", "4", "--repeats", "1", "--budgets", "0,1"])
    # (0: whole; 2: ahead; 1 only if the stream ended during the pass, when its chunk finishes the rest)
    assert whole["encoder_token_budget"] is None and whole["stages_run"] in (0, 1, 2)
    assert ahead["encoder_token_budget"] == 1 and ahead["stages_run"] == 2  # CLIP's feature layer is the 2nd of 3
    assert whole["images_encoded"] == ahead["images_encoded"] == 2  # the warm-up image and the stream's
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_bf16_decode_tiles_tiny_run(model_dir_factory, tmp_path, capsys):
    """The bf16 decode-step comparison at toy size: every way this machine has gets a time per step for every
    batch, the ways it lacks are named with the reason, and the AMX threshold is back as it was afterwards."""
    from asyncllm.kernels.cpu_decode_stack import amx_rows
    from benchmarks import bf16_decode_tiles

    before = amx_rows()
    out = tmp_path / "tiles.json"
    assert bf16_decode_tiles.main(["--model-dir", str(model_dir_factory("llama")), "--batches", "2,16",
                                   "--rounds", "1", "--new-tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert amx_rows() == before == report["amx_rows"]
    assert [r["batch"] for r in report["rows"]] == [2, 16]
    ways = [w for w in ("amx", "vdpbf16ps", "onednn") if w not in report["skipped"]]
    assert "onednn" in ways
    for row in report["rows"]:
        assert all(0 < row[f"{w}_ms"][0] <= row[f"{w}_ms"][1] for w in ways)
    assert "B=16:" in capsys.readouterr().out


def test_bf16_batch_phases_tiny_run(model_dir_factory, tmp_path, capsys):
    """The prefill/decode split at toy size: every way gets a prefill time and a decode step, and the switches it
    flips (the fused bf16 attention, the bf16 SDPA decision) are back as they were afterwards."""
    from asyncllm.kernels import cpu_attention
    from asyncllm.model.decoder import Attention
    from benchmarks import bf16_batch_phases

    before = (Attention.bf16_prefill, cpu_attention.amx_attention)
    out = tmp_path / "phases.json"
    assert bf16_batch_phases.main(["--model-dir", str(model_dir_factory("llama")), "--batch", "2", "--prompt-len",
                                   "8", "--new-tokens", "3", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (Attention.bf16_prefill, cpu_attention.amx_attention) == before
    assert [r["way"] for r in report["rows"]] == list(bf16_batch_phases.WAYS)
    for row in report["rows"]:
        assert 0 < row["prefill_s"][0] <= row["prefill_s"][1] and row["decode_step_ms"][0] <= row["decode_step_ms"][1]
    assert "float32-sdpa: prefill" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bf16_batch_phases.main(["--ways", "fast"])


def test_wave_steps_tiny_run(model_dir_factory, tmp_path, capsys):
    """The wave trace at toy size: the cold steps are timed as often as asked, every prompt token of the wave is
    in a listed step, and the report's TTFTs are ordered."""
    from benchmarks import wave_steps

    out = tmp_path / "wave.json"
    assert wave_steps.main(["--model-dir", str(model_dir_factory("llama")), "--streams", "2", "--prompt-len", "8",
                            "--new-tokens", "3", "--cold-repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [len(c["ms"]) for c in report["cold_steps"]] == [2, 2]
    assert all(c["tokens"] == 8 * c["rows"] for c in report["cold_steps"])
    wave = report["wave"]
    assert sum(s["prompt_tokens"] for s in wave["prompt_steps"]) == 4 * 8  # 2 streams x 2 prompts each
    assert 0 < wave["ttft_ms"]["p50"] <= wave["ttft_ms"]["max"]
    assert "wave:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        wave_steps.main(["--streams", "0"])
