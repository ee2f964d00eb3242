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
(:mod:`treedec.search`) stay for programs that need them.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from treedec.checks import describe, nonnegative_int, positive_int
from treedec.engine import Engine
from treedec.models import Decoder, DecoderModel, from_pretrained
from treedec.models.text import load_tokenizer
from treedec.search import (BeamSearchResult, PrefixCache, RequestResult, RequestSpec, SamplingParams, SchedulerStats,
                            generate_batch, run_programs)
from treedec.search.batch import step_progress
from treedec.search.beam import beam_program
from treedec.search.request import MODEL_EOS
from treedec.search.speculative import SpeculativeConfig, speculative_batch
from treedec.search.speculative.batch import sampled_acceptance

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

logger = logging.getLogger(__name__)

#: The CPU pool's default size in tokens (there is no free-memory query there).
CPU_KV_TOKENS = 32768


@dataclass
class CompletionOutput:
    """One output of a request (vLLM's ``CompletionOutput``).

    Attributes
    ----------
    index : which of the request's ``n`` outputs.
    text : the output's text (cut at a stop string unless ``include_stop_str_in_output``).
    token_ids : its tokens (an EOS or stop token that ended it included).
    cumulative_logprob : the sum of its tokens' log-probabilities, with ``SamplingParams.logprobs``; else None.
    logprobs : with ``SamplingParams.logprobs``: per token, token id -> :class:`~treedec.search.logits.Logprob`.
    finish_reason : ``"stop"`` (an EOS, a stop token or a stop string) or ``"length"`` (``max_tokens``).
    stop_reason : the stop string or stop token id that ended it; None for the model's EOS or ``"length"``.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None
    finish_reason: str
    stop_reason: str | int | None


@dataclass
class RequestOutput:
    """What :meth:`LLM.generate` returns for one prompt (vLLM's ``RequestOutput``).

    Attributes
    ----------
    request_id : the prompt's index in the call (a string, as vLLM's).
    prompt : the prompt's text or chat messages (None for token ids).
    prompt_token_ids : the prompt's tokens (after the chat template).
    prompt_logprobs : with ``SamplingParams.prompt_logprobs``: per prompt token (None for the first).
    outputs : its ``n`` :class:`CompletionOutput`.
    finished : always True (an offline call returns finished requests).
    stats : the request's counters: ``steps`` (engine steps), ``seconds`` (admission to retirement),
        ``tokens_per_step``; speculative decoding adds ``accepted`` (draft tokens accepted each step).
    """

    request_id: str
    prompt: str | list[dict] | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    stats: dict = field(default_factory=dict)


class LLM:
    """A model, its tokenizer and one engine, for offline batched generation.

    Parameters
    ----------
    model : a name :func:`~treedec.models.from_pretrained` resolves (``"smollm2"``, a ``.gguf`` file, a checkpoint
        folder, a hub repo id in the local cache), or a loaded model (a :class:`~treedec.models.DecoderModel`: any family's).
    tokenizer : the tokenizer (anything :func:`~treedec.models.text.load_tokenizer` loads, or a loaded one);
        default the model's own when ``model`` is a name; None with a loaded model: token-id prompts only.
    device : default ``"cuda"`` when a GPU is there, else ``"cpu"`` (a model given by name only).
    dtype : default bf16 on a GPU, fp32 on the CPU (a model given by name only).
    kv_tokens : the KV pool's size in tokens; default what free GPU memory holds, or 32768 on the CPU.
    page_size : tokens per KV page.
    backend : tree attention's backend (``"auto"`` reports what it chose: ``llm.engine.attn.backend_reason``).
    speculative : a :class:`~treedec.search.speculative.SpeculativeConfig` (or a dict of its fields): every
        :meth:`generate` request is decoded speculatively with it.
    cuda_graphs : capture decode steps as CUDA graphs (default: on a GPU).
    seed : the draws of requests without a ``seed`` of their own.
    enable_prefix_caching : keep prompts and conversations in the KV pool across calls (vLLM's name; a
        :class:`~treedec.search.prefix_cache.PrefixCache`, ``llm.prefix_cache``): a later prompt starting with an
        earlier one's tokens reads them (``stats["cached_tokens"]``); its pages are given back as calls need them.
        Off by default (``treedec serve`` keeps a cache over the engine either way: this one if it is on).
    """

    def __init__(self, model: str | DecoderModel = "smollm2", tokenizer=None, *, device: str | None = None,
                 dtype: torch.dtype | None = None, kv_tokens: int | None = None, page_size: int = 16,
                 backend: str = "auto", speculative: SpeculativeConfig | Mapping | None = None,
                 cuda_graphs: bool | None = None, seed: int = 0, enable_prefix_caching: bool = False):
        if isinstance(speculative, Mapping):
            speculative = SpeculativeConfig(**speculative)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, a dict of its fields or None, got "
                            f"{describe(speculative)}")
        nonnegative_int("seed", seed)
        if kv_tokens is not None:
            positive_int("kv_tokens", kv_tokens)
        if isinstance(model, Decoder):   # (every family's model; the protocol's isinstance misses nn.Module members)
            if device is not None or dtype is not None:
                raise ValueError(f"device and dtype place a model loaded by name; a loaded model keeps its own "
                                 f"({model.device}, {model.dtype}): move it first, or give its name")
            self.model, self.name = model, type(model).__name__
        elif isinstance(model, str):
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
            self.model, self.name = from_pretrained(model, dtype=dtype, device=device), model
            if tokenizer is None:
                tokenizer = model
        else:
            raise TypeError(f"model must be a model name or path, or a loaded treedec model (a Decoder), got "
                            f"{describe(model)}")
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        on_gpu = self.model.device.type == "cuda"
        if kv_tokens is None and not on_gpu:
            kv_tokens = CPU_KV_TOKENS
        self.engine = Engine(self.model, kv_tokens=kv_tokens, page_size=page_size, backend=backend,
                             cuda_graphs=on_gpu if cuda_graphs is None else cuda_graphs)
        self.speculative = speculative
        self.drafts = None if speculative is None else speculative.build(self.engine)
        if self.drafts is not None:
            logger.info("speculative decoding: %s", self.drafts.note)
        self.generator = torch.Generator(self.model.device).manual_seed(seed)
        self.prefix_cache = PrefixCache(self.engine.tree) if enable_prefix_caching else None

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, chat_template: bool = False) -> list[RequestOutput]:
        """Generate for every prompt, batched; the outputs in the prompts' order.

        Parameters
        ----------
        prompts : a text, a ``{"prompt_token_ids": [...]}`` dict (vLLM's tokens prompt), a ``{"prompt": text}``
            dict, or a list of them.
        sampling_params : one :class:`~treedec.search.sampling.SamplingParams` for all prompts, or one per
            prompt; default ``SamplingParams()`` (vLLM's defaults: temperature 1.0, 16 tokens).
        use_tqdm : a progress bar of finished requests on stderr.
        chat_template : render text prompts through the tokenizer's chat template (:meth:`chat` does).

        Raises
        ------
        ValueError, TypeError : a bad prompt or parameter (before anything runs); with ``speculative``, a
            request that speculative decoding cannot take (``n > 1``, penalties, logprobs, ...).
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

    def beam_search(self, prompt_ids: Sequence[int] | Sequence[Sequence[int]], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    eos_token_id: int | Sequence[int] | str | None = MODEL_EOS) -> list[BeamSearchResult]:
        """Beam search (transformers' semantics, :func:`~treedec.search.beam.beam_search`) of one prompt's token
        ids or several, batched on this LLM's engine; one :class:`~treedec.search.beam.BeamSearchResult` each."""
        many = bool(prompt_ids) and not isinstance(prompt_ids[0], int)
        programs = [beam_program(self.engine, p, beam_width, max_tokens, length_penalty, eos_token_id, early_stopping)
                    for p in (prompt_ids if many else [prompt_ids])]
        results, _ = self.run(programs)
        return results

    def run(self, programs: Sequence) -> tuple[list, SchedulerStats]:
        """Run any scheduler programs (:class:`~treedec.search.Program`: generation, speculative decoding, beams,
        ToT, the branch controller) together on this LLM's engine: ``(results, stats)`` as
        :func:`~treedec.search.run_programs` returns them."""
        return run_programs(self.engine, programs, prefix_cache=self.prefix_cache)

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

    def _run(self, specs: list[RequestSpec], use_tqdm: bool, chat_template: bool) -> list[RequestOutput]:
        with tqdm(total=len(specs), unit="request", desc="generate", disable=not use_tqdm or None,
                  file=sys.stderr) as bar:
            done = lambda outputs: bar.update(1)   # noqa: E731
            step = step_progress(bar)   # the bar moves every engine step, not only when a request finishes
            if self.drafts is None:
                results, _ = generate_batch(self.engine, specs, self.tokenizer, chat_template, self.generator,
                                            on_request_done=done, on_step=step, prefix_cache=self.prefix_cache)
            else:
                results, _ = speculative_batch(self.engine, specs, self.drafts.source, self.tokenizer, chat_template,
                                               acceptance=lambda spec: sampled_acceptance(spec, self._seed),
                                               on_request_done=done, on_step=step, prefix_cache=self.prefix_cache)
        by_request: dict[str, list[RequestResult]] = {}
        for r in results:
            by_request.setdefault(r.id, []).append(r)
        return [_request_output(spec, by_request[spec.id]) for spec in specs]

    def _seed(self, spec: RequestSpec) -> int:
        if spec.params.seed is not None:
            return spec.params.seed
        return int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))


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
    steps = stats.get("steps") or 0
    stats["tokens_per_step"] = len(first.output_ids) / steps if steps else 0.0
    prompt = first.prompt
    return RequestOutput(spec.id, prompt, list(first.prompt_ids), first.prompt_logprobs, outputs, True,
                         {k: v for k, v in stats.items() if k not in ("root", "nodes")})
