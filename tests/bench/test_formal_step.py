"""benchmarks/formal_step.py end to end on the CPU (`--quick`: width 32, batch 8, aot_eager): one
model timed eager and compiled, then two runs of it at once; every row carries its numbers."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "formal_step.py"


def test_quick_run_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "lstm-plain", "--parallel", "2",
                          "--window-s", "0.3", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "formal_step.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["phase"] in ("single", "parallel")]
    assert sorted((r["phase"], r["mode"]) for r in timed) == [
        ("parallel", "compiled"), ("parallel", "compiled"), ("parallel", "eager"), ("parallel", "eager"),
        ("single", "compiled"), ("single", "eager")]
    for r in timed:
        assert "status" not in r, r
        assert r["model"] == "lstm-plain" and r["batch"] == 8 and r["finite"]
        assert r["steps_per_s"] > 0 and r["steps_timed"] >= 3 and r["sample_ms"] > 0
        assert (r["compile_s"] is None) == (r["mode"] == "eager")
        assert (r["compiled"]["options"] == "aot_eager") if r["mode"] == "compiled" else "compiled" not in r
    assert {r["rank"] for r in timed if r["phase"] == "parallel"} == {0, 1}
    table = (tmp_path / "formal_step.md").read_text()
    assert "| lstm-plain | " in table and "| lstm-plain | compiled | 2 | 2 of 2 |" in table
