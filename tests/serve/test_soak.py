"""bench/soak.py's machinery in a short run: ``treedec serve --max-core-restarts 1`` of the tiny model on the CPU,
a few hundred mixed requests with disconnects and aborts, its engine core killed once; every check passes and the
results say so (about 45 s on two cores: the core's restart alone takes 5-20 s)."""
import json

from bench.soak import main


def test_a_short_soak_with_a_crash_passes_every_check(tmp_path, capsys):
    assert main(["--minutes", "0.2", "--concurrency", "4", "--crash-at", "0.25", "--smoke", "--out",
                 str(tmp_path)]) == 0, capsys.readouterr().out
    [path] = tmp_path.glob("*-cpu-soak-smoke.json")
    results = json.loads(path.read_text())
    checks, crash = results["checks"], results["crash"]
    requests = checks["requests"]
    assert results["ok"] and all(c["ok"] for c in checks.values())
    assert requests["completed"] > 20 and requests["disconnected"] + requests["aborted"] > 0
    assert requests["compared_with_reference"] == requests["completed"] and requests["differ_count"] == 0
    assert set(requests["error_codes"]) <= {"engine_failed", "engine_restarting"}
    assert crash["restart_seconds"] > 0 and crash["health_while_restarting"] == "engine_restarting"
    assert checks["answering_after_crash"]["health"] == {"status": "ok", "engine_restarts": 1}
    assert checks["pages_at_end"]["held"] == 0 and results["server"]["exit_code"] == 0
    assert "soak                 PASSED" in capsys.readouterr().out


def test_the_soak_counts_a_failure_unexpected_only_outside_the_crash_window():
    """A request sent between the kill and the server seeing its core gone fails ``engine_failed`` (it reached the
    dead core's socket) and counts as the crash's; the same code before the kill or after the core answers again,
    or another code, is unexpected."""
    import random

    from bench.soak_checks import check_outcomes
    from bench.soak_load import Outcome, draw

    crash = {"at": 10.0, "healthy_at": 15.0}
    spec = draw(random.Random(0), 0)

    def failed(code, started, ended):
        return Outcome(spec, started, ended, status="error", http=503, code=code)

    expected = [failed("engine_failed", 9.0, 10.2), failed("engine_failed", 10.05, 10.3),
                failed("engine_restarting", 12.0, 12.1)]
    assert check_outcomes(expected, {}, crash)["unexpected_count"] == 0
    unexpected = [failed("engine_failed", 1.0, 2.0), failed("engine_failed", 15.5, 16.0),
                  failed("engine_restarting", 16.0, 16.1), failed("overloaded", 11.0, 11.1)]
    verdict = check_outcomes(expected + unexpected, {}, crash)
    assert verdict["unexpected_count"] == 4 and not verdict["ok"]
    assert [e[1] for e in verdict["unexpected_errors"]] == ["engine_failed", "engine_failed", "engine_restarting",
                                                            "overloaded"]
    assert verdict["unexpected_errors"][0][3] == -9.0
