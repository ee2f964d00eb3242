"""Medusa heads (the network): the ResBlocks' arithmetic, Medusa's initialisation, the checkpoint
layout and the loader's validation."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from treedec.models import from_config
from treedec.models.medusa import MedusaHeads, load_medusa_heads
from tests.engines import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def random_heads(model, num_heads=3, num_layers=1, seed=0):
    c = model.config
    torch.manual_seed(seed)
    return MedusaHeads(c.hidden_size, c.vocab_size, num_heads, num_layers)


def test_heads_compute_medusa_resblocks(tiny):
    heads = random_heads(tiny, num_heads=2, num_layers=2)
    x = torch.randn(3, 128)
    out = heads(x)
    assert out.shape == (3, 2, 512)
    sd = heads.medusa_head.state_dict()
    for i in range(2):
        h = x
        for j in range(2):
            h = h + F.silu(h @ sd[f"{i}.{j}.linear.weight"].T + sd[f"{i}.{j}.linear.bias"])
        torch.testing.assert_close(out[:, i], h @ sd[f"{i}.2.weight"].T)


def test_untrained_heads_start_as_lm_head(tiny):
    heads = MedusaHeads.untrained(tiny, num_heads=2)
    assert heads.num_heads == 2 and heads.num_layers == 1
    for head in heads.medusa_head:
        assert torch.equal(head[0].linear.weight, torch.zeros(128, 128))
        assert torch.equal(head[1].weight, tiny.lm_head.weight)
    assert torch.equal(MedusaHeads.untrained(tiny, seed=1).medusa_head[0][0].linear.bias,
                       MedusaHeads.untrained(tiny, seed=1).medusa_head[0][0].linear.bias)


@pytest.mark.parametrize("layout", ["pt-dir", "safetensors-dir", "pt-file", "prefixed-safetensors"])
def test_checkpoint_round_trip(tiny, tmp_path, layout):
    heads = random_heads(tiny, num_heads=3, num_layers=2)
    state = heads.medusa_head.state_dict()      # Medusa's own layout: '0.0.linear.weight', ..., '0.2.weight'
    assert sorted(state)[:3] == ["0.0.linear.bias", "0.0.linear.weight", "0.1.linear.bias"]
    if layout == "pt-dir":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
        path = tmp_path
    elif layout == "safetensors-dir":
        save_file(state, tmp_path / "medusa_lm_head.safetensors")
        path = tmp_path
    elif layout == "pt-file":
        path = tmp_path / "heads.pt"
        torch.save(state, path)
    else:
        path = tmp_path / "model.safetensors"
        save_file(heads.state_dict(), path)     # keys under 'medusa_head.'
    loaded = load_medusa_heads(path, tiny)
    assert (loaded.num_heads, loaded.num_layers) == (3, 2)
    x = torch.randn(2, 128)
    torch.testing.assert_close(loaded(x), heads(x), atol=0, rtol=0)


def _save(state, tmp_path):
    path = tmp_path / "medusa_lm_head.pt"
    torch.save(state, path)
    return path


def test_loader_errors(tiny, tmp_path):
    good = random_heads(tiny, num_heads=2).medusa_head.state_dict()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_medusa_heads(tmp_path / "nope.pt", tiny)
    with pytest.raises(FileNotFoundError, match="holds no Medusa head checkpoint"):
        load_medusa_heads(tmp_path, tiny)
    (tmp_path / "heads.txt").write_text("x")
    with pytest.raises(ValueError, match="must be a .safetensors, .pt"):
        load_medusa_heads(tmp_path / "heads.txt", tiny)
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")       # a pickled module, not a state dict
    with pytest.raises(ValueError, match="could not be read as a state dict of tensors"):
        load_medusa_heads(tmp_path / "module.pt", tiny)
    other = from_config("tiny", dtype=torch.float32, device="cpu").config
    wide = MedusaHeads(other.hidden_size, 1000, 2).medusa_head.state_dict()
    with pytest.raises(ValueError, match=r"'0.1.weight' has shape \[1000, 128\], expected \[512, 128\] for a model "
                                         r"of hidden size 128 and vocabulary 512"):
        load_medusa_heads(_save(wide, tmp_path), tiny)
    narrow = MedusaHeads(64, 512, 2).medusa_head.state_dict()
    with pytest.raises(ValueError, match=r"'0.0.linear.weight' has shape \[64, 64\], expected \[128, 128\]"):
        load_medusa_heads(_save(narrow, tmp_path), tiny)
    missing = {k: v for k, v in good.items() if k != "1.0.linear.bias"}
    with pytest.raises(ValueError, match=r"missing \['1.0.linear.bias'\], unexpected \[\]"):
        load_medusa_heads(_save(missing, tmp_path), tiny)
    no_output = {k: v for k, v in good.items() if k != "1.1.weight"}
    with pytest.raises(ValueError, match=r"every head 0..1 needs an output layer .* found it for heads \[0\]"):
        load_medusa_heads(_save(no_output, tmp_path), tiny)
    with pytest.raises(ValueError, match=r"not a Medusa head checkpoint: .* got \['lm_head.weight'\]"):
        load_medusa_heads(_save({**good, "lm_head.weight": good["0.1.weight"]}, tmp_path), tiny)
