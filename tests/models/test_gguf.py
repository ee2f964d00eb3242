"""convert_gguf on tiny GGUF files made here with gguf.GGUFWriter: a good one converts and loads; each kind
of bad one is a CheckpointError naming the file, checked before anything is allocated or written, and no
output folder is left behind."""
import logging
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from treedec.models import from_pretrained  # noqa: E402
from treedec.models.gguf import convert_gguf  # noqa: E402
from tests.gguf_files import (HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, byte_level_tokens, good_tensors,  # noqa: E402
                              write_gguf)
from treedec.errors import UnsupportedModelError  # noqa: E402
from treedec.models.loading import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_good_file_converts_and_loads(good_file, tmp_path):
    out = convert_gguf(good_file, tmp_path / "sub" / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["hf"]   # no staging folder left
    model = from_pretrained(out, device="cpu")
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (LAYERS, HIDDEN, HEADS,
                                                                                          KV_HEADS, VOCAB)
    assert torch.equal(model.embed_tokens.weight, torch.from_numpy(good_tensors()["token_embd.weight"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (convert_gguf(good_file, empty) / "model.safetensors").is_file()   # an empty folder is filled


def test_the_output_folder_is_checked_first(good_file, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=f"{full} exists and is not an empty folder"):
        convert_gguf(good_file, full)
    assert [p.name for p in full.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not an empty folder"):
        convert_gguf(good_file, tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    for under in (tmp_path / "file" / "out", tmp_path / "file" / "a" / "b"):   # issue 48 item 15
        with pytest.raises(NotADirectoryError, match=f"out_dir {under} cannot be made: {tmp_path / 'file'} is a "
                                                     f"file, not a folder"):
            convert_gguf(good_file, under)
    assert (tmp_path / "file").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def _cut(keep):
    """Bytes of the good file cut to ``keep`` (a count, a negative count from the end, or a share)."""
    def make(path, good):
        data = good.read_bytes()
        n = int(len(data) * keep) if isinstance(keep, float) else keep if keep >= 0 else len(data) + keep
        path.write_bytes(data[:n])
    return make


def _raw(content):
    def make(path, good):
        path.write_bytes(content)
    return make


def _gguf(**kwargs):
    def make(path, good):
        write_gguf(path, **kwargs)
    return make


NAN = float("nan")
BAD_FILES = {
    "empty": (_raw(b""), "not a readable GGUF file"),
    "text": (_raw(b"this is not a GGUF file, just text\n" * 10), "not a readable GGUF file"),
    "zeros": (_raw(b"\0" * 4096), "not a readable GGUF file"),
    "magic only": (_raw(b"GGUF\x03\x00\x00\x00"), "not a readable GGUF file"),
    "cut in the header": (_cut(20), "not a readable GGUF file"),
    "cut in the metadata": (_cut(400), "not a readable GGUF file"),
    "cut in the tensors": (_cut(0.5), "not a readable GGUF file"),
    "last byte cut": (_cut(-1), "not a readable GGUF file"),
    "no architecture": (_gguf(meta={"general.architecture": None}), "lacks metadata key 'general.architecture'"),
    "architecture not a string": (_gguf(meta={"general.architecture": 7}), "'general.architecture' must be a "
                                                                             "string, got INT64"),
    "unsupported architecture": (_gguf(arch="gpt2"), "'general.architecture' must be one of \\('llama', "
                                                     "'qwen2', 'qwen3', 'gemma2', 'gemma3', 'phi3'\\) .* got 'gpt2'"),
    "architecture unknown to anyone": (_gguf(arch="llama-evil"), "must be one of .* got 'llama-evil'"),
    "no block_count": (_gguf(meta={"llama.block_count": None}), "lacks metadata key 'llama.block_count'"),
    "no embedding_length": (_gguf(meta={"llama.embedding_length": None}), "lacks metadata key "
                                                                          "'llama.embedding_length'"),
    "no context_length": (_gguf(meta={"llama.context_length": None}), "lacks metadata key 'llama.context_length'"),
    "no head_count": (_gguf(meta={"llama.attention.head_count": None}), "lacks metadata key "
                                                                        "'llama.attention.head_count'"),
    "block_count 1000": (_gguf(meta={"llama.block_count": 1000}), "lacks 8982 tensor\\(s\\) the config needs, "
                                                                  "e.g. \\['blk.2.attn_norm.weight'"),
    "block_count 10**12": (_gguf(meta={"llama.block_count": 10 ** 12}), "lacks 8999999999982 tensor"),
    "block_count 0": (_gguf(meta={"llama.block_count": 0}), "metadata key 'llama.block_count' must be a positive "
                                                            "int, got int 0"),
    "block_count a string": (_gguf(meta={"llama.block_count": "2"}), "metadata key 'llama.block_count' must be a "
                                                                     "positive int, got str '2'"),
    "block_count a float": (_gguf(meta={"llama.block_count": 2.0}), "'llama.block_count' must be a positive int, "
                                                                    "got float 2.0"),
    "head_count 0": (_gguf(meta={"llama.attention.head_count": 0}), "'llama.attention.head_count' must be a "
                                                                    "positive int, got int 0"),
    "kv heads not dividing": (_gguf(meta={"llama.attention.head_count_kv": 3}), "metadata key "
                              "'llama.attention.head_count' \\(4\\) must be a multiple of metadata key "
                              "'llama.attention.head_count_kv' \\(3\\)"),
    "embedding_length huge": (_gguf(meta={"llama.embedding_length": 2 ** 40}), "the config's sizes make tensors "
                              "too large to exist \\(hidden_size 1099511627776"),
    "rms eps negative": (_gguf(meta={"llama.attention.layer_norm_rms_epsilon": -0.5}), "metadata key "
                         "'llama.attention.layer_norm_rms_epsilon' must be a finite number > 0, got float -0.5"),
    "rms eps nan": (_gguf(meta={"llama.attention.layer_norm_rms_epsilon": NAN}), "layer_norm_rms_epsilon' must be "
                                                                                 "a finite number > 0, got float nan"),
    "rope base 0": (_gguf(meta={"llama.rope.freq_base": 0.0}), "metadata key 'llama.rope.freq_base' must be a "
                                                               "finite number > 0, got float 0.0"),
    "rope base negative": (_gguf(meta={"llama.rope.freq_base": -10000.0}), "'llama.rope.freq_base' .* -10000.0"),
    "rms eps huge": (_gguf(meta={"llama.attention.layer_norm_rms_epsilon": 1e30}), "metadata key "
                     "'llama.attention.layer_norm_rms_epsilon' must be at most 0.01"),
    "rope base huge": (_gguf(meta={"llama.rope.freq_base": 1e30}), "'llama.rope.freq_base' must be at most 1e\\+12"),
    "rope base inf": (_gguf(meta={"llama.rope.freq_base": float("inf")}), "'llama.rope.freq_base' .* got float inf"),
    "tensor of the wrong shape": (_gguf(tensors={"token_embd.weight": np.zeros((300, 32), np.float32)}),
                                  "tensor token_embd.weight has shape \\(300, 32\\), expected \\(300, 64\\)"),
    "layer tensor of the wrong shape": (_gguf(tensors={"blk.1.ffn_down.weight": np.zeros((64, 64), np.float32)}),
                                        "tensor blk.1.ffn_down.weight has shape \\(64, 64\\), expected \\(64, 128\\)"),
    "int32 weights": (_gguf(tensors={"blk.0.attn_q.weight": np.zeros((64, 64), np.int32)}),
                      "tensor blk.0.attn_q.weight has dtype I32, expected one of \\['F32', 'F16'"),
    "float64 weights": (_gguf(tensors={"output_norm.weight": np.ones(64, np.float64)}),
                        "tensor output_norm.weight has dtype F64, expected one of"),
    "missing tensor": (_gguf(tensors={"blk.1.ffn_down.weight": None}), "lacks 1 tensor\\(s\\) the config needs, "
                                                                       "e.g. \\['blk.1.ffn_down.weight'\\]"),
    "missing embedding": (_gguf(tensors={"token_embd.weight": None}), "lacks 1 tensor.*token_embd.weight"),
    "unknown tensor": (_gguf(tensors={"blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32)}),
                       "has 1 tensor\\(s\\) this decoder does not use, e.g. \\['blk.0.attn_qkv.weight'\\]"),
    "a block past block_count": (_gguf(tensors={"blk.2.attn_norm.weight": np.ones(64, np.float32)}),
                                 "does not use, e.g. \\['blk.2.attn_norm.weight'\\]"),
    "a bias llama has not": (_gguf(tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)}),
                             "does not use, e.g. \\['blk.0.attn_q.bias'\\]"),
    "qwen2 without its biases": (_gguf(arch="qwen2"), "lacks 6 tensor\\(s\\) .* \\['blk.0.attn_q.bias'"),
    "no tokenizer metadata": (_gguf(meta={"tokenizer.ggml.model": None, "tokenizer.ggml.tokens": None,
                                          "tokenizer.ggml.token_type": None, "tokenizer.ggml.merges": None,
                                          "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None}),
                              "lacks metadata key 'tokenizer.ggml.model' \\(the tokenizer"),
    "no token list": (_gguf(meta={"tokenizer.ggml.tokens": None, "tokenizer.ggml.token_type": None,
                                  "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None}),
                      "lacks metadata key 'tokenizer.ggml.tokens'"),
    "tokenizer without merges or scores": (_gguf(meta={"tokenizer.ggml.merges": None}),
                                           "cannot be converted \\(KeyError: 'scores'\\)"),
    "more tokens than the vocabulary": (_gguf(meta={"tokenizer.ggml.tokens": byte_level_tokens(400),
                                                    "tokenizer.ggml.token_type": [1] * 400}),
                                        "the tokenizer has 400 tokens, more than the model's vocabulary \\(300"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_files_are_named_and_leave_nothing(good_file, tmp_path, monkeypatch, kind):
    make, message = BAD_FILES[kind]
    bad = tmp_path / "bad.gguf"
    make(bad, good_file)
    if "tokenizer" not in kind:   # everything but the tokenizer is checked before a model is built
        import transformers
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config",
                            lambda *a, **k: pytest.fail("a model was built before the file was checked"))
    out = tmp_path / "parent" / "hf"
    with pytest.raises((CheckpointError, UnsupportedModelError), match=message) as e:   # (an unknown architecture)
        convert_gguf(bad, out)
    assert str(e.value).startswith(f"{bad}: "), e.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]   # no output, no staging, no parent
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises((CheckpointError, UnsupportedModelError)):
        convert_gguf(bad, empty)
    assert empty.is_dir() and not any(empty.iterdir())   # an empty folder given stays as it was


@pytest.mark.parametrize("missing, key, value", [
    ("llama.attention.layer_norm_rms_epsilon", "llama.attention.layer_norm_rms_epsilon", "1e-06"),
    ("llama.rope.freq_base", "llama.rope.freq_base", "10000.0"),
])
def test_missing_eps_and_theta_take_defaults_with_a_warning(tmp_path, caplog, missing, key, value):
    bad = write_gguf(tmp_path / "tiny.gguf", meta={missing: None})
    with caplog.at_level(logging.WARNING, logger="treedec"):
        out = convert_gguf(bad, tmp_path / "hf")
    warnings = [r.getMessage() for r in caplog.records if r.name == "treedec"]
    assert any(str(bad) in w and f"'{key}'" in w and value in w for w in warnings), warnings
    assert math.isfinite(from_pretrained(out, device="cpu").config.rms_norm_eps)


def test_qwen2_with_biases_converts(tmp_path):
    out = convert_gguf(write_gguf(tmp_path / "qwen.gguf", arch="qwen2", qkv_bias=True), tmp_path / "hf")
    model = from_pretrained(out, device="cpu")
    assert model.config.model_type == "qwen2" and model.config.qkv_bias


def test_a_failure_while_writing_leaves_nothing(good_file, tmp_path, monkeypatch):
    """Disk full after the weights are written: the staging folder and the parents made for it go."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(good_file, tmp_path / "a" / "b" / "hf")
    assert list(tmp_path.iterdir()) == []
