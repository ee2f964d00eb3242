"""bench/programs.py's transformers rows: HF's decode and verify steps, and the logits yardstick.

transformers runs ``bench/step.py``'s steps (sdpa, 4D tree mask, on views of the same
weights) repeated over a cropped cache; each prompt length also gets the yardstick for
treedec-vs-transformers differences (:func:`logits_yardstick`).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from bench.program_runs import Workload
from bench.step import free_memory, hf_cache_kwargs, hf_model, hf_tree_inputs, rel_err, time_hf_steps
from treedec.engine import Engine

#: bench/step.py's step that matches each program.
HF_STEPS = {"greedy": "decode", "tree_verify": "verify"}


def bench_hf(work: Workload, prompt_ids: dict, args, bandwidth: float, kv_bytes_per_token: int) -> list[dict]:
    """transformers sdpa: bench/step.py's decode and Medusa verify steps, repeated over a cropped cache; with
    each prompt's logits yardstick (:func:`logits_yardstick`)."""
    model = work.model
    hf = hf_model(model, model.device)
    rng = np.random.default_rng(args.seed + 1)
    tree_ids = [int(rng.integers(0, model.config.vocab_size))] + work.draft_tokens
    runs = []
    for p in args.prompts:
        steps, hf_logits = time_hf_steps(hf, prompt_ids[p], tree_ids, work.medusa, tree_ids[0], args.steps,
                                          model.device)
        yardstick = logits_yardstick(work, hf, prompt_ids[p], tree_ids, hf_logits, args)
        print(f"verify logits, {p}-token prompt, relative error: " + ", ".join(f"{k} {v:.2e}" for k, v in
                                                                                yardstick.items()), file=sys.stderr)
        for program, step in HF_STEPS.items():
            if program not in args.programs:
                continue
            kv = p + (1 if step == "decode" else work.medusa.size)
            floor_ms = 1e3 * (model.weight_bytes() + kv * kv_bytes_per_token) / bandwidth
            ms = steps[step]["wall_ms"]
            runs.append({"program": program, "prompt": p, "method": "hf_sdpa", "ms": ms,
                         "device_ms": steps[step]["ms"], "steps": args.steps, "prefill_s": steps["prefill_s"],
                         "kv_tokens": kv, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                         "verify_logits_rel_err": yardstick,
                         "note": f"bench/step.py's {step} step, repeated over a cropped DynamicCache"})
    return runs


@torch.inference_mode()
def logits_yardstick(work: Workload, hf, prompt: list[int], tree_ids: list[int], hf_sdpa: torch.Tensor,
                      args) -> dict:
    """Relative (Frobenius) differences of one Medusa-64 verify step's logits in the model dtype: transformers
    sdpa vs transformers eager attention (how far two correct implementations of the same step drift apart:
    the yardstick; the prompt's cache is prefilled with sdpa either way: eager attention over a 32000-token
    prompt would need 61 GiB), and treedec (a graphed engine, as the programs run) vs each."""
    from transformers import DynamicCache

    device = work.model.device
    cache = DynamicCache()
    hf(torch.tensor([prompt], device=device), **hf_cache_kwargs(hf, cache), use_cache=True, logits_to_keep=1)  # sdpa
    tree_input, positions, mask = hf_tree_inputs(len(prompt), tree_ids, work.medusa, work.model.dtype, device)
    hf.config._attn_implementation = "eager"   # LlamaAttention reads it at every call
    try:
        hf_eager = hf(tree_input, attention_mask=mask, position_ids=positions, **hf_cache_kwargs(hf, cache),
                      use_cache=True).logits[0].float().cpu()
    finally:
        hf.config._attn_implementation = "sdpa"
    del cache
    engine = Engine(work.model, kv_tokens=len(prompt) + 4 * work.medusa.size, page_size=args.page_size,
                    backend=args.backend, cuda_graphs=work.model.device.type == "cuda")
    root = engine.prefill(prompt).node
    ids = engine.tree.add_token_tree(root, tree_ids, work.medusa.parents)
    ours = engine.step(logits_rows=engine.pending_rows(ids)).logits.float().cpu()
    del engine
    free_memory(work.model.device)
    return {"hf_sdpa_vs_hf_eager": rel_err(hf_sdpa, hf_eager), "treedec_vs_hf_sdpa": rel_err(ours, hf_sdpa),
            "treedec_vs_hf_eager": rel_err(ours, hf_eager)}
