"""The networks and their weights: the Llama-family decoder (Llama 2/3/3.1, Qwen2, Mistral), its config and
RoPE, model arguments and what they resolve to (a known name such as ``smollm2``, a GGUF file, a folder, a
hub repo id in the local cache), checkpoint loading (safetensors, GGUF, transformers models), tokenizers and
chat templates, tensor-parallel loading, EAGLE drafters, Medusa heads. An :class:`~treedec.engine.Engine`
runs them."""
from treedec.models.catalog import KNOWN_MODELS, ResolvedModel, model_form, resolve_model
from treedec.models.config import MODEL_SIZES, ModelConfig, RopeScaling
from treedec.models.llama import Llama
from treedec.models.loading import (CheckpointError, checkpoint_shards, from_config, from_hf_model, from_pretrained,
                                    to_hf_config, to_hf_state_dict)
from treedec.models.medusa import MedusaHeads, load_medusa_heads
from treedec.models.tensor_parallel import TensorParallel, init_tensor_parallel
from treedec.models.text import IncrementalDetokenizer, encode_prompt, load_tokenizer

__all__ = ["KNOWN_MODELS", "MODEL_SIZES", "CheckpointError", "IncrementalDetokenizer", "Llama", "MedusaHeads",
           "ModelConfig", "ResolvedModel", "RopeScaling", "TensorParallel", "checkpoint_shards", "encode_prompt",
           "from_config", "from_hf_model", "from_pretrained", "init_tensor_parallel", "load_medusa_heads",
           "load_tokenizer", "model_form", "resolve_model", "to_hf_config", "to_hf_state_dict"]
