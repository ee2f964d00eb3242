"""Model runner: Llama-family decoders on treedec's tree attention."""
from treedec.engine.config import MODEL_SIZES, ModelConfig, RopeScaling
from treedec.engine.cuda_graphs import CudaGraphConfig
from treedec.engine.engine import Engine, greedy
from treedec.engine.llama import Llama
from treedec.engine.loading import (CheckpointError, checkpoint_shards, from_config, from_hf_model, from_pretrained,
                                    to_hf_config, to_hf_state_dict)
from treedec.engine.step_chain import ChainContext, ChainStep, StepChain
from treedec.engine.step_output import PrefillOutput, StepOutput
from treedec.engine.tensor_parallel import TensorParallel, init_tensor_parallel
from treedec.engine.text import IncrementalDetokenizer, encode_prompt, load_tokenizer

__all__ = ["MODEL_SIZES", "CheckpointError", "CudaGraphConfig", "Engine", "Llama", "ModelConfig", "PrefillOutput",
           "RopeScaling", "StepOutput", "ChainContext", "ChainStep", "StepChain", "checkpoint_shards", "from_config", "from_hf_model", "from_pretrained", "greedy",
           "to_hf_config", "to_hf_state_dict", "IncrementalDetokenizer", "encode_prompt", "load_tokenizer",
           "TensorParallel", "init_tensor_parallel"]
