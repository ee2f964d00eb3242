"""models/linear.py: the unquantized Linear is nn.Linear bit for bit (weights, init, outputs); its modes and shards
are checked by name."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from treedec.models import from_config
from treedec.models.linear import MODES, UNQUANTIZED, Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_unquantized_is_nn_linear_bit_for_bit(dtype, bias):
    """Same seed -> the same initial weights (nn.Linear's init, same draws); the same outputs, bit for bit."""
    torch.manual_seed(3)
    ref = nn.Linear(48, 40, bias=bias, dtype=dtype)
    torch.manual_seed(3)
    ours = Linear(48, 40, bias, dtype)
    assert torch.equal(ours.weight, ref.weight) and ours.weight.dtype == dtype
    assert (ours.bias is None) == (not bias) and (not bias or torch.equal(ours.bias, ref.bias))
    x = torch.randn(7, 3, 48, dtype=dtype)
    assert torch.equal(ours(x), ref(x))
    assert ours.state_dict().keys() == ref.state_dict().keys()   # the names checkpoints and to_hf read


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_f_linear_without_a_group(mode):
    layer = Linear(16, 24, True, torch.float32, mode=mode, shards=(8, 8, 8))
    x = torch.randn(5, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.tp is None and layer.method is UNQUANTIZED


def test_bad_modes_and_shards_are_named():
    with pytest.raises(ValueError, match="mode must be one of \\('replicated', 'column', 'row'\\), got 'diagonal'"):
        Linear(4, 4, mode="diagonal")
    with pytest.raises(ValueError, match="shards \\(2, 3\\) must sum to out_features \\(4\\)"):
        Linear(4, 4, shards=(2, 3))


def test_decoder_projections_are_linears_with_their_shards():
    """qkv / gate_up are column-parallel with their fused shards, o / down row-parallel; a loaded model says its
    compute path (every unquantized projection: F.linear)."""
    model = from_config("tiny", dtype=torch.float32, device="cpu")
    c, layer = model.config, model.layers[0]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    assert (layer.qkv_proj.mode, layer.qkv_proj.shards) == ("column", (q, kv, kv))
    assert (layer.gate_up_proj.mode, layer.gate_up_proj.shards) == ("column", (c.intermediate_size,) * 2)
    assert layer.o_proj.mode == layer.down_proj.mode == "replicated"   # row-parallel in a group of one
    assert model.linear_paths() == {"F.linear": 4 * c.num_layers + 1}
