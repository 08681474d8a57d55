"""benchmarks/serve_speed.py --quick end to end on the CPU: a row per load level with every
requested token streamed back, the generate baseline, the prefix runs with and without the
cache, one prompt's read eager and compiled, and the markdown tables."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_rows(script: str, tmp_path) -> list[dict]:
    """benchmarks/<script>.py --quick on the CPU, writing into tmp_path; its jsonl rows."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--out",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / f"{script}.jsonl").read_text().splitlines()]


def test_quick_run_end_to_end(tmp_path):
    rows = quick_rows("serve_speed", tmp_path)
    load = [r for r in rows if r["case"] == "load"]
    assert [r["concurrency"] for r in load] == [1, 4]
    for r in load:
        assert r["short"] == 0 and r["tokens"] > 0 and r["tok_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"]
        # the server's own split of the first token's time adds up, and is part of the client's
        assert abs(r["srv_queue_ms"] + r["srv_read_ms"] - r["srv_ttft_ms"]) < 1e-3 and r["srv_read_ms"] > 0
        assert r["srv_ttft_ms"] < r["ttft_p99_ms"]
    gen = next(r for r in rows if r["case"] == "generate")
    assert gen["batch"] == 4 and gen["tokens"] == load[1]["tokens"] and gen["tok_s"] > 0
    prefix = {(r["cache"], r["concurrency"]): r for r in rows if r["case"] == "prefix"}
    assert set(prefix) == {(True, 1), (True, 8), (False, 1), (False, 8)}
    assert all(r["short"] == 0 and r["system_len"] == 200 for r in prefix.values())
    reads = {(r["compiled"], r["length"]): r["ms"] for r in rows if r["case"] == "prefill"}
    assert set(reads) == {(False, 5), (False, 9), (True, 5), (True, 9)} and min(reads.values()) > 0
    md = (tmp_path / "serve_speed.md").read_text()
    assert "| 4 | 8 |" in md and "| on | 1 |" in md and "| off | 8 |" in md and "model.generate" in md
    assert "| eager |" in md and "| compiled |" in md
    share = load[1]["tok_s"] / gen["tok_s"]
    ratio = load[1]["ttft_p99_ms"] / load[0]["ttft_p50_ms"]
    gain = prefix[False, 8]["ttft_p50_ms"] / prefix[True, 8]["ttft_p50_ms"]
    assert f"- throughput at concurrency 4: {share:.0%} of `model.generate`" in md
    assert f"- TTFT p99 at concurrency 4: {ratio:.1f}x a lone request's p50" in md
    later = load[1]["ttft_p99_later_ms"]
    assert 0 < later <= load[1]["ttft_p99_ms"]  # p99 over the requests after the first wave
    assert f"; {later / load[0]['ttft_p50_ms']:.1f}x without the first 4, which arrive together" in md
    assert f"- prefix cache at concurrency 8: TTFT p50 {gain:.1f}x lower with it" in md
    # the CPU server reads prompts eagerly; the table says so
    assert next(r for r in rows if r["case"] == "server")["prompt_read_graphs"] == 0
    assert "Prompt reads: eager (no CUDA graphs)." in md
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # the temporary model folder is gone


def test_prompt_pieces_quick_times_every_bucket_and_length(tmp_path):
    rows = quick_rows("prompt_pieces", tmp_path)
    assert {(r["batch"], r["length"]) for r in rows} == {
        (b, L) for b in (1, 2) for L in (8, "1 as steps", "2 as steps", "step")}
    assert all(r["ms"] > 0 and not r["graph"] for r in rows)
    md = (tmp_path / "prompt_pieces.md").read_text()
    assert "| batch | 8 | 1 as steps | 2 as steps | step |" in md and "(eager)" in md


def test_a_server_that_fails_to_start_is_reported_with_its_error(tmp_path):
    """A server that exits at start (here: no model in the folder) is a RuntimeError carrying the
    server's own message, whenever the exit is seen."""
    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import serve_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with pytest.raises(RuntimeError, match="the server did not start") as err:
        serve_speed.Server(str(tmp_path / "missing"), ["--device", "cpu"])
    assert "missing" in str(err.value)
