"""The ``treedec`` command line.

``treedec demo``: build a small forest (a speculative token tree and a few-shot branching
request), plan one step, run tree attention with the chosen backend and check it against
the dense fp32 reference.

``treedec generate --prompts FILE --out FILE``: a prompts JSONL file run as one batch over
the forest, one results line per output (see :mod:`treedec.commands.generate`).

``treedec replay <workload>``: replay a recorded decoding tree (ToT, Medusa, few-shot or a
schedule JSON file) through the engine and time every step; ``treedec plot``: chart the
results (see :mod:`treedec.replay`).

``treedec spec``: speculative decoding with a token-tree draft (n-gram, Medusa heads, a
draft model or a fixed tree) and greedy, typical or rejection-sampling acceptance; per-step
acceptance stats (see :mod:`treedec.commands.spec`).

``treedec tot``: Tree-of-Thought search (BFS or DFS) on a Game-of-24 problem (see
:mod:`treedec.commands.tot`).

``treedec serve --model NAME``: an OpenAI-compatible HTTP server (completions, chat, streaming, metrics) over
one model, every request batched on one engine (see :mod:`treedec.commands.serve`).

``treedec train-drafter --model NAME --out DIR``: train Medusa heads for a model on its own answers
(self-distillation; see :mod:`treedec.commands.train_drafter`).

``treedec env``: the installed versions of treedec's dependencies (:mod:`treedec.versions`).

``treedec --version``: the version.

Errors and exit codes. Every argument is checked when it is parsed (counts, sizes, seeds,
names, devices, input files), and the rest before a model is loaded where it can be. No flag may
be abbreviated; an argument a command does not take is refused naming the command, the argument
and what was meant (a flag's new spelling, e.g. ``--max-new-tokens`` is now ``--max-tokens``, or
the closest flag). An
output file's folder must exist and be writable when the command starts (it is not
created: a mistyped path fails at once, not after the run), and an output that is one of the
command's input files (or another of its outputs) is refused before anything runs. A
``--kv-tokens`` pool larger than the memory available is refused before it is allocated (an
allocation that fails anyway is reported the same way). A mistake prints one line to
stderr, ``treedec <command>: error: <what was wrong and what to do>``, and exits 2: bad
arguments, and the exceptions the library raises for bad input (ValueError and its
subclasses, e.g. treedec.errors' TreeError and PlanError, json.JSONDecodeError; TypeError;
OSError, e.g. a missing file; BackendUnavailableError; PoolExhaustedError; out of memory).
Any other exception is unexpected (a bug, or a failure in torch): one line naming it and
"rerun with --debug for the traceback", exit 1. Ctrl-C exits 130. The line ends with the
exception's notes in parentheses: a batch command's says which requests finished (their
results are in the results file) and which did not. ``--debug``, before or
after the command, lets every exception through with its traceback. ``treedec demo`` exits
1 when its result does not match the reference.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import shlex
import sys
import time

import numpy as np
import torch

from treedec import __version__
from treedec.attention import PLANNERS, PlanConfig, TreeAttention, reference_tree_attention
from treedec.errors import BackendUnavailableError, PoolExhaustedError
from treedec.commands.args import backend_arg, device_arg, int_arg, positive_int, refuse_overwrites, seed_int
from treedec.commands.generate import add_generate_parser, run_generate
from treedec.commands.replay import add_plot_parser, add_replay_parser, run_plot, run_replay
from treedec.commands.serve import add_serve_parser, run_serve
from treedec.commands.spec import add_spec_parser, run_spec
from treedec.commands.tot import add_tot_parser, run_tot
from treedec.commands.train_drafter import add_train_drafter_parser, run_train_drafter
from treedec.tree import PagedKVPool, SequenceTree
from treedec.versions import format_versions


def build_demo_forest(pool: PagedKVPool, rng: np.random.Generator) -> SequenceTree:
    """Two requests with one decode step pending.

    Request 1 (speculative verification): a 300-token prompt and a random 24-token token
    tree under it, all 24 tree tokens pending. Request 2 (few-shot branching): a 200-token
    prompt with 4 branches of 20 tokens, each getting one new pending token.
    """
    tree = SequenceTree(pool)
    spec_root = tree.add_prompt(rng.integers(0, 32000, 300))
    fewshot_root = tree.add_prompt(rng.integers(0, 32000, 200))
    branches = tree.branch(fewshot_root, [rng.integers(0, 32000, 20) for _ in range(4)])
    tree.commit_step()  # prompts and branches are computed; now the step's new tokens:
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, 24)]
    tree.add_token_tree(spec_root, rng.integers(0, 32000, 24), parents)
    tree.extend_many({b: [int(rng.integers(0, 32000))] for b in branches})
    tree.check_invariants()
    return tree


DEMO_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEMO_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2}  # max abs error vs the fp32 reference


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(args: argparse.Namespace) -> dict:
    """Plan and run one step on :func:`build_demo_forest`; the summary, with the error against the reference,
    the tolerance of ``args.dtype`` and ``matches_reference``."""
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    heads, kv_heads, head_dim = 8, 2, 64
    dtype = DEMO_DTYPES[args.dtype]
    pool = PagedKVPool(num_pages=-(-1024 // args.page_size) + 64, page_size=args.page_size, num_layers=1,
                       num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=args.device)
    tree = build_demo_forest(pool, rng)
    pool.k.normal_()
    pool.v.normal_()
    attn = TreeAttention(heads, kv_heads, head_dim, backend=args.backend,
                         plan_config=PlanConfig(args.planner, args.chunk_size, args.query_tile), device=args.device,
                         dtype=dtype)
    attn.plan(tree)  # warm-up: the first call pays for imports and caches
    t0 = time.perf_counter()
    plan = attn.plan(tree)
    plan_us = (time.perf_counter() - t0) * 1e6
    q = torch.randn(plan.plan.num_queries, heads, head_dim).to(dtype=dtype, device=args.device)
    k_cache, v_cache = pool.layer(0)
    attn.run(q, k_cache, v_cache, plan)  # warm-up: kernel compiles and builds
    _synchronize(attn.device)
    t0 = time.perf_counter()
    out, lse = attn.run(q, k_cache, v_cache, plan, return_lse=True)
    _synchronize(attn.device)
    run_ms = (time.perf_counter() - t0) * 1e3
    ref, ref_lse = reference_tree_attention(q, k_cache, v_cache, plan.plan.layout, attn.variant)
    max_err = float((out.float() - ref).abs().max())
    return {
        "backend": attn.backend, "backend_reason": attn.backend_reason,
        "kernel_backend": plan.backend, "device": str(attn.device), "dtype": args.dtype,
        "requests": len(tree.roots), "nodes": tree.num_nodes, "forest_tokens": tree.num_tokens,
        "pages_used": pool.num_pages - pool.num_free_pages, "page_size": pool.page_size,
        **plan.plan.summary(), "plan_us": round(plan_us, 1), "run_ms": round(run_ms, 2),
        "max_abs_err_vs_reference": max_err, "max_lse_err_vs_reference": float((lse - ref_lse).abs().max()),
        "tolerance": DEMO_TOLERANCE[args.dtype], "matches_reference": max_err < DEMO_TOLERANCE[args.dtype],
    }


DEMO_MAX_PAGE_SIZE = 1024  # the demo's pool holds 1024 tokens (+ 64 pages); larger pages only waste memory

#: Exceptions that mean the input was wrong (see the module docstring); anything else is a bug.
USER_ERRORS = (ValueError, TypeError, OSError, BackendUnavailableError, PoolExhaustedError, MemoryError,
               torch.cuda.OutOfMemoryError)


class UsageError(Exception):
    """A command line argparse refused; ``prog`` is the (sub)command it was parsed for."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UsageError` instead of printing usage and exiting.

    Subparsers are made with the parser's own class, so every subcommand raises it too. No option
    may be abbreviated (``allow_abbrev=False``: a prefix of a flag is an unknown flag, never another
    flag). An argument no command knows is refused naming the command and the argument, with the
    flag it was renamed to (``renamed``: old spelling -> new, set by the command) or the closest
    flag of the command. ``commands`` maps each subcommand's name to its parser (set by
    :func:`build_parser`).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}
        self.renamed: dict[str, str] = {}

    def error(self, message: str):
        raise UsageError(self.prog, f"{message} (see '{self.prog} --help')")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = self.commands.get(getattr(parsed, "command", None), self)
            raise UsageError(command.prog, f"{command.unknown_argument(unknown[0])} (see '{command.prog} --help')")
        return parsed

    def unknown_argument(self, argument: str) -> str:
        """What to say about ``argument``, which this parser does not take."""
        if not argument.startswith("-") or argument == "-":
            hint = f"; give it as --prompt {shlex.quote(argument)}" if "--prompt" in self._option_string_actions else ""
            return f"unexpected argument {argument!r}{hint}"
        flag = argument.split("=", 1)[0]
        if flag in self.renamed:
            return f"{flag} is now {self.renamed[flag]}"
        options = [o for o in self._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
        return f"unrecognized argument {flag}" + (f"; did you mean {close[0]}?" if close else "")


def build_parser() -> Parser:
    """The ``treedec`` parser: ``--debug`` and the demo, generate, replay, plot, spec, tot, serve, train-drafter and
    env subcommands."""
    parser = Parser(prog="treedec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"treedec {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{demo,generate,replay,plot,spec,tot,serve,train-drafter,env}")
    demo = sub.add_parser("demo", help="plan and run one tree-attention step on a small random forest")
    demo.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    demo.add_argument("--planner", default="flatten", choices=PLANNERS)
    demo.add_argument("--chunk-size", type=positive_int, default=None,
                      help="default: chosen per step by the planner")
    demo.add_argument("--query-tile", type=positive_int, default=None, help="default: about 64 rows per program")
    demo.add_argument("--page-size", type=int_arg(1, DEMO_MAX_PAGE_SIZE), default=16,
                      help=f"tokens per KV page, 1 to {DEMO_MAX_PAGE_SIZE} (default 16)")
    demo.add_argument("--seed", type=seed_int, default=0)
    demo.add_argument("--device", type=device_arg, default="cpu",
                      help="cpu or cuda[:N] (the triton and cuda backends need cuda)")
    demo.add_argument("--dtype", default="fp32", choices=sorted(DEMO_DTYPES),
                      help="K/V and q dtype (the cuda backend takes fp16 or bf16)")
    demo.add_argument("--json", action="store_true",
                      help="print the summary as JSON, and nothing else, on stdout")
    add_generate_parser(sub)
    add_replay_parser(sub)
    add_plot_parser(sub)
    add_spec_parser(sub)
    add_tot_parser(sub)
    add_serve_parser(sub)
    add_train_drafter_parser(sub)
    sub.add_parser("env", help="print the installed versions of what treedec uses (for bug reports)")
    for command in sub.choices.values():  # --debug after the command too; SUPPRESS keeps the global value
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``treedec`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    ``--help`` exits through SystemExit(0), as argparse does.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # before parsing, which can fail; after it, args.debug
    prog = "treedec"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        debug, prog = args.debug, f"treedec {args.command}"
        refuse_overwrites(parser.commands[args.command], args)
        logging.basicConfig(level=logging.WARNING)
        return COMMANDS[args.command](args)
    except UsageError as e:
        if debug:
            raise
        return _fail(e.prog, str(e), 2)
    except KeyboardInterrupt as e:
        if debug:
            raise
        return _fail(prog, "interrupted" + _notes(e), 130)
    except USER_ERRORS as e:
        if debug:
            raise
        return _fail(prog, (str(e) or type(e).__name__) + _notes(e), 2)
    except Exception as e:
        if debug:
            raise
        return _fail(prog, f"{type(e).__name__}: {e}{_notes(e)} (unexpected; rerun with --debug for the traceback)", 1)


def run_demo_command(args: argparse.Namespace) -> int:
    """``treedec demo``: the summary on stdout (a table, or JSON only with ``--json``); 1 on a mismatch."""
    summary = run_demo(args)
    if args.json:
        print(json.dumps(summary, indent=2))
        if not summary["matches_reference"]:
            print("MISMATCH against the dense fp32 reference", file=sys.stderr)
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            print(f"{key:<{width}}  {value}")
        print("OK: matches the dense fp32 reference" if summary["matches_reference"] else
              "MISMATCH against the dense fp32 reference")
    return 0 if summary["matches_reference"] else 1


def run_env_command(args: argparse.Namespace) -> int:
    """``treedec env``: Python, torch (and its CUDA), triton, numpy, transformers, ... as installed."""
    print(format_versions())
    return 0


COMMANDS = {"demo": run_demo_command, "generate": run_generate, "replay": run_replay, "plot": run_plot,
            "spec": run_spec, "tot": run_tot, "serve": run_serve, "train-drafter": run_train_drafter,
            "env": run_env_command}


def _notes(error: BaseException) -> str:
    """The exception's notes (``add_note``), each in parentheses after its message."""
    return "".join(f" ({note})" for note in getattr(error, "__notes__", ()))


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
