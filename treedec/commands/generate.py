"""``treedec generate``: a prompts file run as one batch over the forest; a results file out.

    treedec generate --prompts requests.jsonl --out results.jsonl          # tiny random model, CPU
    treedec generate --model /models/Llama-3.1-8B-Instruct --chat-template \\
        --prompts requests.jsonl --out results.jsonl --max-new-tokens 256 --temperature 0.7

Each line of the prompts file is a request (``prompt``, ``messages`` or ``prompt_ids``, and
its own ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``n``: see :mod:`treedec.search.requests_file`); the flags give the
defaults for what a line leaves out. All requests run batched
(:func:`~treedec.search.batch.generate_batch`): admitted while the KV pool holds their worst
case, one engine step per iteration for every live request, prompts that start alike sharing
one copy of their common prefix. The results file (JSONL) has one line per output (``id``,
``index``, ``output_ids``, ``text``, ``stop_reason``, ...), each request's lines appended as it
finishes, so the order is the order the requests finish and a run that fails keeps every
finished request's results (:mod:`treedec.commands.batch_io`). Text prompts, text outputs and
stop strings need ``--model`` (its tokenizer); the tiny random default takes ``prompt_ids`` only.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from tqdm import tqdm

from treedec.commands.args import (add_model_arguments, backend_arg, check_backend, existing_file, load_model,
                                   nonnegative_float, output_file, positive_float, positive_int, seed_int)
from treedec.commands.batch_io import ResultsWriter, read_prompts, request_name
from treedec.commands.kv_memory import build_engine
from treedec.models.text import load_tokenizer
from treedec.search.batch import generate_batch

CPU_KV_TOKENS = 32768  # the CPU pool's default size in tokens (no free-memory query there)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="run a prompts file (JSONL) as one batch; write a results file",
                       description="Batched generation: every request of a prompts JSONL file, sampled or greedy "
                                   "with its own stop rule, in one forest; one results line per output.")
    p.add_argument("--prompts", type=existing_file, required=True,
                   help="JSONL, one request per line: {\"prompt\" | \"messages\" | \"prompt_ids\": ..., "
                        "\"max_new_tokens\": 32, \"stop\": [...], \"temperature\": 0.7, \"n\": 2, ...}")
    p.add_argument("--out", type=output_file, required=True,
                   help="results JSONL: one line per output, each request's written as it finishes")
    add_model_arguments(p)
    p.add_argument("--chat-template", action="store_true",
                   help="render text prompts through the tokenizer's chat template (messages always are)")
    g = p.add_argument_group("defaults for what a prompts line leaves out")
    g.add_argument("--max-new-tokens", type=positive_int)
    g.add_argument("--temperature", type=nonnegative_float, help="0: greedy")
    g.add_argument("--top-p", type=positive_float)
    g.add_argument("--top-k", type=positive_int)
    g.add_argument("--n", type=positive_int, help="outputs per request")
    g.add_argument("--stop", action="append", help="a stop string (repeat the flag for several)")
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-tokens", type=positive_int,
                   help=f"KV pool size; default: on a GPU what free memory holds, on the CPU {CPU_KV_TOKENS} (requests "
                        f"wait for pages when the pool is full)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="random weights, and the draws of requests without a seed of their own")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_generate(args: argparse.Namespace) -> int:
    """Read the prompts, load the model and tokenizer, run the batch, write the results; a summary on stderr."""
    defaults = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_p", "top_k", "n")
                if getattr(args, name) is not None}
    if args.stop:
        defaults["stop"] = args.stop
    specs = read_prompts(args.prompts, defaults)
    check_backend(args)
    model, name = load_model(args)
    tokenizer = load_tokenizer(args.model) if args.model is not None else None
    kv_tokens = args.kv_tokens
    if kv_tokens is None and model.device.type != "cuda":
        kv_tokens = CPU_KV_TOKENS
    engine = build_engine(model, kv_tokens, args.page_size, backend=args.backend,
                          cuda_graphs=model.device.type == "cuda")
    generator = torch.Generator(model.device).manual_seed(args.seed)

    def done(outputs) -> None:
        writer.write(outputs[0].id, [dataclasses.asdict(r) for r in outputs])
        bar.update(1)

    with (tqdm(total=len(specs), unit="request", desc="generate", disable=args.no_progress or None,
              file=sys.stderr) as bar,   # (None: on a terminal only; errors stay one line in logs)
          ResultsWriter(args.out, {spec.id: request_name(spec.id, spec.line) for spec in specs}) as writer):
        results, stats = generate_batch(engine, specs, tokenizer, args.chat_template, generator, on_request_done=done)
    tokens = sum(len(r.output_ids) for r in results)
    reasons = {reason: sum(r.stop_reason == reason for r in results) for reason in ("eos", "stop_string", "length")}
    print(f"{name}: {len(specs)} requests, {len(results)} outputs, {tokens} tokens in {stats.seconds:.2f} s "
          f"({tokens / max(stats.seconds, 1e-9):.1f} tokens/s), {stats.steps} batched steps (up to "
          f"{max(stats.programs_per_step, default=0)} requests a step), {stats.waits} waits for pages, stop reasons "
          f"{reasons}; results in {args.out}", file=sys.stderr)
    return 0
