"""AttentionVariant: its one definition of the semantics (scale, soft-cap, window), the values the kernels and the
custom op get from it, and its checks."""
import math

import numpy as np
import pytest
import torch

from treedec.attention import AttentionVariant
from treedec.attention.variant import LogitArgs


@pytest.mark.parametrize("kwargs,match", [
    ({"sm_scale": float("nan")}, "sm_scale must be a finite number > 0 or None, got nan"),
    ({"sm_scale": float("inf")}, "sm_scale must be a finite number > 0 or None, got inf"),
    ({"sm_scale": -0.1}, "sm_scale must be a finite number > 0 or None, got -0.1"),
    ({"sm_scale": "0.1"}, "sm_scale must be a finite number > 0 or None, got '0.1'"),
    ({"sm_scale": True}, "sm_scale must be a finite number > 0 or None, got True"),
    ({"logit_softcap": 0.0}, "logit_softcap must be a finite number > 0 or None, got 0.0"),
    ({"window": 0}, "window must be an int >= 1 or None, got 0"),
    ({"window": 4.0}, "window must be an int >= 1 or None, got 4.0"),
    ({"window": np.int64(4)}, "window must be an int >= 1 or None"),
])
def test_bad_fields_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionVariant(**kwargs)


def test_scale_defaults_to_one_over_sqrt_head_dim():
    assert AttentionVariant().scale(128) == 1 / math.sqrt(128)
    assert AttentionVariant(sm_scale=0.25).scale(128) == 0.25
    assert AttentionVariant(sm_scale=1).sm_scale == 1.0 and type(AttentionVariant(sm_scale=1).sm_scale) is float


@pytest.mark.parametrize("window", [None, 1, 3, 50])
def test_visible_is_causal_within_the_window(window):
    variant = AttentionVariant(window=window)
    q = torch.arange(12)
    k = torch.arange(12)
    seen = variant.visible(q, k)
    for i in range(12):
        for j in range(12):
            expect = j <= i and (window is None or i - j < window)   # transformers: q_idx - kv_idx < window
            assert bool(seen[i, j]) == expect, (i, j)
    # numpy positions too (the planners' type), and the bound the planners clip at
    assert (variant.visible(np.arange(12), np.arange(12)) == seen.numpy()).all()
    first = variant.first_visible(np.arange(12))
    assert first.dtype == np.int64 and (first == (np.zeros(12) if window is None
                                                  else np.maximum(np.arange(12) - window + 1, 0))).all()


def test_logits_hook_is_the_soft_cap():
    scores = torch.linspace(-500, 500, 101)
    assert AttentionVariant().logits(scores) is scores
    capped = AttentionVariant(logit_softcap=50.0).logits(scores)
    assert torch.allclose(capped, 50.0 * torch.tanh(scores / 50.0)) and capped.abs().max() <= 50.0


@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(sm_scale=0.3),
                                     AttentionVariant(logit_softcap=30.0), AttentionVariant(sm_scale=0.06, logit_softcap=50.0)])
def test_logit_args_give_the_hooks_in_base_two(variant):
    """What the kernels compute from LogitArgs (``t * scale_log2`` with ``t = tanh(s * softcap_scale)`` where the
    soft-cap is on) is the variant's logit in base 2."""
    s = torch.linspace(-40, 40, 81, dtype=torch.float64)
    args = variant.logit_args(64)
    assert isinstance(args, LogitArgs)
    t = torch.tanh(s * args.softcap_scale) if args.softcap_scale > 0 else s
    expect = variant.logits(s * variant.scale(64)) / math.log(2)
    assert torch.allclose(t * args.scale_log2, expect, rtol=1e-12, atol=1e-12)
    assert (args.softcap_scale > 0) == ("softcap" in variant.kernel_key())


def test_kernel_and_mask_keys_split_the_fields():
    assert AttentionVariant().kernel_key() == () == AttentionVariant(sm_scale=0.1, window=7).kernel_key()
    assert AttentionVariant(logit_softcap=20.0, window=7).kernel_key() == ("softcap",)
    assert AttentionVariant(window=7).mask_key() == (7,) == AttentionVariant(logit_softcap=2.0, window=7).mask_key()
    assert AttentionVariant().mask_key() == (None,)


@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(sm_scale=0.2, logit_softcap=30.0, window=512),
                                     AttentionVariant(window=4096), AttentionVariant(window=64, kv_dtype="fp8")])
def test_op_values_round_trip(variant):
    values = variant.op_values()
    assert all(type(v) is float for v in values)
    assert AttentionVariant.from_op_values(values) == variant
    with pytest.raises(ValueError, match="AttentionVariant takes 4 values"):
        AttentionVariant.from_op_values(values[:2])
