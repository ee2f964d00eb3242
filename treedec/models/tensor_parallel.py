"""Tensor parallelism over torch.distributed: one decoder (any family's) split Megatron-style across the ranks of a
group.

    tp = init_tensor_parallel()                                   # under torchrun: NCCL on GPUs, gloo on CPUs
    model = from_pretrained(path, tensor_parallel=tp)             # each rank reads its slices only
    engine = Engine(model)                                        # every rank runs the same program
    tokens = greedy_generate(engine, prompt_ids, 64)              # the same tokens on every rank

What each of ``N`` ranks holds (a :class:`~treedec.models.decoder.Decoder` built with ``tensor_parallel``;
the family's weight map says how each checkpoint tensor is cut, :class:`~treedec.models.weights.Split`,
fused checkpoint tensors such as Phi-3's ``qkv_proj`` included):

Each projection is a :class:`~treedec.models.linear.Linear` in its mode:

- ``qkv_proj``: column-parallel by heads, rank r's ``num_heads / N`` query heads and the
  ``num_kv_heads / N`` KV heads they read (GQA groups stay whole), fused as ``[q_r | k_r | v_r]``;
  its KV pool holds those KV heads only. ``o_proj``: the matching input columns, one all-reduce.
- ``gate_up_proj``: rank r's ``intermediate_size / N`` columns of gate and of up, fused as
  ``[gate_r | up_r]``; ``down_proj``: the matching input columns, one all-reduce.
- ``lm_head``: vocab-parallel (rank r's ``ceil(vocab / N)`` rows), its logits all-gathered, so
  every rank holds the whole ``[rows, vocab]`` logits; a tied head is a view of the embedding.
  Gathered rather than replicated: a replicated head would make each rank stream all of it every
  step (1 GB of Llama-3-8B's 16), which is worth more than the gather of a step's logits.
- The embedding, the norms (per-head q/k norms and Gemma's four a layer included) and the biases after a
  row-parallel GEMM: whole on every rank (the
  embedding is read a row per token, so a vocab-parallel one would save memory but cost an
  all-reduce; those biases are added once, after the sum).

The collectives are functional (``torch.ops._c10d_functional``): ``torch.compile`` traces them
(tested on the CPU) and a CUDA graph captures them with the rest of the step (NCCL; to be
measured on a machine with several GPUs, ``bench/tp_step.py``).

Programs' decisions are computed on every rank, not on rank 0 and broadcast. After the
all-reduces and the all-gather every rank holds the same bits (a collective's result is one
value copied to all ranks), so the tree, the plans, the greedy choices and the draws of
identically seeded generators agree without a host round trip or a collective per step, and the
search programs run unchanged (each rank does the host work, planning included, itself). :func:`init_tensor_parallel` seeds the global generators alike
(programs that take no generator draw from them); :meth:`TensorParallel.check_replicated`
verifies a result is the same everywhere. Not supported: a ``num_kv_heads`` or ``intermediate_size``
the number of ranks does not divide (no KV-head replication over more ranks than KV heads),
``from_hf_model``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from treedec.checks import positive_int
from treedec.models.config import ModelConfig
from treedec.models.weights import Split

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TensorParallel:
    """This process's place in a tensor-parallel group (a torch.distributed process group).

    Parameters
    ----------
    group : the ranks that split one model (default: the world). Its backend runs the collectives:
        NCCL for CUDA tensors, gloo for CPU tensors.

    Attributes
    ----------
    rank, size : this rank's index in the group and the group's size.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TensorParallel needs torch.distributed initialized: call dist.init_process_group "
                               "first, or init_tensor_parallel() under torchrun")
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._name = self.group.group_name

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, backend={dist.get_backend(self.group)!r})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (same shape), as a functional collective."""
        if self.size == 1:
            return x
        ops = torch.ops._c10d_functional
        return ops.wait_tensor(ops.all_reduce(x.contiguous(), "sum", self._name))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., w]`` from every rank -> ``[..., size * w]``, rank 0's columns first."""
        if self.size == 1:
            return x
        ops = torch.ops._c10d_functional
        out = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), self.size, self._name))
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_first(self, x: torch.Tensor) -> torch.Tensor:
        """``[w, ...]`` from every rank -> ``[size * w, ...]``, rank 0's rows first."""
        if self.size == 1:
            return x
        ops = torch.ops._c10d_functional
        return ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), self.size, self._name))

    def gather_objects(self, value) -> list:
        """Every rank's ``value`` (picklable), in rank order."""
        out = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def check_replicated(self, tensor: torch.Tensor, what: str = "tensor") -> None:
        """Raise RuntimeError unless ``tensor`` has the same shape, dtype and bits on every rank."""
        t = tensor.detach().contiguous().cpu()
        digest = (tuple(t.shape), str(t.dtype), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest())
        digests = self.gather_objects(digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise RuntimeError(f"{what} differs across the {self.size} tensor-parallel ranks: rank(s) {differ} "
                               f"hold {[digests[r][:2] for r in differ]} (shape, dtype) or other values than rank 0's "
                               f"{digests[0][:2]}")

    def seed_alike(self, seed: int | None = None) -> int:
        """Seed the global torch generators (CPU and CUDA) with the same seed on every rank: ``seed``
        if given (on rank 0), else rank 0's ``torch.initial_seed()``. Returns the seed."""
        chosen = self.gather_objects(torch.initial_seed() if seed is None else int(seed))[0]
        torch.manual_seed(chosen)
        return chosen


def init_tensor_parallel(backend: str | None = None, seed: int | None = None) -> TensorParallel:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless one is initialized, and return the world's
    :class:`TensorParallel`.

    ``backend``: default NCCL when CUDA is available (each process then uses GPU ``LOCAL_RANK``),
    else gloo. The global generators are seeded alike on every rank (:meth:`TensorParallel.seed_alike`).
    """
    if not dist.is_initialized():
        missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise RuntimeError(f"init_tensor_parallel reads torchrun's environment, but {missing} are not set: "
                               f"launch with `torchrun --nproc-per-node N ...`")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    tp = TensorParallel()
    tp.seed_alike(seed)
    return tp


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one of ``size`` ranks computes: ``num_heads / size`` query heads, ``num_kv_heads / size``
    KV heads, ``intermediate_size / size`` MLP columns; hidden size and vocabulary whole.

    Raises ValueError, naming the values, when they do not divide.
    """
    positive_int("the tensor-parallel size", size)
    if config.num_kv_heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs num_kv_heads ({config.num_kv_heads}) divisible "
                         f"by {size}: each rank holds whole KV heads and the query heads that read them "
                         f"(replicating KV heads over more ranks than heads is not supported)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs intermediate_size ({config.intermediate_size}) "
                         f"divisible by {size}")
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)``: the vocabulary rows of ``rank``'s ``lm_head`` shard (``ceil(vocab / size)`` rows,
    fewer on the last ranks when it does not divide)."""
    shard = -(-vocab_size // size)
    start = min(rank * shard, vocab_size)
    return start, min(start + shard, vocab_size)


def rank_pieces(split: Split, full_rows: int, size: int, rank: int) -> tuple[int, list[tuple[int, int]]]:
    """``(dim, [(start, stop), ...])``: the pieces along ``dim`` of a checkpoint tensor cut by ``split`` (of
    ``full_rows`` along that dim in the whole model) that ``rank`` of ``size`` holds, concatenated in that
    order: its share of each fused part (:class:`~treedec.models.weights.Split`), or its vocabulary rows."""
    if split.vocab:
        return split.dim, [vocab_range(full_rows, size, rank)]
    pieces, start = [], 0
    for part in split.parts:
        width = part // size
        pieces.append((start + rank * width, start + (rank + 1) * width))
        start += part
    return split.dim, pieces


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary rows: ``hidden [..., hidden_size]`` -> logits ``[..., vocab_size]``,
    every rank's ``weight_shard`` ([stop - start, hidden_size], rows of :func:`vocab_range`) applied, the
    shards' logits all-gathered (then soft-capped, ``c * tanh(logits / c)``, with ``softcap``: Gemma 2).
    ``matmul`` computes a shard's logits (``F.linear``, or the batch-invariant mode's:
    :mod:`~treedec.models.batch_invariant`)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel, dtype: torch.dtype | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.tp, self.vocab_size, self.softcap = tp, vocab_size, softcap
        self.start, self.stop = vocab_range(vocab_size, tp.size, tp.rank)
        self.shard_rows = -(-vocab_size // tp.size)
        self.weight_shard = nn.Parameter(torch.empty(self.stop - self.start, hidden_size, dtype=dtype))
        self.matmul = F.linear

    def tie(self, embedding: torch.Tensor) -> None:
        """Make the shard a view of the embedding's rows (not a parameter of its own: counted once)."""
        if "weight_shard" in self._parameters:
            del self.weight_shard
        self.weight_shard = embedding[self.start:self.stop]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, self.weight_shard)
        if logits.shape[-1] < self.shard_rows:   # the last ranks' shorter shards, padded for the gather
            logits = F.pad(logits, (0, self.shard_rows - logits.shape[-1]))
        logits = self.tp.all_gather_last(logits)[..., :self.vocab_size]
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    @property
    def weight(self) -> torch.Tensor:
        """The whole head ``[vocab_size, hidden_size]``, all-gathered (a collective: every rank must read it,
        as code that runs alike on every rank does, e.g. ``MedusaHeads.untrained``)."""
        shard = self.weight_shard.detach()
        shard = F.pad(shard, (0, 0, 0, self.shard_rows - shard.shape[0]))
        return self.tp.all_gather_first(shard)[:self.vocab_size]


def check_tensor_parallel_size(model, size: int) -> None:
    """``tensor_parallel_size`` (``LLM``'s) against the model (a DecoderModel, or None): 1 for a model of one process, the group's size for a
    tensor-parallel one (None: not loaded yet, only a size > 1 can be refused)."""
    tp = None if model is None else model.tensor_parallel   # (the group a tensor-parallel model is split over)
    if tp is not None:
        if size not in (1, tp.size):
            raise ValueError(f"tensor_parallel_size must be the model's group size {tp.size}, got {size}")
    elif size > 1:
        raise NotImplementedError(
            f"LLM(tensor_parallel_size={size}) would start {size} worker processes, which treedec does not do: "
            f"tensor parallelism runs one process per GPU under torchrun (`torchrun --nproc-per-node {size} "
            f"script.py`), each rank loading its slice, "
            f"`from_pretrained(path, tensor_parallel=init_tensor_parallel())` (treedec.models.tensor_parallel), and "
            f"making an LLM of it")
