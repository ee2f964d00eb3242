#!/usr/bin/env python3
"""Attention microbenchmark: treedec backends x planners and the peers on the suite of BENCH.md
and the families of its section 2 (bench/families.py: unshared decode batches, long sequences,
forests of many requests' trees).

For each workload: random fp16 q [Q, 32, 128] (``--head-dim``: 64, 128 or 256) and K/V pool, an fp32 reference
(``reference_tree_attention``, tree by tree); every method's output is checked (relative Frobenius error
< 2e-3) before it is timed, a wrong one is marked FAIL and not timed. Results go to
``<out>/<date>-<gpu>.json`` and, for the suite, a table into bench/README.md.

Attention variants (issue #50): ``--window W`` (a sliding window of W keys, scaled with ``--smoke``'s token
counts) and ``--softcap C`` (a logit soft-cap) make every method compute that variant (treedec's
``AttentionVariant``; FlashInfer's ``window_left`` / ``logits_soft_cap``, a window in the dense masks,
flex_attention's ``score_mod``; a peer that cannot says so). With a window each workload also times the
*yardstick*: treedec's plain kernel over the same windowed KV (``bench.suite.windowed_kv_layout``), the
windowed kernel's target being at most 1.05x of it (``yardstick_ratio``, best treedec / yardstick).

    python bench/attention.py                                  # on a GPU: the whole suite
    python bench/attention.py --families unshared,long         # on a GPU: those families, their peers
    python bench/attention.py --smoke --backends torch         # CPU, tiny scale (CI)
    python bench/attention.py --head-dim 256 --kv-heads 16 --window 512 --tag gemma3-w512   # Gemma 3's shape
    python bench/attention.py --workloads spec_medusa64_p32k --families long --window 4096 --tag mistral-w4096
    python bench/attention.py --softcap 50 --tag softcap50     # the suite soft-capped (against a plain run)
    python bench/attention.py --kv-dtype fp8 --workloads spec_medusa64_p32k,fewshot_b50_p16k --tag fp8kv
    python bench/attention.py --render bench/results/X.json [Y.json]  # rewrite the README table only

An fp8 KV cache (issue #52, ``--kv-dtype fp8``): K/V drawn as usual, stored as e4m3 with one scale a cache
(``amax / 448``: FlashInfer's fp8 KV takes one K and one V scale a layer), the reference over the de-quantized
values; treedec's methods read the e4m3 caches (``AttentionVariant(kv_dtype="fp8")``), each beside its twin over the
same de-quantized K/V in ``--dtype`` (``..._kv16``), and the FlashInfer peers run their fp8-KV kernels; each
workload's ``fp8_kv`` entry gives the best 16-bit-KV treedec time over the best fp8 one (target >= 1.6x).

See bench/README.md for the columns.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.families import FAMILIES, FAMILY_PEERS, WORKLOADS, family_of, tokens_read  # noqa: E402
from bench.peers import PEERS, PeerUnavailable, split_by_root  # noqa: E402
from bench.report import print_summary, write_readme_table  # noqa: E402
from bench.results_file import device_name, results_path, versions  # noqa: E402
from bench.suite import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, SUITE, Workload, windowed_kv_layout  # noqa: E402
from bench.timing import copy_bandwidth, graphed_us, time_us  # noqa: E402
from treedec import PlanConfig, TreeAttention  # noqa: E402
from treedec.attention import PLANNERS, AttentionVariant, reference_tree_attention  # noqa: E402
from treedec.attention import get_backend  # noqa: E402
from treedec.errors import BackendUnavailableError  # noqa: E402
from treedec.attention.backends.cuda_backend import plan_schedule  # noqa: E402
from treedec.tree.kv_cache_dtype import FP8_E4M3_MAX, dequantize_kv, quantize_kv  # noqa: E402

MAX_REL_ERR = 2e-3
TENSOR_CORE_FLOPS = 790e12       # measured bf16 GEMM on an H200 (BENCH.md)
SMOKE_SCALE = 0.05
GRAPH_KV_COPIES, GRAPH_CALLS = 8, 32
KV_HEAD_CHOICES = (1, 2, 4, 8, 16, 32)  # divisors of the 32 query heads
GRAPH_KV_BUDGET_BYTES = 16 << 30  # fewer K/V copies for the graph where 8 would not fit (each is far beyond L2)
GRAPHED_PEERS = ("flashinfer_custom_mask", "flashinfer_batch_decode")  # graphed beside the best treedec method
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 128, 256)       # the head dims the cuda backend builds; the suite's is HEAD_DIM (Llama-3-8B)
TREEDEC_BACKENDS = ("torch", "triton", "cuda", "auto")  # auto: what TreeAttention picks (cuda on H100/H200)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.render:
        parts = [json.loads(Path(p).read_text()) for p in args.render]
        results = {**parts[0], "workloads": {n: w for part in parts for n, w in part["workloads"].items()}}
        write_readme_table(results, Path(args.readme or REPO / "bench" / "README.md"))
        print_summary(results)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    configs = _treedec_configs(args, device)
    for name in args.peers or []:
        if name not in PEERS:
            raise SystemExit(f"unknown peer {name!r}; peers: {list(PEERS)}")
    for name in args.workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; the suite: {list(SUITE)}; the families "
                             f"(--families {','.join(FAMILIES)}): {[n for f in FAMILIES.values() for n in f]}")
    peers = {name: _peers_of(name, args.peers) for name in args.workloads}

    bandwidth = copy_bandwidth(device)
    scale = SMOKE_SCALE if args.smoke else 1.0
    window = None if args.window is None else max(1, round(args.window * scale))   # smoke: with the token counts
    variant = AttentionVariant(logit_softcap=args.softcap, window=window,
                               kv_dtype="fp8" if args.kv_dtype == "fp8" else None)
    results = {
        "device": device_name(device), "date": datetime.date.today().isoformat(),
        "versions": versions("triton", "flashinfer"), "copy_bandwidth_TBps": bandwidth / 1e12, "dtype": args.dtype,
        "page_size": args.page_size, "head_dim": args.head_dim, "kv_heads": args.kv_heads, "smoke": args.smoke,
        "scale": scale, "variant": {"window": variant.window, "logit_softcap": variant.logit_softcap,
                                    "kv_dtype": variant.kv_dtype},
        "max_rel_err": MAX_REL_ERR, "tensor_core_flops": TENSOR_CORE_FLOPS,
        "cuda_flags": os.environ.get("TREEDEC_CUDA_FLAGS", ""),  # compile-time knobs of the cuda kernels
        "workloads": {},
    }
    print(f"device {results['device']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"treedec configs {configs}, peers {sorted(set(p for ps in peers.values() for p in ps))}", file=sys.stderr)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, results["device"], smoke=args.smoke, tag=args.tag)
    progress = tqdm(total=sum(len(configs) + len(p) for p in peers.values()), desc="attention", file=sys.stderr)
    for name in args.workloads:
        workload = WORKLOADS[name](page_size=args.page_size, scale=results["scale"])
        results["workloads"][name] = _bench_workload(workload, configs, peers[name], device, dtype, bandwidth,
                                                     graph=device.type == "cuda" and not args.no_graph, graph_all=args.graph_all,
                                                     progress=progress, head_dim=args.head_dim,
                                                     kv_heads=args.kv_heads, variant=variant)
        results["workloads"][name]["family"] = family_of(name)
        path.write_text(json.dumps(results, indent=1) + "\n")  # after every workload: a cut-off run keeps its part
    progress.close()
    print(f"wrote {path}", file=sys.stderr)
    # The README's table is the suite's shape at full scale: other runs write it only when asked.
    suite_only = all(name in SUITE for name in args.workloads)
    readme = args.readme or (None if args.smoke or args.head_dim != HEAD_DIM or args.kv_heads != NUM_KV_HEADS
                             or not suite_only or variant != AttentionVariant()
                             else REPO / "bench" / "README.md")
    if readme:
        write_readme_table(results, Path(readme))
        print(f"wrote the table into {readme}", file=sys.stderr)
    print_summary(results)
    return 0


# ===================================================================== one workload


def _bench_workload(workload: Workload, configs, peers, device, dtype, bandwidth, graph, progress,
                    graph_all=False, head_dim=HEAD_DIM, kv_heads=NUM_KV_HEADS,
                    variant: AttentionVariant = AttentionVariant()) -> dict:
    layout = workload.layout
    q, k, v = workload.random_inputs(device, dtype, head_dim=head_dim, kv_heads=kv_heads)
    kv16 = kv_scale = None
    if variant.fp8_kv:   # e4m3 caches, their de-quantized twin in q's dtype, the reference over it in fp32
        (k, v), kv16, kv_scale = fp8_caches(k, v, dtype)
        plain = dataclasses.replace(variant, kv_dtype=None)
        ref = _reference(q, *(dequantize_kv(c.view(-1, *c.shape[2:]), kv_scale[i]).view(c.shape)
                              for i, c in enumerate((k, v))), layout, plain)
    else:
        ref = _reference(q, k, v, layout, variant)

    read = tokens_read(layout)
    elt = q.element_size()
    hbm_bytes = 2 * layout.num_tokens * kv_heads * head_dim * k.element_size() + 2 * q.numel() * elt
    hbm_floor = hbm_bytes / bandwidth * 1e6
    tc_floor = 4 * NUM_QO_HEADS * head_dim * read / TENSOR_CORE_FLOPS * 1e6
    entry = {
        "description": workload.description, "tree_tokens": layout.num_tokens, "queries": layout.num_queries,
        "nodes": layout.num_nodes, "trees": int((layout.parent < 0).sum()), "tokens_read": read,
        "pool_pages": workload.num_pages,
        "hbm_bytes": hbm_bytes, "hbm_floor_us": hbm_floor, "tensor_core_floor_us": tc_floor,
        "floor_us": max(hbm_floor, tc_floor), "methods": {},
    }
    makers = {}
    for backend, planner, chunk_size in configs:
        progress.set_postfix_str(f"{workload.name} treedec {backend}/{planner}")
        method = f"treedec_{backend}_{planner}" + (f"_c{chunk_size}" if chunk_size else "")
        entry["methods"][method], makers[method] = _bench_treedec(layout, backend, planner, chunk_size,
                                                                  q, k, v, ref, device, variant, kv_scale)
        if kv16 is not None:   # the same kernel over the de-quantized K/V in q's dtype
            entry["methods"][method + "_kv16"], makers[method + "_kv16"] = _bench_treedec(
                layout, backend, planner, chunk_size, q, *kv16, ref, device, plain)
        progress.update()
    for name in peers:
        progress.set_postfix_str(f"{workload.name} {name}")
        entry["methods"][name], makers[name] = _bench_peer(name, layout, q, k, v, variant, ref, device, kv_scale)
        progress.update()
    for result in entry["methods"].values():
        if result.get("us"):
            result["TBps"] = hbm_bytes / result["us"] / 1e6
            result["x_floor"] = result["us"] / entry["floor_us"]
    if graph:
        _add_graphed(entry, makers, layout, k, v, graph_all, None if kv16 is None else dtype)
    if kv16 is not None:
        entry["fp8_kv"] = _fp8_speedup(entry["methods"])
    if variant.window is not None:
        entry["yardstick"] = _yardstick(entry, layout, variant, q, k, v, device, graph)
    return entry


def _yardstick(entry, layout, variant, q, k, v, device, graph) -> dict:
    """The windowed kernel's yardstick: treedec's fastest config, plain (no window; the same soft-cap), over the same
    windowed KV (:func:`bench.suite.windowed_kv_layout`), checked against its own reference; with the best windowed
    treedec method's time over it (``yardstick_ratio``, target <= 1.05)."""
    methods = entry["methods"]
    best = min((m for m in methods if m.startswith("treedec_") and methods[m]["status"] == "ok"),
               key=lambda m: methods[m]["us"], default=None)
    if best is None:
        return {"status": "n/a", "reason": "no treedec method ran"}
    backend, planner = methods[best]["backend"], methods[best]["planner"]
    plain = AttentionVariant(sm_scale=variant.sm_scale, logit_softcap=variant.logit_softcap)
    windowed = windowed_kv_layout(layout, variant.window)
    result, maker = _bench_treedec(windowed, backend, planner, methods[best]["chunk_size"], q, k, v,
                                   _reference(q, k, v, windowed, plain), device, plain)
    result.update(method=best, kv_tokens=windowed.num_tokens)
    if result["status"] == "ok":
        result["yardstick_ratio"] = methods[best]["us"] / result["us"]
        if graph and maker is not None and "graphed_us" in methods[best]:
            result["graphed_us"] = graphed_us([maker(k, v)], GRAPH_CALLS)
            result["graphed_yardstick_ratio"] = methods[best]["graphed_us"] / result["graphed_us"]
    return result


def fp8_caches(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
    """``k``, ``v`` as e4m3 caches with one scale each (``amax / 448``, FlashInfer's one scale a layer, as ``[2, Hkv]``
    for treedec), and their de-quantized values in ``dtype``: ``((k8, v8), (k16, v16), kv_scale)``."""
    hkv = k.shape[2]
    kv_scale = torch.stack([t.float().abs().amax().div(FP8_E4M3_MAX).expand(hkv) for t in (k, v)]).contiguous()
    stored = tuple(quantize_kv(t.view(-1, *t.shape[2:]), kv_scale[i]).view(t.shape) for i, t in enumerate((k, v)))
    twin = tuple(dequantize_kv(t.view(-1, *t.shape[2:]), kv_scale[i], dtype).view(t.shape)
                 for i, t in enumerate(stored))
    return stored, twin, kv_scale


def _fp8_speedup(methods: dict) -> dict:
    """The best 16-bit-KV treedec method's time over the best fp8 one, eager and graphed (target >= 1.6)."""
    out = {}
    for column in ("us", "graphed_us"):
        fp8 = [m for m in methods if m.startswith("treedec_") and not m.endswith("_kv16") and column in methods[m]]
        kv16 = [m for m in methods if m.endswith("_kv16") and column in methods[m]]
        if fp8 and kv16:
            best8 = min(fp8, key=lambda m: methods[m][column])
            best16 = min(kv16, key=lambda m: methods[m][column])
            out[column] = {"fp8": best8, "kv16": best16, "speedup": methods[best16][column] / methods[best8][column]}
    return out


def _reference(q, k, v, layout, variant) -> torch.Tensor:
    """fp32 reference output [Q, Hq, D], one tree at a time (a forest's dense [Q, Hq, T] scores would not fit)."""
    parts = split_by_root(layout)
    if len(parts) == 1:
        return reference_tree_attention(q, k, v, layout, variant)[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for queries, sub in parts:
        index = torch.from_numpy(queries).to(q.device)
        out[index] = reference_tree_attention(q[index], k, v, sub, variant)[0]
    return out


def _peers_of(workload: str, chosen: list[str] | None) -> list[str]:
    """The peers run on ``workload``: those chosen (--peers), else every peer for the suite, the family's for a family."""
    if chosen is not None:
        return chosen
    family = family_of(workload)
    return list(PEERS) if family == "suite" else list(FAMILY_PEERS[family])


def _bench_treedec(layout, backend, planner, chunk_size, q, k, v, ref, device,
                   variant: AttentionVariant = AttentionVariant(), kv_scale: torch.Tensor | None = None):
    """Returns (result dict, maker(k, v) -> run or None); the head dim is q's, the KV heads k's."""
    config = PlanConfig(planner=planner) if chunk_size is None else PlanConfig(planner, chunk_size)
    try:
        attn = TreeAttention(NUM_QO_HEADS, k.shape[2], q.shape[-1], backend=backend, variant=variant,
                             plan_config=config, device=device, dtype=q.dtype)
    except BackendUnavailableError as e:
        return {"status": "unavailable", "reason": str(e)}, None
    plan_us = time_us(lambda: attn.plan(layout), torch.device("cpu"))
    plan = attn.plan(layout)
    result = {"plan": plan.plan.summary(), "plan_us": plan_us, "kernel_backend": plan.backend, "backend": backend,
              "planner": planner, "chunk_size": chunk_size}

    def maker(k_i, v_i):
        return lambda: attn.run(q, k_i, v_i, plan, kv_scale=kv_scale)
    result.update(_check_and_time(maker(k, v), ref, device))
    if backend == "cuda" and result["status"] == "ok":
        schedule = plan_schedule(plan)  # what the backend chose for this plan
        result["plan"].update(kv_tile_tokens=schedule.tile_tokens, cta_imbalance=schedule.imbalance())
    return result, maker if result["status"] == "ok" else None


def _bench_peer(name, layout, q, k, v, variant, ref, device, kv_scale=None):
    """Returns (result dict, maker(k, v) -> run or None)."""
    peer = PEERS[name]
    reason = peer.unavailable(device)
    if reason is not None:
        return {"status": "unavailable", "reason": reason}, None

    def maker(k_i, v_i):
        return peer.make(layout, q, k_i, v_i, variant, kv_scale)
    try:
        run = maker(k, v)
    except PeerUnavailable as e:
        return {"status": "unavailable", "reason": str(e)}, None
    except Exception as e:
        return {"status": "error", "reason": f"setup: {type(e).__name__}: {_first_line(e)}"}, None
    result = _check_and_time(run, ref, device)
    return result, maker if result["status"] == "ok" else None


def _check_and_time(run, ref, device) -> dict:
    """Check ``run()`` against the fp32 reference; time it only when it is right."""
    try:
        out = run()
        rel = float((out.float() - ref).norm() / ref.norm())
    except Exception as e:
        return {"status": "error", "reason": f"run: {type(e).__name__}: {_first_line(e)}"}
    if not rel < MAX_REL_ERR:  # catches NaN too
        return {"status": "FAIL", "rel_err": rel, "reason": f"relative error {rel:.3g} >= {MAX_REL_ERR}"}
    return {"status": "ok", "rel_err": rel, "us": time_us(run, device)}


def _add_graphed(entry, makers, layout, k, v, graph_all=False, kv16_dtype=None) -> None:
    """Per-call time in a CUDA graph for the best treedec config (or all; with fp8 caches and ``kv16_dtype`` the best
    fp8-KV one and the best ``kv16_dtype``-KV one) and the FlashInfer peers that ran (custom mask, batch decode).
    K/V copies: 8, fewer where 8 would not fit GRAPH_KV_BUDGET_BYTES (e4m3 copies for the fp8 methods, 16-bit
    ones for the ``_kv16`` methods)."""
    methods = entry["methods"]
    treedec_ok = [m for m in methods if m.startswith("treedec_") and methods[m]["status"] == "ok"]
    if graph_all:
        chosen = list(treedec_ok)
    else:
        kinds = [[m for m in treedec_ok if m.endswith("_kv16") == kv16]
                 for kv16 in ((False, True) if kv16_dtype is not None else (False,))]
        chosen = [min(ms, key=lambda m: methods[m]["us"]) for ms in kinds if ms]
    chosen += [m for m in GRAPHED_PEERS if methods.get(m, {}).get("status") == "ok"]
    kv_bytes = 2 * k.numel() * (k.element_size() + (2 if kv16_dtype is not None else 0))
    n = entry["graph_kv_copies"] = max(2, min(GRAPH_KV_COPIES, GRAPH_KV_BUDGET_BYTES // kv_bytes))

    def draw(dtype):   # (randn has no fp8 kernel: drawn in fp16, rounded)
        return torch.randn(k.shape, dtype=torch.float16 if dtype.itemsize == 1 else dtype, device=k.device).to(dtype)
    copies = {False: [(draw(k.dtype), draw(v.dtype)) for _ in range(n)]}
    if kv16_dtype is not None:
        copies[True] = [(draw(kv16_dtype), draw(kv16_dtype)) for _ in range(n)]
    for method in chosen:
        try:
            runs = [makers[method](k_i, v_i) for k_i, v_i in copies[method.endswith("_kv16")]]
            methods[method]["graphed_us"] = graphed_us(runs, GRAPH_CALLS)
        except Exception as e:
            methods[method]["graphed_reason"] = f"{type(e).__name__}: {_first_line(e)}"


# ===================================================================== setup


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", type=_csv, default=None,
                        help=f"comma- or space-separated (default: all of {list(SUITE)} unless --families)")
    parser.add_argument("--families", nargs="+", type=_csv, default=None,
                        help=f"run every workload of these families too, among suite,{','.join(FAMILIES)} "
                             f"(bench/families.py); each family's default peers: {FAMILY_PEERS}")
    parser.add_argument("--backends", nargs="+", type=_csv, default=None,
                        help="treedec backends among torch,triton,cuda,auto (default: on a GPU the runnable "
                             "ones of triton,cuda, and auto; on a CPU torch); 'none' for peers only")
    parser.add_argument("--planners", nargs="+", type=_csv, default=None,
                        help=f"planners among {','.join(PLANNERS)} (default: flatten, plus node and "
                             f"node_chunk for the triton backend)")
    parser.add_argument("--chunk-sizes", nargs="+", type=_csv, default=None,
                        help="flatten/node_chunk chunk sizes to sweep (default: the PlanConfig default); "
                             "each size is its own method, e.g. treedec_triton_flatten_c512")
    parser.add_argument("--peers", nargs="+", type=_csv, default=None,
                        help=f"peers among {','.join(PEERS)} (default: all for the suite, the family's own "
                             f"for a family's workloads); 'none' for none")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=HEAD_DIM,
                        help=f"head dim of q, k and v (default {HEAD_DIM}, the suite's; other dims do not "
                             f"rewrite bench/README.md's table unless --readme names a file)")
    parser.add_argument("--kv-heads", type=int, choices=KV_HEAD_CHOICES, default=NUM_KV_HEADS,
                        help=f"KV heads beside the {NUM_QO_HEADS} query heads (default {NUM_KV_HEADS}, Llama-3's "
                             f"GQA group of 4; 32: no GQA, one query row per KV head; the README table as --head-dim)")
    parser.add_argument("--window", type=int, default=None,
                        help="a sliding window of this many keys (AttentionVariant.window; scaled with --smoke); "
                             "adds each workload's yardstick: the plain kernel over the same windowed KV")
    parser.add_argument("--softcap", type=float, default=None, help="a logit soft-cap (AttentionVariant.logit_softcap)")
    parser.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                        help="the K/V caches' dtype: auto (--dtype) or fp8 (e4m3, one scale a cache; every treedec "
                             "method also runs over the de-quantized K/V in --dtype, as <method>_kv16)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for the results JSON")
    parser.add_argument("--readme", default=None,
                        help="markdown file whose table to rewrite (default: bench/README.md; none with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"token counts x{SMOKE_SCALE}, CPU timers; for CI (the whole suite in seconds)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph column")
    parser.add_argument("--graph-all", action="store_true",
                        help="graph every treedec config, not only the fastest (for tuning chunk sizes)")
    parser.add_argument("--tag", default=None, help="appended to the results file name (e.g. part1)")
    parser.add_argument("--render", metavar="JSON", nargs="+", default=None,
                        help="only rewrite the README table (and print the summary) from results JSON "
                             "file(s); several are merged (workloads of later files win)")
    args = parser.parse_args(argv)
    families = _flatten(args.families or [])
    for family in families:
        if family != "suite" and family not in FAMILIES:
            raise SystemExit(f"unknown family {family!r}; families: suite, {', '.join(FAMILIES)}")
    workloads = _flatten(args.workloads) if args.workloads is not None else ([] if families else list(SUITE))
    for family in families:
        workloads += [n for n in (SUITE if family == "suite" else FAMILIES[family]) if n not in workloads]
    args.workloads = workloads
    for name in ("backends", "planners", "peers", "chunk_sizes"):
        value = getattr(args, name)
        if value is not None:
            value = _flatten(value)
            setattr(args, name, [] if value == ["none"] else value)
    return args


def _treedec_configs(args, device) -> list[tuple[str, str]]:
    backends = args.backends
    if backends is None:
        if device.type == "cuda":
            backends = [b for b in ("triton", "cuda") if get_backend(b).why_unavailable(device) is None] + ["auto"]
        else:
            backends = ["torch"]
    for b in backends:
        if b not in TREEDEC_BACKENDS:
            raise SystemExit(f"unknown treedec backend {b!r}; backends: {list(TREEDEC_BACKENDS)}")
    for p in args.planners or []:
        if p not in PLANNERS:
            raise SystemExit(f"unknown planner {p!r}; planners: {list(PLANNERS)}")
    sizes = [None if c == "auto" else int(c) for c in args.chunk_sizes] if args.chunk_sizes else [None]
    configs = []
    for b in backends:
        planners = args.planners or (list(PLANNERS) if b == "triton" else ["flatten"])
        for p in planners:
            configs.extend((b, p, c) for c in (sizes if p != "node" else [None]))
    return configs


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def _flatten(lists) -> list[str]:
    return [x for part in lists for x in part]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


if __name__ == "__main__":
    sys.exit(main())
