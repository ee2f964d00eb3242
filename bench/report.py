"""Render bench/attention.py results: the markdown table of bench/README.md and the printed summary."""
from __future__ import annotations

from pathlib import Path

from bench.peers import DEFT_TRITON_H200_US, PEERS

TABLE_START, TABLE_END = "<!-- attention-table:start -->", "<!-- attention-table:end -->"


def render_table(results: dict) -> str:
    """Markdown: one row per workload, one column per method (microseconds), then the best of each side."""
    methods = _method_order(results)
    full_scale = results.get("scale", 1.0) == 1.0
    v = results["versions"]
    lines = [
        f"Measured {results['date']} on {results['device']} (copy bandwidth "
        f"{results['copy_bandwidth_TBps']:.2f} TB/s), {results['dtype']}, head dim {results.get('head_dim', 128)}, "
        f"{results.get('kv_heads', 8)} KV heads, "
        f"page size {results['page_size']}"
        f"{', SMOKE scale x' + str(results['scale']) if not full_scale else ''}; torch {v.get('torch')}, "
        f"triton {v.get('triton')}, flashinfer {v.get('flashinfer')}. Microseconds per call, median, L2 "
        f"flushed; every number passed the check against the fp32 reference (rel. error < "
        f"{results['max_rel_err']}).",
        "",
        "| workload | tokens / queries | floor | " + " | ".join(methods)
        + " | best peer / floor | best treedec / floor | best peer / best treedec "
          "| graphed: best treedec | graphed: FlashInfer mask (or batch decode) |",
        "|---" * (len(methods) + 8) + "|",
    ]
    notes: dict[tuple[str, str], list[str]] = {}
    for name, w in results["workloads"].items():
        cells = []
        for m in methods:
            r = w["methods"].get(m)
            cells.append(_cell(m, name, r, full_scale))
            if r is not None and r["status"] != "ok" and m != "deft_triton":
                notes.setdefault((m, f"{r['status']}: {r.get('reason', '')}"), []).append(name)
        treedec, peer = best(w, "treedec"), best(w, "peer")
        fi = w["methods"].get("flashinfer_custom_mask") or w["methods"].get("flashinfer_batch_decode", {})
        lines.append(
            f"| {name} | {w['tree_tokens']} / {w['queries']} | {w['floor_us']:.1f} | " + " | ".join(cells)
            + f" | {_best_cell(w, peer)} | {_best_cell(w, treedec)} | {_ratio(peer, treedec, w)} "
              f"| {_graphed(w, treedec)} | {_graphed_value(fi)} |")
    if "deft_triton" in methods and full_scale:
        lines += ["", "deft_triton: BENCH.md's number on an NVIDIA H200 (the DeFT repository's Triton kernel "
                      "is not vendored here; not run in this measurement)."]
    if notes:
        lines += ["", "Not timed:"]
        lines += [f"- {m}, {reason} ({', '.join(ws)})" for (m, reason), ws in notes.items()]
    return "\n".join(lines)


def write_readme_table(results: dict, readme: Path) -> None:
    """Replace the text between the table markers of ``readme`` (appended if the markers are missing)."""
    text = readme.read_text() if readme.exists() else ""
    block = f"{TABLE_START}\n{render_table(results)}\n{TABLE_END}"
    if TABLE_START in text and TABLE_END in text:
        head, rest = text.split(TABLE_START, 1)
        tail = rest.split(TABLE_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    readme.write_text(text)


def print_summary(results: dict) -> None:
    """A short fixed-width table on stdout: floor, best treedec and best peer per workload."""
    print(f"{results['device']}  copy {results['copy_bandwidth_TBps']:.2f} TB/s  {results['date']}")
    print(f"{'workload':<20} {'floor us':>9}  {'best treedec':<34} {'best peer':<38} {'speedup':>7}")
    for name, w in results["workloads"].items():
        treedec, peer = best(w, "treedec"), best(w, "peer")
        print(f"{name:<20} {w['floor_us']:>9.1f}  {_summary_cell(w, treedec):<34} {_summary_cell(w, peer):<38} "
              f"{_ratio(peer, treedec, w):>7}")


def best(workload: dict, side: str) -> str | None:
    """The fastest checked method of ``side`` ("treedec" or "peer"), or None."""
    ok = [m for m, r in workload["methods"].items()
          if r["status"] == "ok" and m.startswith("treedec_") == (side == "treedec")]
    return min(ok, key=lambda m: workload["methods"][m]["us"]) if ok else None


# ===================================================================== private


def _method_order(results: dict) -> list[str]:
    seen: list[str] = []
    for w in results["workloads"].values():
        seen += [m for m in w["methods"] if m not in seen]
    treedec = [m for m in seen if m.startswith("treedec_")]
    peers = [m for m in PEERS if m in seen] + [m for m in seen if m not in treedec and m not in PEERS]
    return treedec + peers


def _cell(method: str, workload: str, r: dict | None, full_scale: bool) -> str:
    if method == "deft_triton" and full_scale and workload in DEFT_TRITON_H200_US:
        return f"({DEFT_TRITON_H200_US[workload]})"
    if r is None:
        return ""
    if r["status"] == "ok":
        return f"{r['us']:.1f}"
    if r["status"] == "unavailable" and r.get("reason", "").startswith("fails to compile"):
        return "fails to compile"
    return {"unavailable": "n/a", "FAIL": "FAIL", "error": "error"}[r["status"]]


def _best_cell(w: dict, method: str | None) -> str:
    if method is None:
        return "-"
    return f"{w['methods'][method]['x_floor']:.1f}x ({method})"


def _summary_cell(w: dict, method: str | None) -> str:
    if method is None:
        return "-"
    r = w["methods"][method]
    return f"{method} {r['us']:.1f} ({r['x_floor']:.1f}x)"


def _ratio(peer: str | None, treedec: str | None, w: dict) -> str:
    if peer is None or treedec is None:
        return "-"
    return f"{w['methods'][peer]['us'] / w['methods'][treedec]['us']:.2f}x"


def _graphed(w: dict, method: str | None) -> str:
    return "-" if method is None else _graphed_value(w["methods"][method])


def _graphed_value(r: dict) -> str:
    if "graphed_us" in r:
        return f"{r['graphed_us']:.1f}"
    return "capture failed" if "graphed_reason" in r else "-"
