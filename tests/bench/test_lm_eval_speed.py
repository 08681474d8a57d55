"""benchmarks/lm_eval_speed.py --quick on the CPU: both backends score the same lm-eval requests
on the same weights, equally (float32, 1e-4), and the script writes its JSON and table."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "lm_eval_speed.py"


def test_quick_run_agrees_with_the_hf_backend(tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("lm_eval_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "lm_eval_speed.json").read_text())
    assert [r["backend"] for r in summary["rows"]] == ["xlstm_kit", "hf"]
    assert all(r["requests"] == 32 and r["requests_per_s"] > 0 for r in summary["rows"])
    assert summary["max_abs_logprob_diff"] < 1e-4 and summary["same_answer_share"] == 1
    assert 16 <= summary["context_tokens_mean"] <= 48 + 8  # the question's own words on top
    assert "| xlstm_kit |" in (tmp_path / "lm_eval_speed.md").read_text()
