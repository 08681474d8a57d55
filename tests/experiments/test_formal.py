"""Formal-language generators: exact labels on hand-made strings, encodings, batches, metrics."""
import numpy as np
import pytest
import torch

from xlstm_kit.experiments import formal as F
from xlstm_kit.experiments.formal import PAD, SEP, TASKS, make_batch, sample_train_batch, scaled_accuracy, sequence_accuracy
from xlstm_kit.experiments.registry import get_task

P, M, X = F.PLUS, F.MINUS, F.TIMES
A, B, POP, PA, PB = F.STACK_A, F.STACK_B, F.POP, F.PUSH_A, F.PUSH_B


@pytest.mark.parametrize("x, y", [([1, 0, 1, 1], [1]), ([1, 1, 0, 0], [0]), ([0, 0, 0], [0]), ([1], [1])])
def test_parity(x, y):
    assert F.parity_label(x) == y


@pytest.mark.parametrize("x, y", [([0, 1, 1, 0], [1]), ([0, 1, 1, 1], [0]), ([1, 0, 1], [1]), ([1, 1], [1]), ([0, 1], [0])])
def test_even_pairs(x, y):
    # "abba": pairs ab, ba -> 2 (even); "abbb": one ab -> odd
    assert F.even_pairs_label(x) == y
    assert y == [int(x[0] == x[-1])]


@pytest.mark.parametrize("x, y", [([1, 1, 1], [3]), ([2, 2], [3]), ([1, 1, 1, 1, 1, 1, 0], [1]), ([0, 0], [0]), ([2, 1, 2, 2], [3])])
def test_cycle_navigation(x, y):
    # moves: 0 stay, 1 forward, 2 back, on a cycle of 5 from 0
    assert F.cycle_navigation_label(x) == y


@pytest.mark.parametrize("x, y", [
    ([3, M, 2, X, 4, P, 1], [1]),   # 3 - 8 + 1 = -4 = 1 (mod 5)
    ([2, X, 3, X, 4], [4]),          # 24 = 4
    ([4, P, 4, P, 4], [2]),          # 12 = 2
    ([1, M, 4], [2]),                # -3 = 2
    ([3], [3]),
    ([2, P, 3, X, 3, M, 1], [0]),    # 2 + 9 - 1 = 10 = 0
])
def test_modular_arithmetic(x, y):
    assert F.modular_arithmetic_label(x) == y


def test_modular_arithmetic_rejects_malformed():
    with pytest.raises(ValueError, match="expression"):
        F.modular_arithmetic_label([1, P])
    with pytest.raises(ValueError, match="expression"):
        F.modular_arithmetic_label([1, 2, 3])


def test_reverse_and_sort_and_majority():
    assert F.reverse_string_label([1, 0, 0, 1, 1]) == [1, 1, 0, 0, 1]
    assert F.bucket_sort_label([4, 0, 3, 0, 2]) == [0, 0, 2, 3, 4]
    assert F.majority_label([2, 3, 3, 1, 3, 2]) == [3]
    assert F.majority_label([2, 1, 2, 1]) == [1]  # tie: the smaller symbol
    assert F.majority_label([0, 3, 3]) == [3]


@pytest.mark.parametrize("x, y", [
    ([A, B, PA, POP, POP], [A, F.STACK_END]),            # ab, push a, pop, pop -> a
    ([B, PB, PA], [A, B, B, F.STACK_END]),               # top to bottom
    ([A, POP, POP, POP], [F.STACK_END]),                 # pop on empty does nothing
    ([A, B, A, PB], [B, A, B, A, F.STACK_END]),
])
def test_stack_manipulation(x, y):
    assert F.stack_manipulation_label(x) == y


def test_stack_rejects_stack_symbol_after_actions():
    with pytest.raises(ValueError, match="action"):
        F.stack_manipulation_label([A, POP, B])


def test_encode_layout():
    task = get_task("reverse_string")
    inputs, targets, mask = task.encode([1, 0, 0], [0, 0, 1])
    o = 2 + task.n_in  # first output token id
    assert inputs == [3, 2, 2, SEP, o, o]
    assert targets == [PAD, PAD, PAD, o, o, o + 1]
    assert mask == [False, False, False, True, True, True]
    inputs, targets, mask = get_task("parity").encode([1, 1, 0], [0])
    assert inputs == [3, 3, 2, SEP] and targets == [PAD] * 3 + [4] and mask == [False] * 3 + [True]


@pytest.mark.parametrize("name", list(TASKS))
def test_samples_are_labelled_consistently_and_deterministic(name):
    task = TASKS[name]
    for n in (3, 8, 41):
        x, y = task.sample(np.random.default_rng(5), n)
        x2, y2 = task.sample(np.random.default_rng(5), n)
        assert (x, y) == (x2, y2)
        # modular arithmetic has the largest odd length <= n
        assert len(x) == (n if name != "modular_arithmetic" or n % 2 else n - 1)
        assert all(0 <= s < task.n_in for s in x) and all(0 <= s < task.n_out for s in y)
        assert 1 <= len(y) <= task.max_output(n)
    b1 = sample_train_batch(task, np.random.default_rng(1), 16)
    b2 = sample_train_batch(task, np.random.default_rng(1), 16)
    b3 = sample_train_batch(task, np.random.default_rng(2), 16)
    assert torch.equal(b1.inputs, b2.inputs) and torch.equal(b1.targets, b2.targets)
    assert not torch.equal(b1.inputs, b3.inputs)
    assert int(b1.inputs.max()) < task.vocab_size and int(b1.targets.max()) < task.vocab_size


def test_train_batch_lengths_masks_and_padding():
    task = get_task("bucket_sort")
    batch = sample_train_batch(task, np.random.default_rng(0), 64, (3, 40))
    assert batch.inputs.shape == (64, task.max_seq_len(40)) == (64, 80)
    n = batch.lengths
    assert int(n.min()) >= 3 and int(n.max()) <= 40 and len(set(n.tolist())) > 10
    for b in range(64):
        k = int(n[b])
        # scored positions: SEP and the outputs fed back, exactly n of them for sorting
        assert batch.mask[b].nonzero().flatten().tolist() == list(range(k, 2 * k))
        assert int(batch.inputs[b, k]) == SEP
        assert (batch.inputs[b, 2 * k:] == PAD).all()
        xs = (batch.inputs[b, :k] - 2).tolist()
        ys = (batch.targets[b, k : 2 * k] - 2 - task.n_in).tolist()
        assert ys == sorted(xs)
        # teacher forcing: each output is fed as the next input
        assert torch.equal(batch.inputs[b, k + 1 : 2 * k], batch.targets[b, k : 2 * k - 1])


def test_make_batch_pad_to_and_errors():
    task = get_task("parity")
    b = make_batch(task, np.random.default_rng(0), [5, 9], pad_to=64)
    assert b.inputs.shape == (2, 64) and b.mask.sum(1).tolist() == [1, 1]
    assert b.mask[0, 5] and b.mask[1, 9]
    with pytest.raises(ValueError, match="pad_to"):
        make_batch(task, np.random.default_rng(0), [50], pad_to=20)
    with pytest.raises(ValueError, match="unknown formal task"):
        get_task("parityy")


def test_scaled_accuracy():
    assert scaled_accuracy(0.5, 0.5) == 0.0
    assert scaled_accuracy(1.0, 0.5) == 1.0
    assert scaled_accuracy(0.75, 0.5) == pytest.approx(0.5)
    assert scaled_accuracy(0.6, 0.2) == pytest.approx(0.5)  # (0.6 - 0.2) / 0.8
    assert scaled_accuracy(0.0, 0.5) == -1.0
    with pytest.raises(ValueError):
        scaled_accuracy(0.5, 1.0)


def test_sequence_accuracy_hand_case():
    logits = torch.zeros(2, 3, 4)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 1.0
    logits[1, 0, 0] = logits[1, 1, 1] = logits[1, 2, 2] = 1.0
    targets = torch.tensor([[1, 2, 0], [0, 1, 3]])
    mask = torch.tensor([[True, True, True], [False, True, True]])
    acc = sequence_accuracy(logits, targets, mask)
    assert acc.tolist() == pytest.approx([2 / 3, 1 / 2])
    with pytest.raises(ValueError, match="scored"):
        sequence_accuracy(logits, targets, torch.zeros_like(mask))
