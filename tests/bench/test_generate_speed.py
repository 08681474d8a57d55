"""benchmarks/generate_speed.py end to end on the CPU (`--quick`: tiny models, one child per
job): every case of every job gives a row with a number and no error, decode rows carry their
bandwidth floor, and the KV-cache Transformer's greedy decode equals its full forward's argmax."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "generate_speed.py"


def _load():
    spec = importlib.util.spec_from_file_location("generate_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kv_cache_transformer_decodes_like_the_full_forward():
    from xlstm_kit.experiments.baselines import TransformerLM

    gs = _load()
    torch.manual_seed(0)
    lm = TransformerLM(64, 32, 2, 2).eval()
    prompt = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        out = gs.KVCacheTransformer(lm, 2, 7 + 6).generate(prompt, 6)
        seq = prompt
        for _ in range(6):  # greedy with the plain forward over the whole text each step
            seq = torch.cat([seq, lm(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq[:, 7:])


def test_quick_run_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "l13b,tf125", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "generate_speed.jsonl").read_text().splitlines()]
    assert {r["job"] for r in rows} == {"l13b", "tf125"}
    for r in rows:
        assert "status" not in r, r
        assert r["case"] in ("prefill", "decode", "ttft", "decode compiled", "decode compiled unfused")
        assert r.get("ms", r.get("step_ms")) is not None
        if r["case"].startswith("decode"):
            assert r["floor_tok_s"] > 0 and r["of_floor"] == r["of_floor"]
    assert "| l13b |" in (tmp_path / "generate_speed.md").read_text()
    assert any(r["case"] == "decode compiled" for r in rows if r["job"] == "l13b")
    assert any(r["case"] == "decode compiled unfused" for r in rows if r["job"] == "l13b")
