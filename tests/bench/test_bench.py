"""`xlstm-kit bench`: the registry, the timing, and the runner end to end on the CPU at the
`--quick` shapes (tiny, a few seconds), with peers present, absent and failing."""
import dataclasses
import math
import re

import pytest
import torch

from xlstm_kit.cli import app as cli
from xlstm_kit.bench import peers, registry, runner, timing

REQUIRED = {
    "ops": {"mlstm_chunkwise", "mlstm_parallel", "mlstm_recurrent", "slstm_recurrent", "dplr_chunkwise",
            "kda_chunkwise", "dplr_chunkwise_f32gates", "kda_chunkwise_f32gates"},
    "model": {"train_step"},
    "generate": {"generate"},
}


def table_rows(text: str) -> list[dict]:
    """The data rows of every markdown table in `text`, as dicts keyed by the header cells."""
    rows, head = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            head = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            head = cells
        elif not set(line) <= set("|-"):
            rows.append(dict(zip(head, cells)))
    return rows


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


# ------------------------------------------------------------------------------ registry
@pytest.mark.parametrize("suite", registry.SUITES)
def test_registry_lists_the_cases_of_each_suite(suite):
    cs = registry.cases(suite)
    assert REQUIRED[suite] <= {c.name for c in cs}
    for c in cs:
        assert c.suite == suite
        assert c.gpu_shapes and c.cpu_shapes and c.quick_shape
        assert set(c.peers) <= set(peers.PEERS), c.name
    assert len(registry.cases()) == len({c.name for c in registry.CASES}) == len(registry.CASES)


def test_registry_work_counts_scale_with_the_shape():
    case = registry.get("mlstm_chunkwise")
    env = registry.Env(torch.device("cpu"), torch.float32)
    small = case.work(dict(B=1, T=64, H=2, K=16, V=16), env)
    double = case.work(dict(B=2, T=64, H=2, K=16, V=16), env)
    assert small.flop > 0 and small.bytes > 0
    assert double.flop == pytest.approx(2 * small.flop) and double.bytes == pytest.approx(2 * small.bytes)
    half = case.work(dict(B=1, T=64, H=2, K=16, V=16), registry.Env(torch.device("cpu"), torch.bfloat16))
    assert half.bytes == pytest.approx(small.bytes / 2) and half.flop == small.flop


def test_unknown_suite_or_case_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="unknown benchmark suite 'bogus'.*ops, model, generate"):
        registry.cases("bogus")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--suite", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "ops" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["bench", "--case", "no_such_case", "--quick"]) == 2
    assert "unknown benchmark case 'no_such_case'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ timing
def test_timing_on_cpu_is_positive_and_bounded():
    calls = []

    def fn():
        calls.append(1)
        torch.randn(64, 64) @ torch.randn(64, 64)

    budget = timing.Budget(warmup_calls=2, warmup_s=0.0, rep_s=0.0, min_reps=4, max_reps=4)
    t = timing.measure(fn, "cpu", budget)
    assert t.reps == 4 and len(calls) == 2 + 4
    assert 0 < t.min_ms <= t.median_ms and math.isfinite(t.median_ms)
    assert timing.peak_memory_mib(fn, "cpu") is None


# ------------------------------------------------------------------------------ runner
def test_quick_run_on_cpu_times_every_case(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--device", "cpu", "--threads", "1", "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("*.md"))
    assert len(files) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d-cpu-all\.md", files[0].name)
    text = files[0].read_text()
    assert f"torch {torch.__version__}" in text and "xlstm-kit bench --suite all --quick --device cpu --threads 1`" in text
    rows = table_rows(text)
    assert {r["case"] for r in rows} == {c.name for c in registry.CASES}
    for r in rows:
        assert r["implementation"] == "xlstm_kit"
        timed = [r[k] for k in ("fwd ms", "fwd+bwd ms", "ms per call", "tokens/s", "GB/s") if k in r and r[k] != "–"]
        assert timed, r
        for cell in timed:
            v = number(cell)  # a status text ("error: ...") fails here
            assert v > 0 and math.isfinite(v), r
        if r["case"] in REQUIRED["ops"]:
            assert number(r["fwd+bwd ms"]) > 0
    assert text.strip() in capsys.readouterr().out  # the table is also printed
    # a second run does not overwrite the first
    path = runner.output_path(tmp_path, torch.device("cpu"), "all", runner._dt.datetime.now(runner._dt.timezone.utc))
    assert path.name.endswith("-2.md")


def test_missing_peer_is_reported_not_fatal(tmp_path, monkeypatch):
    missing = dataclasses.replace(peers.PEERS["sdpa"], package="xlstm_kit_no_such_package", pip="no-such-package")
    monkeypatch.setitem(peers.PEERS, "sdpa", missing)
    assert cli.main(["bench", "--quick", "--device", "cpu", "--suite", "ops", "--case", "mlstm_parallel",
                     "--peers", "--out", str(tmp_path)]) == 0
    rows = table_rows(next(tmp_path.glob("*.md")).read_text())
    assert [r["implementation"] for r in rows] == ["xlstm_kit", "torch SDPA causal"]
    assert rows[1]["fwd ms"] == "not installed (pip install no-such-package)"
    assert number(rows[0]["fwd+bwd ms"]) > 0


def test_a_failed_case_keeps_its_row_and_fails_the_command(tmp_path, monkeypatch, capsys):
    """One of our cases failing (here: made to raise) is written into the table beside the
    cases that ran, and the command exits 2 with one line naming it, not 0."""
    real = runner._measure_ours

    def flaky(case, shape, env, quick):
        if case.name == "mlstm_parallel":
            raise RuntimeError("injected failure")
        return real(case, shape, env, quick)

    monkeypatch.setattr(runner, "_measure_ours", flaky)
    code = cli.main(["bench", "--quick", "--device", "cpu", "--suite", "ops", "--case", "mlstm_parallel",
                     "--case", "mlstm_recurrent", "--threads", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress lines ("# case shape: result")
    assert code == 2 and "1 of our benchmark cases failed, first mlstm_parallel" in last, err
    assert "Traceback" not in err
    rows = {r["case"]: r for r in table_rows(next(tmp_path.glob("*.md")).read_text())}
    assert rows["mlstm_parallel"]["fwd ms"].startswith("error: RuntimeError: injected failure")
    assert number(rows["mlstm_recurrent"]["fwd ms"]) > 0


def test_peer_runs_in_a_child_process_and_gets_a_ratio(tmp_path):
    """SDPA (always installed) against mlstm_parallel: measured in a child, ratio = ours ÷ theirs."""
    assert cli.main(["bench", "--quick", "--device", "cpu", "--case", "mlstm_parallel", "--peers",
                     "--out", str(tmp_path)]) == 0
    ours, sdpa = table_rows(next(tmp_path.glob("*.md")).read_text())
    assert sdpa["implementation"] == "torch SDPA causal"
    ratio = number(sdpa["ours ÷ this"])
    assert ratio == pytest.approx(number(ours["fwd+bwd ms"]) / number(sdpa["fwd+bwd ms"]), rel=0.02, abs=0.006)


def test_peer_that_cannot_run_a_shape_says_so(capsys):
    """The child's protocol, in-process: K != V is a shape SDPA cannot run; its row says why."""
    peers._child("sdpa", "mlstm_chunkwise", '{"B": 1, "T": 8, "H": 1, "K": 4, "V": 8}', "cpu", "float32", "1")
    assert capsys.readouterr().out.strip() == 'RESULT {"status": "skipped: K \\u2260 V"}'


def test_default_out_dir(tmp_path):
    assert runner.default_out_dir(tmp_path) == tmp_path
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    assert runner.default_out_dir(tmp_path) == tmp_path / "benchmarks" / "results"
