"""`xlstm-kit eval DIR --tasks ...`: lm-eval tasks on a run folder, results as JSON beside it
(replacing only a file of its own), one-line errors for what cannot work (no [eval] extra, unknown
tasks, flags of the perplexity evaluation, a results file it did not write)."""
from __future__ import annotations

import json
import sys

import pytest

from xlstm_kit.cli import app as cli
from xlstm_kit.cli.harness import MARK

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_tasks_run_and_their_json_lands_beside_the_run(run_folder, in_tasks, capsys):
    pytest.importorskip("lm_eval")
    argv = ["eval", str(run_folder), "--tasks", "xk_choice,xk_rolling", "--include-path", str(in_tasks),
            "--limit", "2", "--device", "cpu", "--threads", "1", "--batch-size", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    path = run_folder / "lm-eval-xk_choice+xk_rolling.json"
    saved = json.loads(path.read_text())
    assert saved[MARK]["tasks"] == ["xk_choice", "xk_rolling"] and saved[MARK]["limit"] == 2
    assert saved["results"]["xk_choice"]["sample_len"] == 2 and saved["n-samples"]["xk_rolling"]["effective"] == 2
    bpb = saved["results"]["xk_rolling"]["bits_per_byte,none"]
    assert 0 < bpb < 8.5 and f"{bpb:.4f}" in out  # bytes of a barely trained byte model; the table shows it
    # a second run replaces its own file; a file it did not write is refused before any work
    assert cli.main(argv) == 0
    assert json.loads(path.read_text())[MARK]["written"] >= saved[MARK]["written"]
    capsys.readouterr()
    path.write_text('{"results": "someone else\'s"}')
    err = error_line(capsys, argv)
    assert "was not written by 'xlstm-kit eval --tasks'" in err and "--output" in err
    assert path.read_text() == '{"results": "someone else\'s"}'


@pytest.mark.parametrize("extra,needle", [
    (["--tasks", "xk_choice", "--data", "x.txt"], "--data belongs to the perplexity evaluation"),
    (["--limit", "3"], "--limit goes with --tasks"),
    (["--tasks", "a,,b"], "without empty ones"),
    (["--tasks", "xk_choice", "--output", "."], "is a folder"),
])
def test_flags_that_cannot_go_together_are_one_line_errors(run_folder, capsys, extra, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("text")  # an existing --data file: the combination is what is refused
    assert needle in error_line(capsys, ["eval", str(run_folder), *extra])


def test_an_unknown_task_fails_before_the_model_loads(run_folder, in_tasks, capsys, monkeypatch):
    tasks = pytest.importorskip("lm_eval.tasks")

    class LocalOnly(tasks.TaskManager):  # lm-eval's own 14,000 tasks take 10-25 s to index
        def __init__(self, include_path=None, **kw):
            super().__init__(include_path=include_path, **{**kw, "include_defaults": False})

    monkeypatch.setattr(tasks, "TaskManager", LocalOnly)
    err = error_line(capsys, ["eval", str(run_folder / "nowhere"), "--tasks", "xk_choice"])
    assert "nowhere does not exist" in err
    err = error_line(capsys, ["eval", str(run_folder), "--tasks", "xk_nope", "--include-path", str(in_tasks),
                              "--output", str(run_folder / "x.json")])
    assert "unknown task xk_nope" in err and not (run_folder / "x.json").exists()


def test_without_the_extra_the_error_names_it(run_folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    err = error_line(capsys, ["eval", str(run_folder), "--tasks", "arc_easy"])
    assert err.strip() == ("xlstm-kit eval: error: --tasks (lm-evaluation-harness) needs the extra: "
                           "pip install 'xlstm-kit[eval]'")
    from xlstm_kit.evaluation.__main__ import main

    assert main() == 2
    assert "pip install 'xlstm-kit[eval]'" in capsys.readouterr().err


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", ["fifo", "oversized", "nested", "a link to nothing", "a JSON string"])
def test_a_hostile_file_at_the_output_is_refused_in_one_line_at_once(tmp_path, kind):
    """The check that an existing results file is ours read it whole: a FIFO there hung it, deep
    nesting was a RecursionError traceback, a JSON string holding the mark passed for ours."""
    from tests.helpers import HOSTILE_MESSAGES, make_hostile
    from xlstm_kit.cli.args import UsageError
    from xlstm_kit.cli.harness import MAX_RESULTS_BYTES, _check_output

    out = tmp_path / "results.json"
    if kind == "a link to nothing":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "a JSON string":
        out.write_text(json.dumps(f"not a results file, whatever it says: {MARK}"))
    else:
        make_hostile(out, kind, MAX_RESULTS_BYTES)
    with pytest.raises(UsageError) as e:
        _check_output(out, explicit=True)
    message = str(e.value)
    assert "was not written by 'xlstm-kit eval --tasks'" in message and "\n" not in message, message
    assert {"a link to nothing": "a link to nothing", "a JSON string": "must hold a JSON object"}.get(
        kind, HOSTILE_MESSAGES.get(kind, "")) in message
    assert out.is_symlink() or out.exists()  # left where it was
