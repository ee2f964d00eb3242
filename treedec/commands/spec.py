"""``treedec spec``: speculative decoding with a token-tree draft, per-step acceptance stats.

    treedec spec                                         # tiny random model, n-gram drafts, greedy, CPU
    treedec spec --speculative medusa --check                  # untrained Medusa heads; tokens == plain greedy?
    treedec spec --speculative draft_model --accept sample --temperature 0.8
    treedec spec --model smollm2 --chat-template --prompt "Fix the bug ..." --check   # against plain greedy
    treedec spec --model /models/vicuna-7b --speculative medusa --medusa /models/medusa-vicuna-7b \\
        --prompt "Tell me a story" --out spec.json
    treedec spec --prompts requests.jsonl --out results.jsonl   # many requests batched (spec_batch.py)

Prints the draft, the acceptance rule, tokens per verification step, the accepted-length
histogram, tokens/s and why generation stopped (an EOS id, ``--eos``, default the
model's own; or ``--max-tokens``), then the text (with a tokenizer). ``--check``
(greedy acceptance) also decodes plainly (timed the same way), checks the tokens are the
same and prints a table of both runs: tokens, decode steps after the prefill, tokens per
step, tokens/s. ``--out`` is the results file: for one prompt a JSON document (every
step's accepted length, draft size and times, the summary, the check), for ``--prompts``
a JSONL file (one line per request); the mode decides, not the file's suffix. Without
``--model`` the target is the tiny random model (and Medusa heads, if not given, are
untrained; the draft model, if not given, is the target's own weights).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from treedec.checks import is_int
from treedec.models import from_config, from_pretrained
from treedec.commands.args import (MODEL_HELP, add_model_arguments, backend_arg, check_backend, choice_arg,
                                   engine_options, existing_dir, existing_file, existing_path, load_model, model_arg,
                                   model_size, nonnegative_float, output_file, positive_float, positive_int, read_json,
                                   seed_int)
from treedec.commands.kv_memory import build_engine
from treedec.commands.spec_batch import run_spec_batch
from treedec.models.text import check_text, encode_prompt, has_tokenizer, load_tokenizer
from treedec.models.eagle_drafter import EagleDrafter, load_eagle
from treedec.models.medusa import MedusaHeads, load_medusa_heads
from treedec.programs.speculative.acceptance import GreedyAcceptance, RejectionSampling, TypicalAcceptance
from treedec.sampling.params import SamplingParams
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.programs.speculative.medusa import DEFAULT_MEDUSA_CHOICES, MEDUSA_64_CHOICES, MedusaDraft
from treedec.runtime.request import MODEL_EOS, eos_token_ids
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.config import METHODS
from treedec.programs.speculative.program import SpeculativeStats, speculative_generate
from treedec.tree.token_tree import TokenTree

ACCEPTS = ("greedy", "typical", "sample")
DEFAULT_TEXT = "Speculative decoding verifies a whole tree of draft tokens in one step. Speculative decoding"


def add_spec_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding with a token-tree draft; acceptance stats per step",
                       description="Speculative decoding: each step a draft source proposes a token tree, one "
                                   "engine step verifies all of it, an acceptance rule keeps a path (its K/V "
                                   "kept, the rest freed).")
    p.add_argument("--speculative", type=choice_arg(METHODS), default="ngram", metavar="METHOD",
                   help=f"the draft source, as treedec serve's --speculative and SpeculativeConfig.method (vLLM's "
                        f"names): {', '.join(METHODS)} (default ngram)")
    p.add_argument("--accept", choices=ACCEPTS, default="greedy",
                   help="greedy (exactly plain greedy's tokens), typical (Medusa) or sample (lossless "
                        "rejection sampling)")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="new tokens at most (default 64; with --prompts, for the lines that give none)")
    p.add_argument("--eos", type=_eos_ids,
                   help="comma-separated EOS token ids that end the generation, or 'none'; default: the model's "
                        "(its checkpoint's generation_config.json or config.json; none for random weights)")
    add_model_arguments(p, batch_invariant=True)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs --model with a tokenizer)")
    prompt.add_argument("--prompt-ids", type=_token_ids,
                        help="comma-separated prompt token ids (default for random weights: random ids with a "
                             "repeated phrase)")
    prompt.add_argument("--prompts", type=existing_file,
                        help="a prompts file (JSONL, one request per line, as treedec generate's), run batched; "
                             "with --out")
    p.add_argument("--out", type=output_file,
                   help="the results file: for one prompt the run's JSON (every step, the summary, --check's "
                        "result); with --prompts a JSONL file, one line per request (its folder must exist)")
    p.add_argument("--chat-template", action="store_true",
                   help="render text prompts (--prompt, or --prompts' text lines) through the tokenizer's chat "
                        "template, as a user message")
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--kv-tokens", type=positive_int,
                   help="KV pool size of each engine (target, draft model, --check); default prompt + max new "
                        "tokens + 2048 (room for the draft trees)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="random weights and sampling (default 0; with --prompts, for the lines that give none)")
    g = p.add_argument_group("acceptance")
    g.add_argument("--temperature", type=positive_float, help="typical / sample (default 0.7 / 1.0)")
    g.add_argument("--posterior-threshold", type=nonnegative_float, default=0.09,
                   help="typical: epsilon (default 0.09)")
    g.add_argument("--posterior-alpha", type=nonnegative_float, default=0.3, help="typical: delta (default 0.3)")
    g.add_argument("--top-k", type=positive_int,
                   help="sample: the target's distribution cut to its top-k tokens (and a --draft-sample draft's); "
                        "with --prompts, for the lines that give none")
    g.add_argument("--top-p", type=positive_float,
                   help="sample: the target's distribution cut to its top-p mass (and a --draft-sample draft's); "
                        "with --prompts, for the lines that give none")
    g = p.add_argument_group("drafts")
    g.add_argument("--medusa", type=existing_path,
                   help="Medusa head checkpoint (file or directory); default: untrained heads")
    g.add_argument("--medusa-heads", type=positive_int, default=4, help="untrained heads (default 4)")
    g.add_argument("--medusa-choices", type=_medusa_choices,
                   help=f"JSON list of index paths, e.g. '[[0],[1],[0,0]]', or mc_sim_7b_63 (Medusa's 64-token tree) "
                        f"(medusa, tree); default {len(DEFAULT_MEDUSA_CHOICES)} paths, depth 4")
    g.add_argument("--draft-model", type=model_arg,
                   help=f"the draft model (same vocabulary as the target): {MODEL_HELP}")
    g.add_argument("--draft-config", type=model_size,
                   help="draft model: a named size with random weights (default with random target weights: the "
                        "target's size and seed, i.e. its own weights)")
    g.add_argument("--draft-seed", type=seed_int, help="seed of the random draft model (default --seed)")
    g.add_argument("--drafter", type=existing_dir,
                   help="eagle / eagle3: an EAGLE checkpoint folder in the EAGLE reference layout (config.json and "
                        "pytorch_model.bin or model.safetensors) for the target; default: random drafter weights")
    g.add_argument("--depth", type=positive_int, default=4, help="draft_model / eagle tree depth (default 4)")
    g.add_argument("--draft-sample", action="store_true",
                   help="draft_model / eagle with --accept sample: sample the tree's tokens from the draft's "
                        "distribution (at the acceptance's temperature, top-k, top-p) instead of taking its top-k; "
                        "still lossless")
    g.add_argument("--draft-top-k", type=positive_int, default=4,
                   help="draft_model / eagle expansion width (default 4)")
    g.add_argument("--total-tokens", type=positive_int, default=None,
                   help="draft_model / eagle tree size (default 16; --eagle-tree chains: draft-top-k x depth)")
    g.add_argument("--eagle-tree", choices=["dynamic", "chains"], default="dynamic",
                   help="eagle / eagle3: EAGLE-2's dynamic tree (default) or fixed chains (the root's top-k children, "
                        "each extended to --depth tokens by argmax: drafted on the device, the loop pipelined on a "
                        "GPU)")
    g.add_argument("--max-ngram", type=positive_int, default=3, help="ngram: longest n-gram (default 3)")
    g.add_argument("--num-draft-tokens", type=positive_int, default=8, help="ngram: tokens per match (default 8)")
    g.add_argument("--max-matches", type=positive_int, default=2, help="ngram: continuations merged (default 2)")
    g.add_argument("--tree-json", type=existing_file,
                   help="tree: JSON file with 'parents' or 'choices', and 'tokens' (the draft tokens, replayed every "
                        "step); default the --medusa-choices shape with seeded random tokens")
    p.add_argument("--check", action="store_true",
                   help="greedy: also decode plainly (timed the same way), check the tokens are equal and print "
                        "both runs' tokens, steps, tokens/step and tokens/s")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.renamed = {"--max-new-tokens": "--max-tokens (SamplingParams.max_tokens, vLLM's name)",
                 "--draft": "--speculative (as treedec serve's; its values are SpeculativeConfig.method's: "
                            f"{', '.join(METHODS)})"}


def run_spec(args: argparse.Namespace) -> int:
    """Run ``treedec spec``; returns the exit code (1 when ``--check`` finds a difference)."""
    if args.check and args.accept != "greedy":
        raise ValueError(f"--check compares with plain greedy decoding and needs --accept greedy, "
                         f"got --accept {args.accept}")
    # everything the user typed is checked before any model is loaded
    if args.draft_sample and (args.speculative not in ("draft_model", "eagle", "eagle3") or args.accept != "sample"):
        raise ValueError(f"--draft-sample samples a draft model's or EAGLE drafter's trees for --accept sample, got "
                         f"--speculative {args.speculative} --accept {args.accept}")
    if args.drafter is not None and args.speculative not in ("eagle", "eagle3"):
        raise ValueError(f"--drafter is an EAGLE checkpoint for --speculative eagle / eagle3, got --speculative "
                         f"{args.speculative}")
    if args.eagle_tree == "chains":
        if args.speculative not in ("eagle", "eagle3"):
            raise ValueError(f"--eagle-tree chains is for --speculative eagle / eagle3, got --speculative "
                             f"{args.speculative}")
        if args.draft_sample:
            raise ValueError("--eagle-tree chains drafts by argmax: it takes no --draft-sample")
        if args.total_tokens not in (None, args.draft_top_k * args.depth):
            raise ValueError(f"--eagle-tree chains verifies draft-top-k x depth = {args.draft_top_k * args.depth} "
                             f"draft tokens; "
                             f"leave --total-tokens out or give that, got {args.total_tokens}")
    if (args.top_k or args.top_p is not None) and args.accept != "sample":
        raise ValueError(f"--top-k / --top-p shape --accept sample's distribution, "
                         f"got --accept {args.accept}")
    if args.prompt is not None:
        if not args.prompt:
            raise ValueError("--prompt is empty; give a text (or leave --prompt out for the default text)")
        check_text(args.prompt, "--prompt")
    choices = [list(c) for c in DEFAULT_MEDUSA_CHOICES] if args.medusa_choices is None else args.medusa_choices
    rule = _rule(args)
    tree_json = _tree_json(args.tree_json)
    if args.prompts is not None:
        check_backend(args)
        return run_spec_batch(args, choices, tree_json, load_model, _draft)
    if args.chat_template and (args.prompt_ids is not None or args.model is None):
        raise ValueError("--chat-template renders a text prompt through --model's tokenizer: give --model (and "
                         "--prompt, or none for the default text), not " +
                         ("--prompt-ids" if args.prompt_ids is not None else "random weights"))
    check_backend(args)
    model, model_name = load_model(args)
    prompt, tokenizer = _prompt(args, model)
    eos = _eos(args, model)
    # a fixed size, not the GPU's free memory: the draft model and --check need engines too
    kv_tokens = args.kv_tokens or len(prompt) + args.max_tokens + 2048
    engine = build_engine(model, kv_tokens, args.page_size, **engine_options(args))
    draft, draft_note = _draft(args, model, choices, tree_json, kv_tokens)
    print(f"spec: {model_name} {str(model.dtype).removeprefix('torch.')} on {model.device}, "
          f"{engine.attn.backend} backend, page size {args.page_size}, KV pool {engine.kv_capacity_tokens} tokens "
          f"of {engine.kv_cache_dtype}"
          + ("" if args.kv_tokens else " (the prompt, --max-tokens and 2048 for the drafts)")
          + f"; prompt {len(prompt)} tokens")
    print(f"draft: {draft_note}")
    print(f"acceptance: {rule}")
    print(f"eos: {list(eos) if eos else 'none'}")

    progress = _progress(args)
    tokens, stats = speculative_generate(engine, prompt, draft, args.max_tokens, rule, on_step=progress,
                                         eos_token_id=list(eos) or None)
    progress(stats, len(tokens), close=True)
    summary = summarize(stats, len(tokens))
    check = _check(args, model, prompt, tokens, kv_tokens, eos, summary["tokens_per_second"]) if args.check else None
    _print_summary(summary, check, draft_name=args.speculative)
    if tokenizer is not None:
        print("text:")
        print(tokenizer.decode(tokens, skip_special_tokens=True))
    if args.out:
        results = {
            "command": "spec", "model": model_name, "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "backend": engine.attn.backend, "page_size": args.page_size,
            "kv_cache_dtype": engine.kv_cache_dtype, "batch_invariant": engine.batch_invariance is not None,
            "draft": {"kind": args.speculative, "description": draft_note}, "acceptance": {"rule": args.accept,
                                                                                     "repr": repr(rule)},
            "eos_token_ids": list(eos), "prompt_ids": prompt, "tokens": tokens,
            "text": None if tokenizer is None else tokenizer.decode(tokens),
            "steps": [{"accepted": a, "draft_tokens": d, "draft_ms": round(ds * 1e3, 3),
                       "verify_ms": round(vs * 1e3, 3)}
                      for a, d, ds, vs in zip(stats.accepted, stats.draft_sizes, stats.draft_seconds,
                                              stats.verify_seconds)],
            "summary": summary, "check": check,
        }
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {args.out}")
    return 1 if check is not None and not check["equal"] else 0


def summarize(stats: SpeculativeStats, num_tokens: int) -> dict:
    """Run totals: steps, stop reason, tokens per step, accepted-length mean and histogram, times, tokens/s."""
    decode_s = sum(stats.draft_seconds) + sum(stats.verify_seconds)
    return {
        "new_tokens": num_tokens, "stop_reason": stats.stop_reason, "steps": stats.steps,
        "tokens_per_step": round(stats.tokens_per_step, 3),
        "accepted_mean": round(float(np.mean(stats.accepted)), 3) if stats.accepted else 0.0,
        "accepted_histogram": {str(k): v for k, v in sorted(Counter(stats.accepted).items())},
        "draft_tokens_mean": round(float(np.mean(stats.draft_sizes)), 3) if stats.draft_sizes else 0.0,
        "prefill_ms": round(stats.prefill_seconds * 1e3, 3), "draft_ms": round(sum(stats.draft_seconds) * 1e3, 3),
        "verify_ms": round(sum(stats.verify_seconds) * 1e3, 3),
        # the first token comes from the prefill; the others from the verification steps
        "decode_tokens_per_second": round((num_tokens - 1) / decode_s, 2) if decode_s > 0 else None,
        "tokens_per_second": round(num_tokens / (stats.prefill_seconds + decode_s), 2),
    }


# ================================================================ private


def _token_ids(text: str) -> list[int]:
    """An argparse ``type``: comma- (or space-) separated token ids, at least one, each >= 0."""
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids (ints >= 0), got {text!r}")
    return ids


def _eos_ids(text: str) -> list[int]:
    """An argparse ``type``: comma- (or space-) separated EOS token ids, or ``none`` (no EOS stop: [])."""
    if text.strip().lower() == "none":
        return []
    try:
        return _token_ids(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids (ints >= 0) or 'none', got {text!r}") \
            from None


def _eos(args: argparse.Namespace, model) -> tuple[int, ...]:
    """The EOS ids of the run: ``--eos``'s, checked against the vocabulary, else the model's own."""
    if args.eos is None:
        return eos_token_ids(MODEL_EOS, model)
    vocab = model.config.vocab_size
    if args.eos and max(args.eos) >= vocab:
        raise ValueError(f"--eos must be token ids in [0, {vocab}) for {args.model or 'random weights'}, "
                         f"got {max(args.eos)}")
    return tuple(dict.fromkeys(args.eos))


def _medusa_choices(text: str) -> list[list[int]]:
    """An argparse ``type``: a JSON list of index paths that make a token tree, or ``mc_sim_7b_63`` (Medusa's
    64-token tree)."""
    if text == "mc_sim_7b_63":
        return [list(p) for p in MEDUSA_64_CHOICES]
    expected = "must be a non-empty JSON list of index paths, e.g. '[[0],[1],[0,0]]'"
    try:
        choices = json.loads(text)
        TokenTree.from_medusa_choices(choices)   # the tree's own checks
    except ValueError as e:                      # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(f"{expected}: {e}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"{expected}: nested too deeply") from None
    if not choices:                              # a tree with no draft tokens drafts nothing
        raise argparse.ArgumentTypeError(f"{expected}, got []")
    return choices


def _rule(args: argparse.Namespace):
    if args.accept == "greedy":
        return GreedyAcceptance()
    if args.accept == "typical":
        return TypicalAcceptance(temperature=0.7 if args.temperature is None else args.temperature,
                                 posterior_threshold=args.posterior_threshold,
                                 posterior_alpha=args.posterior_alpha, seed=args.seed)
    return RejectionSampling(temperature=1.0 if args.temperature is None else args.temperature, seed=args.seed,
                             top_k=args.top_k, top_p=1.0 if args.top_p is None else args.top_p)


def _prompt(args: argparse.Namespace, model) -> tuple[list[int], object | None]:
    """The prompt ids and the tokenizer (of ``--model``, when it has tokenizer files: one that does not
    load is an error, not a silent fallback to token ids)."""
    vocab = model.config.vocab_size
    tokenizer = None
    if args.model is not None and has_tokenizer(args.model):
        tokenizer = load_tokenizer(args.model)
    if args.prompt_ids is not None:
        if max(args.prompt_ids) >= vocab:
            raise ValueError(f"--prompt-ids must be token ids in [0, {vocab}) for {args.model or 'random weights'}, "
                             f"got {max(args.prompt_ids)}")
        return args.prompt_ids, tokenizer
    if args.prompt is not None or args.model is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer: {args.model or 'random weights'} has none; "
                             f"give --prompt-ids instead")
        return encode_prompt(tokenizer, args.prompt or DEFAULT_TEXT, chat_template=args.chat_template), tokenizer
    rng = np.random.default_rng(args.seed)
    phrase = rng.integers(0, vocab, 6).tolist()
    return rng.integers(0, vocab, 5).tolist() + phrase + rng.integers(0, vocab, 4).tolist() + phrase, None


def _draft(args: argparse.Namespace, model, choices: list[list[int]], tree_json, kv_tokens: int):
    """The draft source and a line that says what it is."""
    if args.speculative == "ngram":
        draft = PromptLookupDraft(max_ngram=args.max_ngram, num_draft_tokens=args.num_draft_tokens,
                                  max_matches=args.max_matches)
        return draft, f"prompt lookup {draft}"
    if args.speculative == "medusa":
        if args.medusa is not None:
            heads = load_medusa_heads(args.medusa, model)
            note = f"Medusa heads from {args.medusa}"
        else:
            heads = MedusaHeads.untrained(model, num_heads=args.medusa_heads, seed=args.seed)
            note = ("UNTRAINED Medusa heads (Medusa's initialisation: zero ResBlocks, lm_head copies), so "
                    "acceptance is low; pass --medusa PATH for trained heads")
        draft = MedusaDraft(heads, choices)
        return draft, (f"{note}; {heads.num_heads} heads x {heads.num_layers} ResBlock(s), "
                       f"{draft.tree.size - 1} draft tokens per step")
    sample = None
    if args.draft_sample:
        rule = _rule(args)
        sample = SamplingParams(temperature=rule.temperature, top_k=rule.top_k, top_p=rule.top_p)
    chains = args.eagle_tree == "chains"
    total = args.total_tokens if args.total_tokens is not None or chains else 16
    shape = f"depth {args.depth}, top-k {args.draft_top_k}, " + (
        f"{args.draft_top_k} chains of {args.depth} tokens" if chains else f"{total} tokens")
    if args.speculative == "draft_model":
        draft_model, note = _draft_model(args, model)
        engine = build_engine(draft_model, kv_tokens, args.page_size, backend=args.backend)
        draft = DraftModelDraft(engine, depth=args.depth, top_k=args.draft_top_k, total_tokens=total,
                                sample=sample, seed=args.seed)
        return draft, f"draft model {note}; {shape}"
    if args.speculative in ("eagle", "eagle3"):
        if args.drafter is not None:
            drafter = load_eagle(args.drafter, model, args.speculative)
            note = f"{args.speculative} drafter from {args.drafter}"
        else:
            drafter = EagleDrafter.random(model, args.speculative, seed=args.seed)
            note = (f"RANDOM {args.speculative} drafter weights, so acceptance is near zero; pass --drafter PATH for a "
                    f"trained one")
        engine = build_engine(drafter, kv_tokens, args.page_size, backend=args.backend)
        draft = EagleDraft(engine, depth=args.depth, top_k=args.draft_top_k, total_tokens=total,
                           sample=sample, seed=args.seed, tree=args.eagle_tree)
        layers = f", target layers {list(drafter.aux_layers)}" if drafter.aux_layers else ""
        return draft, f"{note}{layers}; {shape}"
    return _tree_draft(args, model.config.vocab_size, choices, tree_json)


def _draft_model(args: argparse.Namespace, model):
    if args.draft_model is not None:
        return from_pretrained(args.draft_model, dtype=model.dtype, device=model.device), args.draft_model
    if args.model is not None and args.draft_config is None:
        raise ValueError("--speculative draft_model with --model needs --draft-model PATH (a small model with the "
                         "target's vocabulary) or --draft-config NAME (random weights)")
    name = args.draft_config or args.config or "tiny"
    seed = args.seed if args.draft_seed is None else args.draft_seed
    same = args.draft_config in (None, args.config) and seed == args.seed and args.model is None
    note = f"{name} (random weights, seed {seed})" + (": the target's own weights, so every draft token the "
                                                       "tree holds along the greedy path is accepted" if same else "")
    return from_config(name, seed=seed, dtype=model.dtype, device=model.device), note


def _tree_json(path: str | None) -> tuple[TokenTree, list[int]] | None:
    """``--tree-json``'s tree and draft tokens (None without it); the token ids are checked against the
    vocabulary once the model is loaded."""
    if path is None:
        return None
    spec = read_json(path, "--tree-json")
    if not isinstance(spec, dict) or ("parents" in spec) == ("choices" in spec) or "tokens" not in spec:
        raise ValueError(f"--tree-json {path} must hold an object with 'parents' or 'choices' (one of them) and "
                         f"'tokens'")
    for name in ("parents", "tokens"):
        ids = spec.get(name, [])
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise ValueError(f"--tree-json {path}: '{name}' must be a list of ints, got {ids!r:.60}")
    if any(t < 0 for t in spec["tokens"]):
        raise ValueError(f"--tree-json {path}: 'tokens' must be token ids >= 0, got {spec['tokens']!r:.60}")
    try:
        tree = (TokenTree(tuple(spec["parents"])) if "parents" in spec
                else TokenTree.from_medusa_choices(spec["choices"]))
        TreeDraft(tree, spec["tokens"])   # one token per draft position
    except ValueError as e:
        raise ValueError(f"--tree-json {path}: {e}") from None
    return tree, spec["tokens"]


def _tree_draft(args: argparse.Namespace, vocab: int, choices: list[list[int]], tree_json):
    if tree_json is None:
        tree = TokenTree.from_medusa_choices(choices)
        tokens = np.random.default_rng(args.seed).integers(0, vocab, tree.size - 1).tolist()
        return TreeDraft(tree, tokens), (f"fixed tree of {tree.size - 1} seeded random draft tokens (the "
                                         f"--medusa-choices shape), replayed every step")
    tree, tokens = tree_json
    if tokens and max(tokens) >= vocab:
        raise ValueError(f"--tree-json {args.tree_json}: 'tokens' must be token ids in [0, {vocab}), got {max(tokens)}")
    return TreeDraft(tree, tokens), f"tree from {args.tree_json}: {tree.size - 1} draft tokens every step"


def _progress(args: argparse.Namespace):
    """``update(stats, emitted, close=False)`` for a tqdm bar over the new tokens (a no-op with --no-progress)."""
    if args.no_progress:
        return lambda stats, emitted, close=False: None
    from tqdm import tqdm
    bar = tqdm(total=args.max_tokens, desc=f"spec [{args.speculative}/{args.accept}]", unit="tok")

    def update(stats: SpeculativeStats, emitted: int, close: bool = False) -> None:
        bar.update(emitted - bar.n)
        if stats.steps:
            bar.set_postfix(accepted=f"{np.mean(stats.accepted):.2f}", refresh=False)
        if close:
            bar.close()
    return update


def _check(args: argparse.Namespace, model, prompt: list[int], tokens: list[int], kv_tokens: int,
           eos: tuple[int, ...], summary_rate: float) -> dict:
    """Plain greedy decoding of the same prompt and EOS ids, timed as the speculative run is (prefill included):
    equal tokens? and its tokens, decode steps and speed, for the comparison table; ``speedup``: ``summary_rate``
    (the speculative run's tokens/s) over plain greedy decoding's."""
    engine = build_engine(model, kv_tokens, args.page_size, **engine_options(args))
    if not args.no_progress:   # greedy_generate reports nothing until it ends
        print(f"check: plain greedy decoding of up to {args.max_tokens} tokens ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    plain = greedy_generate(engine, prompt, args.max_tokens, eos_token_id=list(eos) or None)
    seconds = time.perf_counter() - start
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), None)
    if first is None and len(plain) != len(tokens):
        first = min(len(plain), len(tokens))
    # the prefill gives the first token; each decode step after it one more
    return {"equal": plain == tokens, "first_difference": first, "plain_new_tokens": len(plain),
            "plain_steps": max(len(plain) - 1, 0), "plain_seconds": round(seconds, 3),
            "plain_tokens_per_second": round(len(plain) / seconds, 2),
            "speedup": round(summary_rate / (len(plain) / seconds), 3) if plain else None}


def _print_summary(s: dict, check: dict | None, draft_name: str) -> None:
    print(f"{s['new_tokens']} new tokens in {s['steps']} verification steps: {s['tokens_per_step']:.2f} tokens/step "
          f"(accepted {s['accepted_mean']:.2f} of {s['draft_tokens_mean']:.1f} draft tokens per step); "
          f"stopped: {s['stop_reason']}")
    print(f"accepted length histogram: {s['accepted_histogram']}")
    rate = s["decode_tokens_per_second"]
    print(f"time: prefill {s['prefill_ms']:.1f} ms, draft {s['draft_ms']:.1f} ms, verify {s['verify_ms']:.1f} ms; "
          f"{s['tokens_per_second']:.1f} tokens/s ({'-' if rate is None else f'{rate:.1f}'} after the prefill)")
    if check is None:
        return
    print("check: equal to plain greedy decoding" if check["equal"] else
          f"check: MISMATCH with plain greedy decoding at new token {check['first_difference']}")
    plain_steps = check["plain_steps"]
    rows = [(f"speculative ({draft_name})", str(s["new_tokens"]), str(s["steps"]), f"{s['tokens_per_step']:.2f}",
             f"{s['tokens_per_second']:.1f}"),
            ("plain greedy", str(check["plain_new_tokens"]), str(plain_steps),
             f"{(check['plain_new_tokens'] - 1) / plain_steps:.2f}" if plain_steps else "-",
             f"{check['plain_tokens_per_second']:.1f}")]
    header = ("method", "tokens", "steps", "tokens/step", "tokens/s")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join([r[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(r[1:], widths[1:]))]).rstrip())
    print("(steps: decode steps after the prefill, which gives the first token; tokens/s: prefill included)")
    print(f"speedup: {check['speedup']:.2f}x plain greedy decoding's tokens/s (the same run)")
