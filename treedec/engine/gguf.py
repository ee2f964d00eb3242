"""GGUF checkpoints (llama.cpp's format) as Hugging Face checkpoint folders that :func:`from_pretrained` reads.

    from treedec.engine.gguf import convert_gguf
    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/smollm2")   # config, safetensors, tokenizer
    model = from_pretrained(folder)

transformers reads GGUF (with the ``gguf`` package): the config, the tokenizer (and its chat
template) and the tensors, de-quantized to float32. It builds the model through ``accelerate``
when asked for a model; here the tensors are read into a model made from the config instead,
so nothing beyond transformers and ``gguf`` is needed. The result is a float32 checkpoint:
both treedec and transformers then read the same de-quantized tensors.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["convert_gguf"]


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write ``gguf_file``'s model as a Hugging Face checkpoint folder ``out_dir`` (config.json,
    model.safetensors, generation_config.json, the tokenizer files); returns ``out_dir``.

    Raises
    ------
    FileNotFoundError : no such file.
    ImportError : the ``gguf`` package is missing (``pip install gguf``).
    ValueError : the file's model is not one transformers reads from GGUF, or its tensors do not fit it.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    if importlib.util.find_spec("gguf") is None:   # transformers reads GGUF through it
        raise ImportError("reading GGUF needs the gguf package: pip install gguf")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    settings = dict(load_gguf_checkpoint(str(gguf_file), return_tensors=False)["config"])
    model_type = settings.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except ValueError as e:
        raise ValueError(f"{gguf_file.name}: its model type {model_type!r} is not one transformers builds: {e}") from None
    with torch.device("meta"):   # only names and shapes, for the GGUF-to-transformers tensor names
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{gguf_file.name}: tensors do not fit the {model_type} model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(out_dir)
    return out_dir
