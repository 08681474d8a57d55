"""The paper's formal tasks: vocabularies, the four further Figure 4 tasks on
hand-checked examples, the no-teacher-forcing format, and the plain LSTM baseline."""
import numpy as np
import pytest
import torch

from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.experiments import formal_paper as FP
from xlstm_kit.experiments.formal import PAD, SEP, make_batch, sample_train_batch
from xlstm_kit.experiments.registry import get_task, task_set
from xlstm_kit.experiments.models import build_model
from xlstm_kit.experiments.task_loop import evaluate_formal, masked_loss

P, M, X, O, C, U, EQ = FP.PLUS, FP.MINUS, FP.TIMES, FP.OPEN, FP.CLOSE, FP.UNKNOWN, FP.EQUALS


def test_paper_vocabularies_and_task_list():
    tasks = task_set("paper")
    assert len(tasks) == 12
    assert {"majority_count", "missing_duplicate", "modular_arithmetic_brackets", "solve_equation"} <= set(tasks)
    assert tasks["majority"].n_in == 64 and tasks["majority_count"].n_in == 64
    assert tasks["reverse_string"].n_in == 10 and tasks["bucket_sort"].n_in == 10
    assert tasks["missing_duplicate"].n_out == 10
    assert get_task("majority").n_in == 4  # the small variant unchanged
    with pytest.raises(XLSTMKitError, match="variant"):
        task_set("huge")
    with pytest.raises(XLSTMKitError, match="solve_equation"):
        get_task("solve_equation")  # only in the paper set


def test_new_labels_by_hand():
    assert FP.majority_count_label([5, 7, 5, 63, 5, 7]) == [3]
    assert FP.majority_count_label([1] * 70) == [70 % 64]
    N = FP.MISSING
    assert FP.missing_duplicate_label([3, 9, 0, 3, N, 0]) == [9]
    with pytest.raises(XLSTMKitError):
        FP.missing_duplicate_label([3, N, 3, 9])  # MISSING in the first half
    # (2 + 3) * 4 = 20 = 0; 2 + 3 * 4 = 14 = 4; 1 - (2 - (3 * 3)) = 8 = 3
    assert FP.modular_arithmetic_brackets_label([O, 2, P, 3, C, X, 4]) == [0]
    assert FP.modular_arithmetic_brackets_label([2, P, 3, X, 4]) == [4]
    assert FP.modular_arithmetic_brackets_label([1, M, O, 2, M, O, 3, X, 3, C, C]) == [3]
    with pytest.raises(XLSTMKitError):
        FP.modular_arithmetic_brackets_label([O, 2, P, 3])
    # X * 2 + 1 = 0  ->  2X = 4  ->  X = 2;   (X + 1) * 3 = 1  ->  X + 1 = 2  ->  X = 1
    assert FP.solve_equation_label([U, X, 2, P, 1, EQ, 0]) == [2]
    assert FP.solve_equation_label([O, U, P, 1, C, X, 3, EQ, 1]) == [1]
    with pytest.raises(XLSTMKitError, match="solutions"):
        FP.solve_equation_label([U, X, 0, EQ, 0])  # every X solves it


@pytest.mark.parametrize("name", list(task_set("paper")))
def test_paper_generators_are_consistent(name):
    task = get_task(name, "paper")
    rng = np.random.default_rng(1)
    for n in (5, 6, 17, 40):
        x, y = task.sample(rng, n)
        assert len(x) <= max(n, 5) and all(0 <= s < task.n_in for s in x)
        assert len(y) <= task.max_output(n) and all(0 <= s < task.n_out for s in y)
    b = sample_train_batch(task, rng, 16, (3, 12), teacher_forcing=False)
    assert int(b.inputs.max()) < task.vocab_size and int(b.targets.max()) < task.vocab_size


def test_expression_samplers_are_well_formed():
    rng = np.random.default_rng(0)
    for n in range(1, 30):
        x, y = FP._sample_brackets(rng, n)
        assert len(x) == (n if n % 2 else max(1, n - 1)) and y == [FP._evaluate(x)]
        x, y = FP._sample_equation(rng, max(n, 5))
        assert FP.solve_equation_label(x) == y and len(x) <= max(n, 5)


def test_expression_values_match_python_arithmetic():
    # an independent reference: the token string as a Python expression (same precedence),
    # evaluated over the integers and reduced mod 5 at the end
    text = {P: "+", M: "-", X: "*", O: "(", C: ")"}
    rng = np.random.default_rng(3)
    for n in (1, 3, 7, 19, 41):
        for _ in range(40):
            e = FP._random_expression(rng, n)
            assert len(e) == n
            src = "".join(text.get(s, str(s)) for s in e)
            assert FP._values(e) == (eval(src) % 5,) * 5 and FP._evaluate(e) == eval(src) % 5
            digits = [i for i, s in enumerate(e) if s < FP.MOD]
            e[digits[len(digits) // 2]] = U
            src = "".join(text.get(s, "x" if s == U else str(s)) for s in e)
            assert FP._values(e) == tuple(eval(src, {"x": v}) % 5 for v in range(5))
    with pytest.raises(XLSTMKitError):
        FP._evaluate([U, P, 1])  # an unknown with no value given


def test_no_teacher_forcing_inputs_are_pad_at_answer_positions():
    task = get_task("reverse_string", "paper")
    x, y = [3, 1, 4, 1, 5], [5, 1, 4, 1, 3]
    inputs, targets, mask = task.encode(x, y, teacher_forcing=False)
    assert inputs == [2 + s for s in x] + [SEP] + [PAD] * 4
    assert [t for t, m in zip(targets, mask) if m] == [2 + task.n_in + s for s in y]
    assert mask == [False] * 5 + [True] * 5
    tf_inputs, _, _ = task.encode(x, y, teacher_forcing=True)
    assert tf_inputs[6:] == [2 + task.n_in + s for s in y[:-1]]  # the old format sees the answers
    b = make_batch(task, np.random.default_rng(0), [4, 9, 7], teacher_forcing=False)
    # every scored position's input is the action marker or PAD, never an output symbol
    at_answers = b.inputs[b.mask]
    assert bool(((at_answers == SEP) | (at_answers == PAD)).all())
    assert int((b.inputs == SEP).sum()) == 3 and int(b.mask.sum()) == 4 + 9 + 7


def test_loss_and_scoring_only_at_answer_positions():
    task = get_task("bucket_sort", "paper")
    torch.manual_seed(0)
    model = build_model("lstm-plain", task.vocab_size, d_model=16, n_blocks=2)
    b = make_batch(task, np.random.default_rng(0), [5, 8], teacher_forcing=False)
    logits = model(b.inputs).detach().requires_grad_(True)
    masked_loss(logits, b).backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, b.mask)
    res = evaluate_formal(model, task, [6, 7], 3, teacher_forcing=False)
    assert set(res["per_length"]) == {6, 7} and 0 <= res["accuracy"] <= 1


def test_plain_lstm_is_two_nn_lstm_layers():
    torch.manual_seed(0)
    m = build_model("lstm-plain", 12, d_model=16, n_blocks=2)
    assert m.lstm.num_layers == 2 and not hasattr(m, "blocks")
    tokens = torch.randint(0, 12, (2, 7))
    y = m(tokens)
    assert y.shape == (2, 7, 12)
    # causal: the first outputs do not depend on later tokens
    t2 = tokens.clone()
    t2[:, 5:] = (t2[:, 5:] + 1) % 12
    torch.testing.assert_close(m(t2)[:, :5], y[:, :5])
    block = build_model("lstm", 12, d_model=16, n_blocks=2)
    assert len(block.blocks) == 2 and sum(p.numel() for p in block.parameters()) != sum(p.numel() for p in m.parameters())
