"""The front door, in vLLM's manner: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from treedec import LLM, SamplingParams
    llm = LLM("smollm2")                                     # SmolLM2-135M-Instruct, fetched once, on the CPU
    [out] = llm.chat([{"role": "user", "content": "Name three primes."}], SamplingParams(max_tokens=32,
                                                                                         temperature=0))
    print(out.outputs[0].text)

An :class:`LLM` owns one model, its tokenizer and one :class:`~treedec.engine.Engine` (the KV pool, the forest).
:meth:`LLM.generate` runs every prompt batched through the scheduler (one engine step per iteration for every
live request, shared prompt prefixes stored once, admission while the pool holds them); with
``speculative=SpeculativeConfig(...)`` every request is decoded speculatively (greedy acceptance at temperature
0, lossless rejection sampling above). :meth:`LLM.beam_search` and :meth:`LLM.run` (any program objects: ToT,
the branch controller, beams, speculative or plain generation) share the same engine. The lower-level APIs
(:mod:`treedec.programs`) stay for programs that need them.
"""
from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from treedec.checks import describe, is_int, nonnegative_int, positive_int
from treedec.engine import Engine
from treedec.engine.pool_sizing import cpu_pool_tokens
from treedec.models import Decoder, DecoderModel, from_pretrained
from treedec.models.tensor_parallel import check_tensor_parallel_size
from treedec.models.quantization import quantize_on_load
from treedec.tree.kv_cache_dtype import kv_storage_dtype
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from treedec.programs import generate_batch
from treedec.runtime import PrefixCache, RequestResult, RequestSpec, SchedulerStats, run_programs
from treedec.sampling import SamplingParams
from treedec.programs.generate import check_requests, grammar_compiler, prepare_requests, step_progress
from treedec.sampling.grammar import GrammarCompiler
from treedec.programs.beam import BeamSearchParams, beam_program
from treedec.runtime.request import MODEL_EOS, eos_token_ids, position_limit
from treedec.programs.speculative import SpeculativeConfig, speculative_batch
from treedec.programs.speculative.batch import sampled_acceptance
from treedec.programs.speculative.config import as_speculative_config
from treedec.tree.validate import int_list

__all__ = ["LLM", "DTYPES"]

logger = logging.getLogger(__name__)


#: What an ``LLM(engine_process=True)`` keeps in its engine core's process, not in this one.
_IN_CORE = ("model", "engine", "drafts", "prefix_cache", "generator", "grammars")

#: ``dtype`` by name (vLLM's names and treedec's short ones); ``"auto"`` (or None) is bf16 on a GPU, fp32 on the CPU.
DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "half": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class LLM:
    """A model, its tokenizer and one engine, for offline batched generation (vLLM's ``LLM``).

    Parameters
    ----------
    model : a name :func:`~treedec.models.from_pretrained` resolves (``"smollm2"``, a ``.gguf`` file, a checkpoint
        folder, a hub repo id in the local cache), or a loaded model (a :class:`~treedec.models.Decoder`: any family's).
    tokenizer : the tokenizer: a name or folder :func:`~treedec.models.text.load_tokenizer` loads, or a loaded one
        (anything with ``encode`` and ``decode``); default the model's own when ``model`` is a name; None with a
        loaded model: token-id prompts only.
    tensor_parallel_size : 1, or the size of a tensor-parallel model's group (a
        :class:`~treedec.models.Decoder` built with ``tensor_parallel``). An ``LLM`` runs in one process: tensor
        parallelism runs one process per GPU under torchrun, each rank building its slice of the model
        (``from_pretrained(path, tensor_parallel=init_tensor_parallel())``) and an ``LLM`` of it.
    dtype : ``"auto"`` (default: bf16 on a GPU, fp32 on the CPU), ``"bfloat16"``, ``"float16"`` / ``"half"``,
        ``"float32"`` / ``"float"`` (or ``"bf16"``, ``"fp16"``, ``"fp32"``), or a torch dtype; a model given by
        name only.
    seed : the draws of requests without a ``seed`` of their own.
    gpu_memory_utilization : the share of the memory the KV pool may take: on a GPU of the free memory after the
        weights (less the activations' reserve), as vLLM's; on the CPU of the available memory (the pool is
        then sized from ``max_model_len``, below).
    max_model_len : the most positions a request may reach (its prompt and ``max_tokens``); default, and at most,
        the model's (its ``max_position_embeddings``, or its sliding window when smaller). A request past it is
        refused before anything runs.
    speculative_config : vLLM's ``speculative_config`` dict (``{"method": "ngram", "num_speculative_tokens":
        4}``: the fields of :class:`~treedec.programs.speculative.SpeculativeConfig`) or a ``SpeculativeConfig``:
        every :meth:`generate` request is then decoded speculatively.
    enable_prefix_caching : keep prompts and conversations in the KV pool across calls (vLLM's name; a
        :class:`~treedec.runtime.prefix_cache.PrefixCache`, ``llm.prefix_cache``): a later prompt starting with an
        earlier one's tokens reads them (``stats["cached_tokens"]``); its pages are given back as calls need them.
        Off by default (``treedec serve`` keeps a cache over the engine either way: this one if it is on).
    device : default ``"cuda"`` when a GPU is there, else ``"cpu"`` (a model given by name only).
    kv_tokens : the KV pool's size in tokens; default on a GPU what ``gpu_memory_utilization`` of the free memory
        holds, on the CPU one request of ``max_model_len`` tokens, at most
        :data:`~treedec.engine.pool_sizing.CPU_POOL_TOKENS` (logged; ``llm.engine.kv_capacity_tokens``).
    page_size : tokens per KV page.
    backend : tree attention's backend (``"auto"`` reports what it chose: ``llm.engine.attn.backend_reason``).
    cuda_graphs : capture decode steps as CUDA graphs (default: on a GPU).
    quantization : None, or ``"fp8"`` (vLLM's name): quantize a float checkpoint's projections to fp8 e4m3 when
        loading (a model given by name only; an FP8 checkpoint loads as fp8 without it). See
        :func:`~treedec.models.from_pretrained`; ``llm.model.linear_paths()`` says which compute path runs.
    kv_cache_dtype : ``"auto"`` (the model's dtype) or ``"fp8"`` / ``"fp8_e4m3"`` (vLLM's values): K/V stored as
        e4m3, twice the tokens in the same memory, scales from the checkpoint or 1.0 (see
        :class:`~treedec.engine.Engine`; ``llm.engine.kv_cache_dtype``, ``llm.engine.kv_scale_source``). On the CPU
        the attention de-quantizes them (said once, as a warning). A drafter's own KV pool stays in its dtype.
    batch_invariant : a request's tokens and logprobs are the same bits alone or batched with any others (vLLM's
        ``VLLM_BATCH_INVARIANT``, as an argument): see :mod:`treedec.engine.batch_invariance`;
        ``llm.engine.batch_invariance`` says what runs. Refuses ``quantization`` and tensor parallelism.
    engine_process : run the model and its engine in an engine core process of its own, as ``treedec serve`` does
        (default False: in this one). The core is built there from ``model``'s name (a loaded model stays here:
        refused) with these same arguments; :meth:`generate`, :meth:`chat` and :meth:`beam_search` send their requests
        to it through the server's messages and core client (prompts encoded and checked, outputs detokenized and
        their stop strings matched here), their results equal to an in-process LLM's for greedy and seeded requests
        (``stats``: ``prompt_tokens``, ``cached_tokens``, ``seconds``, no ``steps``). Refused, naming what, since
        they need the engine here: :meth:`run`, ``llm.model`` / ``engine`` / ``drafts`` / ``prefix_cache`` /
        ``generator`` / ``grammars``, a beam search with ``structured_outputs`` or on a speculative LLM, a logits
        processor that cannot be pickled. :meth:`shutdown` (or ``with LLM(...)``, or the interpreter's exit) ends the
        process; a core that dies fails the call waiting on it with :class:`~treedec.core.client.EngineDeadError`
        naming its exit code. The process is spawned: a script makes the LLM under ``if __name__ == "__main__":``.
        Needs ``pyzmq`` and ``msgspec`` (the ``serve`` extra).

    Raises
    ------
    TypeError, ValueError : a bad argument (named), before the model loads where it can be told then.
    NotImplementedError : ``tensor_parallel_size > 1`` with a model that is not tensor-parallel.
    MemoryError : a KV pool larger than the device's available memory (nothing allocated).
    """

    def __init__(self, model: str | DecoderModel = "smollm2", tokenizer=None, *, tensor_parallel_size: int = 1,
                 dtype: str | torch.dtype | None = "auto", seed: int = 0, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, speculative_config: SpeculativeConfig | Mapping | None = None,
                 enable_prefix_caching: bool = False, device: str | None = None, kv_tokens: int | None = None,
                 page_size: int = 16, backend: str = "auto", cuda_graphs: bool | None = None,
                 quantization: str | None = None, kv_cache_dtype: str = "auto", batch_invariant: bool = False,
                 engine_process: bool = False, **unknown):
        if unknown:
            raise TypeError(_unknown_arguments(unknown))
        self._core, self.engine_process = None, engine_process
        if engine_process is not False:
            if engine_process is not True:
                raise TypeError(f"engine_process must be True or False, got {describe(engine_process)}")
            options = dict(tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                           speculative_config=speculative_config, enable_prefix_caching=enable_prefix_caching,
                           device=device, kv_tokens=kv_tokens, page_size=page_size, backend=backend,
                           cuda_graphs=cuda_graphs, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                           batch_invariant=batch_invariant)
            self._start_core(model, tokenizer, options)
            return
        if quantization is not None:
            quantize_on_load(quantization)   # (a bad name is refused before the weights load)
            if batch_invariant is True:
                raise ValueError(f"batch_invariant=True needs unquantized projections, got quantization="
                                 f"{quantization!r}: leave it None")
        kv_storage_dtype(kv_cache_dtype, torch.float32)   # (likewise)
        speculative_config = as_speculative_config(speculative_config)
        positive_int("tensor_parallel_size", tensor_parallel_size)
        dtype = _dtype(dtype)
        nonnegative_int("seed", seed)
        if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got "
                             f"{describe(gpu_memory_utilization)}")
        if max_model_len is not None:
            positive_int("max_model_len", max_model_len)
        if kv_tokens is not None:
            positive_int("kv_tokens", kv_tokens)
        if tokenizer is not None and not isinstance(tokenizer, (str, Path)) and not (
                callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer must be a tokenizer name or folder, or a tokenizer with encode() and decode() "
                            f"(e.g. load_tokenizer(...)), got {describe(tokenizer)}")
        if isinstance(model, Decoder):   # (every family's model; a protocol's isinstance misses nn.Module members)
            if device is not None or dtype is not None or quantization is not None:
                raise ValueError(f"device, dtype and quantization apply to a model loaded by name; a loaded model "
                                 f"keeps its own ({model.device}, {model.dtype}): move it first, or give its name")
            self.model, self.name = model, type(model).__name__
        elif isinstance(model, (str, Path)):
            check_tensor_parallel_size(None, tensor_parallel_size)   # before the weights load
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
            self.model = from_pretrained(model, dtype=dtype, device=device, quantization=quantization)
            self.name = str(model)
            if tokenizer is None:
                tokenizer = model
        else:
            raise TypeError(f"model must be a model name or path, or a loaded treedec model (a Decoder), got "
                            f"{describe(model)}")
        check_tensor_parallel_size(self.model, tensor_parallel_size)
        limit = position_limit(self.model)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len must be at most the model's {limit} positions, got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        on_gpu = self.model.device.type == "cuda"
        if kv_tokens is None and not on_gpu:
            size = cpu_pool_tokens(self.model, page_size, self.max_model_len, memory_fraction=gpu_memory_utilization,
                                   kv_cache_dtype=kv_cache_dtype)
            kv_tokens = size.tokens
            logger.info("KV pool: %d tokens (%s)", kv_tokens, size.reason)
        self.engine = Engine(self.model, kv_tokens=kv_tokens, page_size=page_size, backend=backend,
                             memory_fraction=gpu_memory_utilization,
                             cuda_graphs=on_gpu if cuda_graphs is None else cuda_graphs, kv_cache_dtype=kv_cache_dtype,
                             batch_invariant=batch_invariant)
        self.speculative_config = speculative_config
        self.drafts = None if speculative_config is None else speculative_config.build(self.engine)
        if self.drafts is not None:
            logger.info("speculative decoding: %s", self.drafts.note)
        self.generator = torch.Generator(self.model.device).manual_seed(seed)
        self.prefix_cache = PrefixCache(self.engine.tree) if enable_prefix_caching else None
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The :class:`~treedec.sampling.grammar.GrammarCompiler` of requests' ``structured_outputs`` (made at the
        first use: its compiled grammars are cached across calls)."""
        if self._core is not None:   # (__getattr__ says why: the engine core compiles them)
            raise AttributeError("grammars")
        if self._grammars is None:
            self._grammars = grammar_compiler(self.engine, self.get_tokenizer())
        return self._grammars

    def get_tokenizer(self):
        """The tokenizer (vLLM's ``LLM.get_tokenizer``). Raises ValueError when this LLM has none (a loaded model
        without ``tokenizer=``: token-id prompts only)."""
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: give LLM(..., tokenizer=...) (a name, a folder or a loaded "
                             "tokenizer)")
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, chat_template: bool = False) -> list[RequestOutput]:
        """Generate for every prompt, batched; the outputs in the prompts' order.

        Parameters
        ----------
        prompts : a text, a ``{"prompt_token_ids": [...]}`` dict (vLLM's tokens prompt), a ``{"prompt": text}``
            dict, or a list of them.
        sampling_params : one :class:`~treedec.sampling.params.SamplingParams` for all prompts, or one per
            prompt; default ``SamplingParams()`` (vLLM's defaults: temperature 1.0, 16 tokens).
        use_tqdm : a progress bar of finished requests on stderr.
        chat_template : render text prompts through the tokenizer's chat template (:meth:`chat` does).

        Raises
        ------
        ValueError, TypeError : a bad prompt or parameter (before anything runs), a prompt and ``max_tokens`` past
            ``max_model_len``; with ``speculative_config``, a request that speculative decoding cannot take
            (``n > 1``, penalties, logprobs, ...).
        PoolExhaustedError : a request whose worst case exceeds the whole KV pool.
        """
        specs = self._specs(prompts, sampling_params, "prompts")
        return self._run(specs, use_tqdm, chat_template)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """:meth:`generate` for chat conversations through the tokenizer's chat template: ``messages`` is one
        conversation (a list of ``{"role": ..., "content": ...}``) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        specs = self._specs([{"messages": c} for c in conversations], sampling_params, "messages")
        return self._run(specs, use_tqdm, True)

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search of every prompt, batched on this LLM's engine (vLLM's ``LLM.beam_search``; transformers'
        algorithm and scores: :func:`~treedec.programs.beam.beam_program`).

        Parameters
        ----------
        prompts : a text (encoded as it is, no chat template), token ids (a list of ints), a ``{"prompt": text}``
            or ``{"prompt_token_ids": [...]}`` dict, or a list of them.
        params : a :class:`BeamSearchParams` (vLLM's fields; the model's EOS ids end a hypothesis unless
            ``ignore_eos``).
        use_tqdm : a progress bar of finished prompts on stderr.

        Returns
        -------
        One :class:`BeamSearchOutput` per prompt, in order: ``beam_width`` sequences, best first.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {describe(params)}")
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts and is_int(prompts[0])):
            prompts = [prompts]
        ids = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if not ids:
            raise ValueError("prompts is empty: give at least one")
        eos = None if params.ignore_eos else MODEL_EOS
        grammar = None if params.structured_outputs is None or self._core is not None else \
            self.grammars.compile(params.structured_outputs)
        for i, prompt in enumerate(ids):
            self._check_length(f"prompts[{i}]", len(prompt), params.max_tokens)
        with tqdm(total=len(ids), unit="prompt", desc="beam search", disable=not use_tqdm or None,
                  file=sys.stderr) as bar:
            if self._core is not None:   # (each hypothesis an output of the request, best first)
                runs = self._core.beam_search(ids, params, on_done=lambda results: bar.update(1))
                beams = [([r.output_ids for r in rs], [r.stats["beam_score"] for r in rs]) for rs in runs]
            else:
                programs = [beam_program(self.engine, prompt, params.beam_width, params.max_tokens,
                                         params.length_penalty, eos, params.early_stopping, grammar) for prompt in ids]
                results, _ = run_programs(self.engine, programs, prefix_cache=self.prefix_cache,
                                          on_done=lambda index, result: bar.update(1))
                beams = [(r.sequences, r.scores) for r in results]
        return [self._beam_output(prompt, *beam, params) for prompt, beam in zip(ids, beams)]

    def run(self, programs: Sequence) -> tuple[list, SchedulerStats]:
        """Run any scheduler programs (:class:`~treedec.runtime.program.Program`: generation, speculative decoding,
        beams, ToT, the branch controller) together on this LLM's engine: ``(results, stats)`` as
        :func:`~treedec.runtime.scheduler.run_programs` returns them. Not with ``engine_process=True``
        (NotImplementedError): program objects hold this process's engine, and the core takes requests."""
        if self._core is not None:
            raise NotImplementedError("LLM.run(programs) runs program objects on the LLM's engine, which "
                                      "engine_process=True keeps in the engine core's process (it takes requests, not "
                                      "programs): use LLM(..., engine_process=False) to run them")
        return run_programs(self.engine, programs, prefix_cache=self.prefix_cache)

    def shutdown(self) -> None:
        """End the engine core's process (``engine_process=True``; every request in flight aborted; a later call
        raises :class:`~treedec.core.client.EngineDeadError`); nothing for an in-process LLM (its engine is freed
        with it). Also on leaving ``with LLM(...) as llm:`` and at the interpreter's exit."""
        if self._core is not None:
            self._core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __getattr__(self, name: str):
        # (only for attributes this LLM lacks: with engine_process=True, those of the engine in the core's process)
        core = self.__dict__.get("_core")
        if core is not None and name in _IN_CORE:
            raise AttributeError(f"LLM(engine_process=True) has no {name} in this process: the model and its engine "
                                 f"live in the engine core's process (pid {core.pid}); give engine_process=False to "
                                 f"use llm.{name}")
        raise AttributeError(f"'LLM' object has no attribute {name!r}")

    # ---------------------------------------------------------------- private

    def _specs(self, prompts, sampling_params, what: str) -> list[RequestSpec]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError(f"{what} is empty: give at least one")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts: give one for "
                             f"all or one per prompt")
        specs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {describe(p)}")
            if isinstance(prompt, str):
                prompt = {"prompt": prompt}
            if not isinstance(prompt, Mapping) or len(prompt) != 1 or \
                    next(iter(prompt)) not in ("prompt", "prompt_token_ids", "messages"):
                raise ValueError(f"{what}[{i}] must be a text, {{'prompt': text}}, {{'prompt_token_ids': [ids]}} or "
                                 f"chat messages, got {describe(prompt)}")
            key, value = next(iter(prompt.items()))
            key = "prompt_ids" if key == "prompt_token_ids" else key
            specs.append(RequestSpec(str(i), **{key: value}, params=p))
        return specs

    def _prompt_ids(self, prompt, name: str) -> list[int]:
        """A beam search prompt's token ids: a text (encoded as it is), token ids, or vLLM's prompt dicts."""
        if isinstance(prompt, Mapping) and len(prompt) == 1 and next(iter(prompt)) in ("prompt", "prompt_token_ids"):
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{name} is a text: it needs the checkpoint's tokenizer (or give token ids)")
            return encode_prompt(self.tokenizer, prompt, False)
        if isinstance(prompt, Sequence) and not isinstance(prompt, Mapping):
            return int_list(prompt, name, low=0)
        raise ValueError(f"{name} must be a text, token ids, {{'prompt': text}} or {{'prompt_token_ids': [ids]}}, "
                         f"got {describe(prompt)}")

    def _check_length(self, name: str, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(f"{name} may reach {prompt_tokens + max_tokens} positions (a {prompt_tokens}-token prompt "
                             f"+ max_tokens {max_tokens}), more than max_model_len {self.max_model_len}; shorten the "
                             f"prompt or lower max_tokens; nothing was run")

    def _run(self, specs: list[RequestSpec], use_tqdm: bool, chat_template: bool) -> list[RequestOutput]:
        # encoded here once (the batch takes the ids), so every request is checked against max_model_len first
        if self._core is None:
            encoded = prepare_requests(self.engine, specs, self.tokenizer, chat_template)
        else:   # (the same checks for the core's model: nothing is sent before every request passes them)
            ready = self._core.ready
            encoded = check_requests(specs, self.tokenizer, chat_template, ready.vocab_size, ready.positions)
        for spec, ids in encoded:
            self._check_length(f"request {spec.id}", len(ids), spec.params.max_tokens)
        runs = [RequestSpec(spec.id, prompt_ids=tuple(ids), params=spec.params) for spec, ids in encoded]
        with tqdm(total=len(specs), unit="request", desc="generate", disable=not use_tqdm or None,
                  file=sys.stderr) as bar:
            done = lambda outputs: bar.update(1)   # noqa: E731
            step = step_progress(bar)   # the bar moves every engine step, not only when a request finishes
            if self._core is not None:
                results = [r for rs in self._core.generate(runs, on_done=done, on_step=step) for r in rs]
            elif self.drafts is None:
                results, _ = generate_batch(self.engine, runs, self.tokenizer, False, self.generator,
                                            on_request_done=done, on_step=step, prefix_cache=self.prefix_cache,
                                            grammars=self._structured(runs))
            else:
                results, _ = speculative_batch(self.engine, runs, self.drafts.source, self.tokenizer, False,
                                               acceptance=lambda spec: sampled_acceptance(spec, self._seed),
                                               on_request_done=done, on_step=step, prefix_cache=self.prefix_cache,
                                               grammars=self._structured(runs))
        by_request: dict[str, list[RequestResult]] = {}
        for r in results:
            by_request.setdefault(r.id, []).append(r)
        return [_request_output(spec, by_request[spec.id]) for spec in specs]

    def _structured(self, specs: Sequence[RequestSpec]) -> GrammarCompiler | None:
        """:attr:`grammars` when a request has ``structured_outputs``, else None (nothing made)."""
        return self.grammars if any(s.params.structured_outputs is not None for s in specs) else None

    def _beam_output(self, prompt: list[int], hypotheses: list[list[int]], scores: list[float],
                     params: BeamSearchParams) -> BeamSearchOutput:
        model_eos = self._core.ready.eos_token_ids if self._core is not None else eos_token_ids(MODEL_EOS, self.model)
        eos = set() if params.ignore_eos else set(model_eos)
        sequences = []
        for tokens, score in zip(hypotheses, scores):
            text = None if self.tokenizer is None else self.tokenizer.decode(prompt + tokens, skip_special_tokens=True)
            sequences.append(BeamSearchSequence(prompt + tokens, text, score * len(tokens) ** params.length_penalty,
                                                score, "stop" if tokens and tokens[-1] in eos else "length"))
        return BeamSearchOutput(sequences)

    def _start_core(self, model, tokenizer, options: dict) -> None:
        """``engine_process=True``: the engine core's process, its LLM built there with this one's arguments (the
        server's launcher), and this LLM its client's (prompts encoded here with the core's tokenizer)."""
        if not isinstance(model, (str, Path)):
            raise ValueError(f"engine_process=True builds the model in the engine core's process, from its name or "
                             f"path; got {describe(model)}: give its name (a loaded model stays in this process: "
                             f"engine_process=False)")
        missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
        if missing:
            raise ModuleNotFoundError(f"LLM(engine_process=True) needs pyzmq and msgspec ({', '.join(missing)} not "
                                      f"installed): pip install 'treedec[serve]'")
        from treedec.core.sync_client import start_core

        options["speculative_config"] = self.speculative_config = as_speculative_config(options["speculative_config"])
        # (an in-process LLM there; no prefix cache but its own, enable_prefix_caching, as in this process)
        self._core = start_core(functools.partial(LLM, model, tokenizer, **options), seed=options["seed"])
        ready = self._core.ready
        self.name, self.max_model_len, self.tokenizer = ready.name, ready.max_model_len, self._core.tokenizer
        logger.info("engine core: process %d (%s on %s)", ready.pid, ready.name, ready.device)

    def _seed(self, spec: RequestSpec) -> int:
        if spec.params.seed is not None:
            return spec.params.seed
        return int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))


def _unknown_arguments(unknown: dict) -> str:
    """The error for keyword arguments ``LLM`` does not take: vLLM's that treedec has no counterpart for, and the
    spelling meant (``speculative``: ``speculative_config``)."""
    known = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "unknown")]
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"LLM() got unexpected keyword argument(s) {', '.join(parts)}; it takes {', '.join(known)}"


def _dtype(dtype) -> torch.dtype | None:
    """``dtype`` as a torch dtype; None for ``"auto"`` (the device's default)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto', one of {', '.join(DTYPES)} or torch.float32 / float16 / bfloat16, got "
                     f"{describe(dtype)}")


def _request_output(spec: RequestSpec, results: list[RequestResult]) -> RequestOutput:
    first = results[0]
    outputs = []
    for r in results:
        stop = None
        if r.stop_reason == "stop_string":
            stop = r.stats.get("stop_string")
        elif r.stop_reason == "eos" and r.output_ids and r.output_ids[-1] in spec.params.stop_token_ids:
            stop = r.output_ids[-1]
        outputs.append(CompletionOutput(r.index, r.text, list(r.output_ids), r.cumulative_logprob, r.logprobs,
                                        "length" if r.stop_reason == "length" else "stop", stop))
    stats = dict(first.stats)
    if "steps" in stats:   # (the engine's count: an engine core's process sends none)
        stats["tokens_per_step"] = len(first.output_ids) / stats["steps"] if stats["steps"] else 0.0
    prompt = spec.prompt if spec.prompt is not None else (None if spec.messages is None else list(spec.messages))
    return RequestOutput(spec.id, prompt, list(first.prompt_ids), first.prompt_logprobs, outputs, True,
                         {k: v for k, v in stats.items() if k not in ("root", "nodes")})
