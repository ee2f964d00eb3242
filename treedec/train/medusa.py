"""Medusa-1 training (Cai et al. 2024): heads on the frozen target's last hidden state, trained on its own answers.

Head ``k`` (0-based) at position ``t`` learns the token at ``t + k + 2`` of the target's own answer (``lm_head``
gives ``t + 1``): cross-entropy over the vocabulary, head ``k``'s loss weighted ``decay ** k`` (Medusa's
``medusa_decay_coefficient``, 0.8), summed. The heads start as Medusa initialises them
(:meth:`~treedec.models.medusa.MedusaHeads.untrained`: zero ResBlocks, every output layer a copy of ``lm_head``),
the base model is never touched: the hidden states come from :mod:`treedec.train.data`'s shards. AdamW, a linear
warm-up then a cosine decay of the learning rate; fp32 math on the CPU, bf16 autocast (fp32 weights) on a GPU.

Training is resumable: every ``save_every`` steps (and at the end) the heads, the optimiser, the step and the
losses so far go to ``trainer_state.pt`` in the output folder; the batches of an epoch come from a generator
seeded by ``(seed, epoch)`` alone, so a run resumed from step ``s`` takes the same batches and reaches the same
weights as one never stopped (tested: the same loss trajectory).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from treedec.checks import describe, nonnegative_int, positive_int
from treedec.models.base import DecoderModel
from treedec.models.medusa import MedusaHeads
from treedec.train.data import DistillManifest, read_manifest, read_shard

__all__ = ["IGNORE", "STATE_FILE", "MedusaTrainConfig", "MedusaTrainResult", "head_targets", "medusa_logits",
           "medusa_loss", "train_medusa"]

STATE_FILE = "trainer_state.pt"
IGNORE = -100   # a target past the end of its answer (cross_entropy's ignore_index)


@dataclass(frozen=True, kw_only=True)
class MedusaTrainConfig:
    """What :func:`train_medusa` trains and how.

    Attributes
    ----------
    num_heads : Medusa heads (4: the depth of Medusa's 64-token tree ``mc_sim_7b_63``).
    num_layers : ResBlocks per head (Medusa's ``medusa_num_layers``, 1).
    epochs : passes over the data.
    max_steps : stop after this many optimiser steps in all (None: every epoch); the learning-rate schedule
        is the whole run's either way, so a run stopped early resumes where it was.
    batch_size : rows (answer positions) a step.
    lr : peak learning rate (Medusa-1's 1e-3).
    weight_decay : AdamW's.
    warmup : share of the steps the learning rate grows linearly over.
    decay : head ``k``'s loss weight is ``decay ** k``.
    train_output_layers : also train each head's vocabulary projection (Medusa's heads do); False keeps them
        the ``lm_head`` copies (a third less compute, no optimiser state for them).
    save_every : steps between checkpoints of the trainer's state.
    seed : the batch order and the untrained heads' biases.
    """

    num_heads: int = 4
    num_layers: int = 1
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05
    decay: float = 0.8
    train_output_layers: bool = True
    save_every: int = 50
    seed: int = 0

    def __post_init__(self):
        for name in ("num_heads", "epochs", "batch_size", "save_every"):
            positive_int(name, getattr(self, name))
        nonnegative_int("num_layers", self.num_layers)
        nonnegative_int("seed", self.seed)
        if self.max_steps is not None:
            positive_int("max_steps", self.max_steps)
        for name, low, high in (("lr", 0.0, 1.0), ("weight_decay", 0.0, 10.0), ("warmup", 0.0, 1.0),
                                ("decay", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
                    and (name != "lr" or value > 0)):
                raise ValueError(f"{name} must be a number in {'(' if name == 'lr' else '['}{low:g}, {high:g}], "
                                 f"got {describe(value)}")
        if not isinstance(self.train_output_layers, bool):
            raise TypeError(f"train_output_layers must be a bool, got {describe(self.train_output_layers)}")


@dataclass(frozen=True)
class MedusaTrainResult:
    """What :func:`train_medusa` did.

    Attributes
    ----------
    heads : the trained heads (fp32, on the training device).
    losses : the weighted loss of every step, from step 1 (resumed runs included).
    head_accuracy : per step, each head's top-1 accuracy on the step's batch.
    steps : optimiser steps done in all; ``total_steps`` the run's planned steps.
    seconds : this call's training time (not a resumed run's earlier part).
    resumed_from : the step this call started at (0: from scratch).
    """

    heads: MedusaHeads
    losses: list[float]
    head_accuracy: list[list[float]]
    steps: int
    total_steps: int
    seconds: float
    resumed_from: int


def medusa_logits(heads: MedusaHeads, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [B, H]`` -> ``[B, num_heads, vocab]`` with gradients (:meth:`MedusaHeads.forward` runs without)."""
    return torch.stack([head(hidden) for head in heads.medusa_head], dim=1)


def head_targets(labels: torch.Tensor, sequence: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Each row's target per head: ``[n, num_heads]`` int64, head ``k`` of row ``i`` the label of row
    ``i + k + 1`` (the token at ``t + k + 2``) when that row is of the same answer, else :data:`IGNORE`."""
    n = len(labels)
    out = torch.full((n, num_heads), IGNORE, dtype=torch.int64)
    for k in range(num_heads):
        shift = k + 1
        if shift >= n:
            break
        same = sequence[shift:] == sequence[:-shift]
        out[:-shift, k] = torch.where(same, labels[shift:], IGNORE)
    return out


def medusa_loss(logits: torch.Tensor, targets: torch.Tensor, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted cross-entropy of ``logits [B, K, V]`` against ``targets [B, K]`` (:data:`IGNORE` skipped) and
    each head's top-1 accuracy (NaN for a head with no target in the batch)."""
    total = logits.new_zeros((), dtype=torch.float32)
    accuracy = []
    for k in range(logits.shape[1]):
        valid = targets[:, k] != IGNORE
        if not bool(valid.any()):
            accuracy.append(float("nan"))
            continue
        lk = logits[valid, k].float()
        total = total + decay ** k * F.cross_entropy(lk, targets[valid, k])
        accuracy.append(float((lk.argmax(-1) == targets[valid, k]).float().mean()))
    return total, accuracy


def train_medusa(model: DecoderModel, data_dir: str | Path, out_dir: str | Path,
                 config: MedusaTrainConfig = MedusaTrainConfig(), resume: bool = False, device: str | None = None,
                 progress: bool = True, on_step: Callable[[int, float], None] | None = None) -> MedusaTrainResult:
    """Train Medusa heads for ``model`` on a :func:`~treedec.train.data.distill` folder.

    Parameters
    ----------
    model : the target (its ``lm_head`` initialises the heads; it is not trained).
    data_dir : the distilled data (its hidden size and vocabulary must be ``model``'s).
    out_dir : an existing folder: :data:`STATE_FILE` is written there (and read with ``resume``).
    resume : continue from ``out_dir``'s trainer state (its config must equal ``config``, but ``max_steps``).
    device : where to train (default the model's).
    on_step : called as ``on_step(step, loss)`` after every step.
    """
    manifest = read_manifest(data_dir)
    if manifest.prompt_rows:
        raise ValueError(f"{data_dir} was distilled for EAGLE-3 (it holds the prompts' rows); distill for Medusa "
                         f"(no aux_layers)")
    c = model.config
    if (manifest.hidden_size, manifest.vocab_size) != (c.hidden_size, c.vocab_size):
        raise ValueError(f"{data_dir} holds hidden states of size {manifest.hidden_size} over a vocabulary of "
                         f"{manifest.vocab_size}; the model has {c.hidden_size} and {c.vocab_size}")
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"train_medusa: output folder {str(out)!r} does not exist")
    device = torch.device(device or model.device)
    heads = MedusaHeads.untrained(model, config.num_heads, config.num_layers, seed=config.seed)
    heads = heads.to(device=device, dtype=torch.float32)
    for head in heads.medusa_head:
        head[-1].weight.requires_grad_(config.train_output_layers)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    # the schedule's length, wherever max_steps stops the run
    planned = _batches_per_epoch(manifest, config.batch_size) * config.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(planned, config.warmup))
    losses: list[float] = []
    accuracy: list[list[float]] = []
    start = 0
    state_file = out / STATE_FILE
    if resume:
        start, losses, accuracy = _load_state(state_file, heads, optimizer, scheduler, config)
    stop = planned if config.max_steps is None else min(planned, config.max_steps)
    if start > stop:
        raise ValueError(f"{state_file} is at step {start}, past max_steps {config.max_steps}")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _no_autocast()
    bar = _bar(progress, stop, start)
    began = time.perf_counter()
    step = start
    for hidden, targets in _batches(data_dir, manifest, config, start, device):
        if step >= stop:
            break
        with autocast:
            logits = medusa_logits(heads, hidden)
        loss, acc = medusa_loss(logits, targets, config.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(loss.item())
        accuracy.append(acc)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", head0=f"{acc[0]:.2f}", refresh=False)
        if on_step is not None:
            on_step(step, losses[-1])
        if step % config.save_every == 0 or step == stop:
            _save_state(state_file, heads, optimizer, scheduler, config, step, losses, accuracy)
    bar.close()
    if step < stop:
        raise RuntimeError(f"the data ran out at step {step} of {stop} (a shard changed while training?)")
    return MedusaTrainResult(heads, losses, accuracy, step, planned, time.perf_counter() - began, start)


# ================================================================ private


class _no_autocast:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bar(progress: bool, total: int, initial: int):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", desc="train medusa", disable=not progress or None,
                file=sys.stderr)


def _schedule(total: int, warmup: float) -> Callable[[int], float]:
    warm = max(1, round(total * warmup)) if warmup > 0 else 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _batches_per_epoch(manifest: DistillManifest, batch_size: int) -> int:
    # an answer's last row has no head-0 target: a shard has rows - sequences usable rows, batched on their own
    return sum(-(-(rows - seqs) // batch_size) for _, rows, seqs in manifest.shards if rows > seqs)


def _batches(data_dir, manifest: DistillManifest, config: MedusaTrainConfig, skip: int, device: torch.device
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every epoch's batches ``(hidden [B, H] fp32, targets [B, K])`` from step ``skip`` on: the shards in an order,
    each shard's usable rows in an order, both drawn from a generator seeded by ``(seed, epoch)`` alone. One shard
    is in memory at a time; the skipped steps' shards are not read."""
    per_epoch = _batches_per_epoch(manifest, config.batch_size)
    for epoch in range(config.epochs):
        if skip >= per_epoch:
            skip -= per_epoch
            continue
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
        order = torch.randperm(len(manifest.shards), generator=g).tolist()
        perms = [torch.randperm(rows - seqs, generator=g) for _, rows, seqs in manifest.shards]
        for s in order:
            name, rows, seqs = manifest.shards[s]
            batches = -(-(rows - seqs) // config.batch_size)
            if skip >= batches:
                skip -= batches
                continue
            shard = read_shard(data_dir, name)
            targets = head_targets(shard["labels"], shard["sequence"], config.num_heads)
            usable = torch.nonzero(targets[:, 0] != IGNORE).squeeze(1)
            if len(usable) != rows - seqs:
                raise ValueError(f"{data_dir}/{name}: {len(usable)} rows with a target, the manifest says "
                                 f"{rows - seqs}")
            usable = usable[perms[s]]
            for b in range(skip, batches):
                pick = usable[b * config.batch_size:(b + 1) * config.batch_size]
                yield (shard["hidden"][pick].to(device=device, dtype=torch.float32),
                       targets[pick].to(device))
            skip = 0


def _save_state(file: Path, heads: MedusaHeads, optimizer, scheduler, config: MedusaTrainConfig, step: int,
                losses: list[float], accuracy: list[list[float]]) -> None:
    state = {"config": _resume_key(config), "step": step, "heads": heads.medusa_head.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "losses": losses,
             "accuracy": accuracy}
    tmp = file.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(file)   # a run killed while saving keeps the previous state


def _load_state(file: Path, heads: MedusaHeads, optimizer, scheduler, config: MedusaTrainConfig):
    if not file.is_file():
        raise FileNotFoundError(f"--resume: {file} does not exist (no earlier run saved its state there)")
    state = torch.load(file, map_location=heads.medusa_head[0][-1].weight.device, weights_only=True)
    if state.get("config") != _resume_key(config):
        theirs, ours = state.get("config") or {}, _resume_key(config)
        diff = {k: (theirs.get(k), ours[k]) for k in ours if theirs.get(k) != ours[k]}
        raise ValueError(f"--resume: {file} was trained with other settings (saved, given): {diff}; resume with "
                         f"the same ones, or start a new run")
    heads.medusa_head.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]), list(state["losses"]), [list(a) for a in state["accuracy"]]


def _resume_key(config: MedusaTrainConfig) -> dict:
    """The settings a resumed run must share with the run it continues (all but where it stops)."""
    key = dataclasses.asdict(config)
    key.pop("max_steps")
    key.pop("save_every")
    return key
