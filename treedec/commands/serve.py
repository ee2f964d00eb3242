"""``treedec serve``: an OpenAI-compatible HTTP server over one model (:mod:`treedec.serve`).

    treedec serve --model smollm2                                   # http://127.0.0.1:8000/v1, on the CPU
    treedec serve --model /models/Llama-3.1-8B-Instruct --port 8080 --speculative eagle3 --drafter /models/eagle3
    treedec serve --model smollm2 --speculative ngram --num-speculative-tokens 4 --max-queued-requests 256
    treedec serve --config llama3-8b --tokenizer smollm2 --page-size 16      # random weights (benchmarks)

It loads an :class:`~treedec.LLM` (the model, its tokenizer, one engine and, with ``--speculative``, its
:class:`~treedec.programs.speculative.SpeculativeConfig`: every request is then decoded speculatively), builds the app
(:func:`treedec.serve.build_app`) and runs it with uvicorn (:func:`treedec.serve.http.make_server`) until Ctrl-C or
SIGTERM: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. By default (``--engine-process``) the LLM is built and run in an engine-core process of its own
(:mod:`treedec.core.engine_core`: the online scheduler), and this process is the frontend (HTTP, tokenization, chat
templates, streams, metrics), as vLLM's; ``--no-engine-process`` runs both in one process. When the engine core's
process ends unasked (killed, crashed) every request in flight is answered 503 ``engine_failed`` and the server
exits with code 1, for a supervisor to restart it; with ``--max-core-restarts N`` the server starts the core again
itself, up to N times (requests meanwhile are answered 503 ``engine_restarting``), and exits 1 after the next crash.
Requests name the model ``--served-model-name`` (default the
``--model`` argument). The first signal aborts every request (live streams end with an error event) and the server
exits within a few seconds, exit code 0. On a loopback address it answers only the loopback host names
(``--allowed-hosts`` adds others). Needs the ``serve`` extra: ``pip install 'treedec[serve]'``.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import ipaddress
import os
import signal
import sys
from pathlib import Path

from treedec.commands.args import (DTYPES, add_batch_invariant_argument, add_quantization_argument, choice_arg,
                                   device_arg, model_arg, model_size, nonnegative_int, positive_float, positive_int,
                                   unit_fraction)
from treedec.models.config import MODEL_SIZES

#: The names a loopback server answers by default (as :data:`treedec.serve.limits.LOOPBACK_HOSTS`, which cannot be
#: imported before the serve extra is checked).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")

#: The environment variable ``--api-key`` defaults to (vLLM's is ``VLLM_API_KEY``).
API_KEY_ENV = "TREEDEC_API_KEY"

#: ``--speculative`` methods (:data:`treedec.programs.speculative.config.METHODS` but ``tree``, whose fixed tokens a
#: command line does not give).
METHODS = ("ngram", "medusa", "eagle", "eagle3", "draft_model")


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat) over one model",
                       description="An OpenAI-compatible HTTP server over one model (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics). Every request of every "
                                   "client runs batched on one "
                                   "engine; a client that disconnects aborts its request.")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=model_arg, help="the model: a known name (e.g. smollm2), a .gguf file, a "
                       "Hugging Face checkpoint folder or a hub repo id in the local cache")
    model.add_argument("--config", type=model_size, help=f"a named model size with random weights (seeded by --seed; "
                       f"give --tokenizer), for benchmarks: one of {', '.join(MODEL_SIZES)}")
    p.add_argument("--tokenizer", help="the tokenizer (a known name, a checkpoint or tokenizer folder); default the "
                   "--model's; required with --config")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", help="the name requests give as 'model' (default the --model argument)")
    p.add_argument("--device", type=device_arg, help="cpu or cuda[:N]; default cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")
    add_quantization_argument(p)
    add_batch_invariant_argument(p)
    p.add_argument("--kv-tokens", type=positive_int, help="the KV pool's size in tokens (default: what "
                   "--gpu-memory-utilization of the free GPU memory holds; on the CPU one request of --max-model-len, "
                   "at most 32768)")
    p.add_argument("--max-model-len", type=positive_int, help="the most positions a request may reach (its prompt "
                   "and max_tokens; vLLM's); default, and at most, the model's")
    p.add_argument("--gpu-memory-utilization", type=unit_fraction, default=0.9,
                   help="the share of the GPU's free memory after the weights the KV pool may take, in (0, 1] "
                   "(default 0.9; vLLM's); on the CPU, of the available memory")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="1 (the default): treedec serve runs one process; tensor parallelism runs under torchrun, "
                   "which the server does not start (vLLM starts a worker per GPU)")
    p.add_argument("--speculative", type=choice_arg(METHODS), metavar="METHOD",
                   help=f"decode every request speculatively with this draft source (SpeculativeConfig.method, as "
                        f"treedec spec's --speculative): {', '.join(METHODS)}")
    p.add_argument("--drafter", help="--speculative medusa / eagle / eagle3 / draft_model: the drafter's weights "
                   "(a path or model name; 'random' for random weights: the machinery only)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                   help="--speculative: the draft's depth (default 4)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="outputs (prompts x n of each request) that may wait for admission; a request that would "
                   "make more wait is answered 503 (default 1024)")
    p.add_argument("--max-n", type=positive_int, default=128,
                   help="the largest n of a request (default 128; vLLM's VLLM_MAX_N_SEQUENCES)")
    p.add_argument("--max-prompts", type=positive_int, default=256,
                   help="the most prompts one /v1/completions request may hold (default 256)")
    p.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20,
                   help="the largest request body, counted as it arrives (default 8 MiB; 413 past it)")
    p.add_argument("--read-timeout", type=positive_float, default=30.0,
                   help="seconds a request's body may pause between two chunks (default 30; 408 past it)")
    p.add_argument("--engine-iteration-timeout", type=positive_float, default=60.0,
                   help="/health answers 503 while an engine iteration has run longer (default 60 s; vLLM's "
                   "VLLM_ENGINE_ITERATION_TIMEOUT_S)")
    p.add_argument("--chat-template-timeout", type=positive_float, default=5.0,
                   help="seconds the chat template may take to render a request's messages (default 5; 400 past "
                   "it: it runs in a worker process, stopped then)")
    p.add_argument("--allowed-hosts",
                   help="comma-separated Host names the server answers ('*': any); default on a loopback --host: "
                   f"{','.join(LOOPBACK_HOSTS)} (against DNS rebinding), else any")
    p.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    p.add_argument("--chat-template", help="a Jinja chat template (a file, or the template itself) replacing the "
                   "tokenizer's own")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"every route but /health and /metrics needs 'Authorization: Bearer <key>' (401 otherwise); "
                   f"default the {API_KEY_ENV} environment variable (vLLM's --api-key / VLLM_API_KEY), which keeps the "
                   f"key out of the process list")
    p.add_argument("--secure-metrics", action="store_true", help="with --api-key, /health and /metrics need the key "
                   "too")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (the model and its scheduler) in a process of its own, the frontend "
                   "(HTTP, tokenization, streams) in this one (the default; vLLM's shape); --no-engine-process: one "
                   "process")
    p.add_argument("--max-core-restarts", type=nonnegative_int, default=0,
                   help="start a crashed engine core again, up to this many times (its requests in flight are "
                   "answered 503 engine_failed, those sent meanwhile 503 engine_restarting); default 0: the server "
                   "exits 1 when its core crashes, for a supervisor to restart it")
    p.add_argument("--seed", type=int, default=0, help="the seeds of sampled requests without one, and --config's "
                   "random weights' (default 0)")


def run_serve(args: argparse.Namespace) -> int:
    """Run ``treedec serve`` until interrupted; returns the exit code."""
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        # (an OSError: the CLI reports it in one line, as a missing file, exit 2)
        raise OSError(f"treedec serve needs {', '.join(missing)}, not installed: pip install 'treedec[serve]'")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.config is not None and args.tokenizer is None:
        raise ValueError(f"--config {args.config} has random weights and no tokenizer: give --tokenizer (e.g. smollm2)")
    if args.drafter is not None and args.speculative in (None, "ngram"):
        raise ValueError(f"--drafter gives the weights of --speculative medusa / eagle / eagle3 / draft_model, got "
                         f"--speculative {args.speculative}")
    if args.tensor_parallel_size > 1:   # (before the model loads: the server cannot load a tensor-parallel model)
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: treedec serve runs one process on one device; "
            f"tensor parallelism runs one process per GPU under torchrun (treedec.models.tensor_parallel), which the "
            f"server does not start (vLLM starts a worker per GPU); serve with --tensor-parallel-size 1")
    if args.max_core_restarts and not args.engine_process:
        raise ValueError("--max-core-restarts starts the engine core's own process again: it needs --engine-process")
    if args.secure_metrics and args.api_key is None:
        raise ValueError(f"--secure-metrics puts /health and /metrics behind the API key: give --api-key (or set "
                         f"{API_KEY_ENV})")
    if args.api_key is not None:
        from treedec.serve.auth import check_api_key   # (imports no server package)
        try:
            check_api_key(args.api_key)
        except ValueError as e:
            raise ValueError(f"--api-key (or {API_KEY_ENV}): {e}") from None
    allowed_hosts = default_allowed_hosts(args.host) if args.allowed_hosts is None else \
        [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if allowed_hosts is not None and not allowed_hosts:
        raise ValueError(f"--allowed-hosts must name at least one host ('*' for any), got {args.allowed_hosts!r}")
    from treedec.programs.speculative import SpeculativeConfig
    from treedec.serve import build_app
    from treedec.core.process_client import launch_core
    from treedec.serve.http import make_server

    if args.speculative is not None:   # (checked before the model loads)
        SpeculativeConfig(method=args.speculative, model=args.drafter,
                          num_speculative_tokens=args.num_speculative_tokens)
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        template = path.read_text() if path.is_file() else args.chat_template
    name = args.served_model_name or args.model or args.config
    recipe = functools.partial(build_llm, args, template)
    if args.engine_process:
        # (a user's error in the core: its class, one line)
        engine = launch_core(recipe, seed=args.seed, max_restarts=args.max_core_restarts)
        ready = engine.ready
        core = f"engine core: process {ready.pid}"
    else:
        engine = llm = recipe()
        ready = None
        core = "engine core: in-process"
    server = None
    try:
        app = build_app(engine, name, max_queued_requests=args.max_queued_requests, max_n=args.max_n,
                        max_prompts=args.max_prompts, max_body_bytes=args.max_body_bytes,
                        read_timeout=args.read_timeout, engine_iteration_timeout=args.engine_iteration_timeout,
                        chat_template_timeout=args.chat_template_timeout, allowed_hosts=allowed_hosts,
                        enable_docs=args.enable_docs, seed=args.seed, api_key=args.api_key,
                        secure_metrics=args.secure_metrics)
        server = make_server(app, args.host, args.port)
        if ready is None:
            pool = llm.engine.pool
            device, kv_tokens, max_model_len = llm.model.device, pool.num_pages * pool.page_size, llm.max_model_len
            kv_dtype = llm.engine.kv_cache_dtype
            invariant = llm.engine.batch_invariance is not None
            drafting = "" if llm.drafts is None else f", speculative: {llm.drafts.note}"
        else:
            device, kv_tokens, max_model_len = ready.device, ready.kv_tokens, ready.max_model_len
            kv_dtype = ready.kv_cache_dtype
            invariant = ready.batch_invariant
            drafting = f", speculative: {ready.note}" if ready.speculative else ""
        hosts = "any Host" if allowed_hosts is None else f"Host {','.join(allowed_hosts)}"
        key = "API key required" if args.api_key is not None else "no API key"
        print(f"treedec serve: {name} on {device} ({kv_tokens} KV tokens of {kv_dtype}, max_model_len {max_model_len}"
              f"{', batch-invariant' if invariant else ''}{drafting}; "
              f"{core}) at http://{args.host}:{args.port}/v1 (OpenAI API; /metrics, /health; {hosts}; {key})",
              file=sys.stderr)
        if args.api_key is None and not is_loopback(args.host):
            print(f"treedec serve: warning: listening on {args.host} without an API key: whoever reaches the port "
                  f"uses the model (give --api-key or set {API_KEY_ENV})", file=sys.stderr)
    # uvicorn shuts down on the first SIGINT / SIGTERM, then raises that signal again for whoever handled it before;
    # for treedec serve that is its normal end (exit code 0), so the handlers it finds are no-ops.
        quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run()
        finally:
            for sig, handler in quiet.items():
                signal.signal(sig, handler)
    finally:
        if args.engine_process:   # (ended with the app's lifespan; here when the server never started)
            engine.stop()
    failed = getattr(server, "engine_failed", None)
    if failed is not None:   # (a supervisor restarts it)
        print(f"treedec serve: error: the engine core is gone ({failed}); every request in flight was answered 503 "
              f"engine_failed", file=sys.stderr)
        return 1
    return 0


def build_llm(args: argparse.Namespace, template: str | None):
    """``treedec serve``'s LLM from its arguments (in the engine core's process, or in this one)."""
    import torch

    from treedec.llm import LLM
    from treedec.models import from_config
    from treedec.programs.speculative import SpeculativeConfig

    speculative = None
    if args.speculative is not None:
        speculative = SpeculativeConfig(method=args.speculative, model=args.drafter,
                                        num_speculative_tokens=args.num_speculative_tokens)
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    sizes = dict(max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                 tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
                 batch_invariant=args.batch_invariant)
    if args.config is not None:   # random weights, placed here (LLM places only models it loads by name)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = from_config(args.config, seed=args.seed, device=device,
                            dtype=dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
                            quantization=args.quantization)
        llm = LLM(model, args.tokenizer, kv_tokens=args.kv_tokens, page_size=args.page_size,
                  speculative_config=speculative, **sizes)
    else:
        llm = LLM(args.model, args.tokenizer, device=args.device, dtype=dtype, kv_tokens=args.kv_tokens,
                  page_size=args.page_size, speculative_config=speculative, quantization=args.quantization, **sizes)
    if template is not None:
        llm.tokenizer.chat_template = template
    return llm


def default_allowed_hosts(host: str) -> list[str] | None:
    """The Host names a server bound to ``host`` answers by default: on a loopback address its loopback names (and
    ``host`` itself), so a web page cannot reach it by rebinding its own name to 127.0.0.1; elsewhere any (None)."""
    if not is_loopback(host):
        return None
    own = f"[{host.strip('[]')}]" if ":" in host else host
    return list(dict.fromkeys([*LOOPBACK_HOSTS, own]))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is a loopback address; a host name other than ``localhost``
    is not (it may resolve anywhere)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # (a host name)
        return False
