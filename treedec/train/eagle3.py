"""EAGLE-3 training (Li et al. 2025) with its training-time test, on :mod:`treedec.train.data`'s shards.

The drafter (:class:`~treedec.models.eagle_drafter.EagleDrafter`, ``kind="eagle3"``) reads, at position ``t``, the
fused feature ``fc(cat(low, mid, high))`` of the target's hidden states and the embedding of the token at ``t + 1``;
its output feature gives logits over a *draft vocabulary* (the ``draft_vocab_size`` tokens the target says most
often in the data, ``d2t`` / ``t2d``) for the token at ``t + 2``, trained to the target's own distribution there
(``lm_head`` of the target's final-norm state at ``t + 1``, restricted to the draft vocabulary): the KL divergence
(the soft cross-entropy's gradient; 0 when the drafter matches the target).

Training-time test (``ttt_steps``): drafting runs the drafter on its own output features, so training does too.
Step 0 reads the target's features; step ``j`` reads at row ``i`` the step ``j - 1`` output of row ``i - 1`` (the
drafter's guess of the feature at ``t_i``, made from a chain rooted ``j`` rows back) with the true token, and
attends, as the drafter does while drafting, to step 0's keys up to that chain's root and to the chain's own keys
of steps ``1 .. j`` (one a step, on the diagonal). Each step's loss is weighted ``decay ** j``. Batches are whole
sequences (attention is within a sequence); the shared target embedding stays frozen.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from treedec.checks import describe, nonnegative_int, positive_int
from treedec.models.base import DecoderModel
from treedec.models.eagle_drafter import EagleDrafter
from treedec.models.hf_tensors import init_random_
from treedec.train.data import DistillManifest, read_manifest, read_shard

__all__ = ["Eagle3TrainConfig", "Eagle3TrainResult", "draft_vocabulary", "train_eagle3"]


@dataclass(frozen=True, kw_only=True)
class Eagle3TrainConfig:
    """What :func:`train_eagle3` trains and how.

    Attributes
    ----------
    draft_vocab_size : tokens of the draft vocabulary (at most the target's; the most frequent in the data).
    ttt_steps : the training-time test's steps (the drafter's own features fed back ``ttt_steps - 1`` times).
    epochs, batch_tokens : passes over the data; rows a step (whole sequences, at least one).
    lr, weight_decay, warmup, decay : AdamW's, the warm-up share of a cosine schedule, step ``j``'s weight.
    seed : the drafter's random initialisation and the batch order.
    """

    draft_vocab_size: int = 8192
    ttt_steps: int = 5
    epochs: int = 1
    batch_tokens: int = 2048
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup: float = 0.05
    decay: float = 0.8
    seed: int = 0

    def __post_init__(self):
        for name in ("draft_vocab_size", "ttt_steps", "epochs", "batch_tokens"):
            positive_int(name, getattr(self, name))
        nonnegative_int("seed", self.seed)
        for name, low, high in (("lr", 0.0, 1.0), ("weight_decay", 0.0, 10.0), ("warmup", 0.0, 1.0),
                                ("decay", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
                    and (name != "lr" or value > 0)):
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}]{' (> 0)' if name == 'lr' else ''}, "
                                 f"got {describe(value)}")


@dataclass(frozen=True)
class Eagle3TrainResult:
    """``drafter`` (fp32, trained), every step's weighted loss and step-0 top-1 accuracy, steps, seconds."""

    drafter: EagleDrafter
    losses: list[float]
    accuracy: list[float]
    steps: int
    seconds: float


def draft_vocabulary(data_dir: str | Path, manifest: DistillManifest, size: int) -> torch.Tensor:
    """The ``size`` target token ids the answers hold most often (ties: the smaller id), ascending: the draft
    vocabulary (``d2t[i] = ids[i] - i``)."""
    counts = torch.zeros(manifest.vocab_size, dtype=torch.int64)
    for name, _, _ in manifest.shards:
        shard = read_shard(data_dir, name)
        counts += torch.bincount(shard["labels"][shard["answer"]], minlength=manifest.vocab_size)
    size = min(size, manifest.vocab_size)
    order = sorted(range(manifest.vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.int64)


def train_eagle3(model: DecoderModel, data_dir: str | Path, config: Eagle3TrainConfig = Eagle3TrainConfig(),
                 device: str | None = None, progress: bool = True,
                 on_step: Callable[[int, float], None] | None = None) -> Eagle3TrainResult:
    """Train an EAGLE-3 drafter for ``model`` on a :func:`~treedec.train.data.distill` folder made with
    ``aux_layers`` (its low / middle / high layers become the drafter's)."""
    manifest = read_manifest(data_dir)
    if not manifest.prompt_rows or len(manifest.aux_layers) != 3:
        raise ValueError(f"{data_dir} holds no EAGLE-3 data: distill with aux_layers (three target layers, e.g. "
                         f"treedec.models.eagle_config.default_aux_layers) first")
    c = model.config
    if (manifest.hidden_size, manifest.vocab_size) != (c.hidden_size, c.vocab_size):
        raise ValueError(f"{data_dir} is for hidden size {manifest.hidden_size} and vocabulary {manifest.vocab_size}; "
                         f"the model has {c.hidden_size} and {c.vocab_size}")
    device = torch.device(device or model.device)
    ids = draft_vocabulary(data_dir, manifest, config.draft_vocab_size)
    drafter = _untrained(model, manifest.aux_layers, ids, config.seed, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    batches = list(_batch_plan(manifest, config))
    total = len(batches) * config.epochs
    warm = max(1, round(total * config.warmup)) if config.warmup else 0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warm if s < warm else
                                                  0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    lm_head = model.lm_head.weight.detach()[ids.to(model.device)].to(device, torch.float32)   # [Vd, H]
    from tqdm import tqdm
    bar = tqdm(total=total, unit="step", desc="train eagle3", disable=not progress or None, file=sys.stderr)
    losses, accuracy = [], []
    began = time.perf_counter()
    for step, batch in enumerate(_batches(data_dir, manifest, batches, config, device)):
        loss, acc = _ttt_loss(drafter, batch, lm_head, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        accuracy.append(acc)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{acc:.2f}", refresh=False)
        if on_step is not None:
            on_step(step + 1, losses[-1])
    bar.close()
    return Eagle3TrainResult(drafter, losses, accuracy, len(losses), time.perf_counter() - began)


# ================================================================ private


def _untrained(model: DecoderModel, aux_layers: tuple[int, ...], ids: torch.Tensor, seed: int,
               device: torch.device) -> EagleDrafter:
    """An fp32 drafter to train: random weights as :meth:`EagleDrafter.random` makes them, its ``lm_head`` the
    target's rows of the draft vocabulary, a frozen fp32 copy of the target's embedding (its own, so that the
    target's stays in its dtype; :func:`~treedec.models.eagle_drafter.save_eagle` does not write it: the loaded
    drafter shares the target's)."""
    t = model.config
    drafter = EagleDrafter(dataclasses.replace(t, num_layers=1), "eagle3", model, len(ids), aux_layers,
                           own_embedding=True, dtype=torch.float32, device=device).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            init_random_(name, p, 0.02, gen)
        drafter.embed_tokens.weight.copy_(model.embed_tokens.weight.to(device, torch.float32))
        drafter.lm_head.weight.copy_(model.lm_head.weight[ids.to(model.device)].to(device, torch.float32))
        drafter.d2t.copy_((ids - torch.arange(len(ids))).to(device))
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def _batch_plan(manifest: DistillManifest, config: Eagle3TrainConfig) -> Iterator[tuple[int, int, int]]:
    """(shard, first sequence, last sequence + 1) of each batch: whole sequences of a shard, about
    ``batch_tokens`` rows (the shards' sequence counts are in the manifest)."""
    first = 0
    for s, (_, rows, seqs) in enumerate(manifest.shards):
        per = max(1, round(seqs * config.batch_tokens / max(rows, 1)))
        for a in range(0, seqs, per):
            yield s, first + a, first + min(seqs, a + per)
        first += seqs


def _batches(data_dir, manifest: DistillManifest, plan: list, config: Eagle3TrainConfig, device: torch.device):
    loaded: tuple[int, dict] | None = None
    for epoch in range(config.epochs):
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
        for k in torch.randperm(len(plan), generator=g).tolist():
            s, a, b = plan[k]
            if loaded is None or loaded[0] != s:
                loaded = (s, read_shard(data_dir, manifest.shards[s][0]))
            shard = loaded[1]
            pick = (shard["sequence"] >= a) & (shard["sequence"] < b)
            yield {name: t[pick].to(device) for name, t in shard.items()}


def _positions(sequence: torch.Tensor) -> torch.Tensor:
    """Each row's position in its sequence (rows of a sequence are consecutive, from position 0)."""
    start = torch.ones_like(sequence, dtype=torch.bool)
    start[1:] = sequence[1:] != sequence[:-1]
    idx = torch.arange(len(sequence), device=sequence.device)
    first = torch.cummax(torch.where(start, idx, 0), 0).values
    return idx - first


def _ttt_loss(drafter: EagleDrafter, batch: dict, lm_head: torch.Tensor, config: Eagle3TrainConfig
              ) -> tuple[torch.Tensor, float]:
    seq, labels = batch["sequence"], batch["labels"]
    n = len(seq)
    pos = _positions(seq)
    same_next = torch.zeros(n, dtype=torch.bool, device=seq.device)
    same_next[:-1] = seq[1:] == seq[:-1]
    # the target's distribution at t + 1 (row i + 1's final-norm state), over the draft vocabulary
    with torch.no_grad():
        nxt = torch.zeros_like(batch["hidden"], dtype=torch.float32)
        nxt[:-1] = batch["hidden"][1:].float()
        target = torch.softmax(nxt @ lm_head.T, dim=-1)
    trained = batch["answer"] & same_next
    tokens = labels
    features = drafter.fc(batch["aux"].reshape(n, -1).float())
    attend = _TTTAttend(seq, pos)
    total = features.new_zeros(())
    acc0 = 0.0
    for j in range(config.ttt_steps):
        attend.step = j
        out = drafter.forward_graph(tokens, pos, attend, features=features)
        valid = trained & (pos >= j)
        if bool(valid.any()):
            logp = F.log_softmax(out.logits[valid].float(), dim=-1)
            kl = (torch.xlogy(target[valid], target[valid]) - target[valid] * logp).sum(-1).mean()
            total = total + config.decay ** j * kl
            if j == 0:
                acc0 = float((logp.argmax(-1) == target[valid].argmax(-1)).float().mean())
        # the next step reads, at row i, this step's output feature of row i - 1
        features = torch.cat([out.hidden[:1] * 0, out.hidden[:-1]])
    return total, acc0


class _TTTAttend:
    """The drafter layer's attention at training-time-test step ``step`` (see the module docstring): step 0's keys
    causally within the sequence up to the chain's root (row ``i - step``), then the chain's own keys of steps
    ``1 .. step`` (row ``i - (step - s)`` at step ``s``)."""

    def __init__(self, sequence: torch.Tensor, positions: torch.Tensor):
        self.seq, self.pos = sequence, positions
        self.step = 0
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, hq, d = q.shape
        group = hq // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        j = self.step
        if j == 0:
            self.keys = []
        self.keys.append((k, v))
        k0, v0 = self.keys[0]
        scale = d ** -0.5
        idx = torch.arange(n, device=q.device)
        root = idx - j
        mask = (self.seq[None, :] == self.seq[:, None]) & (idx[None, :] <= root[:, None])   # [n(q), n(k)]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k0.float()) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        diag_s, diag_v = [], []
        for s in range(1, j + 1):
            ks, vs = self.keys[s]
            rows = (idx - (j - s)).clamp(min=0)
            diag_s.append((q.float() * ks[rows].float()).sum(-1).T * scale)   # [h, n]
            diag_v.append(vs[rows])
        if diag_s:
            scores = torch.cat([scores, torch.stack(diag_s, dim=-1)], dim=-1)   # [h, n, n + j]
        weights = torch.softmax(scores, dim=-1)
        weights = torch.nan_to_num(weights)   # rows with no key (before their chain's root): unused
        out = torch.einsum("hqk,khd->qhd", weights[..., :n], v0.float())
        for s, vs in enumerate(diag_v):
            out = out + weights[..., n + s].T[..., None] * vs.float()
        return out.to(q.dtype)
