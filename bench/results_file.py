"""Where and under what name the benchmarks write their results, and what they record about the run."""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``CPU <processor>``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}"


def versions(*modules: str) -> dict:
    """torch and python versions, plus each module's (or why it cannot be imported)."""
    found = {"torch": torch.__version__, "python": platform.python_version()}
    for module in modules:
        try:
            found[module] = __import__(module).__version__
        except Exception as e:  # recorded, not fatal: the method that needs it reports why it cannot run
            found[module] = f"unavailable ({type(e).__name__})"
    return found


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def results_path(out_dir: Path, device: str, kind: str = "", smoke: bool = False, tag: str | None = None) -> Path:
    """``<out_dir>/<date>-<device>[-kind][-smoke][-tag].json``."""
    parts = [datetime.date.today().isoformat(), slug(device)] + [slug(p) for p in (kind, "smoke" if smoke else "", tag or "") if p]
    return Path(out_dir) / ("-".join(parts) + ".json")


def write_results(results: dict, out_dir: str | Path, kind: str, smoke: bool = False, tag: str | None = None) -> Path:
    """Write ``results`` (with its ``"device"``) as JSON to :func:`results_path`; say where."""
    path = results_path(Path(out_dir), results["device"], kind, smoke, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return path


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every end-to-end benchmark shares: --seed, --progress, --out, --tag."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="")
