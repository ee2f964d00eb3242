"""Charts of replay results: latency per decode iteration, and where a decode step's time goes."""
from __future__ import annotations

from pathlib import Path

PARTS = (("plan_ms", "planning"), ("bookkeeping_ms", "tree bookkeeping"), ("attention_ms", "attention"),
         ("other_ms", "other (forward)"))


def plot_results(results: list[dict], out: str | Path) -> None:
    """Draw every run of every results file: a latency line each (left) and a stacked bar each (right).

    The bar is the mean per decode step of planning, bookkeeping, attention (when it was
    measured; else it is inside "other") and the rest.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(_label(r, run, len(results) > 1), run) for r in results for run in r["runs"]]
    if not runs:
        raise ValueError("the results hold no runs")
    fig, (lat, parts) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for label, run in runs:
        decode = [s for s in run["steps"] if s["kind"] == "decode"]
        lat.plot([s["step"] for s in decode], [s["total_ms"] for s in decode], label=label, linewidth=1)
    lat.set_xlabel("step (decode iterations)")
    lat.set_ylabel("latency per step (ms)")
    lat.set_title("decode latency per iteration")
    lat.legend(fontsize="small")
    lat.grid(alpha=0.3)
    bottoms = [0.0] * len(runs)
    for key, name in PARTS:
        heights = []
        for _, run in runs:
            decode = [s for s in run["steps"] if s["kind"] == "decode"]
            values = [s[key] for s in decode]
            heights.append(0.0 if not values or any(v is None for v in values) else sum(values) / len(values))
        parts.bar(range(len(runs)), heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    parts.set_xticks(range(len(runs)), [label for label, _ in runs], rotation=20, ha="right", fontsize="small")
    parts.set_ylabel("mean per decode step (ms)")
    parts.set_title("breakdown")
    parts.legend(fontsize="small")
    title = results[0]["schedule"]["name"] if len(results) == 1 else f"{len(results)} results files"
    fig.suptitle(f"{title}: {results[0]['model']} on {results[0]['device']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _label(results: dict, run: dict, several: bool) -> str:
    label = f"{results['workload']} / {run['planner']}" if several else run["planner"]
    return label + (" (split)" if results.get("profile_split") else "")
