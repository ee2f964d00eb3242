"""Self-distillation data: the target model answers prompts, and its hidden states at every answer position are kept.

:func:`distill` runs in two passes over the prompts, both on treedec's engine:

1. **generation**: the prompts are answered batched through the scheduler
   (:func:`~treedec.programs.generate.generate_batch`: any :class:`~treedec.sampling.params.SamplingParams`,
   a progress bar of answered prompts);
2. **teacher forcing**: each ``prompt + answer`` is run again as one prompt of a step (many sequences a step,
   at most ``batch_tokens`` tokens), and the step returns the hidden states at the answer's positions: the
   final-norm state (what Medusa heads read) and, for EAGLE-3, the residual stream entering three target
   layers (low, middle, high: :func:`~treedec.models.eagle_config.default_aux_layers`).

Recomputing the states in a second pass costs one prefill per answer, far less than generating it, and keeps the
batched decode path untouched; the tokens are the model's own (Medusa-2's self-distillation: the heads learn
what the model will say, not what a dataset says).

The rows are streamed to disk in shards (``shard-00000.safetensors``, ...): a shard is written as soon as it
holds ``shard_tokens`` rows, so memory holds at most one shard and one teacher-forcing step of states
(:attr:`DistillSummary.peak_buffered_rows`), whatever the number of prompts. A shard's tensors:

- ``hidden [n, hidden_size]``: the final-norm hidden state at position ``t`` (model dtype);
- ``labels [n] int64``: the token at ``t + 1`` (the model's own next token);
- ``sequence [n] int64``: which answer the row belongs to (rows of an answer are consecutive, in position
  order, and never cross a shard);
- ``aux [n, 3, hidden_size]`` with ``aux_layers``: the inputs of those target layers at ``t``;
- ``answer [n] bool`` with ``aux_layers``: the row's next token is an answer token (EAGLE-3 is trained there).

Row ``t`` runs from the prompt's last token to the answer's last but one: an answer of ``m`` tokens gives ``m``
rows (the first predicts the answer's first token with ``lm_head``, its second with Medusa head 0). With
``aux_layers`` (EAGLE-3) the prompt's rows are kept too (from position 0: an EAGLE drafter attends over the whole
sequence's features). ``data.json`` describes the whole set (:class:`DistillManifest`).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence

import torch

from treedec.checks import describe, positive_int
from treedec.engine import Engine
from treedec.models.base import DecoderModel
from treedec.programs.generate import generate_batch
from treedec.runtime.requests import RequestSpec
from treedec.sampling.params import SamplingParams

__all__ = ["MANIFEST", "DistillConfig", "DistillManifest", "DistillSummary", "ShardWriter", "distill",
           "read_manifest", "read_shard"]

MANIFEST = "data.json"
FORMAT = "treedec-distill-1"


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How :func:`distill` makes its data.

    Attributes
    ----------
    params : how the target answers (vLLM's SamplingParams; default greedy, 128 tokens at most). A prompts file
        line's own parameters win over it.
    chat_template : render text prompts through the tokenizer's chat template (as user messages).
    aux_layers : target layers whose inputs to keep too (EAGLE-3's low / middle / high); () for Medusa.
    shard_tokens : rows a shard holds at most (a shard is written when it is full).
    batch_tokens : tokens a teacher-forcing step runs at most (an answer longer than it runs alone).
    progress : progress bars on stderr.
    """

    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=128))
    chat_template: bool = True
    aux_layers: tuple[int, ...] = ()
    shard_tokens: int = 16384
    batch_tokens: int = 2048
    progress: bool = True

    def __post_init__(self):
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {describe(self.params)}")
        positive_int("shard_tokens", self.shard_tokens)
        positive_int("batch_tokens", self.batch_tokens)
        if not isinstance(self.chat_template, bool):
            raise TypeError(f"chat_template must be a bool, got {describe(self.chat_template)}")


@dataclass(frozen=True)
class DistillManifest:
    """``data.json``: what a distilled data folder holds.

    Attributes
    ----------
    hidden_size, vocab_size : the target's.
    aux_layers : the target layers whose inputs the shards' ``aux`` holds (() when it has none).
    sequences, rows : answers and rows in all shards.
    shards : ``(file name, rows, answers)`` per shard, in order.
    model : what the data was made from (a name, for the record).
    dtype : the hidden states' dtype.
    prompt_rows : the shards hold the prompts' rows too (and an ``answer`` mask): data for EAGLE-3.
    """

    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]
    sequences: int
    rows: int
    shards: tuple[tuple[str, int, int], ...]
    model: str
    dtype: str
    prompt_rows: bool = False


@dataclass(frozen=True)
class DistillSummary:
    """What :func:`distill` did: the manifest, the seconds of each pass, and the most rows memory held at once
    (a shard being filled and one step's states: bounded by ``shard_tokens + batch_tokens``)."""

    manifest: DistillManifest
    generate_seconds: float
    forward_seconds: float
    answer_tokens: int
    peak_buffered_rows: int
    stop_reasons: dict = field(default_factory=dict)


class ShardWriter:
    """Rows in, shards out: appends each answer's rows and writes a shard once it holds ``shard_tokens`` rows
    (an answer's rows never split across shards). :attr:`peak_rows` is the most rows it held at once."""

    def __init__(self, folder: Path, shard_tokens: int):
        self.folder, self.shard_tokens = Path(folder), shard_tokens
        self.shards: list[tuple[str, int, int]] = []
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._rows = self._sequences = 0
        self.peak_rows = 0
        self.sequences = 0

    def add(self, hidden: torch.Tensor, labels: torch.Tensor, aux: torch.Tensor | None,
            answer: torch.Tensor | None = None) -> None:
        """One answer's rows: ``hidden [m, H]``, ``labels [m]``, ``aux [m, 3, H]`` and ``answer [m]`` or None."""
        rows = {"hidden": hidden, "labels": labels.to(torch.int64),
                "sequence": torch.full((len(labels),), self.sequences, dtype=torch.int64)}
        if aux is not None:
            rows["aux"] = aux
        if answer is not None:
            rows["answer"] = answer
        for name, value in rows.items():
            self._parts.setdefault(name, []).append(value.detach().to("cpu", copy=True))
        self.sequences += 1
        self._sequences += 1
        self._rows += len(labels)
        self.peak_rows = max(self.peak_rows, self._rows)
        if self._rows >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the rows held as a shard (nothing when none are held)."""
        if not self._rows:
            return
        from safetensors.torch import save_file
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file({k: torch.cat(v).contiguous() for k, v in self._parts.items()}, str(self.folder / name))
        self.shards.append((name, self._rows, self._sequences))
        self._parts, self._rows, self._sequences = {}, 0, 0


def distill(model: DecoderModel, requests: Sequence[RequestSpec], out_dir: str | Path,
            config: DistillConfig = DistillConfig(), tokenizer=None, model_name: str = "",
            kv_tokens: int | None = None, backend: str = "auto") -> DistillSummary:
    """Answer ``requests`` with ``model`` and write the answers' hidden states to ``out_dir`` (see the module
    docstring); returns a :class:`DistillSummary`.

    Parameters
    ----------
    requests : the prompts (:func:`~treedec.commands.requests_file.read_requests`); text prompts and messages
        need ``tokenizer``.
    out_dir : an existing folder; its shards and ``data.json`` are (over)written.
    kv_tokens : the engine's KV pool (default: room for the teacher-forcing steps and 64 answers at once).
    backend : tree attention's backend.
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"distill: output folder {str(out)!r} does not exist")
    if not requests:
        raise ValueError("distill needs at least one prompt, got none")
    aux_layers = model.check_aux_layers(config.aux_layers) if config.aux_layers else ()
    c = model.config
    default_kv = max(2 * config.batch_tokens, 64 * (config.params.max_tokens + 256))
    # CUDA graphs for the decode steps on a GPU (the teacher-forcing steps are past their bounds: eager)
    engine = Engine(model, kv_tokens=kv_tokens or min(default_kv, 65536), page_size=16, backend=backend,
                    cuda_graphs=model.device.type == "cuda")
    if tokenizer is not None:
        engine.restrict_vocab(min(len(tokenizer), c.vocab_size))
    if aux_layers:
        aux_layers = engine.capture_hidden_layers(aux_layers)   # ascending: the order of the steps' aux
    for old in out.glob("shard-*.safetensors"):
        old.unlink()
    specs = [dataclasses.replace(r, params=_params(r, config.params)) for r in requests]

    started = time.perf_counter()
    results = _generate(engine, specs, tokenizer, config)
    generate_seconds = time.perf_counter() - started
    writer = ShardWriter(out, config.shard_tokens)
    started = time.perf_counter()
    stop_reasons: dict[str, int] = {}
    answer_tokens = 0
    sequences = [(list(r.prompt_ids), list(r.output_ids)) for r in results if len(r.output_ids) >= 1]
    for r in results:
        stop_reasons[r.stop_reason] = stop_reasons.get(r.stop_reason, 0) + 1
        answer_tokens += len(r.output_ids)
    _teacher_force(engine, sequences, writer, aux_layers, config)
    writer.flush()
    forward_seconds = time.perf_counter() - started
    manifest = DistillManifest(c.hidden_size, c.vocab_size, aux_layers, writer.sequences,
                               sum(n for _, n, _ in writer.shards), tuple(writer.shards), model_name,
                               str(model.dtype).removeprefix("torch."), bool(aux_layers))
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, **dataclasses.asdict(manifest)}, indent=1) + "\n")
    return DistillSummary(manifest, generate_seconds, forward_seconds, answer_tokens, writer.peak_rows,
                          stop_reasons)


def read_manifest(data_dir: str | Path) -> DistillManifest:
    """The :class:`DistillManifest` of a :func:`distill` folder (FileNotFoundError / ValueError naming what is
    wrong)."""
    file = Path(data_dir) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{data_dir} is not a distilled data folder: it has no {MANIFEST} (make one with "
                                f"treedec train-drafter, or treedec.train.distill)")
    raw = json.loads(file.read_text())
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else raw
        raise ValueError(f"{file}: not a {FORMAT} manifest (format {found!r:.40})")
    raw.pop("format")
    manifest = DistillManifest(**{**raw, "aux_layers": tuple(raw["aux_layers"]),
                                  "shards": tuple((str(n), int(r), int(q)) for n, r, q in raw["shards"])})
    missing = [n for n, _, _ in manifest.shards if not (Path(data_dir) / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{file} lists shards the folder does not hold: {missing[:3]}")
    return manifest


def read_shard(data_dir: str | Path, name: str) -> dict[str, torch.Tensor]:
    """One shard's tensors (``hidden``, ``labels``, ``sequence``, and ``aux`` when kept)."""
    from safetensors.torch import load_file
    return load_file(str(Path(data_dir) / name))


# ================================================================ private


def _params(spec: RequestSpec, default: SamplingParams) -> SamplingParams:
    """A prompts file line's parameters where it gives them (those differing from SamplingParams()'s), else the
    config's; ``n`` must stay 1 (one answer a prompt)."""
    base = SamplingParams()
    changed = {f.name: getattr(spec.params, f.name) for f in dataclasses.fields(SamplingParams)
               if getattr(spec.params, f.name) != getattr(base, f.name)}
    params = dataclasses.replace(default, **changed)
    if params.n != 1:
        raise ValueError(f"request {spec.id!r}: distillation takes one answer a prompt (n=1), got n={params.n}")
    return params


def _generate(engine: Engine, specs: list[RequestSpec], tokenizer, config: DistillConfig):
    from tqdm import tqdm
    with tqdm(total=len(specs), unit="prompt", desc="distill: answering", disable=not config.progress or None,
              file=sys.stderr) as bar:
        results, _ = generate_batch(engine, specs, tokenizer, config.chat_template,
                                    torch.Generator(engine.device).manual_seed(0),
                                    on_request_done=lambda outputs: bar.update(1))
    order = {spec.id: i for i, spec in enumerate(specs)}
    return sorted(results, key=lambda r: order[r.id])


def _teacher_force(engine: Engine, sequences: list[tuple[list[int], list[int]]], writer: ShardWriter,
                   aux_layers: tuple[int, ...], config: DistillConfig) -> None:
    """Run each ``prompt + answer[:-1]`` as a prompt, many a step, and hand each answer's rows to ``writer``."""
    from tqdm import tqdm
    groups: list[list[int]] = [[]]
    size = 0
    for i, (prompt, answer) in enumerate(sequences):
        n = len(prompt) + len(answer) - 1
        if groups[-1] and size + n > config.batch_tokens:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    tree = engine.tree
    with tqdm(total=len(sequences), unit="answer", desc="distill: hidden states",
              disable=not config.progress or None, file=sys.stderr) as bar:
        for group in groups:
            if not group:
                continue
            nodes = [tree.add_prompt(sequences[i][0] + sequences[i][1][:-1]) for i in group]
            try:
                rows = engine.pending_token_rows(nodes)
                out = engine.step(logits_rows=[0], return_hidden=True, hidden_rows=rows, return_aux=bool(aux_layers))
            finally:
                tree.prune_many(nodes)
            offset = 0
            for i in group:
                prompt, answer = sequences[i]
                n = len(prompt) + len(answer) - 1
                if aux_layers:   # EAGLE-3: every position, the answer's marked
                    rows = slice(offset, offset + n)
                    writer.add(out.hidden[rows], torch.tensor(prompt[1:] + answer), out.aux[rows],
                               torch.arange(n) >= len(prompt) - 1)
                else:            # Medusa: the prompt's last token onwards
                    rows = slice(offset + len(prompt) - 1, offset + n)
                    writer.add(out.hidden[rows], torch.tensor(answer), None)
                offset += n
            bar.update(len(group))
