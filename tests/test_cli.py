import json

import pytest

from treedec.cli import main


@pytest.mark.parametrize("planner", ["flatten", "node", "node_chunk"])
def test_demo_matches_reference(planner, capsys):
    assert main(["demo", "--planner", planner, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[: out.rindex("}") + 1])
    assert summary["backend"] == "torch" and summary["requests"] == 2
    assert summary["queries"] == 24 + 4
    assert summary["max_abs_err_vs_reference"] < 1e-4


def test_demo_rejects_unknown_backend():
    with pytest.raises(Exception, match="backend must be 'auto' or one of"):
        main(["demo", "--backend", "nope"])
