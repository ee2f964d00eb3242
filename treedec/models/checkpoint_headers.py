"""A checkpoint's tensors checked against its config from the files' headers, before a model is allocated.

The config says how large the model is; the files hold its tensors. Building the model first
lets a config larger than its tensors (``num_hidden_layers: 100000``, a 7B config beside tiny
weights) reserve that size before the first tensor is read. Here every tensor's name, shape and
dtype, as the safetensors headers (or a GGUF file's tensor infos) give them, is checked against
the config first, at a cost that grows with the tensors in the files, not with the config.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.config import ModelConfig
from treedec.models.checkpoint_layout import CheckpointLayout, CheckpointTensor, weight_shapes
from treedec.models.hf_config import quantized_message
from treedec.models.kv_scales import check_kv_scale_header, is_kv_scale

if TYPE_CHECKING:   # (annotations only)
    from treedec.models.quantization import Quantization

#: Tensors some checkpoints carry that the decoder recomputes or does not use.
IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# the parts of quantized weights (AWQ/GPTQ/Marlin, fp8, bitsandbytes) in place of a ``.weight``
_QUANTIZED = re.compile(r"\.(qweight|qzeros|scales|g_idx|weight_scale(_inv)?|input_scale|weight_packed|"
                        r"weight_shape|absmax|quant_map|quant_state\.\w+|SCB)$")
_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")
# safetensors' dtype names, as torch names them in messages
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
                       "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class TensorHeader:
    """A tensor as its file describes it: ``shape`` (rows first, as transformers reads it), ``dtype``
    as messages show it (``torch.bfloat16``, GGUF's ``Q4_K``), and the ``file``."""

    shape: tuple[int, ...]
    dtype: str
    file: str


def hf_tensor_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor ``config``'s checkpoint holds, layer by layer (the names of
    its family's weight map, the shapes of the model's own parameters: :func:`~treedec.models.registry.weight_shapes`).

    A generator: a config of a billion layers costs nothing until it is iterated that far.
    """
    global_shapes, layer = weight_shapes(config)
    yield from global_shapes.items()
    for i in range(config.num_layers):
        for suffix, shape in layer.items():
            yield f"model.layers.{i}.{suffix}", shape


def all_checkpoint_tensors(config: ModelConfig, quantization: Quantization | None = None
                           ) -> Iterator[tuple[str, CheckpointTensor]]:
    """(Hugging Face name, :class:`~treedec.models.checkpoint_layout.CheckpointTensor`) of every tensor
    ``config``'s checkpoint holds (quantized by ``quantization``: fp8 weights with their scales), layer by layer,
    lazily."""
    yield from CheckpointLayout(config, quantization)


def check_tensor_headers(headers: dict[str, TensorHeader], config: ModelConfig, dtypes: tuple[str, ...],
                         source: str, shown: Callable[[str], str] = str,
                         quantization: Quantization | None = None) -> None:
    """Check ``headers`` (Hugging Face name -> header) against ``config``: every tensor it needs once,
    of its shape and one of ``dtypes`` (a quantized projection's tensors: of the dtypes its method reads,
    fp8 weights and their scales with ``quantization``); none it does not use (but :data:`IGNORED_TENSORS`
    and a tied ``lm_head.weight``); KV-cache scales (``k_scale`` / ``v_scale``, :mod:`~treedec.models.kv_scales`)
    where they are, each one float.

    ``source`` (the checkpoint) leads the messages about the whole set; ``shown(name)`` is how the
    file names a tensor (GGUF's names differ).

    Raises
    ------
    CheckpointError : naming the file, the tensor, the expected and the actual dtype or shape; or
        the tensors missing or not used (the first five).
    """
    unexpected, found = [], 0
    try:
        layout = CheckpointLayout(config, quantization)
    except CheckpointError as e:   # sizes no tensor can have
        raise CheckpointError(f"{source}: {e}") from None
    for name, header in headers.items():
        m = _LAYER.fullmatch(name)
        tensor = layout.get(name, None, "") if m is None else layout.get(name, int(m[1]), m[2])
        if tensor is None and is_kv_scale(name):   # an fp8 KV cache's scales: optional, one float each
            check_kv_scale_header(name, header.shape, header.dtype, config.num_layers, header.file)
            continue
        if tensor is None:
            if not (IGNORED_TENSORS.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings)):
                unexpected.append(shown(name))
            continue
        allowed = dtypes if tensor.dtypes is None else tuple(str(d) for d in tensor.dtypes)
        if header.dtype not in allowed:
            raise CheckpointError(f"{header.file}: tensor {shown(name)} has dtype {header.dtype}, expected one of "
                                  f"{list(allowed)}")
        if header.shape not in tensor.shapes:
            expected = tensor.shapes[0] if len(tensor.shapes) == 1 else " or ".join(map(str, tensor.shapes))
            raise CheckpointError(f"{header.file}: checkpoint tensor {shown(name)} has shape {header.shape}, "
                                  f"expected {expected} for the config {config}")
        found += 1
    if unexpected:
        raise unused_tensors_error(source, unexpected, quantization)
    if layout.has_more_than(found):   # the first few missing: a walk no longer than the files' tensors and five more
        missing = list(itertools.islice((shown(n) for n, _ in layout if n not in headers), 5))
        raise CheckpointError(f"{source}: the checkpoint lacks {_missing_count(layout, found)} tensor(s) the config "
                              f"needs, e.g. {missing}")


def unused_tensors_error(source: str, unexpected: list[str], quantization: Quantization | None = None
                         ) -> CheckpointError | UnsupportedModelError:
    """The error for a checkpoint's tensors the decoder does not use: :class:`UnsupportedModelError` when they
    are quantized weights' parts (AWQ/GPTQ ``qweight``, ``qzeros``, ``scales``; fp8 ``weight_scale``; ...) of a
    checkpoint read as float (no ``quantization``), else CheckpointError (another architecture's tensors, stray
    ones, the scales of a layer the quantization leaves unquantized)."""
    quantized = [name for name in unexpected if _QUANTIZED.search(name)]
    if quantized and quantization is not None:
        return CheckpointError(f"{source}: the checkpoint has {len(unexpected)} tensor(s) this decoder does not use, "
                               f"e.g. {unexpected[:5]} (scales of a layer the {quantization.format}'s "
                               f"quantization_config leaves unquantized?)")
    if quantized:
        return UnsupportedModelError(f"{source}: {quantized_message(f'its tensors ({quantized[:3]})', None)}")
    return CheckpointError(f"{source}: the checkpoint has {len(unexpected)} tensor(s) this decoder does not use, "
                           f"e.g. {unexpected[:5]} (a different architecture?)")


def safetensors_headers(shards: list[Path]) -> dict[str, TensorHeader]:
    """Name -> :class:`TensorHeader` of every tensor of the safetensors ``shards`` (headers only: no
    tensor is read). CheckpointError names a file that is not safetensors, or a tensor stored twice."""
    import safetensors

    headers: dict[str, TensorHeader] = {}
    for shard in shards:
        try:
            with safetensors.safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in headers:
                        raise CheckpointError(f"{shard}: tensor {name} is stored twice (also in "
                                              f"{headers[name].file})")
                    piece = f.get_slice(name)
                    dtype = piece.get_dtype()
                    headers[name] = TensorHeader(tuple(piece.get_shape()),
                                                 f"torch.{_SAFETENSORS_DTYPES[dtype]}"
                                                 if dtype in _SAFETENSORS_DTYPES else dtype, str(shard))
        except (safetensors.SafetensorError, OSError) as e:   # a truncated or corrupt file
            raise CheckpointError(f"{shard}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
    return headers


# ===================================================================== private


def _missing_count(layout: CheckpointLayout, found: int) -> str:
    """How many tensors a checkpoint of ``found`` lacks, in words: a product for a float checkpoint (its layers'
    tensors are alike), else counted over the layers (up to a million past ``found``: a walk that ends)."""
    c = layout.config
    if layout.quantization is None:
        return str(len(layout.globals) + c.num_layers * len(layout.layer(0)) - found)
    limit = found + 1_000_000
    return f"over {limit - found}" if layout.has_more_than(limit) else str(sum(1 for _ in layout) - found)
