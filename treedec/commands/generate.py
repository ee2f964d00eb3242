"""``treedec generate``: one prompt streamed to the terminal, or a prompts file run as one batch (a results file out).

    treedec generate --model smollm2 --prompt "Name three primes."          # streams the answer (SmolLM2, CPU)
    treedec generate --model smollm2 --no-chat-template --prompt "Once upon a time" --max-tokens 64 \\
        --temperature 0.8 --top-p 0.95 --repetition-penalty 1.1 --seed 1
    treedec generate --prompts requests.jsonl --out results.jsonl          # tiny random model, CPU
    treedec generate --model /models/Llama-3.1-8B-Instruct --chat-template \\
        --prompts requests.jsonl --out results.jsonl --max-tokens 256 --temperature 0.7

A ``--prompt`` is decoded with the flags' :class:`~treedec.sampling.params.SamplingParams` (default greedy, as
``spec`` decodes; ``--temperature`` samples), its text streamed to stdout as the tokens come (each of ``--n``
outputs in turn when there are several), then a line of stats on stderr (and with ``--logprobs`` each token's
log-probability and the most likely others); ``--out`` also writes its results line(s). A model with a chat
template gets the prompt as a user message through it, as ``vllm chat`` and ``transformers chat`` do (a line on
stderr says so; ``--no-chat-template`` sends the text as it is, for a completion). Each line of a prompts file is
a request (``prompt``, ``messages`` or ``prompt_ids``, and
its own :class:`~treedec.sampling.params.SamplingParams`: ``max_tokens``, ``stop``, ``temperature``, ``n``, ...:
see :mod:`treedec.commands.requests_file`); the flags give the defaults for what a line leaves out (a line without a
temperature samples at vLLM's 1.0 unless ``--temperature`` says otherwise). All requests run batched
(:func:`~treedec.programs.generate.generate_batch`): admitted while the KV pool holds their worst
case, one engine step per iteration for every live request, prompts that start alike sharing
one copy of their common prefix. The results file (JSONL) has one line per output (``id``,
``index``, ``output_ids``, ``text``, ``stop_reason``, ...), each request's lines appended as it
finishes, so the order is the order the requests finish and a run that fails keeps every
finished request's results (:mod:`treedec.commands.batch_io`). A line's ``prompt`` is a completion, its
``messages`` a chat (as vLLM's ``/v1/completions`` and ``/v1/chat/completions``); ``--chat-template`` renders the
``prompt`` lines through the chat template too. Text prompts, text outputs and stop strings need ``--model`` (its
tokenizer); the tiny random default takes ``prompt_ids`` only. The KV pool (``--kv-tokens``; default on a GPU what
free memory holds, on the CPU what the requests need at most: :func:`~treedec.engine.pool_sizing.cpu_pool_tokens`)
is said on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from tqdm import tqdm

from treedec.commands.args import (add_model_arguments, backend_arg, check_backend, engine_options, existing_file,
                                   int_arg, load_model, logit_bias_pair, nonnegative_float, nonnegative_int,
                                   output_file, positive_float, positive_int, seed_int)
from treedec.commands.batch_io import ResultsWriter, read_prompts, request_kv_tokens, request_name
from treedec.commands.kv_memory import command_engine
from treedec.engine.pool_sizing import CPU_POOL_TOKENS
from treedec.models.text import check_text, load_tokenizer
from treedec.programs.generate import generate_batch, step_progress
from treedec.runtime.requests import RequestSpec
from treedec.commands.requests_file import write_results_jsonl
from treedec.sampling.params import SamplingParams


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate for one prompt (streamed) or a prompts file (JSONL, batched)",
                       description="Generation: one prompt's text streamed to the terminal, or every request of a "
                                   "prompts JSONL file, sampled or greedy with its own stop rule, in one forest; one "
                                   "results line per output.")
    p.add_argument("--prompt", help="a prompt to decode and stream (needs --model with a tokenizer)")
    p.add_argument("--prompts", type=existing_file,
                   help="JSONL, one request per line: {\"prompt\" | \"messages\" | \"prompt_ids\": ..., "
                        "\"max_tokens\": 32, \"stop\": [...], \"temperature\": 0.7, \"n\": 2, ...}")
    p.add_argument("--out", type=output_file,
                   help="results JSONL: one line per output, each request's written as it finishes (needed with "
                        "--prompts)")
    add_model_arguments(p, batch_invariant=True)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction,
                   help="render text prompts through the tokenizer's chat template as a user message (messages "
                        "always are); default: --prompt is when the tokenizer has one, a prompts file's 'prompt' "
                        "lines are not")
    g = p.add_argument_group("sampling (SamplingParams; with --prompts: the defaults for what a line leaves out)")
    g.add_argument("--max-tokens", type=positive_int, help="SamplingParams.max_tokens (default 16, or 256 for "
                                                           "--prompt)")
    g.add_argument("--temperature", type=nonnegative_float, help="0: greedy (a command-line prompt's default)")
    g.add_argument("--top-p", type=positive_float)
    g.add_argument("--top-k", type=positive_int)
    g.add_argument("--min-p", type=nonnegative_float)
    g.add_argument("--repetition-penalty", type=positive_float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--n", type=positive_int, help="outputs per request")
    g.add_argument("--stop", action="append", help="a stop string (repeat the flag for several)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="do not stop at the model's EOS ids")
    g.add_argument("--logprobs", type=nonnegative_int, help="log-probabilities of each token and the N most likely "
                                                             "(on stderr for --prompt, and in the results file)")
    g.add_argument("--min-tokens", type=nonnegative_int, help="no EOS or stop before this many tokens")
    g.add_argument("--logit-bias", type=logit_bias_pair, action="append", metavar="ID:BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (repeat the flag for several)")
    g.add_argument("--allowed-token-ids", type=nonnegative_int, action="append", metavar="ID",
                   help="only these tokens are drawn (repeat the flag for several)")
    g.add_argument("--bad-words", action="append", metavar="WORD",
                   help="a word never generated (repeat the flag for several)")
    g.add_argument("--truncate-prompt-tokens", type=int_arg(-1), metavar="K",
                   help="keep the prompt's last K tokens (-1: the model's positions)")
    g.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="leave special tokens out of the text (default on)")
    g.add_argument("--spaces-between-special-tokens", action=argparse.BooleanOptionalAction, default=None,
                   help="as the tokenizer decodes consecutive added tokens (default on)")
    g.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=None,
                   help="make the outputs' text (default on; off: token ids only)")
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-tokens", type=positive_int,
                   help=f"KV pool size in tokens; default: on a GPU what free memory holds, on the CPU what the "
                        f"requests need at most, up to {CPU_POOL_TOKENS} (requests wait for pages when the pool is "
                        f"full)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="random weights, and the draws of requests without a seed of their own")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.renamed = {"--max-new-tokens": "--max-tokens (SamplingParams.max_tokens, vLLM's name)"}


#: The sampling flags, as the SamplingParams fields they set.
FLAGS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
         "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "n": "n", "stop": "stop", "ignore_eos": "ignore_eos",
         "logprobs": "logprobs", "min_tokens": "min_tokens", "logit_bias": "logit_bias",
         "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words",
         "truncate_prompt_tokens": "truncate_prompt_tokens", "skip_special_tokens": "skip_special_tokens",
         "spaces_between_special_tokens": "spaces_between_special_tokens", "detokenize": "detokenize"}


def run_generate(args: argparse.Namespace) -> int:
    """Check the arguments and read the prompts, load the model and tokenizer, run, write the results; a summary on
    stderr."""
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("give --prompt TEXT or --prompts FILE, one of them")
    defaults = {field: getattr(args, flag) for flag, field in FLAGS.items() if getattr(args, flag) is not None}
    if "logit_bias" in defaults:   # (ID:BIAS pairs; a repeated ID: the last one)
        defaults["logit_bias"] = dict(defaults["logit_bias"])
    if args.prompt is not None:
        check_text(args.prompt, "the prompt")
        if args.model is None:
            raise ValueError("a text prompt needs --model with a tokenizer (e.g. --model smollm2); the tiny random "
                             "default takes a prompts file of prompt_ids")
        specs = [RequestSpec(0, prompt=args.prompt, params=SamplingParams(**{"temperature": 0.0, "max_tokens": 256,
                                                                             **defaults}))]
    else:
        if args.out is None:
            raise ValueError("--prompts needs --out results.jsonl")
        specs = read_prompts(args.prompts, defaults)
    check_backend(args)
    model, name = load_model(args)
    tokenizer = load_tokenizer(args.model) if args.model is not None else None
    chat = bool(args.chat_template)
    if args.prompt is not None and args.chat_template is None:
        chat = bool(getattr(tokenizer, "chat_template", None))   # (a tokenizer without one has None or "")
        print("prompt: sent as a user message through the model's chat template (--no-chat-template sends the text "
              "as it is)" if chat else "prompt: the text as it is (the tokenizer has no chat template)",
              file=sys.stderr)
    engine = command_engine(model, args.kv_tokens, args.page_size, request_kv_tokens(specs, tokenizer, chat,
                                                                                      args.page_size),
                            cuda_graphs=model.device.type == "cuda", **engine_options(args))
    generator = torch.Generator(model.device).manual_seed(args.seed)
    if args.prompt is not None:
        return _stream(args, engine, specs[0], tokenizer, chat, generator, name)

    def done(outputs) -> None:
        writer.write(outputs[0].id, [dataclasses.asdict(r) for r in outputs])
        bar.update(1)

    with (tqdm(total=len(specs), unit="request", desc="generate", disable=args.no_progress or None,
              file=sys.stderr) as bar,   # (None: on a terminal only; errors stay one line in logs)
          ResultsWriter(args.out, {spec.id: request_name(spec.id, spec.line) for spec in specs}) as writer):
        results, stats = generate_batch(engine, specs, tokenizer, chat, generator, on_request_done=done,
                                        on_step=step_progress(bar))
    tokens = sum(len(r.output_ids) for r in results)
    reasons = {reason: sum(r.stop_reason == reason for r in results) for reason in ("eos", "stop_string", "length")}
    print(f"{name}: {len(specs)} requests, {len(results)} outputs, {tokens} tokens in {stats.seconds:.2f} s "
          f"({tokens / max(stats.seconds, 1e-9):.1f} tokens/s), {stats.steps} batched steps (up to "
          f"{max(stats.programs_per_step, default=0)} requests a step), {stats.waits} waits for pages, stop reasons "
          f"{reasons}; results in {args.out}", file=sys.stderr)
    return 0


def _stream(args: argparse.Namespace, engine, spec: RequestSpec, tokenizer, chat: bool, generator, name: str) -> int:
    """Decode one prompt: the first output's text to stdout as it comes, the others' (``--n``) after it, each under
    a header; the stats on stderr (with ``--logprobs``, each token's); ``--out`` the results lines."""
    n = spec.params.n

    def on_text(_, index: int, delta: str) -> None:
        if index == 0:
            sys.stdout.write(delta)
            sys.stdout.flush()

    if n > 1:
        print("--- output 0 ---")
    results, stats = generate_batch(engine, [spec], tokenizer, chat, generator, on_text=on_text)
    if not spec.params.detokenize:   # (--no-detokenize: token ids only, nothing was streamed)
        print(*(json.dumps(r.output_ids) for r in results), sep="\n", end="")
    for r in results[1:] if spec.params.detokenize else ():
        print(f"\n--- output {r.index} ---\n{r.text}", end="")
    print()
    if args.out is not None:
        write_results_jsonl(args.out, results)
    tokens = sum(len(r.output_ids) for r in results)
    reasons = ", ".join(r.stop_reason for r in results)
    print(f"{name}: {tokens} tokens in {stats.seconds:.2f} s ({tokens / max(stats.seconds, 1e-9):.1f} tokens/s), "
          f"{stats.steps} steps, stop: {reasons}" + (f"; results in {args.out}" if args.out else ""), file=sys.stderr)
    if spec.params.logprobs is not None:
        for r in results:
            _print_logprobs(r, tokenizer, spec.params.logprobs)
    return 0


def _print_logprobs(result, tokenizer, top: int) -> None:
    """One output's logprobs on stderr: a line per token, the chosen token's log-probability and rank, then the
    most likely tokens' (``--logprobs N``)."""
    print(f"logprobs of output {result.index} (token: log-probability, rank; the most likely):", file=sys.stderr)
    for i, (token, entry) in enumerate(zip(result.output_ids, result.logprobs)):
        chosen = entry[token]
        likely = ", ".join(f"{tokenizer.decode([t])!r} {lp.logprob:.4f}"
                           for t, lp in sorted(entry.items(), key=lambda item: item[1].rank) if lp.rank <= top)
        print(f"{i:>4} {tokenizer.decode([token])!r}: {chosen.logprob:.4f}, rank {chosen.rank}"
              + (f"; {likely}" if likely else ""), file=sys.stderr)
