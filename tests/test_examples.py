"""Every script in examples/ runs with its defaults (a random tiny model on the CPU), so none can rot.

Each prints what it checks last (e.g. beam search: "equal to transformers' beam search: True"); the
lines asserted here are the ones whose value is a check, not a random model's output. The examples
that take a model take ``--model`` as the ``treedec`` commands do (the same argument and loader,
:mod:`treedec.commands.args`), tested here on a tiny checkpoint folder with a tokenizer."""
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
# example -> its arguments for a short run on a real (tiny) checkpoint given as --model
MODEL_RUNS = {
    "beam_search.py": ["--beams", "2", "--max-tokens", "4"],
    "branch_decode.py": ["--branches", "2", "--steps", "3"],
    "self_consistency.py": ["-n", "2", "--max-tokens", "4"],
    "spec_medusa.py": ["--max-tokens", "4"],
    "speculative_decode.py": ["--max-tokens", "4"],
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CHECKS)


def test_examples_take_the_commands_model_argument():
    """No example has an option of its own for the model (was: --checkpoint, a folder only), and every one takes
    the commands' (was: spec_medusa.py and speculative_decode.py took no arguments at all)."""
    for path in EXAMPLES.glob("*.py"):
        source = path.read_text()
        assert "--checkpoint" not in source, path.name
        assert "add_model_arguments(parser" in source and "load_model(args)" in source, path.name


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_help(name, tmp_path):
    """``--help`` prints the usage and exits 0 without running anything (was: two examples ignored it and ran)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {name}") and "--model" in proc.stdout, proc.stderr
    assert "equal to" not in proc.stdout and "tokens/step" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_runs(name, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if CHECKS[name] is not None:
        assert CHECKS[name] in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODEL_RUNS))
def test_example_runs_on_a_model_folder(name, tmp_path):
    from tests.models.test_llama import tiny_hf
    from tests.tokenizers_local import build_tokenizer

    folder = tmp_path / "checkpoint"
    tiny_hf("llama", seed=4, vocab_size=400).save_pretrained(folder)   # (the tokenizer's 400 tokens)
    build_tokenizer(folder)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--model", str(folder), "--device", "cpu",
                           "--prompt", "the quick brown fox", *MODEL_RUNS[name]],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
