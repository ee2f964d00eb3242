import json
import math

import pytest

from bench.host_scaling import KINDS, main, slope_us


def test_slope_is_the_least_squares_fit():
    assert slope_us([1, 8, 32], [0.5, 1.2, 3.6]) == pytest.approx(1e3 * 0.1, rel=1e-3)
    assert math.isnan(slope_us([4], [1.0]))


def test_host_scaling_smoke_run(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "forward stubbed" in out
    [path] = tmp_path.glob("*-cpu-host-scaling-smoke.json")
    results = json.loads(path.read_text())
    assert results["requests"] == [1, 4] and set(results["results"]) == set(KINDS)
    for kind, r in results["results"].items():
        assert set(r["ms_per_step"]) == {"1", "4"} and all(ms > 0 for ms in r["ms_per_step"].values()), kind
        assert math.isfinite(r["us_per_request_step"]), kind


def test_unknown_kind_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--smoke", "--programs", "greedy,nope"])
    assert "unknown kind" in capsys.readouterr().err
