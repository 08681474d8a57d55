"""score_continuations (what the lm-eval backend's log-likelihoods run on, torch only): packed,
contexts read once, equal to one plain forward over context + continuation per request, whatever
the batching; for every block type (mLSTM, sLSTM, DPLR; the xLSTM-7B family's large block)."""
from __future__ import annotations

import random

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.evaluation import score_continuations

from .conftest import LARGE, noisy

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)

CONFIGS = {
    "paper blocks": dict(vocab_size=64, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], dplr_at=[2]),
    "large": {**LARGE, "vocab_size": 64},
}


def requests(seed: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """Contexts of 1 to 80 tokens (past the chunk size), each with 1 to 4 continuations of 1 to 9
    tokens, interleaved as lm-eval hands them over."""
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        ctx = [rng.randrange(vocab) for _ in range(rng.choice([1, 5, 37, 80]))]
        out += [(ctx, [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 9]))]) for _ in range(rng.randint(1, 4))]
    rng.shuffle(out)
    return out


def direct(model, ctx, cont):
    ids = torch.tensor(ctx + cont)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None, :-1])[0].double(), -1)[len(ctx) - 1:]
    target = torch.tensor(cont)
    return logp.gather(1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_equals_one_forward_per_request_for_any_batching(kind):
    torch.manual_seed(0)
    model = noisy(XLSTMLanguageModel(XLSTMConfig(**CONFIGS[kind]))).eval()
    reqs = requests(1, model.config.vocab_size)
    # one greedy continuation, so that both answers of `greedy` are checked
    ctx = reqs[0][0]
    with torch.no_grad():
        best = [int(model(torch.tensor(ctx)[None])[0, -1].argmax())]
        best.append(int(model(torch.tensor(ctx + best)[None])[0, -1].argmax()))
    reqs.append((ctx, best))
    want = [direct(model, c, k) for c, k in reqs]
    assert want[-1][1] and not all(g for _, g in want)
    for limits in (dict(), dict(batch_size=1), dict(batch_size=5, max_batch_tokens=40), dict(max_batch_rows=3)):
        got = score_continuations(model, reqs, **limits)
        for (lp, greedy), s in zip(want, got, strict=True):
            assert abs(s.logprob - lp) <= 1e-5 * max(1.0, abs(lp)), (limits, s, lp)
            assert s.greedy == greedy


def test_contexts_are_read_once_and_calls_are_packed():
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(**CONFIGS["paper blocks"])).train()
    reqs = requests(2, model.config.vocab_size)
    calls = []
    real = model.forward

    def spy(tokens, *a, **kw):
        calls.append((tokens.shape[0], tokens.shape[1], kw.get("cu_seqlens")))
        return real(tokens, *a, **kw)

    model.forward = spy
    progress = []
    score_continuations(model, reqs, batch_size=6, progress=progress.append)
    assert model.training  # put back in the mode it came in
    assert sum(progress) == len(reqs) and len(progress) > 1
    contexts = {tuple(c) for c, _ in reqs}
    read = sum(t for _, t, _ in calls)
    assert read == sum(map(len, contexts)) + sum(len(k) - 1 for _, k in reqs)
    assert all(b == 1 and cu is not None for b, _, cu in calls)  # one packed row, never padded


def test_bad_requests_are_refused():
    model = XLSTMLanguageModel(XLSTMConfig(**CONFIGS["paper blocks"]))
    assert score_continuations(model, []) == []
    with pytest.raises(XLSTMKitError, match="request 1 has an empty context"):
        score_continuations(model, [([1], [2]), ([], [2])])
    with pytest.raises(XLSTMKitError, match="request 0 has an empty continuation"):
        score_continuations(model, [([1], [])])
    with pytest.raises(XLSTMKitError, match="batch_size must be None or an integer >= 1"):
        score_continuations(model, [([1], [2])], batch_size=0)


def test_state_rows_per_batch_stay_within_the_limit():
    """Each batch holds at most max_batch_rows recurrent states (one per context and per
    continuation), except a group larger than that, which runs alone."""
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(**CONFIGS["paper blocks"])).eval()
    groups = {(1, 2): 2, (3, 3, 3, 3, 3): 4, (4, 4): 1, (5, 6, 7): 7}  # context -> continuations: 3, 5, 2, 8 rows
    reqs = [(list(ctx), [n + 1, n + 2]) for ctx, k in groups.items() for n in range(k)]
    rows = []
    real = model.forward

    def spy(tokens, *a, **kw):
        rows.append(len(kw["cu_seqlens"]) - 1)
        return real(tokens, *a, **kw)

    model.forward = spy
    score_continuations(model, reqs, max_batch_rows=6)
    per_batch = sorted(rows[k] + rows[k + 1] for k in range(0, len(rows), 2))  # contexts + continuations
    assert per_batch == [5, 5, 8]  # (5 rows) and (3 + 2 rows) within 6; the 8-row group alone
