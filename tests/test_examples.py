"""Every script in examples/ runs with its defaults (a random tiny model on the CPU), so none can rot.

Each prints what it checks last (e.g. beam search: "equal to transformers' beam search: True"); the
lines asserted here are the ones whose value is a check, not a random model's output."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# example -> a line its output must contain (None: only that it runs)
CHECKS = {
    "beam_search.py": "equal to transformers' beam search: True",
    "branch_decode.py": None,
    "self_consistency.py": "majority answer:",
    "spec_medusa.py": None,
    "speculative_decode.py": "equal to plain greedy decoding: True",
    "tot_game24.py": None,
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_runs(name, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if CHECKS[name] is not None:
        assert CHECKS[name] in proc.stdout, proc.stdout[-2000:]
