"""`treedec serve`'s command line: its help, and arguments refused before any model loads."""
import importlib.util

import pytest

from treedec.cli import main


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--config", "--tokenizer", "--page-size", "--host", "--port", "--served-model-name", "--kv-tokens", "--speculative", "--drafter",
                   "--num-speculative-tokens", "--max-queued-requests", "--chat-template"):
        assert option in out


@pytest.mark.parametrize("argv, message", [
    (["serve"], "--model"),
    (["serve", "--config", "tiny"], "--tokenizer"),
    (["serve", "--config", "llama9"], "--config"),
    (["serve", "--model", "smollm2", "--speculative", "ngram", "--drafter", "x"], "--drafter"),
    (["serve", "--model", "smollm2", "--max-queued-requests", "-1"], "--max-queued-requests"),
    (["serve", "--model", "smollm2", "--speculative", "lookahead"], "--speculative"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_missing_fastapi_names_the_extra(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--model", "smollm2"]) == 2
    assert "pip install 'treedec[serve]'" in capsys.readouterr().err
