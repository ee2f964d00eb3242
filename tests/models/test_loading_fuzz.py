"""Fuzzing the checkpoint reader: any index (or shard bytes) loads or raises the documented error.

Documented errors of :func:`treedec.models.from_pretrained` / :func:`checkpoint_shards`:
CheckpointError (a ValueError) and FileNotFoundError. Whatever the index names, no file
outside the checkpoint directory is opened: every path handed to ``safetensors.safe_open``
is recorded and checked.
"""
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import safetensors
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.models.test_llama import tiny_hf
from treedec.models import from_pretrained
from treedec.models.loading import CheckpointError, checkpoint_shards

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """base/ckpt: a sharded tiny Llama, with a subfolder and a symlink to base; base/outside.safetensors: a valid
    shard outside it. Returns (root, the original index text, the shard names)."""
    base = tmp_path_factory.mktemp("fuzz_checkpoint")
    root = base / "ckpt"
    tiny_hf("llama", seed=11).save_pretrained(root, max_shard_size="200KB")
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    shutil.copy(root / shards[0], base / "outside.safetensors")
    (root / "sub").mkdir()
    (root / "linked").symlink_to(base)
    return root, (root / INDEX).read_text(), shards


def _names(shards, base):
    """Shard names: valid, escaping, absolute, odd, and compositions of path parts."""
    parts = st.sampled_from(["..", ".", "", "sub", "linked", "ckpt", "outside.safetensors", *shards])
    composed = st.builds(lambda lead, ps: lead + "/".join(ps), st.sampled_from(["", "/", "./", "../"]),
                         st.lists(parts, min_size=1, max_size=4))
    odd = st.sampled_from(["/etc/passwd", "/dev/zero", "/proc/self/mem", str(base / "outside.safetensors"),
                           "../outside.safetensors", "linked/outside.safetensors", "linked/ckpt/" + shards[0],
                           "sub/../" + shards[0], "./" + shards[0], ".", "..", "", "sub", "a\0b", "x" * 300,
                           "~/" + shards[0], "\\..\\outside.safetensors", shards[0] + "/"])
    non_strings = st.none() | st.integers() | st.floats() | st.booleans() | st.lists(st.text(max_size=3), max_size=2)
    return st.sampled_from(shards) | composed | odd | st.text(max_size=12) | non_strings


def _index_documents(shards, base):
    names = _names(shards, base)
    weight_maps = st.dictionaries(st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"])
                                  | st.text(max_size=8), names, max_size=4)
    values = st.recursive(st.none() | st.integers() | st.text(max_size=4) | names,
                          lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids,
                                                                                    max_size=3),
                          max_leaves=10)
    documents = (st.builds(lambda wm, meta: {"metadata": meta, "weight_map": wm}, weight_maps, values)
                 | st.dictionaries(st.sampled_from(["weight_map", "metadata"]), values, max_size=2) | values)
    return (documents.map(json.dumps).map(str.encode)
            | st.binary(max_size=40) | st.sampled_from([b"", b"{", b"\xff\xfe", b"[" * 3000, b'{"weight_map": 1e999}']))


def _inside(path: Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_index_reader(layout, data):
    """checkpoint_shards on a random index: shard files inside the directory, or CheckpointError/FileNotFoundError."""
    root, original, shards = layout
    content = data.draw(_index_documents(shards, root.parent))
    (root / INDEX).write_bytes(content)
    try:
        paths = checkpoint_shards(root)
    except CheckpointError as e:
        assert str(e).startswith(str(root)), e
        event("CheckpointError")
        return
    except FileNotFoundError as e:
        assert str(root) in str(e), e
        event("FileNotFoundError")
        return
    finally:
        (root / INDEX).write_text(original)
    event("shards listed")
    assert paths and len(set(paths)) == len(paths)
    for p in paths:
        assert p.is_file() and _inside(p, root), p


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_from_pretrained_with_a_fuzzed_weight_map(layout, data):
    """Some weight_map values replaced: the model loads, or the documented error; nothing outside is opened."""
    root, original, shards = layout
    index = json.loads(original)
    names = list(index["weight_map"])
    for tensor in data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        index["weight_map"][tensor] = data.draw(_names(shards, root.parent))
    (root / INDEX).write_text(json.dumps(index))
    opened = []
    real = safetensors.safe_open

    def recording_safe_open(path, *args, **kwargs):
        opened.append(Path(path))
        return real(path, *args, **kwargs)

    try:
        with mock.patch.object(safetensors, "safe_open", recording_safe_open):
            from_pretrained(root, device="cpu")
        event("loaded")
    except (CheckpointError, FileNotFoundError) as e:
        assert str(root) in str(e), e
        event(type(e).__name__)
    finally:
        (root / INDEX).write_text(original)
    assert all(p.is_file() and _inside(p, root) for p in opened), opened


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_from_pretrained_with_corrupted_shard_bytes(layout, data):
    """A shard cut short, with bytes flipped in its header, or grown: it loads or raises CheckpointError naming it."""
    root, _, shards = layout
    shard = root / data.draw(st.sampled_from(shards))
    original = shard.read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    raw = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["cut", "flip", "flip", "append"]))
        if kind == "cut":
            del raw[data.draw(st.integers(0, len(raw))):]
        elif kind == "flip" and raw:
            raw[data.draw(st.integers(0, min(header_end, len(raw)) - 1))] = data.draw(st.integers(0, 255))
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16))
    shard.write_bytes(bytes(raw))
    try:
        from_pretrained(root, device="cpu")
        event("loaded")
    except CheckpointError as e:
        assert str(e).startswith(str(shard)) or str(e).startswith(str(root)), e
        event("CheckpointError")
    finally:
        shard.write_bytes(original)
    assert os.path.getsize(shard) == len(original)
