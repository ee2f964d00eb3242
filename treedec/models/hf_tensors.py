"""Named checkpoint tensors into a model: the whole model's (:func:`load_hf_tensors`) or a tensor-parallel rank's
slices (:func:`load_checkpoint`, :func:`load_random`), every tensor found through the family's weight map
(:func:`~treedec.models.registry.weight_map`)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import torch

from treedec.errors import CheckpointError
from treedec.models.checkpoint_headers import IGNORED_TENSORS, hf_tensor_shapes, unused_tensors_error
from treedec.models.config import ModelConfig
from treedec.models.decoder import Decoder
from treedec.models.registry import build, weight_map
from treedec.models.tensor_parallel import rank_pieces
from treedec.models.weights import Split

__all__ = ["hf_targets", "init_random_", "load_checkpoint", "load_hf_tensors", "load_random", "rank_slice",
           "safetensors_device"]


def init_random_(name: str, param: torch.Tensor, std: float, generator: torch.Generator, norm_offset: float = 0.0
                 ) -> None:
    """Fill ``param`` (named ``name``) as :func:`from_config` does: norms the identity (1, or 0 for a
    ``(1 + w)`` norm: ``norm_offset`` 1), biases 0, the rest ~ N(0, std)."""
    if name.endswith("norm.weight"):
        param.fill_(1.0 - norm_offset)
    elif name.endswith(".bias"):
        param.zero_()
    else:
        param.normal_(0.0, std, generator=generator)


def safetensors_device(device: torch.device) -> str:
    """safetensors opens tensors straight on "cpu" or "cuda:<index>" (no CPU copy for a GPU)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return str(device)


def hf_targets(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """HF tensor name -> (treedec parameter name, rows of it) for every tensor the config needs."""
    return weight_map(config).targets()


def rank_slice(name: str, config: ModelConfig, size: int, rank: int) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of the checkpoint tensor ``name`` (of the whole model ``config``) that
    ``rank`` of ``size`` holds, when it is one piece; None for a tensor every rank holds whole. (A tensor fusing
    parts, Phi-3's ``qkv_proj``, is several pieces: :func:`~treedec.models.tensor_parallel.rank_pieces`.)"""
    w = weight_map(config).get(name)
    if w is None or w.split is None:
        return None
    dim, pieces = rank_pieces(w.split, config.vocab_size, size, rank)
    if len(pieces) != 1:
        raise ValueError(f"{name} is cut in {len(pieces)} pieces (fused parts): use rank_pieces")
    return dim, *pieces[0]


def load_hf_tensors(model: Decoder, tensors: Iterable[tuple[str, torch.Tensor, str]], source: str,
                    dtypes: tuple[torch.dtype, ...] | None = None,
                    targets: dict[str, tuple[str, slice]] | None = None) -> None:
    """Copy HF-named (name, tensor, file) into ``model``; every needed tensor exactly once, no unknown names.

    ``dtypes``: the tensor dtypes accepted (None: any; a copy converts). ``targets``: HF name ->
    (parameter, rows), default :func:`hf_targets` of the model's config.
    """
    targets = hf_targets(model.config) if targets is None else targets
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: dict[str, str] = {}
    unexpected = []
    with torch.no_grad():
        for name, tensor, file in tensors:
            if name not in targets:
                tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
                if not IGNORED_TENSORS.fullmatch(name) and not tied_head:
                    unexpected.append(name)
                continue
            if name in seen:
                raise CheckpointError(f"{file}: tensor {name} is stored twice (also in {seen[name]})")
            if dtypes is not None and tensor.dtype not in dtypes:
                raise CheckpointError(f"{file}: tensor {name} has dtype {tensor.dtype}, expected one of "
                                      f"{[str(d) for d in dtypes]}")
            param_name, rows = targets[name]
            dst = params[param_name][rows]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise CheckpointError(f"{file}: checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(dst.shape)} for the config {model.config}")
            dst.copy_(tensor)
            seen[name] = file
    if unexpected:
        raise unused_tensors_error(source, unexpected)
    missing = sorted(set(targets) - set(seen))
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                              f"{missing[:5]}")


# ===================================================================== tensor-parallel ranks


def load_checkpoint(model: Decoder, shards: list[Path], source: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Copy this rank's slices of the safetensors ``shards`` into ``model`` (a rank's part, built with
    ``tensor_parallel``; only those slices are read), with the checks of the single-GPU loader."""
    load_hf_tensors(model, _read_rank_slices(shards, model), source, dtypes, targets=_local_targets(model))


def load_random(model: Decoder, seed: int, std: float) -> None:
    """Fill ``model`` (a rank's part) with its slices of the weights ``from_config(full_config, seed, std)``
    draws: every parameter drawn whole, in the same order from the same generator, then cut, so that TP=N
    computes what TP=1 does. One whole parameter is in memory at a time."""
    load_hf_tensors(model, _random_rank_slices(model, seed, std), "random weights", targets=_local_targets(model))


def _local_targets(model: Decoder) -> dict[str, tuple[str, slice]]:
    """HF name -> (this rank's parameter, rows of it): the fused layouts of the shard's config."""
    return {hf: ("lm_head.weight_shard" if param == "lm_head.weight" else param, rows)
            for hf, (param, rows) in hf_targets(model.config).items()}


def _cut(whole, split: Split, config: ModelConfig, tp) -> torch.Tensor:
    """This rank's part of a checkpoint tensor cut by ``split`` (``whole``: a tensor, or a safetensors slice,
    read only there)."""
    dim, pieces = rank_pieces(split, config.vocab_size, tp.size, tp.rank)
    parts = [whole[start:stop] if dim == 0 else whole[:, start:stop] for start, stop in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_rank_slices(shards: list[Path], model: Decoder) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, this rank's part of the tensor, file) for every tensor of ``shards``, read with
    ``safe_open(...).get_slice``; each tensor's whole shape is checked first."""
    import safetensors

    c, tp = model.full_config, model.tensor_parallel
    shapes, weights = dict(hf_tensor_shapes(c)), weight_map(c)
    for shard in shards:
        try:
            with safetensors.safe_open(str(shard), framework="pt", device=safetensors_device(model.device)) as f:
                for name in list(f.keys()):
                    if name not in shapes:   # unknown or unused: reported (or ignored) by the loader, not read
                        yield name, torch.empty(0), str(shard)
                        continue
                    try:
                        piece = f.get_slice(name)
                        shape = tuple(piece.get_shape())
                        split = weights.get(name).split
                        tensor = None if shape != shapes[name] else f.get_tensor(name) if split is None else \
                            _cut(piece, split, c, tp)
                    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as e:
                        raise CheckpointError(f"{shard}: tensor {name} cannot be read ({type(e).__name__}: "
                                              f"{str(e)[:200]})") from None
                    if tensor is None:
                        raise CheckpointError(f"{shard}: checkpoint tensor {name} has shape {shape}, expected "
                                              f"{shapes[name]} for the config {c}")
                    yield name, tensor, str(shard)
        except (safetensors.SafetensorError, OSError) as e:   # a truncated or corrupt file
            raise CheckpointError(f"{shard}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None


def _random_rank_slices(model: Decoder, seed: int, std: float) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, this rank's part, "random weights") of the weights from_config draws (see :func:`load_random`)."""
    c, tp = model.full_config, model.tensor_parallel
    with torch.device("meta"):
        full = build(c, dtype=model.dtype)
    parts = defaultdict(list)
    for w in weight_map(c):
        parts[w.param].append(w)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in full.named_parameters():   # from_config's order (a tied head once)
        whole = torch.empty(p.shape, dtype=model.dtype, device=model.device)
        init_random_(name, whole, std, gen, c.norm_offset)
        for w in parts[name]:
            piece = whole[w.row_slice()]
            yield w.hf, piece if w.split is None else _cut(piece, w.split, c, tp), "random weights"
