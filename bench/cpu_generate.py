#!/usr/bin/env python3
"""Greedy decoding on the CPU: treedec against transformers' ``generate``, same model, prompt, process and threads.

The model is SmolLM2-135M-Instruct in float32 (treedec's known model ``smollm2``:
:func:`treedec.models.resolve_model` fetches and converts it once); transformers loads the same converted
folder. A chat prompt goes through the checkpoint's chat template; both decode ``--max-new-tokens`` tokens
greedily (no EOS stop, so both run every step), in alternating rounds after one warm-up of each, so that
the load of a shared machine falls on both alike. The tokens must be identical (the script fails if not).

    python bench/cpu_generate.py                         # 3 rounds of 64 tokens, torch's thread count
    python bench/cpu_generate.py --threads 1 --rounds 5
    python bench/cpu_generate.py --smoke                 # 1 round of 4 tokens (CI)

Prints a table (tokens/s of each round and the medians, transformers' time / treedec's, the same of CPU
time, which a loaded machine disturbs less) and writes ``<--out>/<date>-cpu-generate[-tag].json``
(default folder ``bench/results``): the machine (CPU model, cores, threads), versions, the attention
forms the torch backend chose, every round's numbers and the medians. Progress per round on stderr.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import versions, write_results  # noqa: E402
from treedec.attention.backends import TorchBackend  # noqa: E402
from treedec.engine import Engine  # noqa: E402
from treedec.models import encode_prompt, from_pretrained, load_tokenizer, resolve_model  # noqa: E402
from treedec.programs.greedy import greedy_generate  # noqa: E402

PROMPT = "Explain what a hash table is to a new programmer."


def cpu_facts() -> dict:
    """The CPU model (``/proc/cpuinfo``), the logical cores this process may use, and torch's threads."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS")}


class Timed(NamedTuple):
    """One generation: its new tokens, wall seconds and CPU seconds of this process (all its threads)."""

    tokens: list[int]
    seconds: float
    cpu_seconds: float


def run_treedec(engine: Engine, prompt: list[int], new: int) -> Timed:
    """treedec's greedy decoding of one request (the prompt's prefill included), its tree freed after."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = greedy_generate(engine, prompt, new, eos_token_id=None)
    timed = Timed(tokens, time.perf_counter() - wall, time.process_time() - cpu)
    for root in engine.tree.roots:
        engine.tree.prune(root)
    return timed


@torch.inference_mode()
def run_hf(hf, prompt: list[int], new: int) -> Timed:
    """transformers' greedy ``generate`` (no EOS stop, so every token is decoded)."""
    ids = torch.tensor([prompt])
    wall, cpu = time.perf_counter(), time.process_time()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=None,
                      pad_token_id=0)
    return Timed(out[0, len(prompt):].tolist(), time.perf_counter() - wall, time.process_time() - cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds after one warm-up")
    parser.add_argument("--prompt", default=PROMPT, help="the user message (through the chat template)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"),
                        help="folder of the results file <date>-cpu-generate[-smoke][-tag].json")
    parser.add_argument("--tag", default="", help="added to the file name")
    parser.add_argument("--smoke", action="store_true", help="1 round of 4 tokens (a -smoke file)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.max_new_tokens = 1, 4
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    facts = cpu_facts()
    print(f"{facts['cpu']}: {facts['usable_cores']} usable cores, torch threads {facts['torch_threads']} "
          f"({'--threads' if args.threads is not None else 'torch default'})", file=sys.stderr)

    from transformers import AutoModelForCausalLM

    resolved = resolve_model("smollm2")
    model = from_pretrained(resolved, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(resolved.checkpoint, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(resolved)
    prompt = encode_prompt(tokenizer, args.prompt, chat_template=True)
    engine = Engine(model, kv_tokens=len(prompt) + args.max_new_tokens + args.page_size, page_size=args.page_size)

    run_treedec(engine, prompt, args.max_new_tokens)   # warm-up
    run_hf(hf, prompt, args.max_new_tokens)
    engine.attn.backend_impl.forms.clear()
    rounds = []
    for r in range(args.rounds):
        ours = run_treedec(engine, prompt, args.max_new_tokens)
        theirs = run_hf(hf, prompt, args.max_new_tokens)
        if ours.tokens != theirs.tokens:
            first = next(i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b)
            raise SystemExit(f"round {r + 1}: the tokens differ at {first}: treedec {ours.tokens[first:first + 5]}, "
                             f"transformers {theirs.tokens[first:first + 5]}")
        n = len(ours.tokens)
        rounds.append({"treedec_s": ours.seconds, "transformers_s": theirs.seconds,
                       "treedec_cpu_s": ours.cpu_seconds, "transformers_cpu_s": theirs.cpu_seconds,
                       "treedec_tok_s": n / ours.seconds, "transformers_tok_s": n / theirs.seconds,
                       "ratio": theirs.seconds / ours.seconds, "cpu_ratio": theirs.cpu_seconds / ours.cpu_seconds})
        print(f"round {r + 1}/{args.rounds}: treedec {n / ours.seconds:.2f} tok/s, transformers "
              f"{n / theirs.seconds:.2f} tok/s", file=sys.stderr)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    forms = dict(engine.attn.backend_impl.forms) if isinstance(engine.attn.backend_impl, TorchBackend) else {}

    print(f"\n{args.max_new_tokens} greedy tokens, {len(prompt)}-token prompt, float32, "
          f"{torch.get_num_threads()} thread(s), tokens identical; attention {engine.attn.backend} {forms}")
    print("| round | treedec tok/s | transformers tok/s | treedec / transformers | CPU-time ratio |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(rounds):
        print(f"| {i + 1} | {r['treedec_tok_s']:.2f} | {r['transformers_tok_s']:.2f} | {r['ratio']:.3f} | "
              f"{r['cpu_ratio']:.3f} |")
    print(f"| median | {medians['treedec_tok_s']:.2f} | {medians['transformers_tok_s']:.2f} | "
          f"{medians['ratio']:.3f} | {medians['cpu_ratio']:.3f} |")
    results = {"device": "cpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": facts, "threads_from": "--threads" if args.threads is not None else "torch default",
               "versions": versions("transformers", "numpy"), "model": "smollm2 (SmolLM2-135M-Instruct, float32)",
               "prompt": args.prompt, "prompt_tokens": len(prompt), "max_new_tokens": args.max_new_tokens,
               "page_size": args.page_size, "attention_backend": engine.attn.backend, "attention_forms": forms,
               "tokens": ours.tokens, "rounds": rounds, "medians": medians,
               "note": "tokens/s count the prompt's prefill and every new token; alternating rounds after one "
                       "warm-up of each; tokens identical in every round; ratio = transformers' seconds / "
                       "treedec's (> 1: treedec faster), cpu_ratio the same of the process's CPU seconds"}
    write_results(results, args.out, "generate", args.smoke, args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
