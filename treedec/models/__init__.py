"""The networks and their weights: the model seam (:class:`DecoderModel`, what the engine uses), the families
treedec runs (:mod:`~treedec.models.registry`: Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3),
each a :class:`Decoder` of shared layers with one weight map; their config and RoPE; model arguments and what
they resolve to (a known name such as ``smollm2`` or ``gemma3-270m``, a GGUF file, a folder, a hub repo id in the
local cache), checkpoint loading (safetensors, GGUF, transformers models), tokenizers and chat templates,
tensor-parallel loading, every projection a :class:`Linear` with its quantization method (fp8 weights:
:mod:`~treedec.models.fp8`, :class:`Quantization`), EAGLE drafters, Medusa heads. An :class:`~treedec.engine.Engine`
runs them."""
from treedec.models.base import DecoderModel, ForwardOutput
from treedec.models.catalog import KNOWN_MODELS, ResolvedModel, model_form, resolve_model
from treedec.models.config import MODEL_SIZES, ModelConfig, RopeScaling
from treedec.models.decoder import Decoder
from treedec.models.linear import Linear
from treedec.models.loading import (CheckpointError, checkpoint_shards, from_config, from_hf_model, from_pretrained,
                                    to_hf_state_dict)
from treedec.models.medusa import MedusaHeads, load_medusa_heads
from treedec.models.quantization import Quantization
from treedec.models.registry import FAMILIES, config_from_hf, to_hf_config
from treedec.models.tensor_parallel import TensorParallel, init_tensor_parallel
from treedec.models.text import IncrementalDetokenizer, encode_prompt, load_tokenizer

__all__ = ["FAMILIES", "KNOWN_MODELS", "MODEL_SIZES", "CheckpointError", "Decoder", "DecoderModel", "ForwardOutput",
           "IncrementalDetokenizer", "Linear", "MedusaHeads", "ModelConfig", "Quantization", "ResolvedModel",
           "RopeScaling", "TensorParallel",
           "checkpoint_shards", "config_from_hf", "encode_prompt", "from_config", "from_hf_model", "from_pretrained",
           "init_tensor_parallel", "load_medusa_heads", "load_tokenizer", "model_form", "resolve_model",
           "to_hf_config", "to_hf_state_dict"]
