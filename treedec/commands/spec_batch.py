"""``treedec spec --prompts FILE --out FILE``: a prompts file's requests decoded speculatively, batched.

    treedec spec --prompts requests.jsonl --out results.jsonl                   # tiny random model, n-grams
    treedec spec --model /models/vicuna-7b --speculative medusa --medusa /models/medusa-vicuna-7b \\
        --chat-template --prompts requests.jsonl --out results.jsonl

Every request of the prompts file (:mod:`treedec.commands.requests_file`; one output each) gets
its own draft source of the ``--speculative`` kind (Medusa drafts share the heads, draft_model drafts
the draft engine), and all requests' token trees are verified in one engine step per iteration
(:func:`~treedec.programs.speculative.batch.speculative_batch`). Greedy acceptance (the default)
gives each request exactly plain greedy decoding's tokens; ``--accept typical|sample`` accepts
at each request's ``temperature``, ``top_k`` and ``top_p`` (``--accept sample``; default the
flags of the same names), seeded by its ``seed`` (default ``--seed``). The results file (``--out``, JSONL
whatever its suffix) has one line per request, its ``stats`` with the accepted draft tokens of each step, each
appended as its request finishes (so in the order they finish; a run that fails keeps every finished request's
line: :mod:`treedec.commands.batch_io`).

Everything that does not need the model's weights is checked before they load: the flags, the
prompts file, each request against the acceptance rule (one output, greedy at temperature 0,
sampled at a temperature > 0), and that text prompts and stop strings have a tokenizer.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from tqdm import tqdm

from treedec.commands.args import engine_options
from treedec.commands.batch_io import ResultsWriter, read_prompts, request_kv_tokens, request_name
from treedec.commands.kv_memory import command_engine
from treedec.models.text import has_tokenizer, load_tokenizer
from treedec.programs.generate import step_progress
from treedec.programs.speculative.acceptance import RejectionSampling, TypicalAcceptance
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.drafts import PromptLookupDraft
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.programs.speculative.batch import SPECULATIVE_PARAMS, speculative_batch

#: The draft engine's pool on a GPU (where the target's takes what free memory holds); on the CPU it gets the
#: target's size.
GPU_DRAFT_KV_TOKENS = 65536
#: A request's room for its draft trees in a CPU pool sized from the requests (the tokens of a tree's nodes, each
#: node in pages of its own).
DRAFT_TREE_TOKENS = 2048


def run_spec_batch(args: argparse.Namespace, choices: list[list[int]], tree_json, load_model, make_draft) -> int:
    """Run the prompts file; ``load_model`` and ``make_draft`` are ``treedec spec``'s (one draft, then one per
    request like it)."""
    for flag, value in [("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids), ("--eos", args.eos)]:
        if value is not None:
            hint = " (give each request's stop_token_ids in the prompts file)" if flag == "--eos" else ""
            raise ValueError(f"{flag} goes with a single prompt, not with --prompts{hint}")
    if args.check:
        raise ValueError("--check goes with a single prompt, not with --prompts (greedy acceptance gives each "
                         "request plain greedy's tokens: tested)")
    if args.out is None:
        raise ValueError("--prompts needs --out results.jsonl")
    defaults = {"max_tokens": args.max_tokens}
    if args.accept == "greedy":
        defaults["temperature"] = 0.0
    else:
        defaults.update({name: value for name in ("temperature", "top_k", "top_p")
                         if (value := getattr(args, name)) is not None})
    specs = read_prompts(args.prompts, defaults)
    rules = {spec.id: _acceptance(args, spec) for spec in specs}   # each request checked against --accept
    # A checkpoint without tokenizer files still runs prompt_ids requests; text ones say what they need, now.
    tokenizer = load_tokenizer(args.model) if args.model is not None and has_tokenizer(args.model) else None
    if tokenizer is None:
        _check_token_ids_only(args, specs)
    model, name = load_model(args)
    on_gpu = model.device.type == "cuda"
    engine = command_engine(model, args.kv_tokens, args.page_size,
                            request_kv_tokens(specs, tokenizer, args.chat_template, args.page_size, DRAFT_TREE_TOKENS),
                            cuda_graphs=on_gpu, **engine_options(args))
    draft_kv_tokens = args.kv_tokens or (GPU_DRAFT_KV_TOKENS if on_gpu else engine.kv_capacity_tokens)
    draft, note = make_draft(args, model, choices, tree_json, draft_kv_tokens)
    factory = _draft_factory(draft, choices)
    acceptance = None if args.accept == "greedy" else (lambda spec: rules[spec.id])
    print(f"spec: {name}, {len(specs)} requests; draft: {note}; acceptance: {args.accept}", file=sys.stderr)

    def done(outputs) -> None:
        writer.write(outputs[0].id, [dataclasses.asdict(r) for r in outputs])
        bar.update(1)

    with (tqdm(total=len(specs), unit="request", desc="spec", disable=args.no_progress or None,
              file=sys.stderr) as bar,   # (None: on a terminal only; errors stay one line in logs)
          ResultsWriter(args.out, {spec.id: request_name(spec.id, spec.line) for spec in specs}) as writer):
        results, stats = speculative_batch(engine, specs, factory, tokenizer, args.chat_template,
                                           acceptance=acceptance, on_request_done=done, on_step=step_progress(bar))
    tokens = sum(len(r.output_ids) for r in results)
    verify_steps = sum(r.stats["steps"] for r in results)
    accepted = sum(sum(r.stats["accepted"]) for r in results)
    per_step = (accepted + verify_steps) / verify_steps if verify_steps else 0.0
    print(f"{name}: {len(specs)} requests, {tokens} tokens in {stats.seconds:.2f} s "
          f"({tokens / max(stats.seconds, 1e-9):.1f} tokens/s), {stats.steps} batched steps (up to "
          f"{max(stats.programs_per_step, default=0)} requests a step), {per_step:.2f} tokens per request step; "
          f"results in {args.out}", file=sys.stderr)
    return 0


def _draft_factory(draft, choices: list[list[int]]):
    """Each request's draft source, like ``draft``: stateful ones new, sharing heads or the draft engine."""
    if isinstance(draft, PromptLookupDraft):
        return lambda spec: dataclasses.replace(draft)
    if isinstance(draft, MedusaDraft):
        return lambda spec: MedusaDraft(draft.heads, choices)
    if isinstance(draft, DraftModelDraft):
        return lambda spec: DraftModelDraft(draft.engine, draft.depth, draft.top_k, draft.total_tokens, draft.sample,
                                            draft.seed if spec.params.seed is None else spec.params.seed)
    if isinstance(draft, EagleDraft):
        return lambda spec: EagleDraft(draft.engine, draft.depth, draft.top_k, draft.total_tokens, draft.sample,
                                       draft.seed if spec.params.seed is None else spec.params.seed, draft.tree)
    return lambda spec: draft   # a TreeDraft: the same tree and tokens every step, no state


def _acceptance(args: argparse.Namespace, spec):
    """A request's acceptance rule, at its temperature and seed (None for greedy acceptance, which takes a request
    at temperature 0 only); a request ``--accept`` cannot take raises ValueError naming it and its line."""
    name, params = request_name(spec.id, spec.line), spec.params
    params.check_supported(SPECULATIVE_PARAMS, "speculative decoding", f"request {name}")
    if params.n != 1:
        raise ValueError(f"request {name} asks for n={params.n} outputs: treedec spec decodes one output a request; "
                         f"give it n=1, or run the file with treedec generate")
    if args.accept == "greedy":
        if params.temperature != 0:
            raise ValueError(f"request {name} samples at temperature {params.temperature:g}, which --accept greedy "
                             f"cannot take: run the file with --accept sample (lossless) or typical, or give the "
                             f"request temperature 0")
        return None
    seed = args.seed if params.seed is None else params.seed
    if params.temperature == 0:
        raise ValueError(f"request {name}: --accept {args.accept} samples and needs a temperature > 0 "
                         f"(the request's or --temperature), got 0")
    if args.accept == "typical":
        if params.top_k is not None or params.top_p != 1.0:
            raise ValueError(f"request {name} gives top_k / top_p, which --accept typical does not take: run the "
                             f"file with --accept sample, or leave them out")
        return TypicalAcceptance(temperature=params.temperature, posterior_threshold=args.posterior_threshold,
                                 posterior_alpha=args.posterior_alpha, seed=seed)
    return RejectionSampling(temperature=params.temperature, seed=seed, top_k=params.top_k, top_p=params.top_p)


def _check_token_ids_only(args: argparse.Namespace, specs) -> None:
    """Without a tokenizer (random weights, or a checkpoint without tokenizer files) every request must give
    ``prompt_ids`` and no stop strings."""
    where = "random weights" if args.model is None else f"{args.model} (no tokenizer files)"
    for spec in specs:
        if spec.prompt_ids is None:
            raise ValueError(f"request {request_name(spec.id, spec.line)} gives its prompt as text: it needs "
                             f"--model with a tokenizer, and the model is {where}; give prompt_ids")
        if spec.params.stop:
            raise ValueError(f"request {request_name(spec.id, spec.line)} has stop strings: they are matched on "
                             f"the output text and need --model with a tokenizer, and the model is {where}")
