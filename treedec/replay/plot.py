"""Charts of replay results: latency per decode iteration, and where a decode step's time goes."""
from __future__ import annotations

from pathlib import Path

from treedec.checks import describe

PARTS = (("plan_ms", "planning"), ("bookkeeping_ms", "tree bookkeeping"), ("attention_ms", "attention"),
         ("other_ms", "other (forward)"))
#: What :func:`plot_results` reads from a results document, a run and a step.
RESULTS_FIELDS = ("workload", "schedule", "model", "device", "runs")
RUN_FIELDS = ("planner", "steps")
STEP_FIELDS = ("kind", "step", "total_ms") + tuple(key for key, _ in PARTS)
#: The largest magnitude of a step number or time a chart takes (ms: over 30,000 years).
MAX_VALUE = 1e15


def results_documents(data, source: str) -> list[dict]:
    """The replay results documents of one loaded results file, checked to hold what :func:`plot_results` reads.

    ``data`` is a ``treedec replay --out`` document, or a ``bench/replay.py`` one holding a
    document per workload family under ``"families"``. Anything else raises ValueError
    naming ``source`` and the first field that is missing or of the wrong kind: the names a
    chart shows (workload, model, device, schedule name, planner, step kind) must be text, a
    step's number and times numbers of magnitude at most :data:`MAX_VALUE` (NaN: not measured).
    """
    def refuse(detail: str):
        raise ValueError(f"{source} is not a treedec replay results file ({detail}); write one with "
                         f"`treedec replay <workload> --out FILE`")

    def check(doc, fields: tuple[str, ...], where: str) -> None:
        if not isinstance(doc, dict):
            refuse(f"{where}: expected a JSON object, got {type(doc).__name__}")
        missing = [f for f in fields if f not in doc]
        if missing:
            refuse(f"{where} has no {', '.join(repr(f) for f in missing)}")

    if isinstance(data, dict) and "families" in data:
        if not isinstance(data["families"], dict) or not data["families"]:
            refuse("'families' must be a non-empty JSON object")
        docs = [(f"families[{name!r}]", doc) for name, doc in data["families"].items()]
    else:
        docs = [("the top level", data)]
    def text(value, where: str) -> None:
        if not isinstance(value, str):
            refuse(f"{where} must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")   # a lone surrogate is not text: the chart's font cannot draw it
        except UnicodeEncodeError as e:
            refuse(f"{where} is not text (a lone surrogate at character {e.start})")

    for where, doc in docs:
        check(doc, RESULTS_FIELDS, where)
        check(doc["schedule"], ("name",), f"{where} 'schedule'")
        for key in ("workload", "model", "device"):
            text(doc[key], f"{where} {key!r}")
        text(doc["schedule"]["name"], f"{where} 'schedule' 'name'")
        if not isinstance(doc["runs"], list):
            refuse(f"{where} 'runs' must be a list")
        for i, run in enumerate(doc["runs"]):
            check(run, RUN_FIELDS, f"{where} runs[{i}]")
            if not isinstance(run["steps"], list):
                refuse(f"{where} runs[{i}] 'steps' must be a list")
            text(run["planner"], f"{where} runs[{i}] 'planner'")
            for j, step in enumerate(run["steps"]):
                check(step, STEP_FIELDS, f"{where} runs[{i}] steps[{j}]")
                text(step["kind"], f"{where} runs[{i}] steps[{j}] 'kind'")
                for key in ("step", "total_ms") + tuple(key for key, _ in PARTS if step[key] is not None):
                    if not _is_number(step[key]):
                        refuse(f"{where} runs[{i}] steps[{j}] {key!r} must be a number of magnitude at most "
                               f"{MAX_VALUE:g}, got {describe(step[key])}")
    return [doc for _, doc in docs]


def check_image_format(out: str | Path) -> None:
    """Raise ValueError unless ``out`` ends with an image extension matplotlib writes (.png, .pdf, .svg, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    ext = Path(out).suffix.lower().removeprefix(".")
    if ext not in formats:
        raise ValueError(f"--out {str(out)!r} must end with an image extension, one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


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


def _is_number(value) -> bool:
    """A JSON number a chart can hold: not a bool, NaN or at most MAX_VALUE in magnitude (an axis
    spanning -1e308..1e308 overflows, an int of 400 digits has no float)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not abs(value) > MAX_VALUE


def _label(results: dict, run: dict, several: bool) -> str:
    label = f"{results['workload']} / {run['planner']}" if several else run["planner"]
    return label + (" (split)" if results.get("profile_split") else "")
