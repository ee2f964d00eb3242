"""Tensor parallelism for every family on the CPU: two gloo ranks split a tiny random model of each family (and
load a checkpoint written from it, Phi-3's fused qkv_proj / gate_up_proj cut in their parts); TP=2 == TP=1.

The families here: llama, qwen3, gemma2, gemma3, phi3 (the registry's test checks each is named here). Each
rank runs the forward over one sequence with each layer's attention variant (tests/models/families.py), its
own heads only: attention is head-local, the sums of o_proj / down_proj and the vocabulary are the collectives.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.tp_spawn import spawn_ranks
from treedec.models import ModelConfig

WORLD = 2
TOL = 1e-5   # fp32: TP=2 only regroups the sums of o_proj and down_proj

_SMALL = dict(vocab_size=509, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
              head_dim=64, max_position=512)
CONFIGS = {
    "llama": ModelConfig.from_name("tiny", vocab_size=509, qkv_bias=True, o_bias=True, mlp_bias=True),
    "qwen3": ModelConfig.from_name("qwen3-8b", **_SMALL, sliding_window=6, layer_types=("full",) * 2 + ("sliding",) * 2),
    "gemma2": ModelConfig.from_name("gemma2-9b", **_SMALL, sliding_window=5, layer_types=("sliding", "full") * 2,
                                    query_pre_attn_scalar=48.0, attn_logit_softcap=3.0, final_logit_softcap=5.0),
    "gemma3": ModelConfig.from_name("gemma3-270m", **_SMALL, sliding_window=5, query_pre_attn_scalar=48.0,
                                    layer_types=("sliding", "sliding", "full", "sliding"),
                                    rope_scaling=ModelConfig.from_name("gemma3-4b").rope_scaling),
    "phi3": ModelConfig.from_name("phi3-mini-4k", **_SMALL, sliding_window=7),
}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from tests.models.families import DenseAttend
        from treedec.models import TensorParallel, from_config, from_pretrained, to_hf_config, to_hf_state_dict
        from safetensors.torch import save_file

        tp = TensorParallel()
        tokens = torch.randint(0, 509, (11,), generator=torch.Generator().manual_seed(1))
        results = {}
        for name, config in CONFIGS.items():
            f32 = dict(dtype=torch.float32, device="cpu")
            full = from_config(config, seed=3, std=0.1, **f32)
            split = from_config(config, seed=3, std=0.1, tensor_parallel=tp, **f32)
            ckpt = Path(out) / name
            if rank == 0:
                ckpt.mkdir()
                save_file({k: v.contiguous().clone() for k, v in to_hf_state_dict(full).items()},
                          str(ckpt / "model.safetensors"))
                to_hf_config(config).save_pretrained(ckpt)
            tp.gather_objects(None)   # the checkpoint is written
            loaded = from_pretrained(ckpt, tensor_parallel=tp, **f32)

            def logits(model):
                return model(tokens, torch.arange(len(tokens)), DenseAttend(model.attention_variants())).logits

            reference = logits(full)
            results[name] = {"shard_heads": split.config.num_heads,
                             "random": float((logits(split) - reference).abs().max() / reference.abs().max()),
                             "checkpoint": float((logits(loaded) - reference).abs().max() / reference.abs().max())}
            tp.check_replicated(logits(loaded), f"{name}'s logits")
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, tmp_path_factory.mktemp("tp_families"), WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CONFIGS))
def test_tp2_equals_tp1(ranks, family):
    for r in ranks:
        result = r[family]
        assert result["shard_heads"] == 2
        assert result["random"] < TOL and result["checkpoint"] < TOL, result
