"""The prompt reader: pieces of power-of-two lengths from each request's own state row reach
the state and the logits of one read (float64 on the CPU; on a GPU the recorded graphs against
the same reads run eagerly)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.serve.prefill import PromptReader

pytestmark = pytest.mark.usefixtures("single_thread")


def model64(kind="padded"):
    """A float64 model whose blocks read padded rows (mLSTM, sLSTM), or one whose DPLR block
    does not (read in pieces of exact power-of-two lengths)."""
    torch.manual_seed(0)
    blocks = dict(slstm_at=[1]) if kind == "padded" else dict(dplr_at=[1])
    cfg = XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, chunk_size=8, **blocks)
    m = XLSTMLanguageModel(cfg).double().eval()
    assert m.supports_lengths == (kind == "padded")
    return m


def flat(state):
    return torch.cat([x.reshape(x.shape[0], -1) for s in state for x in s], 1)


# replays and decode steps of the first read below (lengths 37, 5, 16, 1, 64; pieces up to 16):
# padded: four rounds of one 16-token piece each; exact pieces: L=16 four times (64's pieces,
# with 37's two and 16's one alongside), L=4 once (37's and 5's), L=1 once (37's, 5's and 1),
# and with step_below=4 the L=4 piece as 4 steps and L=1 as one
FIRST_READ = {("padded", 0): (4, 0), ("padded", 4): (4, 0), ("pow2", 0): (6, 0), ("pow2", 4): (6, 5),
              ("at once", 0): (1, 0)}


@pytest.mark.parametrize("kind, step_below", list(FIRST_READ))
@torch.no_grad()
def test_reads_equal_one_read_from_each_rows_state(kind, step_below):
    """In pieces (as the graphs read; the shortest as decode steps) or at once (one packed
    call, the reads without graphs); a second read goes on from where the first left."""
    m = model64("pow2" if kind == "pow2" else "padded")
    reader = PromptReader(m, 6, 16, "cpu", pieces=kind != "at once", step_below=step_below)
    steps = []
    real_step = m.step
    m.step = lambda *a, **k: steps.append(1) or real_step(*a, **k)
    rng = np.random.default_rng(0)
    lengths = [37, 5, 16, 1, 64, 23]
    toks = [rng.integers(0, 256, n) for n in lengths]
    # rows 2 and 4 continue from a state, the others start from zeros; row 5 is not read
    _, start = m(torch.as_tensor(rng.integers(0, 256, 9))[None], return_state=True)
    inits = [None, None, start, None, start]
    rows = [3, 1, 2, 0, 4]
    for row, init in zip(rows, inits):
        reader.load(row, init)
    reader.load(5, start)
    before5 = reader.work[5].clone()
    logits = reader.read(rows, toks[:5])
    assert (reader.replays, len(steps)) == FIRST_READ[kind, step_below]
    # four more tokens each for the first two: a read of one length (decode steps where allowed)
    more = [rng.integers(0, 256, 4) for _ in range(2)]
    replays, n_steps = reader.replays, len(steps)
    logits[:2] = reader.read(rows[:2], more)
    assert reader.replays == replays + 1
    assert len(steps) - n_steps == (4 if step_below >= 4 and kind != "at once" else 0)
    for j, t in enumerate(toks[:5]):
        t = np.concatenate([t, more[j]]) if j < 2 else t
        out, state = m(torch.as_tensor(t)[None], state=inits[j], return_state=True)
        torch.testing.assert_close(logits[j], out[0, -1], rtol=0, atol=1e-12)
        torch.testing.assert_close(reader.work[rows[j]], flat(state)[0], rtol=0, atol=1e-12)
        got = reader.row_state(rows[j])
        torch.testing.assert_close(flat(got), flat(state), rtol=0, atol=1e-12)
    assert torch.equal(reader.work[5], before5)


@pytest.mark.parametrize("kind, step_below", [("padded", 0), ("padded", 2), ("pow2", 0), ("pow2", 2)])
@torch.no_grad()
def test_a_piece_longer_than_the_longest_repeats_and_lengths_round_down(kind, step_below):
    # one row: its state's views are contiguous, which the steps must not update in place
    m = model64(kind)
    reader = PromptReader(m, 2, 24, "cpu", pieces=True, step_below=step_below)
    assert reader.lengths == ([16] if kind == "padded" else [16, 8, 4, 2, 1])
    t = np.random.default_rng(1).integers(0, 256, 50)  # 16 x 3 + 2
    reader.load(0, None)
    [lg] = reader.read([0], [t])
    assert reader.replays == 4  # 16, 16, 16, then 2 (padded to 16, exact, or two steps)
    out, state = m(torch.as_tensor(t)[None], return_state=True)
    torch.testing.assert_close(lg, out[0, -1], rtol=0, atol=1e-12)
    torch.testing.assert_close(reader.work[0], flat(state)[0], rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("step_below", [0, 4])
@torch.no_grad()
def test_cuda_graphs_read_as_the_eager_pieces(step_below):
    torch.manual_seed(0)
    cfg = XLSTMConfig(vocab_size=256, d_model=128, n_blocks=4, n_heads=2, slstm_at=[1])
    m = XLSTMLanguageModel(cfg).cuda().eval()
    graphs = PromptReader(m, 4, 64, "cuda", step_below=step_below)
    graphs.capture()
    assert graphs.padded
    assert len(graphs.graphs) == len(graphs.buckets) * (len(graphs.lengths) + len(graphs.step_lengths))
    eager = PromptReader(m, 4, 64, "cuda", cuda_graph=False)
    rng = np.random.default_rng(2)
    _, start = m(torch.as_tensor(rng.integers(0, 256, 9), device="cuda")[None], return_state=True)
    for reads in ([100, 3, 64], [1], [7, 200, 33, 64], [3, 3]):
        toks = [rng.integers(0, 256, n) for n in reads]
        rows = list(range(len(reads)))[::-1]
        for r in (graphs, eager):
            for i, row in enumerate(rows):
                r.load(row, start if i % 2 else None)
        a, b = graphs.read(rows, toks), eager.read(rows, toks)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(graphs.work[:len(reads)], eager.work[:len(reads)], rtol=1e-4, atol=1e-4)
        for j, t in enumerate(toks):  # and one read of the whole prompt
            out, state = m(torch.as_tensor(t, device="cuda")[None], state=start if j % 2 else None,
                           return_state=True)
            torch.testing.assert_close(a[j], out[0, -1], rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_the_graphs_self_check_refuses_pieces_that_lose_the_state(monkeypatch):
    """capture() ends with a probe read through the pieces and at once; a recorded read that
    replays a stale value (here: every piece read from the zero state) must not serve."""
    m = model64()
    reader = PromptReader(m, 2, 16, "cpu", pieces=True)
    reader._check_graphs()  # faithful pieces pass
    run = reader._run

    def from_zeros(L, idx, ids, lengths=None):
        reader.work.index_fill_(0, idx, 0.0)
        return run(L, idx, ids, lengths)

    monkeypatch.setattr(reader, "_run", from_zeros)
    with pytest.raises(RuntimeError, match="differ from eager ones"):
        reader._check_graphs()
