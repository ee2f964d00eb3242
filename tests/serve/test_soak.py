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
