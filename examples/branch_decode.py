#!/usr/bin/env python3
"""Branching greedy decoding on treedec: one prompt, k branches (its top-k first tokens), then
``--steps`` steps that each run one forward over one new token per branch. The prompt's KV is
stored once and read once per step for all branches (tree attention).

    python examples/branch_decode.py                                   # random tiny model, CPU or GPU
    python examples/branch_decode.py --checkpoint /models/Llama-3.1-8B-Instruct --prompt "The capital of"
"""
from __future__ import annotations

import argparse
import time

import torch

from treedec.engine import Engine, greedy
from treedec.models import from_config, from_pretrained, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="local Hugging Face checkpoint directory (default: random tiny model)")
    parser.add_argument("--prompt", default="Tree attention reads a shared prefix once because")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cuda-graphs", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    tokenizer = None
    if args.checkpoint:
        model = from_pretrained(args.checkpoint)
        tokenizer = load_tokenizer(args.checkpoint)
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    else:
        model = from_config("tiny", dtype=torch.bfloat16 if cuda else torch.float32)
        prompt_ids = [ord(c) % model.config.vocab_size for c in args.prompt]
    engine = Engine(model, kv_tokens=None if cuda else 8192, cuda_graphs=args.cuda_graphs and cuda)
    print(f"KV pool: {engine.kv_capacity_tokens} tokens ({engine.kv_pool_reason}); attention: {engine.attn.backend}")

    root = engine.prefill(prompt_ids)
    firsts = root.logits.topk(args.branches).indices.tolist()
    leaves = engine.tree.branch(root.node, [[t] for t in firsts])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        nodes = engine.pending_nodes()                     # one pending token per leaf: the step's queries
        next_tokens = greedy(engine.step().logits).tolist()
        engine.tree.extend_many({int(n): [t] for n, t in zip(nodes, next_tokens)})
    engine.step()                                          # the last tokens' K/V (their logits unused)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    print(f"{args.steps + 1} steps x {len(leaves)} branches in {elapsed:.2f} s "
          f"({(args.steps + 1) * len(leaves) / elapsed:.0f} tokens/s)")
    for leaf in leaves:
        ids = engine.tree.tokens(leaf)
        print(f"branch {leaf}: {tokenizer.decode(ids) if tokenizer else ids}")


if __name__ == "__main__":
    main()
