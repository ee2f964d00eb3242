"""What does each tree edit of a speculative step cost on the host?

Drives a bookkeeping-only :class:`~treedec.tree.SequenceTree` (no K/V tensors: moving the accepted
tokens' K/V is device work, not a tree edit) through the edits the search programs make per step,
with the arguments they pass (lists of Python ints), over a 4000-token prompt:

- ``medusa_verify``: ``search/speculative/program.py``'s fixed-tree step: ``extend`` the root token, ``add_token_tree``
  the 63 draft tokens of the Medusa-64 tree (``medusa_tree(64)``), ``layout``, ``commit_step``, then
  ``accept`` a root path of 1-4 tokens (the tree is 4 deep), one length per step in turn;
- ``eagle_layers``: ``tree_drafting.py``'s drafter (EAGLE-2 / draft model, depth 5, top-k 8): 4 layers
  of ``add_children`` (8 nodes under the previous layer's), each with ``layout`` and ``commit_step``;
  the next proposal's ``accept(node, [])`` frees them and ``extend`` adds 1-5 accepted tokens;
- ``eagle_chains``: ``eagle.py``'s greedy EAGLE-3 drafter: ``add_children`` of 8 chains, then 3 layers of
  ``slots`` of each chain and ``extend_many`` of the 8 chains by one token, ``accept(node, [])`` and
  ``extend`` as above;
- ``decode_8`` / ``decode_64``: batched decoding of 8 / 64 leaves under the prompt, ``extend_many``
  of one token each, ``layout``, ``commit_step``;
- ``lanes_64x4k``: issue 49's lanes: 64 requests, each a 4000-token prompt with one growing leaf, one decode
  step for all: ``append`` one token to each leaf (``append_tokens`` where the tree has it, else
  ``extend_many`` of one token each), ``layout``, ``queries`` (the step's query slots, token ids and
  positions: ``pending_queries``, else the layout's and ``pending_tokens``), ``commit_step``;
- ``beam_8``: ``beam.py``-like: 8 beams each ``branch`` into 2 one-token children, ``layout``,
  ``commit_step``, then ``prune`` of the worse child of each (pages freed);
- ``*_x8`` / ``*_x32``: a forest of 8 / 32 requests doing the same in one step (one layout, one commit).

``--tree reference`` drives the object tree (``treedec.tree.reference``) instead of ``SequenceTree``; run
on an older checkout (``PYTHONPATH``), ``SequenceTree`` is that checkout's.

Page sizes 1 and 16. Each edit's cost per step (the sum over its calls in the step) is the median of
``--steps`` steps after ``--warmup`` steps, in microseconds, of wall time and of this thread's CPU time
(the table shows ``--clock``); a shared or loaded machine moves these numbers, so compare versions in
one session. Writes ``bench/results/<date>-tree-edit-cost-cpu[-tag].json``.

    python bench/tree_edit_cost.py [--steps 400] [--rounds 3] [--page-sizes 1 16] [--cases medusa_verify ...]
                                   [--tree SequenceTree|reference] [--tag before]
    python bench/tree_edit_cost.py --profile medusa_verify --page-sizes 16   # cProfile: own time per function
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import treedec
from treedec.tree import PagedKVPool, SequenceTree, TokenTree
from treedec.workloads.deft import medusa_tree

PROMPT = 4000
TREES = {"SequenceTree": lambda: SequenceTree}
try:   # (an older checkout, run for the numbers before, has no reference package)
    from treedec.tree.reference import ReferenceSequenceTree
    TREES["reference"] = lambda: ReferenceSequenceTree
except ImportError:
    pass
TREE = ["SequenceTree"]   # the class the cases drive (--tree)


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def clock_overhead_ns(clock) -> float:
    """Median cost of reading ``clock`` twice around nothing: subtracted from every timed call."""
    samples = []
    for _ in range(2000):
        t0 = clock()
        samples.append(clock() - t0)
    return float(np.median(samples))


class EditTimer:
    """Per-step sums of each edit's time on both clocks, keyed by edit name: wall time (perf_counter)
    and this thread's CPU time (thread_time, which leaves out the time other processes of a shared
    machine hold the core), each less the clock's own overhead."""

    overhead_ns = {name: clock_overhead_ns(clock) for name, clock in CLOCKS.items()}

    def __init__(self):
        self.step: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[tuple[str, str], list[float]] = defaultdict(list)

    def __call__(self, name: str, fn, *args):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        out = fn(*args)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        self.step["wall", name] += w1 - w0 - self.overhead_ns["wall"]
        self.step["cpu", name] += c1 - c0 - self.overhead_ns["cpu"]
        return out

    def end_step(self, record: bool) -> None:
        if record:
            for key, ns in self.step.items():
                self.steps[key].append(ns / 1e3)
        self.step = defaultdict(float)


def fresh_tree(page_size: int, requests: int, extra_tokens: int) -> tuple[SequenceTree, list[int]]:
    """``requests`` committed 4000-token prompts in a pool with room for ``extra_tokens`` more per request."""
    per_request = -(-(PROMPT + extra_tokens) // page_size) + 64
    tree = TREES[TREE[0]]()(PagedKVPool(requests * per_request, page_size, allocate_storage=False))
    roots = [tree.add_prompt(list(range(PROMPT))) for _ in range(requests)]
    tree.commit_step()
    return tree, roots


def root_paths(parents: list[int]) -> dict[int, list[int]]:
    """For each depth, one root path of that length (token indices, parents first): the first-born chain."""
    chain, i, out = [], -1, {}
    while True:
        children = [j for j, p in enumerate(parents) if p == i]
        if not children:
            return out
        i = children[0]
        chain.append(i)
        out[len(chain)] = list(chain)


def medusa_verify(page_size: int, requests: int, steps: int, warmup: int) -> EditTimer:
    draft_parents = TokenTree(tuple(int(p) for p in medusa_tree(64).parents)).draft_parents()
    paths = root_paths(draft_parents)
    tree, roots = fresh_tree(page_size, requests, (steps + warmup) * (len(paths) + 1))
    timer, rng = EditTimer(), np.random.default_rng(0)
    for step in range(warmup + steps):
        ids = {}
        for r in roots:
            timer("extend", tree.extend, r, [int(rng.integers(32000))])
            drafts = rng.integers(0, 32000, len(draft_parents)).tolist()
            ids[r] = timer("add_token_tree", tree.add_token_tree, r, drafts, draft_parents)
        timer("layout", tree.layout)
        timer("commit_step", tree.commit_step)
        path = paths[1 + step % len(paths)]
        for r in roots:
            timer("accept", tree.accept, r, [ids[r][i] for i in path])
        timer.end_step(step >= warmup)
    return timer


def _drafter_step(tree: SequenceTree, timer: EditTimer) -> None:
    timer("layout", tree.layout)
    timer("commit_step", tree.commit_step)


def _next_proposal(tree: SequenceTree, timer: EditTimer, roots: list[int], step: int) -> None:
    """The next proposal's sync: the last tree freed, the accepted tokens (1-5) appended and computed."""
    for r in roots:
        timer("accept", tree.accept, r, [])
    for r in roots:
        timer("extend", tree.extend, r, list(range(1 + step % 5)))
    _drafter_step(tree, timer)


def eagle_layers(page_size: int, requests: int, steps: int, warmup: int, depth: int = 5, top_k: int = 8) -> EditTimer:
    tree, roots = fresh_tree(page_size, requests, (steps + warmup) * (depth * top_k + 6))
    timer, rng = EditTimer(), np.random.default_rng(0)
    for step in range(warmup + steps):
        frontier = {r: [r] * top_k for r in roots}
        for _ in range(depth - 1):
            for r in roots:
                parents = [frontier[r][i] for i in np.sort(rng.integers(0, top_k, top_k))]
                tokens = rng.integers(0, 32000, top_k).tolist()
                frontier[r] = timer("add_children", tree.add_children, parents, tokens)
            _drafter_step(tree, timer)
        _next_proposal(tree, timer, roots, step)
        timer.end_step(step >= warmup)
    return timer


def eagle_chains(page_size: int, requests: int, steps: int, warmup: int, depth: int = 5, top_k: int = 8) -> EditTimer:
    tree, roots = fresh_tree(page_size, requests, (steps + warmup) * (depth * top_k + 6))
    timer = EditTimer()
    for step in range(warmup + steps):
        chains = {r: timer("add_children", tree.add_children, [r] * top_k, [0] * top_k) for r in roots}
        _drafter_step(tree, timer)
        for _ in range(2, depth):
            for r in roots:
                for c in chains[r]:
                    timer("slots", tree.slots, c)
                timer("extend_many", tree.extend_many, {c: [0] for c in chains[r]})
            _drafter_step(tree, timer)
        _next_proposal(tree, timer, roots, step)
        timer.end_step(step >= warmup)
    return timer


def decode(page_size: int, requests: int, steps: int, warmup: int, leaves: int) -> EditTimer:
    tree, roots = fresh_tree(page_size, requests, (steps + warmup + page_size) * leaves)
    grow = [leaf for r in roots for leaf in tree.branch(r, [[0]] * leaves)]
    tree.commit_step()
    timer, rng = EditTimer(), np.random.default_rng(0)
    for step in range(warmup + steps):
        tokens = rng.integers(0, 32000, len(grow)).tolist()
        timer("extend_many", tree.extend_many, dict(zip(grow, ([t] for t in tokens))))
        timer("layout", tree.layout)
        timer("commit_step", tree.commit_step)
        timer.end_step(step >= warmup)
    return timer


def lanes(page_size: int, requests: int, steps: int, warmup: int) -> EditTimer:
    """One growing leaf under each request's prompt; a decode step appends one token to every leaf."""
    tree, roots = fresh_tree(page_size, requests, steps + warmup + page_size)
    grow = [tree.branch(r, [[0]])[0] for r in roots]
    tree.commit_step()
    batched = hasattr(tree, "append_tokens")   # the array tree's batch operations, else the per-node API
    timer, rng = EditTimer(), np.random.default_rng(0)
    for step in range(warmup + steps):
        tokens = rng.integers(0, 32000, len(grow))
        if batched:
            timer("append", tree.append_tokens, grow, tokens)
        else:
            timer("append", tree.extend_many, dict(zip(grow, ([t] for t in tokens.tolist()))))
        layout = timer("layout", tree.layout)
        if batched:
            timer("queries", tree.pending_queries)
        else:
            timer("queries", lambda: (layout.query_slot, tree.pending_tokens(), layout.query_position))
        timer("commit_step", tree.commit_step)
        timer.end_step(step >= warmup)
    return timer


def beam(page_size: int, requests: int, steps: int, warmup: int, width: int = 8) -> EditTimer:
    tree, roots = fresh_tree(page_size, requests, (steps + warmup + 2) * width * 2 * page_size)
    beams = [leaf for r in roots for leaf in tree.branch(r, [[0]] * width)]
    tree.commit_step()
    timer, rng = EditTimer(), np.random.default_rng(0)
    for step in range(warmup + steps):
        pairs = [timer("branch", tree.branch, b, [[int(t)] for t in rng.integers(0, 32000, 2)]) for b in beams]
        timer("layout", tree.layout)
        timer("commit_step", tree.commit_step)
        keep = rng.integers(0, 2, len(pairs))
        for (a, b), k in zip(pairs, keep):
            timer("prune", tree.prune, b if k == 0 else a)
        beams = [pair[k] for pair, k in zip(pairs, keep)]
        timer.end_step(step >= warmup)
    return timer


CASES = {
    "medusa_verify": lambda ps, s, w: medusa_verify(ps, 1, s, w),
    "medusa_verify_x8": lambda ps, s, w: medusa_verify(ps, 8, s, w),
    "medusa_verify_x32": lambda ps, s, w: medusa_verify(ps, 32, s, w),
    "eagle_layers": lambda ps, s, w: eagle_layers(ps, 1, s, w),
    "eagle_layers_x8": lambda ps, s, w: eagle_layers(ps, 8, s, w),
    "eagle_chains": lambda ps, s, w: eagle_chains(ps, 1, s, w),
    "decode_8": lambda ps, s, w: decode(ps, 1, s, w, 8),
    "decode_64": lambda ps, s, w: decode(ps, 1, s, w, 64),
    "decode_x8": lambda ps, s, w: decode(ps, 8, s, w, 1),
    "lanes_64x4k": lambda ps, s, w: lanes(ps, 64, s, w),
    "beam_8": lambda ps, s, w: beam(ps, 1, s, w),
}


def summarize(timer: EditTimer) -> dict:
    """Per clock: the median (and 90th percentile) microseconds per step of each edit, and of the
    step's edits together."""
    out = {}
    for clock in CLOCKS:
        series = {name: v for (c, name), v in timer.steps.items() if c == clock}
        series["step_total"] = np.sum(list(series.values()), axis=0)
        out[clock] = {name: {"median_us": round(float(np.median(v)), 1), "p90_us": round(float(np.percentile(v, 90)), 1)}
                      for name, v in series.items()}
    return out


def lowest(rows: tuple[dict, ...]) -> dict:
    """One case's results over several rounds: per clock and edit, the round with the lowest median (a shared
    machine's other work only adds time), with every round's median beside it."""
    out = {"case": rows[0]["case"], "page_size": rows[0]["page_size"], "edits": {}}
    for clock, edits in rows[0]["edits"].items():
        out["edits"][clock] = {}
        for name in edits:
            best = min((r["edits"][clock][name] for r in rows), key=lambda e: e["median_us"])
            out["edits"][clock][name] = {**best, "round_medians_us": [r["edits"][clock][name]["median_us"] for r in rows]}
    return out


def profile(case: str, page_size: int, steps: int, warmup: int, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    CASES[case](page_size, steps, warmup)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every case this many times and keep, per edit, the lowest median")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--profile", choices=sorted(CASES), help="cProfile one case (no results file)")
    parser.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="the table's clock (the results file holds both): cpu leaves out the time other "
                             "processes hold the core, which a shared machine's wall clock counts")
    parser.add_argument("--tree", choices=sorted(TREES), default="SequenceTree",
                        help="the tree class the cases drive: SequenceTree (this checkout's) or the object reference")
    parser.add_argument("--tag", default="", help="appended to the results file's name")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    TREE[0] = args.tree
    if args.profile:
        for ps in args.page_sizes:
            print(f"== {args.profile}, page size {ps}")
            profile(args.profile, ps, args.steps, args.warmup, args.top)
        return
    rounds = [[{"case": case, "page_size": ps, "edits": summarize(CASES[case](ps, args.steps, args.warmup))}
               for case in args.cases for ps in args.page_sizes] for _ in range(args.rounds)]
    rows = [lowest(same) for same in zip(*rounds)]
    table = [(r["case"], r["page_size"], r["edits"][args.clock]) for r in rows]
    edits = list(dict.fromkeys(e for _, _, t in table for e in t if e != "step_total")) + ["step_total"]
    print(f"median us per step ({args.clock} time; the sum over the step's calls of each edit); "
          f"{args.steps} steps after {args.warmup}" + (f", the lowest of {args.rounds} rounds" if args.rounds > 1 else ""))
    print(f"{'case':<18}{'page':>5}" + "".join(f"{e:>15}" for e in edits))
    for case, ps, t in table:
        print(f"{case:<18}{ps:>5}" + "".join(f"{t[e]['median_us']:>15.1f}" if e in t else f"{'':>15}" for e in edits))
    result = {"date": datetime.date.today().isoformat(), "device": f"CPU {platform.processor() or platform.machine()}",
              "cpu_count": os.cpu_count(), "host": platform.node(),
              "versions": {"python": platform.python_version(), "numpy": np.__version__},
              "treedec": str(Path(treedec.__file__).resolve().parent), "tag": args.tag, "prompt_tokens": PROMPT,
              "tree": f"{TREES[args.tree]().__module__}.{TREES[args.tree]().__name__}",
              "clock_overhead_ns": EditTimer.overhead_ns, "steps": args.steps, "warmup": args.warmup,
              "rounds": args.rounds,
              "argv": sys.argv[1:], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['date']}-tree-edit-cost-cpu{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
