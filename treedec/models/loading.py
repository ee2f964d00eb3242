"""Building a model (a :class:`~treedec.models.decoder.Decoder` of its family): from a checkpoint (a local HF
checkpoint folder, or what :mod:`treedec.models.catalog` resolves a known name, a GGUF file or a hub repo id
to), an in-memory transformers model, or random weights.

Hugging Face tensor names map onto treedec's (fused) parameters through the family's weight map
(:mod:`~treedec.models.weights`, :mod:`~treedec.models.registry`): ``model.embed_tokens.weight`` ->
``embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v}_proj.*`` -> rows of ``layers.{i}.qkv_proj.*``,
``mlp.{gate,up}_proj.*`` -> rows of ``layers.{i}.gate_up_proj.*``, ``input_layernorm`` -> ``input_norm``,
``post_attention_layernorm`` -> ``post_attention_norm`` (and Gemma's ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``; Qwen3's and Gemma 3's ``self_attn.{q,k}_norm`` -> ``{q,k}_norm``),
``model.norm.weight`` -> ``norm.weight``, ``lm_head.weight`` (absent when tied).

A checkpoint directory is input like any other: the shard paths of
``model.safetensors.index.json`` must name files inside the directory (see
:func:`checkpoint_shards`), and a malformed index, config, shard or tensor raises
:class:`CheckpointError` naming the file (and the key or tensor) before the model is allocated:
the config's fields and every tensor's name, dtype and shape (from the safetensors headers) are
checked first (:mod:`treedec.models.checkpoint_headers`).
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Iterator

import torch

from treedec.checks import is_int
from treedec.errors import CheckpointError, UnsupportedModelError
from treedec.models.catalog import ResolvedModel, resolve_model
from treedec.models.checkpoint_headers import check_tensor_headers, safetensors_headers
from treedec.models.config import ModelConfig
from treedec.models.decoder import Decoder
from treedec.models.hf_config import check_hf_fields, quantized_message, warn_hf_defaults
from treedec.models.hf_tensors import (finish_linears, hf_targets, init_random_, load_checkpoint, load_hf_tensors,
                                       load_random, safetensors_device)
from treedec.models.linear import Linear
from treedec.models.quantization import Quantization, quantize_on_load, read_quantization
from treedec.models.registry import build, config_from_hf

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
#: Weight dtypes a checkpoint may hold and a model may be built in.
SUPPORTED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def from_pretrained(model: str | Path | ResolvedModel, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, tensor_parallel=None,
                    quantization: str | None = None) -> Decoder:
    """Load a model: a known name (``smollm2``), a ``.gguf`` file, a local Hugging Face checkpoint
    directory (``config.json`` + ``*.safetensors``) or a repo id in the local hub cache, resolved by
    :func:`~treedec.models.catalog.resolve_model` (a known name is fetched, a GGUF file converted, once).

    Sharded checkpoints (``model.safetensors.index.json``) and single files
    (``model.safetensors``) are read shard by shard straight onto ``device``. The model's
    ``eos_token_ids`` (where the search programs stop by default) are the ``eos_token_id``
    (an id or a list) of ``generation_config.json``, as transformers' ``generate`` uses
    them, else of ``config.json``; empty when neither names one.

    Nothing is allocated before the config's fields and every tensor's name, dtype and shape
    (read from the safetensors headers) are checked; real numbers out of their ranges
    (:data:`~treedec.models.config.REAL_RANGES`: ``rms_norm_eps`` 1e308, a RoPE factor 1e308) are refused
    by name. A config without ``rms_norm_eps`` or ``rope_theta`` takes transformers' default for its model
    type, as transformers does, with a warning (logger ``treedec``) naming it; a ``llama3`` RoPE scaling
    without ``rope_theta`` is refused (that default, 10000, is known wrong for every such checkpoint).

    Parameters
    ----------
    model : a model argument of :func:`~treedec.models.catalog.resolve_model`, or what it returned. A
        hub repo id that is not in the local cache raises FileNotFoundError (treedec never downloads
        from the hub: fetch it first with ``hf download <repo id>``).
    dtype : float32, float16 or bfloat16; default the checkpoint config's ``dtype`` /
        ``torch_dtype``, else bfloat16.
    device : default CUDA when available, else CPU.
    tensor_parallel : a :class:`~treedec.models.tensor_parallel.TensorParallel`: build this rank's
        part of the :class:`~treedec.models.decoder.Decoder`, reading only its slices.
    quantization : None, or ``"fp8"``: quantize a float checkpoint's projections to fp8 e4m3 when loading
        (per output row; the LM head stays in ``dtype``). An FP8 checkpoint (its ``quantization_config``:
        :mod:`~treedec.models.quantization`) loads as fp8 whatever this says. Which compute path the fp8
        projections run (``torch._scaled_mm`` on a CUDA GPU with fp8 tensor cores, else de-quantized) is
        logged (logger ``treedec``) and read by ``model.linear_paths()``.

    Raises
    ------
    FileNotFoundError
        ``model`` names nothing (see :func:`~treedec.models.catalog.resolve_model`), a folder has no
        ``config.json`` or no weights, or a shard the index lists is missing.
    ImportError, ModelUnavailableError
        A known name or GGUF file that cannot be fetched or converted here (the message says what to run).
    CheckpointError
        (a ValueError) A malformed ``config.json`` (a size that is not a positive int, head
        counts that do not divide, an ``rms_norm_eps`` or ``rope_theta`` that is not a finite
        number > 0 or out of range, ...), ``generation_config.json`` (its
        ``eos_token_id`` not token ids of the vocabulary) or index, a shard path outside the
        directory, a truncated or corrupt shard, a tensor of another dtype than
        :data:`SUPPORTED_DTYPES` or of the wrong shape, a missing or unknown tensor; a GGUF file
        that does not convert.
    UnsupportedModelError
        (a ValueError and a NotImplementedError) An architecture or feature the decoder does not implement
        (the message names the model types it runs), a quantized checkpoint other than fp8 (AWQ's, GPTQ's,
        block-wise fp8: its ``quantization_config``, or quantized tensors such as AWQ's ``qweight``), which
        treedec does not load.
    """
    from transformers import AutoConfig

    if dtype is not None and dtype not in SUPPORTED_DTYPES.values():
        raise ValueError(f"dtype must be one of torch.{', torch.'.join(SUPPORTED_DTYPES)} or None, got {dtype!r}")
    root = resolve_model(model).checkpoint
    config_file = root / "config.json"
    raw_config = read_json_object(config_file)
    if dtype is None:
        dtype = _config_dtype(raw_config, config_file)
    shards = checkpoint_shards(root)
    check_hf_fields(raw_config, str(config_file))
    requested = None if quantization is None else quantize_on_load(quantization)
    scheme = read_quantization(raw_config, str(config_file)) or requested
    try:
        hf_config = AutoConfig.from_pretrained(root, local_files_only=True)
    except Exception as e:  # transformers 5's config classes raise their own errors (StrictDataclassError)
        raise CheckpointError(f"{config_file}: transformers cannot read it ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    try:
        config = config_from_hf(hf_config)
    except UnsupportedModelError as e:   # a documented limit, not a malformed file
        raise UnsupportedModelError(f"{config_file}: {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    warn_hf_defaults(raw_config, config, str(config_file))
    eos = _checkpoint_eos(root, raw_config, config.vocab_size)
    # every tensor's name, dtype and shape from the headers first: a config larger than its weights
    # (or a bad index, a truncated shard) costs no allocation
    check_tensor_headers(safetensors_headers(shards), config, tuple(str(d) for d in SUPPORTED_DTYPES.values()),
                         str(root), quantization=scheme)
    llama = _empty_model(config, dtype, _default_device(device), tensor_parallel, scheme)
    llama.eos_token_ids = eos
    if tensor_parallel is not None:
        load_checkpoint(llama, shards, str(root), tuple(SUPPORTED_DTYPES.values()))
        return llama
    load_hf_tensors(llama, _read_safetensors(shards, llama.device), dtypes=tuple(SUPPORTED_DTYPES.values()),
                    source=str(root))
    return llama


def checkpoint_shards(root: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in the order they are read.

    With ``model.safetensors.index.json``: the distinct files of its ``weight_map`` (a
    JSON object of tensor name -> file name). Each file name must be relative, must not
    leave the directory (no absolute path, no ``..`` past it, no directory symlinked to
    elsewhere) and must name a regular file. A file that is itself a symlink must resolve
    inside the directory, or, for a Hugging Face cache snapshot
    (``.../snapshots/<revision>/``), into that cache's ``blobs/`` folder. Without an index:
    ``model.safetensors``.

    Raises CheckpointError for a malformed index or a path that breaks these rules (nothing
    outside the directory is opened), FileNotFoundError for a missing file.
    """
    root = Path(root)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: field 'weight_map' must be a non-empty object of tensor name -> "
                                  f"shard file, got {type(weight_map).__name__} {weight_map!r:.80}")
        names = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index}: field 'weight_map[{tensor!r:.80}]' must be a non-empty shard file "
                                      f"name, got {type(shard).__name__} {shard!r:.80}")
            names.setdefault(os.path.normpath(shard), shard)
        return [_shard_path(root, normal, f"{index}: field 'weight_map' shard {shard!r:.120}")
                for normal, shard in sorted(names.items())]
    if (root / SINGLE_FILE).is_file():
        return [_shard_path(root, SINGLE_FILE, str(root / SINGLE_FILE))]
    found = sorted(p.name for p in root.iterdir())[:20]
    raise FileNotFoundError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                            f"(only safetensors checkpoints are read); it holds {found}")


def from_hf_model(hf_model, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Decoder:
    """Copy the weights of an in-memory transformers model of a supported family (``LlamaForCausalLM``,
    ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``, ... :mod:`~treedec.models.registry`).

    ``dtype`` and ``device`` default to those of the HF model's parameters.
    """
    if getattr(hf_model.config, "quantization_config", None) is not None:
        raise UnsupportedModelError(quantized_message("the model's config.quantization_config",
                                                      hf_model.config.quantization_config))
    config = config_from_hf(hf_model.config)
    first = next(hf_model.parameters())
    model = _empty_model(config, dtype or first.dtype, device or first.device)
    state = hf_model.state_dict()
    if not any(name.startswith("model.") for name in state):
        raise ValueError(f"expected a *ForCausalLM model (parameters named 'model.*' and 'lm_head.weight'), "
                         f"got {type(hf_model).__name__} with names like {next(iter(state), None)!r}")
    load_hf_tensors(model, ((name, tensor, type(hf_model).__name__) for name, tensor in state.items()),
                    source=type(hf_model).__name__)
    return model


def from_config(config: ModelConfig | str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str | None = None, std: float = 0.02, tensor_parallel=None,
                quantization: str | None = None) -> Decoder:
    """Random weights (benchmarks, tests): linear and embedding weights ~ N(0, std), norms the identity (1, or
    0 for a family's ``(1 + w)`` norms), biases 0.

    ``config`` is a :class:`ModelConfig` or a name of :data:`~treedec.models.config.MODEL_SIZES`.
    The same seed gives the same weights on the same device. ``tensor_parallel``: this rank's
    slices of those same weights (see :func:`from_pretrained`); ``quantization`` ``"fp8"``: those same
    weights quantized when loaded (see :func:`from_pretrained`).
    """
    if isinstance(config, str):
        config = ModelConfig.from_name(config)
    scheme = None if quantization is None else quantize_on_load(quantization)
    model = _empty_model(config, dtype, _default_device(device), tensor_parallel, scheme)
    if tensor_parallel is not None or scheme is not None:
        load_random(model, seed, std)
        return model
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_random_(name, p, std, gen, config.norm_offset)
    finish_linears(model)
    return model


def to_hf_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """``model``'s weights under Hugging Face names, as views (no copy): the inverse of loading.

    ``transformers_model.load_state_dict(to_hf_state_dict(model), assign=True)`` makes a
    transformers model that shares treedec's weight memory. A quantized model (fp8 projections) has no such
    weights: ValueError.
    """
    quantized = [name for name, m in model.named_modules() if isinstance(m, Linear) and m.method.quantized]
    if quantized:
        raise ValueError(f"to_hf_state_dict reads float weights; {len(quantized)} projection(s) of this model are "
                         f"quantized (e.g. {quantized[0]}: {model.quantization.format})")
    params = dict(model.named_parameters(remove_duplicate=False))
    return {hf: params[ours][rows] for hf, (ours, rows) in hf_targets(model.config).items()}


def read_state_dict(file: Path, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``torch.save``d (``.pt``/``.pth``/``.bin``, read with
    ``weights_only``) state dict, on the CPU.

    Raises ValueError for another file suffix; CheckpointError naming ``file`` for a file that is
    truncated, corrupt, holds pickled objects other than tensors, or is not a dict of name -> tensor.
    """
    if file.suffix == ".safetensors":
        import safetensors
        from safetensors.torch import load_file
        try:
            return load_file(str(file), device="cpu")
        except (safetensors.SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
    if file.suffix in (".pt", ".bin", ".pth"):
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if "weights only load failed" in str(e).lower():   # (torch's text goes on to advise weights_only=False)
                raise CheckpointError(f"{file} could not be read as a state dict of tensors: it holds pickled "
                                      f"objects other than tensors, which treedec does not unpickle") from None
            raise CheckpointError(f"{file} could not be read as a state dict of tensors (UnpicklingError: "
                                  f"{' '.join(str(e).split())[:200]})") from None
        except (RuntimeError, EOFError, OSError, ValueError) as e:   # a truncated or corrupt archive
            raise CheckpointError(f"{file} could not be read as a state dict of tensors ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:200]})") from None
        if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items())):
            raise CheckpointError(f"{file} does not hold a state dict of tensors (a dict of name -> tensor), got "
                                  f"{type(state).__name__} {str(state)[:80]}")
        return state
    raise ValueError(f"{what} {file} must be a .safetensors, .pt, .pth or .bin file")


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; CheckpointError naming it for bad JSON or UTF-8 or another top-level value."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an over-long int literal, deep nesting
        raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


# ===================================================================== private


def _default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _config_dtype(raw_config: dict, path: Path) -> torch.dtype:
    """The dtype a config.json asks for (``dtype``, or transformers 4's ``torch_dtype``); bfloat16 if none."""
    name = "dtype" if raw_config.get("dtype") is not None else "torch_dtype"
    value = raw_config.get(name)
    if value is None:
        return torch.bfloat16
    if not isinstance(value, str) or value not in SUPPORTED_DTYPES:
        raise CheckpointError(f"{path}: field '{name}' must be one of {list(SUPPORTED_DTYPES)}, got {value!r:.60} "
                              f"(pass dtype= to load the weights in a supported dtype)")
    return SUPPORTED_DTYPES[value]


def _checkpoint_eos(root: Path, raw_config: dict, vocab_size: int) -> tuple[int, ...]:
    """The EOS ids of a checkpoint: ``eos_token_id`` of its generation config, else of its config."""
    sources = [(root / "config.json", raw_config)]
    if (root / GENERATION_CONFIG_FILE).is_file():
        sources.insert(0, (root / GENERATION_CONFIG_FILE, read_json_object(root / GENERATION_CONFIG_FILE)))
    for path, data in sources:
        value = data.get("eos_token_id")
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else value
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
            raise CheckpointError(f"{path}: field 'eos_token_id' must be a token id in [0, {vocab_size}) or a list "
                                  f"of them, got {value!r:.80}")
        return tuple(dict.fromkeys(ids))
    return ()


def _shard_path(root: Path, name: str, where: str) -> Path:
    """``root / name`` after checking it stays inside ``root`` (see :func:`checkpoint_shards`)."""
    if "\0" in name:
        raise CheckpointError(f"{where}: a file name cannot contain a NUL byte")
    if os.path.isabs(name):
        raise CheckpointError(f"{where}: is an absolute path; shard files must be relative to {root}")
    if name == os.curdir or name.split(os.sep)[0] == os.pardir:  # name is normalized: ".." leads or is gone
        raise CheckpointError(f"{where}: resolves outside the checkpoint directory {root}")
    path = root / name
    try:
        base = root.resolve(strict=True)
        parent = path.parent.resolve()
        if not parent.is_relative_to(base):
            raise CheckpointError(f"{where}: its folder resolves to {parent}, outside the checkpoint directory "
                                  f"{base} (a symlinked directory)")
        exists, regular = path.exists(), path.is_file()
        target = path.resolve(strict=True) if regular else None
    except (OSError, RuntimeError) as e:  # a name too long, a symlink loop, ...
        raise CheckpointError(f"{where}: cannot resolve {path} ({type(e).__name__}: {str(e)[:200]})") from None
    if not exists:
        raise FileNotFoundError(f"{path} is listed in {INDEX_FILE} but missing")
    if not regular:
        raise CheckpointError(f"{where}: {path} is not a regular file")
    blobs = base.parent.parent / "blobs" if base.parent.name == "snapshots" else None
    if not (target.is_relative_to(base) or (blobs is not None and target.is_relative_to(blobs))):
        raise CheckpointError(f"{where}: {path} is a symlink to {target}, outside the checkpoint directory {base}")
    return path


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, tensor_parallel=None,
                 quantization: Quantization | None = None) -> Decoder:
    """``config``'s model (this rank's part of one, with ``tensor_parallel``; its projections quantized by
    ``quantization``) with uninitialized weights on ``device`` (built on the meta device: no init cost)."""
    with torch.device("meta"):
        model = build(config, dtype, tensor_parallel, quantization)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_buffers()
    model.requires_grad_(False)
    return model.eval()


def _read_safetensors(shards: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) of every tensor of the checked shard files, one shard open at a time."""
    import safetensors

    for shard in shards:
        try:
            with safetensors.safe_open(str(shard), framework="pt", device=safetensors_device(device)) as f:
                names = list(f.keys())
                for name in names:
                    try:
                        tensor = f.get_tensor(name)
                    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as e:
                        raise CheckpointError(f"{shard}: tensor {name} cannot be read ({type(e).__name__}: "
                                              f"{str(e)[:200]})") from None
                    yield name, tensor, str(shard)
        except (safetensors.SafetensorError, OSError) as e:  # a truncated or corrupt file
            raise CheckpointError(f"{shard}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from None
