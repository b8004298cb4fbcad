"""Markdown tables of the benchmark JSON, as in docs/benchmarks.md.

    python -m benchmarks.tables [--results benchmarks/results] [--update-doc docs/benchmarks.md]

One table per workload whose JSON is in the folder; workloads without a dedicated table are skipped.
``--update-doc`` rewrites what stands between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in the
document (NAME: a workload, or ``machine`` for the machine and load averages of summary.json).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable


def _ms(d: dict[str, Any] | None, q: str) -> str:
    v = (d or {}).get(q)
    return "-" if v is None else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table_w_cpu(r: dict[str, Any]) -> str:
    rows = []
    for name, e in r["results"].items():
        mem = e.get("memory", {}).get("peak_rss_delta_mb")
        share = e.get("roofline_share")
        rows.append([name, f"{e.get('tokens_per_s') or 0:.1f}", str(len(e.get("wall_s", []))),
                     _x(e.get("ratio_to_hf_static")), _x(e.get("ratio_to_hf_continuous")),
                     "-" if share is None else f"{100 * share:.1f}%",
                     _ms(e.get("ttft_ms"), "p50"), _ms(e.get("ttft_ms"), "p99"),
                     _ms(e.get("itl_ms"), "p50"), _ms(e.get("itl_ms"), "p99"),
                     "-" if mem is None else f"{mem:.0f}"])
    roof = r["roofline"]
    rows.append(["roofline", f"{roof['roofline_tokens_per_s']:.1f}", "", "", "", "100%", "", "", "", "", ""])
    return _table(["engine", "tok/s", "runs", "x hf-static", "x hf-CB", "roofline", "TTFT p50 ms", "TTFT p99 ms",
                   "ITL p50 ms", "ITL p99 ms", "peak RSS MB"], rows)


def table_w_prefix(r: dict[str, Any]) -> str:
    rows = [[mode, f"{e['tokens_per_s']:.1f}", _ms(e["ttft_ms"], "p50"), _ms(e["ttft_ms"], "p99"),
             _ms(e["itl_ms"], "p50"), _ms(e["itl_ms"], "p99"), f"{100 * e['prefix_cache_hit_rate']:.1f}%",
             f"{e['memory']['peak_rss_delta_mb'] or 0:.0f}"] for mode, e in r["results"].items()]
    text = _table(["mode", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "prompt tokens cached",
                   "peak RSS MB"], rows)
    return text + (f"\n\nTTFT p50 without / with caching: **{_x(r['ttft_p50_ratio'])}** "
                   f"(p99 {_x(r['ttft_p99_ratio'])}); throughput with / without: {_x(r['throughput_ratio'])}.")


def table_w_latency(r: dict[str, Any]) -> str:
    rows = [[label, _ms(r[key], "p50"), _ms(r[key], "p99")] for key, label in
            (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
             ("engine_decode_step_ms", "engine decode step"))]
    return _table(["", "p50 ms", "p99 ms"], rows) + (
        f"\n\nDelivery overhead (ITL p50 - step p50): {r['delivery_overhead_ms_p50']:.3f} ms.")


def table_w_lora(r: dict[str, Any]) -> str:
    lat = r.get("latency", {})
    rows = [[label, f"{r[key]:.1f}", _ms(lat.get(mode, {}).get("ttft_ms"), "p50"),
             _ms(lat.get(mode, {}).get("itl_ms"), "p50"), _ms(lat.get(mode, {}).get("itl_ms"), "p99")]
            for key, mode, label in (("base_tokens_per_s", "base", "base model"),
                                     ("lora_tokens_per_s", "lora", f"{r['workload']['adapters']} adapters"))]
    return _table(["run", "tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"], rows) + (
        f"\n\nLoRA / base: **{100 * r['lora_vs_base']:.0f}%**.")


def table_w_scale(r: dict[str, Any]) -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rows = [[str(x["concurrency"]), str(x["requests"]), f"{x['tokens_per_s']:.1f}", _ms(x["ttft_ms"], "p50"),
             _ms(x["itl_ms"], "p50"), _ms(x["itl_ms"], "p99"), pct(x["kv_utilization"]["weighted"]),
             pct(x["kv_utilization"]["min"])] for x in r["levels"]]
    return _table(["concurrency", "requests", "tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
                   "KV utilization", "worst step"], rows)


def table_w_stream(r: dict[str, Any]) -> str:
    rows = []
    for level in r["levels"]:
        for mode, x in level["runs"].items():
            rows.append([str(level["concurrency"]), mode, f"{x['tokens_per_s']:.1f}", _ms(x["ttft_ms"], "p50"),
                         _ms(x["ttft_ms"], "p99"), _ms(x["itl_ms"], "p50"), _ms(x["itl_ms"], "p99"),
                         _ms(x["itl_ms"], "max"), f"{x['itl_p99_over_p50']:.2f}"])
    checks = "; ".join(f"{level['concurrency']} streams: tokens/s x{level['comparison']['throughput_ratio']:.3f}, "
                       f"TTFT p99 x{level['comparison']['ttft_p99_ratio']:.2f}" for level in r["levels"])
    return _table(["streams", "policy", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                   "ITL max ms", "ITL p99/p50"], rows) + f"\n\nStall-free against throughput mode: {checks}."


def table_w_json(r: dict[str, Any]) -> str:
    rates = r.get("throughput_tok_s") or {}
    rows = [[name, f"{v:.1f}"] for name, v in rates.items()]
    ratio = r.get("ratio_constrained_over_unconstrained")
    return _table(["run", "tok/s"], rows) + (
        f"\n\nConstrained / unconstrained: **{100 * ratio:.0f}%**; valid JSON: {r.get('valid_json_outputs')}."
        if ratio is not None else "")


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "w_cpu": table_w_cpu, "w_prefix": table_w_prefix, "w_latency": table_w_latency, "w_lora": table_w_lora,
    "w_scale": table_w_scale, "w_json": table_w_json, "w_stream": table_w_stream,
}


def _section(results_dir: Path, name: str) -> str | None:
    """One workload's table under a line giving its date and load average; None without its JSON."""
    path = results_dir / f"{name}.json"
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    try:
        body = TABLES[name](r)
    except (KeyError, TypeError, ValueError) as e:  # a JSON of another shape (an older or newer script)
        body = f"(no table: {type(e).__name__}: {e})"
    machine, entry = r.get("machine", {}), _summary_entry(results_dir, name)  # the runner's record if the JSON
    load = [machine.get("loadavg_start") or entry.get("loadavg_start"),   # has no date or load of its own
            machine.get("loadavg_end") or entry.get("loadavg_end")]
    loads = " / ".join(f"{x[0]:.2f}" for x in load if x)
    date = r.get("date") or entry.get("date", "?")
    return f"Run {date}; load average (1 min) at start / end: {loads or '?'}.\n\n{body}"


def _summary_entry(results_dir: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((results_dir / "summary.json").read_text())["workloads"].get(name, {})
    except (OSError, ValueError, KeyError):
        return {}


def machine_section(results_dir: Path) -> str | None:
    path = results_dir / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    m, git = s["machine"], s.get("git", {})
    dirty = git.get("dirty_files")
    rows = [["CPU", f"{m.get('cpu_model')}, {m.get('cpus_usable')} usable of {m.get('cpu_count')}"],
            ["memory", f"{m.get('mem_total_gb')} GB"], ["torch", f"{m.get('torch_version')}, "
                                                                 f"{m.get('torch_num_threads')} threads"],
            ["transformers", str(m.get("transformers_version"))], ["Python", str(m.get("python_version"))],
            ["platform", str(m.get("platform"))], ["last suite run", f"{s.get('date')} (size {s.get('size')})"],
            ["commit", f"{git.get('commit')}" + (f" + uncommitted {', '.join(dirty)}" if dirty else "")],
            ["load average (1/5/15 min), last run", f"start {m.get('loadavg_start')}, end {m.get('loadavg_end')}"]]
    return _table(["", ""], rows)


def update_doc(doc: str | Path, results_dir: str | Path) -> list[str]:
    """Fill the doc's marked result sections from the JSON; returns the names filled."""
    text, filled = Path(doc).read_text(), []
    for name in ["machine", *TABLES]:
        content = machine_section(Path(results_dir)) if name == "machine" else _section(Path(results_dir), name)
        pattern = re.compile(rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.S)
        if content is not None and pattern.search(text):
            text = pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(2), text)
            filled.append(name)
    Path(doc).write_text(text)
    return filled


def markdown(results_dir: str | Path) -> str:
    """All tables, each under a heading with the run's date and load average."""
    parts = []
    for name in TABLES:
        section = _section(Path(results_dir), name)
        if section is not None:
            parts.append(f"### {name.replace('_', '-').upper()}\n\n{section}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--update-doc", metavar="DOC", help="fill the marked result sections of this markdown file")
    args = parser.parse_args(argv)
    if args.update_doc:
        print(f"filled in {args.update_doc}: {', '.join(update_doc(args.update_doc, args.results)) or 'nothing'}")
    text = markdown(args.results)
    print(text)
    return text


if __name__ == "__main__":
    main()
