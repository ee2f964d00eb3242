"""Named checkpoint tensors into a model: the whole model's (:func:`load_hf_tensors`) or a tensor-parallel rank's
slices (:func:`load_checkpoint`, :func:`load_random`), every tensor found through the family's weight map
(:func:`~treedec.models.registry.weight_map`)."""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import torch

from treedec.errors import CheckpointError
from treedec.models.checkpoint_headers import IGNORED_TENSORS, all_checkpoint_tensors, unused_tensors_error
from treedec.models.kv_scales import KVScaleReader, is_kv_scale
from treedec.models.config import ModelConfig
from treedec.models.decoder import Decoder
from treedec.models.fp8 import DEQUANTIZE
from treedec.models.linear import Linear
from treedec.models.checkpoint_layout import CheckpointTensor
from treedec.models.registry import build, weight_map
from treedec.models.tensor_parallel import rank_pieces
from treedec.models.weights import Split

__all__ = ["finish_linears", "hf_targets", "init_random_", "load_checkpoint", "load_hf_tensors", "load_random",
           "rank_slice", "safetensors_device"]

logger = logging.getLogger("treedec")


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
                    targets: dict[str, CheckpointTensor] | None = None) -> None:
    """Copy HF-named (name, tensor, file) into ``model``; every needed tensor exactly once, no unknown names;
    then finish every projection (:func:`finish_linears`). An FP8 checkpoint's KV-cache scales become
    ``model.kv_scales`` (:mod:`~treedec.models.kv_scales`).

    A projection's tensors go through its method (:meth:`~treedec.models.linear.LinearMethod.load`: an fp8
    weight, its scale, a float weight quantized on load). ``dtypes``: the float dtypes accepted (None: any;
    a copy converts); a quantized tensor has its method's. ``targets``: HF name -> where it goes, default
    every tensor of the model's config and quantization
    (:func:`~treedec.models.checkpoint_headers.all_checkpoint_tensors`).
    """
    targets = dict(all_checkpoint_tensors(model.config, model.quantization)) if targets is None else targets
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    seen: dict[str, str] = {}
    unexpected = []
    kv_scales = KVScaleReader(model.full_config.num_layers, source)
    with torch.no_grad():
        for name, tensor, file in tensors:
            if name not in targets and kv_scales.take(name, tensor, file):
                continue
            if name not in targets:
                tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
                if not IGNORED_TENSORS.fullmatch(name) and not tied_head:
                    unexpected.append(name)
                continue
            if name in seen:
                raise CheckpointError(f"{file}: tensor {name} is stored twice (also in {seen[name]})")
            t = targets[name]
            allowed = dtypes if t.dtypes is None else t.dtypes
            if allowed is not None and tensor.dtype not in allowed:
                raise CheckpointError(f"{file}: tensor {name} has dtype {tensor.dtype}, expected one of "
                                      f"{[str(d) for d in allowed]}")
            if tuple(tensor.shape) not in t.shapes:
                expected = t.shapes[0] if len(t.shapes) == 1 else " or ".join(map(str, t.shapes))
                raise CheckpointError(f"{file}: checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                                      f"{expected} for the config {model.config}")
            module, _, suffix = t.param.rpartition(".")
            linear = modules.get(module)
            if isinstance(linear, Linear) and suffix != "bias":   # (a bias is the layer's own, never quantized)
                linear.method.load(linear, suffix, tensor, t.row_slice(), name, file)
            else:
                params[t.param][t.row_slice()].copy_(tensor)
            seen[name] = file
    if unexpected:
        raise unused_tensors_error(source, unexpected, model.quantization)
    missing = sorted(set(targets) - set(seen))
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                              f"{missing[:5]}")
    model.kv_scales = kv_scales.result()
    finish_linears(model)


def finish_linears(model: Decoder) -> None:
    """Finish every projection after loading (:meth:`~treedec.models.linear.LinearMethod.finish`: each chooses
    its compute path for the weights' device); a quantized model says which paths run (logger ``treedec``: a
    warning where fp8 weights are de-quantized, the CPU's reference path)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                m.finish_loading()
    if model.quantization is not None:
        paths = model.linear_paths()
        line = (f"{model.quantization.method.name} ({model.quantization.format}) on {model.device}: "
                f"{', '.join(f'{n} projection(s) by {p}' for p, n in paths.items())}")
        (logger.warning if DEQUANTIZE in paths else logger.info)(line)


# ===================================================================== tensor-parallel ranks


def load_checkpoint(model: Decoder, shards: list[Path], source: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Copy this rank's slices of the safetensors ``shards`` into ``model`` (a rank's part, built with
    ``tensor_parallel``; only those slices are read), with the checks of the single-GPU loader."""
    load_hf_tensors(model, _read_rank_slices(shards, model), source, dtypes, targets=_local_targets(model))


def load_random(model: Decoder, seed: int, std: float) -> None:
    """Fill ``model`` (a rank's part, or a whole quantized model) with its slices of the weights
    ``from_config(full_config, seed, std)`` draws: every parameter drawn whole, in the same order from the same
    generator, then cut, so that TP=N computes what TP=1 does (and a quantized model quantizes those weights).
    One whole parameter is in memory at a time."""
    load_hf_tensors(model, _random_rank_slices(model, seed, std), "random weights", targets=_local_targets(model))


def _local_targets(model: Decoder) -> dict[str, CheckpointTensor]:
    """HF name -> where it goes in this rank's part: the fused layouts of the shard's config (the vocab-parallel
    head's ``weight_shard``)."""
    targets = dict(all_checkpoint_tensors(model.config, model.quantization))
    if model.tensor_parallel is not None and "lm_head.weight" in targets:
        targets["lm_head.weight"] = dataclasses.replace(targets["lm_head.weight"], param="lm_head.weight_shard",
                                                        shapes=(tuple(model.lm_head.weight_shard.shape),))
    return targets


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
    whole = dict(all_checkpoint_tensors(c, model.quantization))
    for shard in shards:
        try:
            with safetensors.safe_open(str(shard), framework="pt", device=safetensors_device(model.device)) as f:
                for name in list(f.keys()):
                    if is_kv_scale(name) and name not in whole:   # one float a layer: every rank's whole
                        yield name, f.get_tensor(name), str(shard)
                        continue
                    if name not in whole:   # unknown or unused: reported (or ignored) by the loader, not read
                        yield name, torch.empty(0), str(shard)
                        continue
                    try:
                        piece = f.get_slice(name)
                        shape = tuple(piece.get_shape())
                        split = whole[name].split
                        tensor = None if shape not in whole[name].shapes else f.get_tensor(name) if split is None \
                            else _cut(piece, split, c, tp)
                    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as e:
                        raise CheckpointError(f"{shard}: tensor {name} cannot be read ({type(e).__name__}: "
                                              f"{str(e)[:200]})") from None
                    if tensor is None:
                        raise CheckpointError(f"{shard}: checkpoint tensor {name} has shape {shape}, expected "
                                              f"{whole[name].shapes[0]} for the config {c}")
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
            yield w.hf, piece if w.split is None or tp is None else _cut(piece, w.split, c, tp), "random weights"
