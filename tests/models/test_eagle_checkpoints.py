"""load_eagle on bad checkpoints: config files, tensor dtypes, the d2t/t2d mapping and damaged weight files each
give a CheckpointError naming the file, the key or tensor, the expected and the actual value."""
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from treedec.models import ModelConfig, from_config
from treedec.models.eagle_drafter import EagleDrafter, load_eagle, save_eagle
from treedec.models.loading import CheckpointError, read_state_dict

SIX_LAYERS = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=6)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def target():
    return from_config(SIX_LAYERS, seed=3, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """EAGLE-1 (pytorch_model.bin) and EAGLE-3 (model.safetensors) checkpoints (read-only: tests copy them)."""
    base = tmp_path_factory.mktemp("eagle_checkpoints")
    save_eagle(EagleDrafter.random(target, "eagle", seed=1), base / "eagle")
    save_eagle(EagleDrafter.random(target, "eagle3", seed=1, draft_vocab_size=100), base / "eagle3")
    return base


def copy_of(saved, tmp_path, kind):
    folder = tmp_path / kind
    shutil.copytree(saved / kind, folder)
    weights = folder / ("pytorch_model.bin" if kind == "eagle" else "model.safetensors")
    return folder, weights


def write_state(weights, state):
    if weights.suffix == ".safetensors":
        save_file(state, str(weights))
    else:
        torch.save(state, weights)


# ================================================================ config.json


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "the top level must be a JSON object, got list"),
    ('"config"', "the top level must be a JSON object, got str"),
    ("null", "the top level must be a JSON object, got NoneType"),
])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_config_that_is_not_a_json_object_is_named(saved, tmp_path, target, kind, text, message):
    folder, _ = copy_of(saved, tmp_path, kind)
    config = folder / "config.json"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=message) as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{config}: ")


BAD_FIELDS = [
    ({"hidden_size": "abc"}, "field 'hidden_size' must be a positive int, got str 'abc'"),
    ({"hidden_size": [128]}, "field 'hidden_size' must be a positive int, got list"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' must be a positive int, got int 0"),
    ({"num_key_value_heads": 3}, "must be a multiple of field 'num_key_value_heads' \\(3\\)"),
    ({"intermediate_size": -256}, "field 'intermediate_size' must be a positive int, got int -256"),
    ({"num_hidden_layers": "1"}, "field 'num_hidden_layers' must be a positive int, got str '1'"),
    ({"rms_norm_eps": -1e-6}, "field 'rms_norm_eps' must be a finite number > 0, got float -1e-06"),
    ({"rms_norm_eps": NAN}, "field 'rms_norm_eps' must be a finite number > 0, got float nan"),
    ({"rms_norm_eps": "tiny"}, "field 'rms_norm_eps' must be a finite number > 0, got str 'tiny'"),
    ({"rms_norm_eps": True}, "field 'rms_norm_eps' must be a finite number > 0, got bool True"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     "field 'rope_parameters.rope_theta' must be a finite number > 0, got float 0.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "'rope_parameters.rope_theta' .* -5.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": NAN}}, "'rope_parameters.rope_theta' .* nan"),
    ({"rope_parameters": None, "rope_theta": -1.0}, "field 'rope_theta' must be a finite number > 0, got float -1.0"),
    ({"draft_vocab_size": "100"}, "field 'draft_vocab_size' must be a positive int, got str '100'"),
    ({"draft_vocab_size": 0}, "field 'draft_vocab_size' must be a positive int, got int 0"),
    ({"draft_vocab_size": 2.5}, "field 'draft_vocab_size' must be a positive int, got float 2.5"),
    ({"draft_vocab_size": 10 ** 9}, "field 'draft_vocab_size' \\(1000000000\\) must be at most the target's "
                                    "vocabulary \\(512\\)"),
    ({"eagle_config": [1, 2]}, "field 'eagle_config' must be an object or null, got list"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2,3"}},
     "field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a list of 3 distinct layer ids in \\[-1, 4\\], "
     "got str '1,2,3'"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "list of 3 distinct layer ids .* got list"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1.5, 2, 3]}},
     "list of 3 distinct layer ids .* got list \\[1.5, 2, 3\\]"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["a", 2, 3]}}, "list of 3 distinct layer ids"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 100]}},
     "list of 3 distinct layer ids .* got list \\[1, 2, 100\\]"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}, "list of 3 distinct layer ids"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [True, 2, 3]}}, "list of 3 distinct layer ids"),
]


EAGLE1_BAD_FIELDS = [
    ({"bias": "yes"}, "field 'bias' must be true or false, got str 'yes'"),
    ({"bias": 0}, "field 'bias' must be true or false, got int 0"),
    ({"rms_norm_eps": INF}, "field 'rms_norm_eps' must be a finite number > 0, got float inf"),
    ({"head_dim": 63}, "field 'head_dim' must be even"),
]


@pytest.mark.parametrize("kind, changes, message",
                         [("eagle3", c, m) for c, m in BAD_FIELDS] + [("eagle", c, m) for c, m in EAGLE1_BAD_FIELDS],
                         ids=[f"eagle3-{c}" for c, _ in BAD_FIELDS] + [f"eagle-{c}" for c, _ in EAGLE1_BAD_FIELDS])
def test_bad_config_fields_are_named(saved, tmp_path, target, kind, changes, message):
    folder, _ = copy_of(saved, tmp_path, kind)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))
    with pytest.raises(CheckpointError, match=message) as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{config}: ")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("changes", [{"hidden_size": 2 ** 40}, {"head_dim": 2 ** 40}, {"intermediate_size": 2 ** 40},
                                     {"num_attention_heads": 2 ** 30, "num_key_value_heads": 2 ** 30,
                                      "hidden_size": 2 ** 36}])
def test_a_config_larger_than_its_weights_allocates_nothing(saved, tmp_path, target, monkeypatch, kind, changes):
    """Sizes of a terabyte: the drafter is laid out on the meta device (norms and RoPE included), and the
    checkpoint's tensors refuse it."""
    import treedec.models.eagle_drafter as eagle

    def rope_on_meta_only(config, device=None):
        assert str(device) == "meta", f"RoPE frequencies of head dim {config.head_dim} made on {device}"
        return real_rope(config, device)

    real_rope = eagle.rope_inv_freq
    monkeypatch.setattr(eagle, "rope_inv_freq", rope_on_meta_only)
    folder, weights = copy_of(saved, tmp_path, kind)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))
    with pytest.raises(CheckpointError, match="has shape .*, expected|needs its own embed_tokens|"
                                             "EAGLE-1 drafter's hidden size .* must be the target's") as e:
        load_eagle(folder, target)
    assert str(e.value).startswith((f"{weights}: ", f"{config}: ")), e.value


def test_kind_argument_is_checked(saved, target):
    with pytest.raises(ValueError, match="kind must be one of \\('eagle', 'eagle3'\\) or None, got 'eagle2'"):
        load_eagle(saved / "eagle", target, "eagle2")


# ================================================================ tensors


@pytest.mark.parametrize("kind, name, dtype", [
    ("eagle", "fc.weight", torch.int64), ("eagle", "layers.0.self_attn.q_proj.weight", torch.bool),
    ("eagle", "fc.bias", torch.int32), ("eagle", "layers.0.post_attention_layernorm.weight", torch.float64),
    ("eagle3", "fc.weight", torch.int64), ("eagle3", "midlayer.mlp.down_proj.weight", torch.bool),
    ("eagle3", "norm.weight", torch.uint8), ("eagle3", "lm_head.weight", torch.float64),
    ("eagle3", "midlayer.hidden_norm.weight", torch.int8),
])
def test_weights_of_a_non_float_dtype_are_named(saved, tmp_path, target, kind, name, dtype):
    folder, weights = copy_of(saved, tmp_path, kind)
    state = read_state_dict(weights)
    write_state(weights, {**state, name: state[name].to(dtype)})
    with pytest.raises(CheckpointError, match=f"{weights}: '{name}' has dtype {dtype}, expected one of "
                                              "\\[torch.float32, torch.float16, torch.bfloat16\\]"):
        load_eagle(folder, target)


@pytest.mark.parametrize("name, make, message", [
    ("d2t", lambda s: s["d2t"].float(), "'d2t' has dtype torch.float32, expected an integer dtype"),
    ("d2t", lambda s: s["d2t"].double(), "'d2t' has dtype torch.float64, expected an integer dtype"),
    ("d2t", lambda s: s["d2t"].bool(), "'d2t' has dtype torch.bool, expected an integer dtype"),
    ("t2d", lambda s: s["t2d"].to(torch.int64), "'t2d' has dtype torch.int64, expected torch.bool"),
    ("t2d", lambda s: s["t2d"].float(), "'t2d' has dtype torch.float32, expected torch.bool"),
    ("d2t", lambda s: s["d2t"][:50].contiguous(), "'d2t' has shape \\[50\\], expected \\[100\\]"),
    ("d2t", lambda s: s["d2t"] - 10 ** 6, "'d2t' and 't2d' disagree"),
    ("d2t", lambda s: s["d2t"] + 10 ** 6, "'d2t' and 't2d' disagree"),
])
def test_bad_draft_vocabulary_maps_are_named(saved, tmp_path, target, name, make, message):
    folder, weights = copy_of(saved, tmp_path, "eagle3")
    state = read_state_dict(weights)
    write_state(weights, {**state, name: make(state)})
    with pytest.raises(CheckpointError, match=message) as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{weights}: ")


@pytest.mark.parametrize("first, second", [(0, 1), (10, 99), (98, 99)])
def test_a_duplicated_d2t_target_is_named(saved, tmp_path, target, first, second):
    """Two draft ids on one target id: some target id t2d marks is then never drafted."""
    folder, weights = copy_of(saved, tmp_path, "eagle3")
    state = read_state_dict(weights)
    target_ids = state["d2t"] + torch.arange(100)
    d2t = state["d2t"].clone()
    d2t[second] = target_ids[first] - second
    write_state(weights, {**state, "d2t": d2t})
    with pytest.raises(CheckpointError, match=f"{weights}: 'd2t' maps draft ids {first} and {second} both to "
                                              f"target id {int(target_ids[first])}"):
        load_eagle(folder, target)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("keep", [0, 5, 40, 300, 0.5, -50, -1])
def test_truncated_weight_files_are_named(saved, tmp_path, target, kind, keep):
    folder, weights = copy_of(saved, tmp_path, kind)
    data = weights.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep if keep >= 0 else len(data) + keep
    weights.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="could not be read|not a readable") as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{weights}"), e.value


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("content", [b"not a checkpoint at all", b"PK\x03\x04" + b"\0" * 100, b"\0" * 4096])
def test_weight_files_that_are_not_checkpoints_are_named(saved, tmp_path, target, kind, content):
    folder, weights = copy_of(saved, tmp_path, kind)
    weights.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{weights}"), e.value


@pytest.mark.parametrize("state, message", [
    ({"fc.weight": 1}, "does not hold a state dict of tensors"),
    ([torch.zeros(2)], "does not hold a state dict of tensors"),
    ({3: torch.zeros(2)}, "does not hold a state dict of tensors"),
])
def test_bin_files_of_other_objects_are_named(saved, tmp_path, target, state, message):
    folder, weights = copy_of(saved, tmp_path, "eagle")
    torch.save(state, weights)
    with pytest.raises(CheckpointError, match=message) as e:
        load_eagle(folder, target)
    assert str(e.value).startswith(f"{weights}"), e.value


def test_a_good_checkpoint_still_loads(saved, target):
    for kind in ("eagle", "eagle3"):
        drafter = load_eagle(saved / kind, target)
        assert drafter.kind == kind and all(torch.isfinite(p).all() for p in drafter.parameters())
        assert torch.isfinite(drafter.inv_freq).all()
