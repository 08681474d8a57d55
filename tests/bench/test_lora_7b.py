"""benchmarks/lora_7b.py --quick on the CPU: ours and transformers' xLSTMForCausalLM with PEFT
LoRA train on the same weights in child processes (equal first losses and trainable counts), and
the script writes its rows and table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_ours_and_transformers_peft(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_7b.py"), "--quick", "--only",
                          "ours_b4,hf_b4", "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "lora_7b.jsonl").read_text().splitlines()]
    assert [r["job"] for r in rows] == ["ours_b4", "hf_b4"]
    ours, hf = rows
    for r in rows:
        assert r["status"] == "ok" and r["loss_finite"] and r["tok_s"] > 0 and r["steps"] == 2
        assert (r["batch"], r["seq"]) == (2, 64) and r["adapter_dtype"] == ["float32"]
    assert hf["hf_blocks"] == "transformers"  # the xlstm package hidden: transformers' own code
    assert ours["trainable"] == hf["trainable"] > 0 and ours["targets"] == hf["targets"]
    assert abs(ours["loss_first"] - hf["loss_first"]) < 1e-4
    md = (tmp_path / "lora_7b.md").read_text()
    assert "| ours_b4 | xlstm_kit | 2 × 64 |" in md and "transformers+PEFT (native)" in md
