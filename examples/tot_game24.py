#!/usr/bin/env python3
"""Tree-of-Thought BFS on the Game of 24, then DFS on the same problem. Each level's thoughts are
branches of the kept states' nodes and decode together, one engine step per token; each thought is
judged by a value prompt under its own node (reading the thought's KV in place); the thoughts not
kept are pruned and their pages freed.

    python examples/tot_game24.py                                      # random tiny model, CPU
    python examples/tot_game24.py --model /models/Llama-3.1-8B-Instruct --numbers 3 3 8 8

``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too).
"""
from __future__ import annotations

import argparse

from treedec.commands.args import add_model_arguments, load_model, positive_int, seed_int
from treedec.engine import Engine
from treedec.models import load_tokenizer
from treedec.programs.tot.game24 import Game24Task, solve
from treedec.programs.tot import BFSConfig, ByteTokenizer, DFSConfig, HFTokenizer, tot_bfs, tot_dfs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--numbers", type=positive_int, nargs=4, default=[4, 9, 10, 13])
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights (default 0)")
    args = parser.parse_args()

    model, _ = load_model(args)
    if args.model is not None:
        tokenizer = HFTokenizer(load_tokenizer(args.model))
        task, threshold = Game24Task(tuple(args.numbers)), 1.0   # DFS goes on from 'likely' and 'sure' steps
    else:   # random weights write no valid step: the model judges every thought anyway, all of them pass DFS
        tokenizer = ByteTokenizer()
        task = Game24Task(tuple(args.numbers), check_steps=False, thought_max_tokens=12, value_max_tokens=4)
        threshold = 0.0
    engine = Engine(model, kv_tokens=None if model.device.type == "cuda" else 32768)
    print(f"{args.numbers}: a solution is {solve(args.numbers)}")

    for name, search, config in [("BFS", tot_bfs, BFSConfig(k=4, n=2, depth=4)),
                                 ("DFS", tot_dfs, DFSConfig(k=3, depth=4, threshold=threshold, max_expansions=8))]:
        result = search(engine, task, tokenizer, config)
        print(f"\nToT-{name}: {len(result.levels)} expansions, {result.tokens_generated} tokens in "
              f"{result.wall_s:.2f} s, solved: {result.solved is not None}")
        for s in result.levels:
            print(f"  depth {s.depth}: {s.thoughts} thoughts, {s.kept} kept, {s.steps} steps, "
                  f"{s.tokens_per_s:.0f} tokens/s, {s.pages_peak} pages at most, {s.pages_after} after pruning")
        for state in ([result.solved] if result.solved else result.best[:2]):
            print(f"  value {state.value:.3g}: " + " | ".join(repr(t) for t in state.thoughts))
        assert engine.pool.num_free_pages == engine.pool.num_pages   # the search freed every page


if __name__ == "__main__":
    main()
