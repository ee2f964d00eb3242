#!/usr/bin/env python3
"""Branching greedy decoding on treedec: one prompt, k branches (its top-k first tokens), then
``--steps`` steps that each run one forward over one new token per branch. The prompt's KV is
stored once and read once per step for all branches (tree attention).

    python examples/branch_decode.py                                   # random tiny model, CPU
    python examples/branch_decode.py --model smollm2 --prompt "The capital of France is"

``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too).
"""
from __future__ import annotations

import argparse
import time

import torch

from treedec.commands.args import add_model_arguments, load_model, positive_int, seed_int
from treedec.engine import Engine, greedy
from treedec.models import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="Tree attention reads a shared prefix once because")
    parser.add_argument("--branches", type=positive_int, default=4)
    parser.add_argument("--steps", type=positive_int, default=16)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights (default 0)")
    args = parser.parse_args()

    model, _ = load_model(args)
    cuda = model.device.type == "cuda"
    tokenizer = None
    if args.model is not None:
        tokenizer = load_tokenizer(args.model)
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    else:
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
