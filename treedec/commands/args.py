"""Argument types and model options every ``treedec`` subcommand shares.

Each type turns a bad value into an ``argparse.ArgumentTypeError`` that names what was
expected (counts, seeds, finite floats, devices, backends, planners, model sizes, input and
output paths), so a mistake is reported when the arguments are parsed, before anything is
loaded or run. Output paths are checked up front too: their folder must exist and be
writable (no folder is created, so a mistyped path fails at once instead of after a long
run or into a stray new tree), and :func:`refuse_overwrites` refuses an output that is one of
the command's input files or another of its outputs.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path

import torch

from treedec.attention import PLANNERS
from treedec.attention.backends import AUTO, backend_names
from treedec.models.catalog import KNOWN_MODELS, model_form
from treedec.models.config import MODEL_SIZES
from treedec.models.quantization import QUANTIZATIONS
from treedec.tree.kv_cache_dtype import KV_CACHE_DTYPES
from treedec.workloads import WORKLOADS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_MAX = 2**31 - 1  # counts and sizes above this are mistakes (and overflow C longs in numpy / torch)
SEED_MAX = 2**63 - 1  # numpy and torch both take seeds in [0, 2**63)


# ================================================================ argument types


def int_arg(minimum: int, maximum: int = INT_MAX, expected: str | None = None):
    """An argparse ``type``: an int in ``[minimum, maximum]``; ``expected`` says so in an error (default
    "an int >= minimum", or "an int in [minimum, maximum]")."""
    if expected is None:
        expected = f"an int >= {minimum}" if maximum == INT_MAX else f"an int in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return value

    return parse


positive_int = int_arg(1)
nonnegative_int = int_arg(0)
seed_int = int_arg(0, SEED_MAX, "an int in [0, 2**63)")


def float_arg(minimum: float = -math.inf, strictly_above: bool = False):
    """An argparse ``type``: a finite float ``>= minimum`` (``> minimum`` with ``strictly_above``)."""
    op = ">" if strictly_above else ">="
    expected = "a finite number" + ("" if minimum == -math.inf else f" {op} {minimum:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strictly_above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


finite_float = float_arg()
nonnegative_float = float_arg(0.0)
positive_float = float_arg(0.0, strictly_above=True)


def unit_fraction(text: str) -> float:
    """An argparse ``type``: a number in (0, 1] (a share, e.g. ``--gpu-memory-utilization``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:   # (NaN fails it too)
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def logit_bias_pair(text: str) -> tuple[int, float]:
    """An argparse ``type``: ``ID:BIAS``, a token id >= 0 and a finite number (SamplingParams checks its range)."""
    token, sep, bias = text.partition(":")
    try:
        pair = int(token), float(bias)
    except ValueError:
        pair = None
    if not sep or pair is None or pair[0] < 0 or not math.isfinite(pair[1]):
        raise argparse.ArgumentTypeError(f"must be ID:BIAS (a token id >= 0 and a number, e.g. 50256:-100), "
                                         f"got {text!r}")
    return pair


def device_arg(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``, where that device exists."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} needs CUDA, but the installed torch {torch.__version__} is a CPU build; use --device cpu, "
                f"or install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is visible to torch "
                                             f"(torch.cuda.is_available() is False); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r} does not exist: {torch.cuda.device_count()} CUDA "
                                             f"device(s) visible")
    return text


def choice_arg(choices):
    """An argparse ``type``: one of ``choices``; a value that is not says which are, and the one it was probably
    meant to be (``draft-model`` for ``draft_model``)."""
    def parse(text: str) -> str:
        if text in choices:
            return text
        close = difflib.get_close_matches(text.replace("-", "_"), choices, n=1)
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}"
                                         + (f"; did you mean {close[0]}?" if close else ""))
    return parse


def backend_arg(text: str) -> str:
    """An argparse ``type``: ``auto`` or a registered backend (:func:`~treedec.attention.backends.backend_names`)."""
    if text != AUTO and text not in backend_names():
        raise argparse.ArgumentTypeError(f"must be auto or one of {', '.join(backend_names())}, got {text!r}")
    return text


def planner_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated planner names, at least one, each of :data:`PLANNERS`."""
    planners = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in planners if p not in PLANNERS]
    if not planners or unknown:
        raise argparse.ArgumentTypeError(f"must be comma-separated planners from {', '.join(PLANNERS)}, got {text!r}")
    return planners


def model_size(text: str) -> str:
    """An argparse ``type``: a named size of :data:`~treedec.models.config.MODEL_SIZES`."""
    if text not in MODEL_SIZES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(MODEL_SIZES)}, got {text!r}")
    return text


def existing_dir(text: str) -> str:
    """An argparse ``type``: a directory that exists."""
    if not text or not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory; give a local folder")
    return text


def model_arg(text: str) -> str:
    """An argparse ``type``: a model argument (a known name, a ``.gguf`` file, a checkpoint folder, a hub
    repo id in the local cache; :func:`~treedec.models.catalog.model_form`), checked without fetching or
    converting anything: :func:`load_model` resolves it."""
    try:
        model_form(text)
    except (OSError, ValueError, ImportError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing_path(text: str) -> str:
    """An argparse ``type``: a file or directory that exists."""
    if not text or not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def existing_file(text: str) -> str:
    """An argparse ``type``: a readable file."""
    path = Path(text)
    if not text or not path.exists():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"file {text!r} is not readable")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a file path that can be written: its folder exists and is writable.

    Checked when the arguments are parsed, so a bad path fails before the run, not after it.
    """
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path (e.g. {str(path / 'out.json')!r})")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text!r} does not exist; create it first "
                                         f"(mkdir -p {folder}) or write somewhere else")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def workload_arg(text: str) -> str:
    """An argparse ``type``: a name of :data:`~treedec.workloads.WORKLOADS` or a schedule JSON file."""
    if text not in WORKLOADS:
        path = Path(text)
        if not path.exists():
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(WORKLOADS)} or a schedule JSON file, "
                                             f"got {text!r} (no such workload or file)")
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{text!r} is not a file (give a schedule JSON file or one of "
                                             f"{', '.join(WORKLOADS)})")
    return text


def read_json(path: str, what: str):
    """The JSON document in ``path``; a file that is not JSON (not UTF-8, malformed, nested deeper than
    Python's stack, an integer of more digits than Python converts) raises ValueError naming it as ``what``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{what} {path} is not JSON this reader takes (nested too deeply)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is not JSON ({e})") from None
    except ValueError as e:   # an integer of more digits than Python converts (its advice is for programmers)
        raise ValueError(f"{what} {path} is not JSON this reader takes ({str(e).split(';')[0]})") from None


#: The argument types that name a file the command reads (a workload name, a model name or hub repo id is not a file).
INPUT_TYPES = (existing_file, existing_path, workload_arg, model_arg)


def refuse_overwrites(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise ValueError, before anything runs, when an output path of the command (an ``output_file``
    argument) is one of its input files or another output: the same resolved path, or the same file
    (``os.path.samefile``: a hard or symbolic link) where both exist."""
    inputs, outputs = [], []
    for action in parser._actions:   # argparse keeps no public list of a parser's arguments
        values = getattr(args, action.dest, None)
        if values is None or action.type not in (*INPUT_TYPES, output_file):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        for value in values if isinstance(values, list) else [values]:
            if action.type is output_file:
                outputs.append((name, value))
            elif not (action.type is workload_arg and value in WORKLOADS
                      or action.type is model_arg and model_form(value) in ("name", "hub")):
                inputs.append((name, value))
    for i, (name, path) in enumerate(outputs):
        for other_name, other in inputs + outputs[:i]:
            if _same_file(path, other):
                if (other_name, other) in inputs:
                    raise ValueError(f"{name} {path!r} is the file of {other_name} {other!r}: writing it would "
                                     f"overwrite the command's input; write to another file")
                raise ValueError(f"{other_name} {other!r} and {name} {path!r} are the same file: one would overwrite "
                                 f"the other; give them different paths")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:   # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


# ================================================================ model options


#: What ``--model`` takes, for the commands' help.
MODEL_HELP = (f"a known name ({', '.join(KNOWN_MODELS)}: fetched and converted once into treedec's cache), a .gguf "
              f"file, a Hugging Face checkpoint folder, or a hub repo id in the local Hugging Face cache")


def add_model_arguments(p, model_help: str = MODEL_HELP,
                        config_help: str = "a named model size with random weights (default: tiny, on the CPU)",
                        batch_invariant: bool = False) -> None:
    """``--model`` or ``--config``, ``--device``, ``--dtype`` and ``--quantization``: what :func:`load_model`
    reads; with ``batch_invariant`` (a command whose engine decodes requests) ``--batch-invariant`` too."""
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=model_arg, help=model_help)
    model.add_argument("--config", type=model_size, help=f"{config_help}; one of {', '.join(MODEL_SIZES)}")
    p.add_argument("--device", type=device_arg, help="cpu or cuda[:N]; default: cpu for the tiny default, else "
                                                     "cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")
    add_quantization_argument(p)
    if batch_invariant:
        add_batch_invariant_argument(p)


def add_quantization_argument(p) -> None:
    """``--quantization`` (quantize the model's projections when loading) and ``--kv-cache-dtype`` (what the KV
    pool stores): vLLM's flags."""
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="quantize a float checkpoint's projections when loading: fp8 (e4m3, a scale per output row; "
                        "the LM head stays in --dtype); an FP8 checkpoint loads as fp8 without it")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what the KV pool stores: auto (the model's dtype) or fp8 / fp8_e4m3 (e4m3 with the "
                        "checkpoint's k_scale / v_scale or 1.0: twice the tokens in the same memory, half the K/V a "
                        "step reads; de-quantized by the attention on the CPU)")


def add_batch_invariant_argument(p) -> None:
    """``--batch-invariant``: the engine's batch-invariant mode (``Engine(..., batch_invariant=True)``; vLLM's
    ``VLLM_BATCH_INVARIANT``), for the commands whose engines decode requests."""
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logits are the same bits alone or in any batch: batch-invariant "
                        "GEMMs and norms, attention planned per query path (slower; refuses --quantization and "
                        "tensor parallelism)")


def engine_options(args: argparse.Namespace) -> dict:
    """The :class:`~treedec.engine.Engine` options of a decoding command's flags (``--backend``, ``--kv-cache-dtype``,
    ``--batch-invariant``), as keyword arguments."""
    return {"backend": args.backend, "kv_cache_dtype": args.kv_cache_dtype, "batch_invariant": args.batch_invariant}


def model_device(args: argparse.Namespace) -> torch.device:
    """The device :func:`load_model` puts the model on."""
    if args.model is None and args.config is None:
        return torch.device(args.device or "cpu")
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def check_backend(args: argparse.Namespace) -> None:
    """Raise BackendUnavailableError now, before a model is loaded, if ``--backend`` cannot run on its device."""
    from treedec.attention.backends import resolve_backend

    resolve_backend(args.backend, model_device(args))


def load_model(args: argparse.Namespace):
    """The model of ``--model`` / ``--config`` (default: tiny random weights on the CPU) and its name; what
    ``--model`` resolved to, and how, is said on stderr (unless it is a checkpoint folder, read as it is)."""
    from treedec.models import from_config, from_pretrained, resolve_model

    device = model_device(args)
    name = "tiny" if args.model is None and args.config is None else args.model or args.config
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model is not None:
        resolved = resolve_model(args.model)
        if resolved.form != "folder":
            print(f"model: {resolved.describe()}", file=sys.stderr)
        return from_pretrained(resolved, dtype=dtype, device=device, quantization=args.quantization), args.model
    return (from_config(name, seed=args.seed, dtype=dtype, device=device, quantization=args.quantization),
            f"{name} (random weights)")
