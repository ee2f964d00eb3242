"""Tensor parallelism of fp8 weights on the CPU: two gloo ranks load FP8 checkpoints (per-channel scales cut with
their rows, per-tensor scales whole on every rank, Phi-3's fused qkv_proj / gate_up_proj with one scale per
fused tensor, an ignored layer in bf16) and quantize on load; TP=2 == TP=1 of the same checkpoint.

Tolerance: fp32 activations over de-quantized weights, so TP=2 only regroups the sums of o_proj and down_proj
(1e-5 of the largest logit, as the float TP tests). Quantize-on-load is exact too: a row-parallel layer's rows
are scaled over each rank's columns, which differs from TP=1's scales, so it is compared within 0.1 (the fp8
rounding of two scalings; seen ~0.02) and its column-parallel layers' scales bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.tp_spawn import spawn_ranks
from treedec.models import ModelConfig

WORLD = 2
TOL = 1e-5
CASES = {   # name: (config, checkpoint format, weight strategy, activations)
    "llama-ct-channel": (ModelConfig.from_name("tiny", vocab_size=509, qkv_bias=True, o_bias=True),
                         "compressed-tensors", "channel", "dynamic"),
    "llama-fp8-tensor": (ModelConfig.from_name("tiny", vocab_size=509), "fp8", "tensor", "static"),
    "phi3-ct-tensor": (ModelConfig.from_name("phi3-mini-4k", vocab_size=509, hidden_size=128, intermediate_size=256,
                                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                             max_position=512, sliding_window=None),
                       "compressed-tensors", "tensor", "none"),
}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from tests.models.families import DenseAttend
        from tests.models.fp8_checkpoints import write_checkpoints
        from treedec.models import TensorParallel, from_config, from_pretrained, to_hf_config, to_hf_state_dict

        tp = TensorParallel()
        tokens = torch.randint(0, 509, (11,), generator=torch.Generator().manual_seed(1))

        def logits(model):
            return model(tokens, torch.arange(len(tokens)), DenseAttend(model.attention_variants())).logits.float()

        def rel(a, b):
            return float((a - b).abs().max() / b.abs().max())

        results = {}
        f32 = dict(dtype=torch.float32, device="cpu")
        for name, (config, fmt, strategy, activations) in CASES.items():
            root = Path(out) / name
            if rank == 0:
                full = from_config(config, seed=3, std=0.1, **f32)
                state = {k: v.contiguous().clone() for k, v in to_hf_state_dict(full).items()}
                write_checkpoints(state, to_hf_config(config).to_dict(), root, fmt, strategy, activations)
                (root / "float").mkdir()
                to_hf_config(config).save_pretrained(root / "float")
                from safetensors.torch import save_file
                save_file(state, str(root / "float" / "model.safetensors"))
            tp.gather_objects(None)   # the checkpoints are written
            whole = from_pretrained(root / "fp8", **f32)
            split = from_pretrained(root / "fp8", tensor_parallel=tp, **f32)
            q_whole = from_pretrained(root / "float", quantization="fp8", **f32)
            q_split = from_pretrained(root / "float", quantization="fp8", tensor_parallel=tp, **f32)
            c = split.config
            rows = slice(tp.rank * c.num_heads * c.head_dim, (tp.rank + 1) * c.num_heads * c.head_dim)
            results[name] = {"checkpoint": rel(logits(split), logits(whole)),
                             "quantized": rel(logits(q_split), logits(q_whole)),
                             "q_scales_equal": bool(torch.equal(q_split.layers[0].qkv_proj.weight_scale[:rows.stop - rows.start],
                                                                q_whole.layers[0].qkv_proj.weight_scale[rows])),
                             "paths": split.linear_paths(), "scale_rows": tuple(split.layers[0].qkv_proj.weight_scale.shape)}
            tp.check_replicated(logits(split), f"{name}'s logits")
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, tmp_path_factory.mktemp("tp_fp8"), WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_fp8_equals_tp1(ranks, case):
    config = CASES[case][0]
    for r in ranks:
        result = r[case]
        assert result["checkpoint"] < TOL, result
        assert result["quantized"] < 0.1 and result["q_scales_equal"], result
        assert result["scale_rows"] == ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim // WORLD,)
        assert sum(result["paths"].values()) == 4 * config.num_layers   # (the vocab-parallel head is no Linear)
