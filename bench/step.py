#!/usr/bin/env python3
"""End-to-end step time: treedec's engine vs HF transformers on the Llama-3-8B shape, random weights.

For each prompt length (default 4000 and 32000 tokens):

- ``verify``: a Medusa t=64 tree-verify step (``treedec.workloads.deft.medusa_tree(64)``:
  the 64 tokens of the token tree hang under the prompt, each reads the prompt and its own
  ancestors); treedec adds the token tree, runs one step (logits of all 64, in token order),
  prunes it again.
- ``decode``: a one-token decode step over the prompt.

Methods (``--methods``): ``hf_sdpa`` (transformers, ``attn_implementation="sdpa"``, a
DynamicCache holding the prompt, the tree as a custom 4D mask, cropped back after each step),
``treedec_eager``, ``treedec_graph`` (steps replayed from CUDA graphs), and both again with
the pointwise ops fused by torch.compile (``*_compiled``). transformers runs on views of
treedec's weights (``to_hf_state_dict``): the same numbers, no second copy. Every treedec
verify step's logits are checked against transformers' (relative Frobenius error). A method
that fails is recorded under ``errors`` and the others still run.

Timing: each step is followed by a device synchronisation (a decoding loop reads its logits
before the next step); the median over ``--reps`` of the CUDA-event time (GPU) or the wall
time (CPU) is reported, with the weight-streaming floor = weight bytes / measured
device-to-device copy bandwidth (read + write), as in BENCH.md.

    python bench/step.py                      # GPU: llama3-8b shape, bf16, prompts 4000 and 32000
    python bench/step.py --methods hf_sdpa,treedec_graph_compiled --prompts 4000
    python bench/step.py --smoke              # CPU: tiny config, fp32, prompts 200 and 1600 (CI)

Results go to ``<out>/<date>-<device>-step[-<tag>].json`` (written after every method and prompt)
and a table is printed.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, results_path, versions  # noqa: E402
from bench.timing import copy_bandwidth, methods_in_order  # noqa: E402
from treedec.engine import Engine  # noqa: E402
from treedec.models import ModelConfig, from_config, to_hf_config, to_hf_state_dict  # noqa: E402
from treedec.workloads.deft import medusa_tree  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMOKE_PROMPTS = (200, 1600)
# Run in this order: the *_compiled methods fuse the model's pointwise ops for good.
METHODS = ["hf_sdpa", "treedec_eager", "treedec_graph", "treedec_eager_compiled", "treedec_graph_compiled"]


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.model, args.dtype, args.reps = "tiny", "fp32", min(args.reps, 3)
        args.prompts = args.prompts or list(SMOKE_PROMPTS)
    prompts = args.prompts or [4000, 32000]
    dtype = DTYPES[args.dtype]
    methods = args.methods or (METHODS if device.type == "cuda" else ["hf_sdpa", "treedec_eager"])
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; methods: {METHODS}")
    if device.type != "cuda" and any(m.startswith("treedec_graph") for m in methods):
        raise SystemExit("the CUDA-graph methods need a CUDA device")
    config = ModelConfig.from_name(args.model)
    medusa = medusa_tree(args.tree)
    rng = np.random.default_rng(args.seed)
    prompt_ids = {p: rng.integers(0, config.vocab_size, p).tolist() for p in prompts}
    tree_ids = rng.integers(0, config.vocab_size, medusa.size).tolist()
    decode_id = int(rng.integers(0, config.vocab_size))

    model = from_config(config, seed=args.seed, dtype=dtype, device=device)
    bandwidth = copy_bandwidth(device)
    weight_bytes = model.weight_bytes()
    floor_ms = 1e3 * weight_bytes / bandwidth
    results = {
        "device": device_name(device), "date": datetime.date.today().isoformat(),
        "versions": versions("transformers", "triton"),
        "smoke": args.smoke, "model": args.model, "dtype": args.dtype, "weight_bytes": weight_bytes,
        "copy_bandwidth_TBps": bandwidth / 1e12, "floor_ms": floor_ms, "tree": medusa.source,
        "tree_tokens": medusa.size, "reps": args.reps, "page_size": args.page_size, "prompts": {},
    }
    print(f"{results['device']}: {args.model} {args.dtype}, {weight_bytes / 1e9:.2f} GB of weights, copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s, floor {floor_ms:.2f} ms", file=sys.stderr)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(out_dir, results["device"], "step", smoke=args.smoke, tag=args.tag)

    def save():
        path.write_text(json.dumps(results, indent=1) + "\n")  # after every part: a cut-off run keeps its part

    hf_logits = {}
    if "hf_sdpa" in methods:
        hf = hf_model(model, device)
        for p in prompts:
            entry = results["prompts"].setdefault(str(p), {})
            entry["hf_sdpa"], hf_logits[p] = time_hf_steps(hf, prompt_ids[p], tree_ids, medusa, decode_id, args.reps,
                                                        device)
            _report(p, "hf_sdpa", entry["hf_sdpa"], floor_ms)
            save()
        del hf
        free_memory(device)

    for method in methods_in_order(model, METHODS, methods):
        engine = None
        try:
            engine = Engine(model, kv_tokens=None if device.type == "cuda" else 2 * max(prompts) + 1024,
                            page_size=args.page_size, cuda_graphs=method.startswith("treedec_graph"))
            results.setdefault("kv_pool", {"tokens": engine.kv_capacity_tokens, "reason": engine.kv_pool_reason})
            for p in prompts:
                entry = results["prompts"].setdefault(str(p), {})
                entry[method] = _bench_treedec(engine, prompt_ids[p], tree_ids, medusa, decode_id, args.reps,
                                               device, hf_logits.get(p))
                if engine.graph_stats:
                    entry[method]["graph_stats"] = dict(engine.graph_stats)
                _report(p, method, entry[method], floor_ms)
                save()
        except Exception as e:  # recorded, and the other methods still run
            traceback.print_exc()
            results.setdefault("errors", {})[method] = f"{type(e).__name__}: {e}"[:2000]
            save()
        del engine
        free_memory(device)
    save()
    print(f"wrote {path}", file=sys.stderr)
    print(render_table(results))
    return 0


# ===================================================================== methods


def _bench_treedec(engine: Engine, prompt, tree_ids, medusa, decode_id, reps, device, hf_logits) -> dict:
    tree = engine.tree
    t0 = time.perf_counter()
    root = engine.prefill(prompt).node
    _sync(device)
    prefill_s = time.perf_counter() - t0
    captured = {}

    def verify():
        ids = tree.add_token_tree(root, tree_ids, medusa.parents)
        captured["logits"] = engine.step(logits_rows=engine.pending_rows(ids)).logits  # rows in token order
        tree.prune(ids[0])

    def decode():
        [child] = tree.branch(root, [[decode_id]])
        engine.step()
        tree.prune(child)

    out = {"prefill_s": prefill_s, "verify": time_calls(verify, reps, device),
           "decode": time_calls(decode, reps, device)}
    ids = tree.add_token_tree(root, tree_ids, medusa.parents)
    t0 = time.perf_counter()
    plan = engine.attn.plan(tree)
    out["verify"]["plan_ms"] = 1e3 * (time.perf_counter() - t0)
    out["verify"]["plan"] = plan.plan.summary()
    engine.step()
    tree.prune(ids[0])
    if hf_logits is not None:
        out["verify"]["rel_err_vs_hf"] = rel_err(captured["logits"], hf_logits)
    tree.prune(root)
    return out


def hf_model(model, device):
    """A transformers LlamaForCausalLM (sdpa) on views of ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    hf_config = to_hf_config(model.config)
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
    hf.load_state_dict(to_hf_state_dict(model), assign=True, strict=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config).to(device)  # its buffers were made on meta
    return hf.eval()


@torch.inference_mode()
def hf_cache_kwargs(hf, cache) -> dict:
    """The keyword that hands ``hf``'s forward its KV cache: ``cache`` where the forward takes it
    (transformers >= 5.24, where ``past_key_values`` warns and is to go in 5.40), else ``past_key_values``."""
    return {"cache": cache} if "cache" in inspect.signature(hf.forward).parameters else {"past_key_values": cache}


def time_hf_steps(hf, prompt, tree_ids, medusa, decode_id, reps, device) -> tuple[dict, torch.Tensor]:
    """Prefill a DynamicCache with the prompt, then verify / decode steps cropped back after each."""
    from transformers import DynamicCache

    n = len(prompt)
    t0 = time.perf_counter()
    cache = DynamicCache()
    hf(torch.tensor([prompt], device=device), **hf_cache_kwargs(hf, cache), use_cache=True, logits_to_keep=1)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    tree_input, positions, mask = hf_tree_inputs(n, tree_ids, medusa, next(hf.parameters()).dtype, device)
    decode_input = torch.tensor([[decode_id]], device=device)
    decode_position = torch.tensor([[n]], device=device)
    captured = {}

    def rollback():  # a negative count removes that many tokens, in transformers 4.x and 5.x alike
        cache.crop(n - cache.get_seq_length())

    def verify():
        captured["logits"] = hf(tree_input, attention_mask=mask, position_ids=positions,
                                **hf_cache_kwargs(hf, cache), use_cache=True).logits[0]
        rollback()

    def decode():
        hf(decode_input, position_ids=decode_position, **hf_cache_kwargs(hf, cache), use_cache=True)
        rollback()

    out = {"prefill_s": prefill_s, "verify": time_calls(verify, reps, device),
           "decode": time_calls(decode, reps, device)}
    return out, captured["logits"].float().cpu()


def hf_tree_inputs(n: int, tree_ids, medusa, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """transformers inputs of a token tree after ``n`` cached tokens: ids [1, t], positions [1, t] and the
    additive 4D mask [1, 1, t, n + t] (the prefix, then each token's ancestors and itself)."""
    tree_input = torch.tensor([tree_ids], device=device)
    positions = torch.from_numpy(n + medusa.depth)[None].to(device)
    mask = torch.full((1, 1, medusa.size, n + medusa.size), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[..., :n] = 0
    mask[0, 0, :, n:][torch.from_numpy(_ancestor_or_self(medusa.parents)).to(device)] = 0
    return tree_input, positions, mask


def _ancestor_or_self(parents: np.ndarray) -> np.ndarray:
    """[t, t] bool: token i reads token j (j is i or an ancestor of i)."""
    t = len(parents)
    reads = np.eye(t, dtype=bool)
    for i in range(t):  # parents come before children
        if parents[i] >= 0:
            reads[i] |= reads[parents[i]]
    return reads


# ===================================================================== timing and report


def time_calls(fn, reps: int, device, warmup: int = 3) -> dict:
    """Median of ``reps`` calls, each followed by a synchronisation: CUDA-event time on a GPU, wall time on a CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times, walls = [], []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            walls.append(1e3 * (time.perf_counter() - t0))
            times.append(walls[-1])
    return {"ms": statistics.median(times), "wall_ms": statistics.median(walls), "min_ms": min(times)}


def rel_err(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative (Frobenius) difference of ``logits`` from ``reference``, in fp32 on the CPU."""
    a, b = logits.float().cpu(), reference.float().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def _report(prompt: int, method: str, r: dict, floor_ms: float) -> None:
    err = r["verify"].get("rel_err_vs_hf")
    print(f"prompt {prompt}: {method}: verify {r['verify']['ms']:.2f} ms ({r['verify']['ms'] / floor_ms:.2f}x floor)"
          f", decode {r['decode']['ms']:.2f} ms" + ("" if err is None else f", rel. err vs HF {err:.1e}"),
          file=sys.stderr)


def render_table(results: dict) -> str:
    """Markdown table: per prompt and method, the step times and their ratio to the weight floor."""
    floor = results["floor_ms"]
    pool = results.get("kv_pool", {})
    lines = [
        f"{results['date']}, {results['device']}, {results['model']} {results['dtype']}"
        f"{' (SMOKE)' if results['smoke'] else ''}: weights {results['weight_bytes'] / 1e9:.2f} GB, copy bandwidth "
        f"{results['copy_bandwidth_TBps']:.2f} TB/s, weight floor {floor:.2f} ms; KV pool {pool.get('tokens')} "
        f"tokens ({pool.get('reason')}); medians of {results['reps']} steps.",
        "",
        "| prompt | method | verify t=64 ms | x floor | decode ms | x floor | prefill s | rel. err vs HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prompt, methods in results["prompts"].items():
        for name, r in methods.items():
            err = r["verify"].get("rel_err_vs_hf")
            lines.append(f"| {prompt} | {name} | {r['verify']['ms']:.2f} | {r['verify']['ms'] / floor:.2f} | "
                         f"{r['decode']['ms']:.2f} | {r['decode']['ms'] / floor:.2f} | {r['prefill_s']:.2f} | "
                         f"{'' if err is None else f'{err:.1e}'} |")
    for name, error in results.get("errors", {}).items():
        lines.append(f"\n{name} failed: {error.splitlines()[0] if error else ''}")
    return "\n".join(lines)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    """Collect garbage and, on a GPU, give the cached blocks back (between runs of fresh engines)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a named size of treedec.models.MODEL_SIZES")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="prompt lengths, comma-separated (default 4000,32000; smoke 200,1600)")
    parser.add_argument("--tree", type=int, default=64, help="Medusa token-tree size (workloads/deft/speculative)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all on a GPU; "
                             f"hf_sdpa,treedec_eager on a CPU)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for the results JSON")
    parser.add_argument("--tag", default=None, help="appended to the results file name (e.g. p32k)")
    parser.add_argument("--smoke", action="store_true", help="tiny config on any device, for CI")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
