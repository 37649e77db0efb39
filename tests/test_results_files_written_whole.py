"""Results files are written whole by their scripts: the chaos soak and the GPU scripts record the commit, the
date, the machine and the command themselves (they were added to the files by hand)."""

import datetime
import json
import subprocess
from pathlib import Path

from benchmarks.run_facts import run_facts

REPO = Path(__file__).resolve().parents[1]


def test_run_facts_name_the_commit_date_machine_and_command(monkeypatch):
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")
    facts = run_facts("python benchmarks/chaos_soak.py", ["--steps", "30"], env=("MC_LOG_LEVEL", "UNSET_HERE"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert facts["commit"] in (head, head + "+dirty")
    assert facts["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert "CPU cores" in facts["machine"] and "GB" in facts["machine"]
    assert facts["command"] == "MC_LOG_LEVEL=WARNING python benchmarks/chaos_soak.py --steps 30"


def test_the_chaos_soak_writes_them_into_its_json(tmp_path):
    from benchmarks import chaos_soak

    out = tmp_path / "soak.json"
    chaos_soak.write_result(str(out), ["--steps", "3"], {"table": [], "rows": []})
    written = json.loads(out.read_text())
    assert {"commit", "date", "machine"} <= set(written)
    assert written["command"].endswith("python benchmarks/chaos_soak.py --steps 3")
    assert (written["argv"], written["table"]) == (["--steps", "3"], [])


def test_gpu_results_get_the_date_and_machine_from_the_writer(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import common
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "gpu"))
    common.write(str(tmp_path), "r.json", {"command": "x", "rows": []})
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert "CPU cores" in written["machine"] and (written["command"], written["rows"]) == ("x", [])
