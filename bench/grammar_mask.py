#!/usr/bin/env python3
"""Structured outputs' cost: which grammar engine (``engines``), and what a grammar costs a decode step (``step``).

    python bench/grammar_mask.py engines --tokenizer smollm2             # CPU: xgrammar vs llguidance
    python bench/grammar_mask.py step --tokenizer PATH                   # GPU: llama3-8b bf16, 64 requests
    python bench/grammar_mask.py step --smoke --tokenizer PATH           # CPU: tiny model

``engines``: on one JSON schema and a ``--vocab``-token tokenizer, each engine's tokenizer setup, the schema's compile
(to a first matcher), the per-step fill of the next-token bitmask at 1 and 64 rows (a row a matcher, all walking one
JSON text token by token; xgrammar's batched fill, llguidance's one-by-one and its parallel fill) and the masking op.

``step``: ``--requests`` greedy requests (random weights of ``--model``, bf16 on a GPU) decode ``--new`` tokens
with CUDA graphs, twice on one engine, alternating ``--rounds`` times: without a grammar (``ignore_eos``) and with
a JSON schema that cannot end before ``--new`` tokens (an array of at least 40 objects), so every lane has a
grammar at every step. Reported: the median step time of each (the gaps between the engine's steps with every request
live), the grammar's share of the step ((with - without) / without; target <= 5%), and the parts measured alone at
the step's shape: the batched fill of the ``--requests`` matchers (host, ``fill_ms``), then its copy to the device
and the masking op of the ``[requests, vocab]`` logits (device, synchronized: ``copy_apply_ms``).
"""
from __future__ import annotations

import argparse
import json
from importlib import metadata
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec.engine import CudaGraphConfig, Engine  # noqa: E402
from treedec.models import from_config  # noqa: E402
from treedec.models.text import load_tokenizer  # noqa: E402
from treedec.programs.generate import generate_batch, grammar_compiler  # noqa: E402
from treedec.runtime import RequestSpec  # noqa: E402
from treedec.sampling import SamplingParams, StructuredOutputsParams  # noqa: E402
from treedec.sampling.grammar import BitmaskRows, apply_bitmask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "kind": {"enum": ["a", "b", "c"]}},
          "required": ["name", "age", "tags", "kind"]}
TEXT = json.dumps({"name": "Anna", "age": 31, "tags": ["x", "yy"], "kind": "b"})
# (at least 40 objects: no output ends within the steps measured)
LONG = {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
    "tag": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["id", "ok", "tag"]}}


def _ms(f, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - start) / repeat * 1e3


def engines(args) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import xgrammar as xgr
    tok = load_tokenizer(args.tokenizer)
    vocab = args.vocab or len(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = {"vocab": vocab, "tokens": len(ids), "xgrammar": {}, "llguidance": {}}
    x, g = out["xgrammar"], out["llguidance"]
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    x["tokenizer_ms"] = (time.perf_counter() - start) * 1e3
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = None

    def compile_x():
        nonlocal compiled
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        xgr.GrammarMatcher(compiled)
    x["compile_ms"] = statistics.median(_ms(compile_x) for _ in range(5))
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    g["tokenizer_ms"] = (time.perf_counter() - start) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    g["compile_ms"] = statistics.median(_ms(lambda: llguidance.LLMatcher(lltok, grammar)) for _ in range(5))
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    executor = llguidance.LLExecutor()
    for rows in (1, 64):
        ms = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        mask = xgr.allocate_token_bitmask(rows, vocab)
        fills = []
        for t in ids:
            fills.append(_ms(lambda: batch.batch_fill_next_token_bitmask(ms, mask)))
            batch.batch_accept_token(ms, [t] * rows)
        x[f"fill_ms_{rows}"] = statistics.median(fills)
        ls = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
        lmask = llt.allocate_token_bitmask(rows, vocab)
        one, par = [], []
        for t in ids:
            one.append(_ms(lambda: [llt.fill_next_token_bitmask(m, lmask, i) for i, m in enumerate(ls)]))
            par.append(_ms(lambda: llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ls)],
                                                                   lmask)))
            for m in ls:
                m.consume_token(t)
        g[f"fill_ms_{rows}"], g[f"fill_par_ms_{rows}"] = statistics.median(one), statistics.median(par)
        logits = torch.randn(rows, vocab)
        x[f"apply_ms_{rows}"] = _ms(lambda: xgr.apply_token_bitmask_inplace(logits, mask), 10)
        out[f"treedec_apply_ms_{rows}"] = _ms(lambda: apply_bitmask(logits, mask), 10)
    return out


def _steps(engine: Engine, specs, tokenizer, grammars) -> tuple[float, list]:
    ends, step = [], engine.step

    def timed(*a, **k):
        out = step(*a, **k)
        ends.append(time.perf_counter())
        return out
    engine.step = timed
    try:
        results, stats = generate_batch(engine, specs, tokenizer, grammars=grammars,
                                        max_step_tokens=16 * engine.prefill_chunk)
    finally:
        engine.step = step
    live = [0] * (len(ends) - len(stats.programs_per_step)) + stats.programs_per_step
    steady = [i for i in range(1, len(ends)) if live[i] == live[i - 1] == len(specs)][-(len(ends) // 2):]
    gaps = [(ends[i] - ends[i - 1]) * 1e3 for i in steady]
    return statistics.median(gaps), results


def step(args) -> dict:
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    model = from_config("tiny" if args.smoke else args.model, seed=0,
                        dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    tok = load_tokenizer(args.tokenizer)
    vocab = model.config.vocab_size
    n, new = args.requests, args.new
    kv = n * (args.prompt + new + 64)
    engine = Engine(model, kv_tokens=kv, page_size=16, cuda_graphs=CudaGraphConfig(max_queries=max(256, n)) if cuda
                    else False)
    grammars = grammar_compiler(engine, tok)
    so = StructuredOutputsParams(json=LONG)
    prompts = [[(7 * k + j) % 1000 + 10 for j in range(args.prompt)] for k in range(n)]
    plain = [RequestSpec(k, prompt_ids=p, params=SamplingParams(
        temperature=0, max_tokens=new, ignore_eos=True, detokenize=False))
             for k, p in enumerate(prompts)]
    masked = [RequestSpec(k, prompt_ids=p, params=SamplingParams(temperature=0, max_tokens=new, detokenize=False,
                                                                 structured_outputs=so)) for k, p in enumerate(prompts)]
    _steps(engine, plain[:2], tok, None)   # (warm: graphs, the compiler's cache)
    _steps(engine, masked[:2], tok, grammars)
    without, with_ = [], []
    for _ in range(args.rounds):
        without.append(_steps(engine, plain, tok, None)[0])
        ms, results = _steps(engine, masked, tok, grammars)
        with_.append(ms)
        assert all(r.stop_reason == "length" for r in results), "an output ended early: raise minItems"
    a, b = statistics.median(without), statistics.median(with_)
    # the parts alone at the step's shape
    grammar = grammars.compile(so)
    matchers = [grammar.matcher() for _ in range(n)]
    text = tok.encode(json.dumps([{"id": 12, "ok": True, "tag": "ab"}] * 3)[:-1], add_special_tokens=False)
    rows = BitmaskRows(vocab, device)
    logits = torch.randn(n, vocab, device=device, dtype=torch.float32)
    fill, copy_apply = [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for t in text:
        sync()
        start = time.perf_counter()
        masks = rows.fill(matchers)   # (the host's batched fill, and the copy queued)
        filled = time.perf_counter()
        apply_bitmask(logits, masks)
        sync()
        fill.append((filled - start) * 1e3)
        copy_apply.append((time.perf_counter() - filled) * 1e3)
        rows.accept(matchers, [t] * n)
    return {"model": "tiny" if args.smoke else args.model, "requests": n, "new_tokens": new, "vocab": vocab,
            "step_ms_without": a, "step_ms_with": b, "grammar_share": (b - a) / a, "rounds_without": without,
            "rounds_with": with_, "fill_ms": statistics.median(fill),
            "copy_apply_ms": statistics.median(copy_apply)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("engines", "step"))
    parser.add_argument("--tokenizer", default="smollm2", help="a name or folder load_tokenizer loads")
    parser.add_argument("--vocab", type=int, default=None, help="engines: the vocabulary (default the tokenizer's)")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    out = engines(args) if args.what == "engines" else step(args)
    device = device_name(torch.device("cuda" if torch.cuda.is_available() and args.what == "step" and not args.smoke
                                      else "cpu"))
    out |= {"device": device, "versions": versions("torch") | {"xgrammar": metadata.version("xgrammar")}}
    print(json.dumps(out, indent=1))
    if not args.smoke:
        write_results(out, args.out, f"grammar_{args.what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
