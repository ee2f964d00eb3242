"""Loading the decoder: saved HF checkpoints (single file, sharded), in-memory models, random weights."""
import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from tests.models.test_llama import hf_logits, tiny_hf
from treedec.engine import Engine
from treedec.models import (MODEL_SIZES, ModelConfig, config_from_hf, from_config, from_hf_model, from_pretrained,
                            to_hf_config, to_hf_state_dict)
from treedec.models.loading import CheckpointError, checkpoint_shards
from treedec.programs.speculative.drafts import PromptLookupDraft
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate


def run_steps(model) -> list[torch.Tensor]:
    """Prefill + a branching step; all logits."""
    engine = Engine(model, kv_tokens=256, page_size=4, backend="torch")
    root = engine.prefill([5, 9, 2, 7, 1, 3])
    engine.tree.branch(root.node, [[4], [8, 6]])
    return [root.logits, engine.step().logits]


@pytest.mark.parametrize("kind,shard", [("llama", None), ("llama", "200KB"), ("qwen2", "200KB")])
def test_from_pretrained_equals_in_memory_model(tmp_path, kind, shard):
    hf = tiny_hf(kind, seed=7)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    loaded = from_pretrained(tmp_path, device="cpu")
    assert loaded.dtype == torch.float32 and loaded.config == config_from_hf(hf.config)
    for a, b in zip(run_steps(loaded), run_steps(from_hf_model(hf))):
        assert torch.equal(a, b)
    torch.testing.assert_close(run_steps(loaded)[0], hf_logits(hf, [5, 9, 2, 7, 1, 3]), atol=1e-4, rtol=0)


def test_from_pretrained_dtype_and_tied_head(tmp_path):
    hf = tiny_hf("qwen2", seed=8)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.weight_bytes() == 2 * model.config.num_parameters()


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        from_pretrained("meta-llama/Llama-3.1-8B")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path)


def test_checkpoint_problems_are_named(tmp_path):
    hf = tiny_hf("llama", seed=9)
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)

    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: the checkpoint lacks 1 tensor.*layers.1.mlp.up_proj"):
        from_pretrained(tmp_path, device="cpu")
    save_file({**state, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, weights)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: .*does not use.*extra"):
        from_pretrained(tmp_path, device="cpu")
    save_file({**state, "model.norm.weight": torch.zeros(3)}, weights)
    with pytest.raises(CheckpointError, match=f"{weights}: checkpoint tensor model.norm.weight has shape "
                                              r"\(3,\), expected \(128,\)"):
        from_pretrained(tmp_path, device="cpu")
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        from_pretrained(tmp_path, device="cpu")


def test_unsupported_architecture(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        from_pretrained(tmp_path, device="cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt2"


def test_from_config_is_seeded():
    a = from_config("tiny", seed=3, dtype=torch.float32, device="cpu")
    b = from_config(MODEL_SIZES["tiny"], seed=3, dtype=torch.float32, device="cpu")
    c = from_config("tiny", seed=4, dtype=torch.float32, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.layers[0].qkv_proj.weight, c.layers[0].qkv_proj.weight)
    assert torch.all(a.norm.weight == 1)
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        from_config("huge")


def test_named_sizes():
    c = ModelConfig.from_name("llama3-8b")
    assert c.num_parameters() == 8_030_261_248   # Llama-3-8B: 16.06 GB in bf16
    assert ModelConfig.from_name("llama3.1-8b").rope_scaling.kind == "llama3"
    assert ModelConfig.from_name("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_name("tiny", num_kv_heads=3)


@pytest.mark.parametrize("name", ["tiny", "llama3.1-8b", "qwen2.5-7b", "mistral-7b", "llama2-7b"])
def test_hf_config_round_trip(name):
    config = ModelConfig.from_name(name)
    assert config_from_hf(to_hf_config(config)) == config


def test_transformers_model_sharing_treedec_weights():
    """to_hf_state_dict gives views: a transformers model built on them computes what treedec does."""
    model = from_config(ModelConfig.from_name("tiny", vocab_size=256), seed=2, dtype=torch.float32, device="cpu")
    hf_config = to_hf_config(model.config)
    hf_config._attn_implementation = "eager"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    hf.load_state_dict(to_hf_state_dict(model), assign=True, strict=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)   # its buffers were made on the meta device
    qkv, attn = model.layers[0].qkv_proj.weight, hf.model.layers[0].self_attn
    q_rows = model.config.num_heads * model.config.head_dim
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv[q_rows:].data_ptr()
    engine = Engine(model, kv_tokens=64, backend="torch")
    logits = engine.prefill([3, 1, 4, 1, 5]).logits
    torch.testing.assert_close(logits, hf_logits(hf.eval(), [3, 1, 4, 1, 5]), atol=1e-4, rtol=0)


# ================================================================ malformed checkpoints


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A tiny Llama saved in several shards (read-only: tests copy it)."""
    path = tmp_path_factory.mktemp("sharded")
    tiny_hf("llama", seed=10).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture
def checkpoint(tmp_path, sharded_checkpoint):
    """A fresh copy of the sharded checkpoint at tmp_path/ckpt, and a valid shard outside it."""
    root = tmp_path / "ckpt"
    shutil.copytree(sharded_checkpoint, root)
    shutil.copy(next(root.glob("*.safetensors")), tmp_path / "outside.safetensors")
    return root


@pytest.fixture
def opened(monkeypatch):
    """Every path safetensors is asked to open during the test."""
    paths = []
    real = safetensors.safe_open

    def recording_safe_open(path, *args, **kwargs):
        paths.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open)
    return paths


def set_shard(root, tensor, shard):
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][tensor] = shard
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("shard, message", [
    ("/etc/passwd", "is an absolute path"),
    ("{outside}", "is an absolute path"),
    ("../outside.safetensors", "resolves outside the checkpoint directory"),
    ("sub/../../outside.safetensors", "resolves outside the checkpoint directory"),
    ("linked_dir/outside.safetensors", "outside the checkpoint directory .* symlinked directory"),
    ("linked_file.safetensors", "is a symlink to .*outside.safetensors, outside the checkpoint directory"),
    ("sub", "is not a regular file"),
    (".", "resolves outside the checkpoint directory"),
    ("", "must be a non-empty shard file name"),
    ("a\0b.safetensors", "NUL byte"),
    (7, "must be a non-empty shard file name, got int 7"),
    (None, "must be a non-empty shard file name, got NoneType"),
    ("x" * 5000, "cannot resolve"),
])
def test_shard_paths_stay_inside_the_checkpoint(checkpoint, opened, shard, message):
    (checkpoint / "sub").mkdir()
    (checkpoint / "linked_dir").symlink_to(checkpoint.parent)
    (checkpoint / "linked_file.safetensors").symlink_to(checkpoint.parent / "outside.safetensors")
    if shard == "{outside}":
        shard = str(checkpoint.parent / "outside.safetensors")
    set_shard(checkpoint, "model.norm.weight", shard)
    with pytest.raises(CheckpointError, match=message) as e:
        from_pretrained(checkpoint, device="cpu")
    assert str(e.value).startswith(str(checkpoint / "model.safetensors.index.json"))
    assert opened == []   # refused before any shard is opened
    with pytest.raises(CheckpointError, match=message):
        checkpoint_shards(checkpoint)


def test_shard_names_are_normalized_and_missing_shards_named(checkpoint, opened):
    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    set_shard(checkpoint, "model.norm.weight", f"./sub/../{shard}")
    from_pretrained(checkpoint, device="cpu")
    # each shard once for its header (checked before the model is built), once for its tensors
    assert len(set(opened)) == len(list(checkpoint.glob("*.safetensors"))) and len(opened) == 2 * len(set(opened))
    assert all(p.parent == checkpoint for p in opened)
    set_shard(checkpoint, "model.norm.weight", "gone.safetensors")
    with pytest.raises(FileNotFoundError, match="gone.safetensors is listed in model.safetensors.index.json"):
        from_pretrained(checkpoint, device="cpu")


def test_hugging_face_cache_snapshot_symlinks_are_followed(tmp_path, sharded_checkpoint):
    """A hub cache snapshot holds symlinks to ../../blobs: those load, a symlink elsewhere does not."""
    repo = tmp_path / "models--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sharded_checkpoint.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob-{f.name}"))
    assert from_pretrained(snapshot, device="cpu").config.num_layers == 2
    shard = next(snapshot.glob("*.safetensors"))
    shutil.copy(repo / "blobs" / f"blob-{shard.name}", tmp_path / "elsewhere.safetensors")
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="is a symlink to .*elsewhere.safetensors, outside"):
        from_pretrained(snapshot, device="cpu")


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ("[1, 2]", "the top level must be a JSON object, got list"),
    ('{"metadata": {}}', "field 'weight_map' must be a non-empty object .* got NoneType"),
    ('{"weight_map": ["model.safetensors"]}', "field 'weight_map' must be a non-empty object .* got list"),
    ('{"weight_map": {}}', "field 'weight_map' must be a non-empty object"),
    ('{"weight_map": {"model.norm.weight": ["a.safetensors"]}}', r"weight_map\['model.norm.weight'\]' must be"),
    ('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}", "not valid JSON"),
    ('{"weight_map": {"a": 1' + "0" * 5000 + "}}", "not valid JSON"),
])
def test_malformed_index_is_named(checkpoint, text, message):
    index = checkpoint / "model.safetensors.index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=message) as e:
        from_pretrained(checkpoint, device="cpu")
    assert str(e.value).startswith(str(index))


@pytest.mark.parametrize("keep", [0, 7, 60, -1000, -1])
@pytest.mark.parametrize("sharded", [False, True])
def test_truncated_shard_is_named(tmp_path, sharded_checkpoint, keep, sharded):
    if sharded:
        shutil.copytree(sharded_checkpoint, tmp_path, dirs_exist_ok=True)
        shard = sorted(tmp_path.glob("*.safetensors"))[1]
    else:
        tiny_hf("llama", seed=10).save_pretrained(tmp_path)
        shard = tmp_path / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
        from_pretrained(tmp_path, device="cpu")
    assert str(e.value).startswith(str(shard))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.int64, torch.bool])
def test_tensor_of_an_unsupported_dtype_is_named(tmp_path, dtype):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    state["model.layers.1.self_attn.k_proj.weight"] = state["model.layers.1.self_attn.k_proj.weight"].to(dtype)
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=f"{weights}: tensor model.layers.1.self_attn.k_proj.weight has dtype "
                                              f"{dtype}, expected one of"):
        from_pretrained(tmp_path, device="cpu")


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "int8", "field 'dtype' must be one of"),
    ("dtype", "float64", "field 'dtype' must be one of"),
    ("dtype", "no_such_dtype", "field 'dtype' must be one of .* got 'no_such_dtype'"),
    ("dtype", 3, "field 'dtype' must be one of .* got 3"),
    ("torch_dtype", "Tensor", "field 'torch_dtype' must be one of"),
])
def test_unsupported_config_dtype_is_named(tmp_path, field, value, message):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    data = json.loads(config.read_text())
    data.pop("dtype", None)
    data.pop("torch_dtype", None)
    config.write_text(json.dumps({**data, field: value}))
    with pytest.raises(CheckpointError, match=message) as e:
        from_pretrained(tmp_path, device="cpu")
    assert str(e.value).startswith(str(config))
    if value in ("int8", "float64"):   # an explicit, supported dtype overrides the config's
        assert from_pretrained(tmp_path, dtype=torch.float32, device="cpu").dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of torch.float32, torch.float16, torch.bfloat16"):
        from_pretrained(tmp_path, dtype=torch.int8, device="cpu")


def test_config_that_is_not_json_is_named(tmp_path):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'config.json'}: not valid JSON"):
        from_pretrained(tmp_path, device="cpu")


def test_tensor_stored_twice_is_named(checkpoint):
    first, second = sorted(checkpoint.glob("*.safetensors"))[:2]
    extra = load_file(first)
    name = next(iter(extra))
    save_file({**load_file(second), name: extra[name]}, second)
    with pytest.raises(CheckpointError, match=f"tensor {re.escape(name)} is stored twice"):
        from_pretrained(checkpoint, device="cpu")


def test_config_with_a_bad_size_is_named(tmp_path):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 0}))
    with pytest.raises(CheckpointError, match=f"{config}: field 'num_hidden_layers' must be a positive int, got int 0"):
        from_pretrained(tmp_path, device="cpu")


# ================================================================ EOS ids


def test_speculative_decoding_stops_at_the_checkpoint_s_eos_by_default(tmp_path):
    """generation_config.json's EOS list is the model's; speculative decoding stops at it by default."""
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    prompt = [5, 9, 2, 7, 1, 3]
    free = greedy_generate(Engine(from_pretrained(tmp_path, device="cpu"), kv_tokens=256, backend="torch"), prompt,
                           24, eos_token_id=None)
    p = next(i for i in range(3, 24) if free[i] not in free[:i])
    eos = [min(set(range(256)) - set(free)), free[p]]
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": eos}))
    model = from_pretrained(tmp_path, device="cpu")
    assert model.eos_token_ids == tuple(eos)
    tokens, stats = speculative_generate(Engine(model, kv_tokens=256, backend="torch"), prompt, PromptLookupDraft(), 24)
    assert tokens == free[:p + 1] and stats.stop_reason == "eos"


def test_eos_ids_fall_back_to_the_config(tmp_path):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    gen, config = tmp_path / "generation_config.json", tmp_path / "config.json"
    assert json.loads(gen.read_text())["eos_token_id"] == 2   # transformers' LlamaConfig default
    assert from_pretrained(tmp_path, device="cpu").eos_token_ids == (2,)
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": None}))
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": [7, 9, 7]}))
    assert from_pretrained(tmp_path, device="cpu").eos_token_ids == (7, 9)
    gen.unlink()
    assert from_pretrained(tmp_path, device="cpu").eos_token_ids == (7, 9)
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": None}))
    assert from_pretrained(tmp_path, device="cpu").eos_token_ids == ()
    assert from_config("tiny", device="cpu").eos_token_ids == ()


@pytest.mark.parametrize("value", ["2", 256, [3, -1], [True], {"id": 2}])
def test_bad_eos_ids_are_named(tmp_path, value):
    tiny_hf("llama", seed=9).save_pretrained(tmp_path)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": value}))
    with pytest.raises(CheckpointError, match=re.escape(f"{gen}: field 'eos_token_id' must be a token id in [0, 256) "
                                                        f"or a list of them, got {value!r}")):
        from_pretrained(tmp_path, device="cpu")
    gen.write_text("{")
    with pytest.raises(CheckpointError, match=f"{gen}: not valid JSON"):
        from_pretrained(tmp_path, device="cpu")
