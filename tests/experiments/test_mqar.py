"""MQAR: structure of the sequences (pairs, queries, answers) and its input checks."""
import numpy as np
import pytest
import torch

from xlstm_kit.experiments.mqar import FILLER, mqar_batch


@pytest.mark.parametrize("T, N, V", [(64, 4, 8192), (256, 64, 8192), (30, 10, 64)])
def test_mqar_structure(T, N, V):
    b = mqar_batch(np.random.default_rng(3), 8, T, N, V)
    assert b.inputs.shape == b.targets.shape == b.mask.shape == (8, T)
    assert b.inputs.dtype == torch.long and b.mask.dtype == torch.bool
    half = V // 2
    for r in range(8):
        x, y, m = b.inputs[r].tolist(), b.targets[r].tolist(), b.mask[r].tolist()
        keys, values = x[0 : 2 * N : 2], x[1 : 2 * N : 2]
        assert len(set(keys)) == N and all(1 <= k < half for k in keys)
        assert all(half <= v < V for v in values)
        pairs = dict(zip(keys, values))
        assert not any(m[: 2 * N])
        queries = [p for p in range(T) if m[p]]
        assert len(queries) == N
        assert sorted(x[p] for p in queries) == sorted(keys)  # every key asked once
        for p in queries:
            assert y[p] == pairs[x[p]]  # the value paired with that key earlier
        assert all(x[p] == FILLER for p in range(2 * N, T) if not m[p])


def test_mqar_determinism_and_variety():
    a = mqar_batch(np.random.default_rng(0), 4, 64, 8)
    b = mqar_batch(np.random.default_rng(0), 4, 64, 8)
    c = mqar_batch(np.random.default_rng(1), 4, 64, 8)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.inputs, c.inputs)
    assert not torch.equal(a.mask[0], a.mask[1])  # query positions differ between rows


def test_mqar_bad_shapes():
    with pytest.raises(ValueError, match="too short"):
        mqar_batch(np.random.default_rng(0), 2, 64, 32)
    with pytest.raises(ValueError, match="too few keys"):
        mqar_batch(np.random.default_rng(0), 2, 64, 8, vocab_size=16)
