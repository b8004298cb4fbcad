"""PNG plots of the benchmark JSON (matplotlib, headless): one figure per workload.

    python -m benchmarks.plots [--results benchmarks/results] [--out docs/img]

Reads ``<results>/<workload>.json`` as written by ``python -m benchmarks`` and writes ``<out>/<workload>.png``.
Workloads without a dedicated plot (another engineer's, say) get a bar chart of every ``*tokens_per_s`` figure
found in their JSON, if there is any.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

ENGINE_COLORS = {"asyncllm": "#1f77b4", "hf-static": "#ff7f0e", "hf-continuous": "#2ca02c"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, labels: list[str], values: list[float], colors=None, fmt: str = "{:.0f}") -> None:
    bars = ax.bar(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)


def _paired(ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str, log: bool = False) -> None:
    """Grouped bars: one group per label in ``groups``, one bar per series."""
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)


def plot_w_cpu(report: dict[str, Any], plt) -> Any:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    res = {k: v for k, v in report["results"].items() if v.get("tokens_per_s")}
    names = list(res)
    _bars(ax1, names, [res[n]["tokens_per_s"] for n in names], [ENGINE_COLORS.get(n) for n in names])
    roof = report["roofline"]["roofline_tokens_per_s"]
    ax1.axhline(roof, color="red", linestyle="--", label=f"roofline {roof:.0f} tok/s")
    ax1.axhline(0.6 * roof, color="red", linestyle=":", label="60% of roofline (target)")
    ax1.set_ylabel("output tokens/s (median)")
    ax1.set_title("W-CPU throughput")
    ax1.legend(fontsize=8)
    series = {f"{label} {q}": [res[n].get(key, {}).get(q) for n in names]
              for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")) for q in ("p50", "p99")}
    _paired(ax2, names, series, "milliseconds (log)", log=True)
    ax2.set_title("W-CPU time to first token / inter-token latency")
    return fig


def plot_w_prefix(report: dict[str, Any], plt) -> Any:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(report["results"])
    res = report["results"]
    _paired(ax1, modes, {q: [res[m]["ttft_ms"][q] for m in modes] for q in ("p50", "p99")}, "TTFT (ms)")
    ax1.set_title(f"W-PREFIX time to first token ({report['ttft_p50_ratio']:.1f}x lower p50 with caching)")
    _bars(ax2, modes, [res[m]["tokens_per_s"] for m in modes])
    ax2.set_ylabel("output tokens/s (median)")
    ax2.set_title("W-PREFIX throughput")
    return fig


def plot_w_latency(report: dict[str, Any], plt) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    groups = ["time to first token", "inter-token latency", "engine decode step"]
    keys = ["ttft_ms", "itl_ms", "engine_decode_step_ms"]
    _paired(ax, groups, {q: [report[k][q] for k in keys] for q in ("p50", "p99")}, "milliseconds")
    w = report["workload"]
    ax.set_title(f"W-LATENCY: {w['prompt_len']}-token prompt, {w['output_len']} output tokens, one at a time")
    return fig


def plot_w_lora(report: dict[str, Any], plt) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    w = report["workload"]
    _bars(ax, ["base model", f"{w['adapters']} LoRA adapters"],
          [report["base_tokens_per_s"], report["lora_tokens_per_s"]], ["#1f77b4", "#9467bd"])
    ax.axhline(0.7 * report["base_tokens_per_s"], color="red", linestyle=":", label="70% of base (target)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"W-LORA: {100 * report['lora_vs_base']:.0f}% of base throughput (rank {w['rank']})")
    ax.legend(fontsize=8)
    return fig


def plot_w_scale(report: dict[str, Any], plt) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    rows = report["levels"]
    conc = [r["concurrency"] for r in rows]
    axes[0].plot(conc, [r["tokens_per_s"] for r in rows], "o-")
    axes[0].set_ylabel("output tokens/s")
    axes[1].plot(conc, [r["itl_ms"]["p50"] for r in rows], "o-", label="ITL p50")
    axes[1].plot(conc, [r["itl_ms"]["p99"] for r in rows], "s--", label="ITL p99")
    axes[1].set_ylabel("inter-token latency (ms)")
    axes[1].legend(fontsize=8)
    axes[2].plot(conc, [100 * (r["kv_utilization"]["weighted"] or 0) for r in rows], "o-", label="weighted")
    axes[2].plot(conc, [100 * (r["kv_utilization"]["min"] or 0) for r in rows], "s--", label="worst step")
    axes[2].axhline(96, color="red", linestyle=":", label="96% (target)")
    axes[2].set_ylabel("KV-cache utilization (%)")
    axes[2].legend(fontsize=8)
    for ax, title in zip(axes, ("throughput", "inter-token latency", "KV-cache utilization")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_title(f"W-SCALE {title}")
    return fig


def plot_w_stream(report: dict[str, Any], plt) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    levels = report["levels"]
    groups = [f"{level['concurrency']} streams" for level in levels]
    modes = list(levels[0]["runs"])
    itl = {f"{mode} {q}": [level["runs"][mode]["itl_ms"][q] for level in levels] for mode in modes
           for q in ("p50", "p99", "max")}
    _paired(axes[0], groups, itl, "inter-token latency (ms)", log=True)
    axes[0].set_title("W-STREAM inter-token latency")
    ttft = {f"{mode} {q}": [level["runs"][mode]["ttft_ms"][q] for level in levels] for mode in modes
            for q in ("p50", "p99")}
    _paired(axes[1], groups, ttft, "time to first token (ms)", log=True)
    axes[1].set_title("W-STREAM time to first token")
    _paired(axes[2], groups, {mode: [level["runs"][mode]["tokens_per_s"] for level in levels] for mode in modes},
            "output tokens/s")
    axes[2].set_title("W-STREAM throughput")
    return fig


def plot_w_json(report: dict[str, Any], plt) -> Any:
    rates = report.get("throughput_tok_s")
    if not isinstance(rates, dict):
        return plot_generic(report, plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars(ax, list(rates), list(rates.values()), ["#8c564b", "#1f77b4"])
    if "unconstrained" in rates:
        ax.axhline(0.9 * rates["unconstrained"], color="red", linestyle=":", label="90% of unconstrained (target)")
        ax.legend(fontsize=8)
    ax.set_ylabel("output tokens/s (median)")
    ratio = report.get("ratio_constrained_over_unconstrained")
    ax.set_title("W-JSON" + (f": constrained at {100 * ratio:.0f}% of unconstrained" if ratio else ""))
    return fig


def _find_rates(obj: Any, path: str = "") -> dict[str, float]:
    """Every numeric ``*tokens_per_s`` value in a JSON tree, keyed by its path."""
    found: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and str(k).endswith("tokens_per_s"):
                found[key] = float(v)
            else:
                found.update(_find_rates(v, key))
    return found


def plot_generic(report: dict[str, Any], plt) -> Any | None:
    rates = _find_rates(report)
    if not rates:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rates)), 4))
    _bars(ax, [k.replace(".", "\n") for k in rates], list(rates.values()))
    ax.set_ylabel("tokens/s")
    ax.set_title(str(report.get("benchmark", "benchmark")))
    ax.tick_params(axis="x", labelsize=7)
    return fig


PLOTTERS: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "w_cpu": plot_w_cpu, "w_prefix": plot_w_prefix, "w_latency": plot_w_latency, "w_lora": plot_w_lora,
    "w_scale": plot_w_scale, "w_json": plot_w_json, "w_stream": plot_w_stream,
}


def make_plots(results_dir: str | Path, out_dir: str | Path, names: list[str] | None = None) -> list[Path]:
    """Plot every ``<results_dir>/<name>.json`` (all of them, or ``names``); return the PNGs written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(results_dir).glob("*.json")):
        name = path.stem
        if name == "summary" or (names is not None and name not in names):
            continue
        report = json.loads(path.read_text())
        fig = PLOTTERS.get(name, plot_generic)(report, plt)
        if fig is None:
            continue
        machine = report.get("machine", {})
        load = machine.get("loadavg_start")
        fig.text(0.01, 0.01, f"{machine.get('cpu_model', '')}, {machine.get('cpus_usable', '?')} CPUs"
                 + (f", load {load[0]:.1f} at start" if load else "") + f"; {report.get('date', '')}",
                 fontsize=7, color="gray")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        target = out / f"{name}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="folder of the benchmark JSON")
    parser.add_argument("--out", default="docs/img", help="folder for the PNGs")
    args = parser.parse_args(argv)
    written = make_plots(args.results, args.out)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
