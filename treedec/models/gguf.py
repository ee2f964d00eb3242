"""GGUF checkpoints (llama.cpp's format) as Hugging Face checkpoint folders that :func:`from_pretrained` reads.

    from treedec.models.gguf import convert_gguf
    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/smollm2")   # config, safetensors, tokenizer
    model = from_pretrained(folder)

transformers reads GGUF (with the ``gguf`` package): the config, the tokenizer (and its chat
template) and the tensors, de-quantized to float32. It builds the model through ``accelerate``
when asked for a model; here the tensors are read into a model made from the config instead,
so nothing beyond transformers and ``gguf`` is needed. The result is a float32 checkpoint:
both treedec and transformers then read the same de-quantized tensors.

A GGUF file is input like any other. Before anything is allocated or written, its metadata
(architecture, sizes, tokenizer), and every tensor's name, type and shape from its tensor infos,
are checked against the config (:func:`~treedec.models.checkpoint_headers.check_tensor_headers`):
a ``block_count`` of 1000 beside two blocks of tensors fails at once. The folder is written under
a temporary name beside ``out_dir`` and renamed at the end, so an error leaves no folder.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.checkpoint_headers import TensorHeader, check_tensor_headers
from treedec.models.config import ModelConfig
from treedec.models.hf_config import check_hf_fields, warn_hf_defaults
from treedec.models.registry import config_from_hf, gguf_architectures, weight_map

__all__ = ["convert_gguf", "require_gguf", "staging_folders"]

# metadata every file of these architectures holds (GGUF spec), without which transformers guesses
_REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
# transformers' config field -> the GGUF metadata key it is read from (after "<architecture>."), for messages
_METADATA_KEYS = {"max_position_embeddings": "context_length", "num_hidden_layers": "block_count",
                  "intermediate_size": "feed_forward_length", "hidden_size": "embedding_length",
                  "head_dim": "rope.dimension_count", "rope_theta": "rope.freq_base",
                  "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                  "rms_norm_eps": "attention.layer_norm_rms_epsilon", "vocab_size": "vocab_size",
                  "sliding_window": "attention.sliding_window"}
# llama.cpp's Llama 3 RoPE factors: RoPE comes from the config here
_IGNORED_TENSORS = ("rope_freqs.weight",)
# the temporary name of a folder being written (then renamed to its name)
_STAGING_PREFIX = ".{}.partial-"
# tensor types that are not weights (integers, and doubles, which gguf does not de-quantize)
_NOT_WEIGHTS = ("I8", "I16", "I32", "I64", "F64")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write ``gguf_file``'s model as a Hugging Face checkpoint folder ``out_dir`` (config.json,
    model.safetensors, generation_config.json, the tokenizer files); returns ``out_dir``.

    ``out_dir`` must not exist, or be an empty folder. Everything is checked and converted in
    memory first, then written under a temporary name beside ``out_dir`` and renamed: on any
    error there is no ``out_dir`` (an empty one given stays as it was).

    Raises
    ------
    FileNotFoundError : no such file.
    FileExistsError : ``out_dir`` is a file or a folder that is not empty.
    NotADirectoryError : ``out_dir`` is under a file (it cannot be made).
    ImportError : the ``gguf`` package is missing (:func:`require_gguf`).
    UnsupportedModelError : an architecture of no family treedec runs (:mod:`~treedec.models.registry`).
    CheckpointError : (a ValueError) naming the GGUF file: not a readable GGUF file (truncated,
        corrupt); metadata missing (sizes,
        tokenizer) or of a bad type or value (as :func:`~treedec.models.hf_config.check_hf_fields`
        checks a config.json); a tensor missing, unknown, of a type that is not a weight's or of the
        wrong shape; a tokenizer transformers cannot build.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder: convert_gguf writes a new folder "
                              f"(remove it or choose another)")
    above = next(p for p in out_dir.absolute().parents if p.exists())   # (the root exists)
    if not above.is_dir():
        raise NotADirectoryError(f"out_dir {out_dir} cannot be made: {above} is a file, not a folder (choose an "
                                 f"out_dir in a folder)")
    require_gguf()
    hf_config = _checked_config(gguf_file)
    write = _converted(gguf_file, hf_config)
    _write_folder(out_dir, write)
    return out_dir


def staging_folders(out_dir: str | Path) -> list[Path]:
    """The temporary folders :func:`convert_gguf` writes ``out_dir`` under (``.<name>.partial-<id>`` beside it)
    that exist now: a conversion in progress, or one killed before it could remove its own (the caller removing
    them must know no conversion into ``out_dir`` runs: :mod:`~treedec.models.catalog` holds a lock)."""
    out_dir = Path(out_dir)
    return sorted(out_dir.parent.glob(f"{glob.escape(_STAGING_PREFIX.format(out_dir.name))}*"))


def require_gguf() -> None:
    """Raise ImportError, saying the pip command, when the ``gguf`` package (through which transformers
    reads GGUF files) is not installed."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf (treedec's gguf extra)")


# ===================================================================== private


def _checked_config(gguf_file: Path):
    """The transformers config of ``gguf_file``, after its metadata and tensor infos are checked."""
    import gguf
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{gguf_file}: not a readable GGUF file ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    arch = _string_field(reader, "general.architecture", gguf_file)
    if arch is None:
        raise CheckpointError(f"{gguf_file}: lacks metadata key 'general.architecture' (the model's architecture)")
    architectures = gguf_architectures()
    if arch not in architectures:
        raise UnsupportedModelError(f"{gguf_file}: metadata key 'general.architecture' must be one of "
                                    f"{tuple(architectures)} (the families treedec runs), got {arch!r:.60}")
    for key in [f"{arch}.{k}" for k in _REQUIRED] + list(_TOKENIZER_KEYS):
        if key not in reader.fields:
            what = "the tokenizer, which the checkpoint folder carries" if key.startswith("tokenizer.") else \
                "one of the model's sizes"
            raise CheckpointError(f"{gguf_file}: lacks metadata key '{key}' ({what})")
    try:
        settings = dict(load_gguf_checkpoint(str(gguf_file), return_tensors=False)["config"])
    except Exception as e:   # transformers' reader raises whatever the values make it
        raise CheckpointError(f"{gguf_file}: transformers cannot read its metadata ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    model_type = settings.pop("model_type", None)

    def name(key: str) -> str:
        return f"metadata key '{arch}.{_METADATA_KEYS[key]}'" if key in _METADATA_KEYS else f"field '{key}'"

    check_hf_fields(settings, str(gguf_file), name)
    if model_type not in architectures[arch].model_types:
        raise CheckpointError(f"{gguf_file}: transformers reads it as a {model_type!r} model, not one of "
                              f"{architectures[arch].model_types}")
    try:
        hf_config = AutoConfig.for_model(model_type, **settings)
        config = config_from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{gguf_file}: {e}") from None
    except Exception as e:   # transformers 5's config classes raise their own errors (StrictDataclassError)
        raise CheckpointError(f"{gguf_file}: its metadata makes no {model_type} config ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    warn_hf_defaults(settings, config, str(gguf_file), name)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if tokens > config.vocab_size:
        raise CheckpointError(f"{gguf_file}: the tokenizer has {tokens} tokens, more than the model's vocabulary "
                              f"({config.vocab_size}, {name('vocab_size')} or the rows of token_embd.weight)")
    _check_tensor_infos(reader, config, gguf_file)
    return hf_config


def _string_field(reader, key: str, gguf_file: Path) -> str | None:
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types != [gguf.GGUFValueType.STRING]:
        raise CheckpointError(f"{gguf_file}: metadata key '{key}' must be a string, got "
                              f"{'/'.join(t.name for t in field.types)}")
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{gguf_file}: metadata key '{key}' is not UTF-8 ({e})") from None


def _check_tensor_infos(reader, config: ModelConfig, gguf_file: Path) -> None:
    """Every tensor's name, type and shape from the tensor infos, against ``config`` (nothing is read); the
    names are the family's weight map's GGUF names."""
    weights = weight_map(config)
    headers, unknown = {}, []
    for tensor in reader.tensors:
        hf = weights.from_gguf(tensor.name)
        if hf is None:
            if tensor.name not in _IGNORED_TENSORS:
                unknown.append(tensor.name)
            continue
        # GGUF lists dimensions innermost first; transformers' tensors put rows first
        headers[hf] = TensorHeader(tuple(int(n) for n in reversed(tensor.shape)), tensor.tensor_type.name,
                                   str(gguf_file))
    if unknown:
        raise CheckpointError(f"{gguf_file}: the file has {len(unknown)} tensor(s) this decoder does not use, e.g. "
                              f"{unknown[:5]} (a different architecture?)")
    import gguf
    types = tuple(t.name for t in gguf.GGMLQuantizationType if t.name not in _NOT_WEIGHTS)
    check_tensor_headers(headers, config, types, str(gguf_file), weights.to_gguf)


def _converted(gguf_file: Path, hf_config) -> Callable[[Path], None]:
    """Convert ``gguf_file`` in memory (model, generation config, tokenizer); returns what writes them to a folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        with torch.device("meta"):   # only names and shapes, for the GGUF-to-transformers tensor names
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
        model = AutoModelForCausalLM.from_config(hf_config).float()   # (no dtype argument: its name changed in 4.56)
        result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        generation = GenerationConfig.from_model_config(hf_config)
    except Exception as e:   # de-quantizing or the tokenizer's builder failing on what the file holds
        raise CheckpointError(f"{gguf_file}: cannot be converted ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and hf_config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{gguf_file}: tensors do not fit the {hf_config.model_type} model: missing "
                              f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        generation.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return write


def _write_folder(out_dir: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a new folder beside ``out_dir``, then rename it to ``out_dir`` (replacing an empty one);
    on an error, remove it and the parent folders made for it."""
    made = [p for p in [out_dir.parent, *out_dir.parent.parents] if not p.exists()]
    staging = out_dir.parent / f"{_STAGING_PREFIX.format(out_dir.name)}{uuid.uuid4().hex[:12]}"
    try:
        staging.mkdir(parents=True)
        write(staging)
        os.replace(staging, out_dir)   # (an empty folder is replaced whole)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:   # nearest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
