"""Packed training (xlstm_kit.training.packing): a packed step equals the sum over documents of separate
steps; packed validation equals evaluating each document alone; documents from files / EOS."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.training.data import document_starts_from_eos, load_data, split_documents
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.training.packing import IGNORE, PackedSampler, PackedTokens, packed_windows
from xlstm_kit.training import TrainConfig, evaluate, lm_loss, train, train_step

VOCAB = 64


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def make_model(slstm_at=(1,), seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=VOCAB, d_model=32, n_blocks=2, n_heads=2, chunk_size=4,
                                           slstm_at=list(slstm_at))).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def stream(lengths, seed=0):
    g = np.random.default_rng(seed)
    tokens = g.integers(0, VOCAB, sum(lengths)).astype(np.uint16)
    return tokens, np.cumsum([0] + list(lengths[:-1])).astype(np.int64)


def doc_loss_sum(model, tokens, a, b):
    """Summed next-token loss of tokens[a:b] read alone (nothing for a 1-token document)."""
    if b - a < 2:
        return None
    x = torch.from_numpy(tokens[a:b].astype(np.int64))[None]
    return F.cross_entropy(model(x[:, :-1]).float()[0], x[0, 1:], reduction="sum")


def test_packed_windows_layout():
    tokens, starts = stream([3, 1, 5, 2, 4])
    (inputs, target) = packed_windows(tokens, starts, [0, 7], 6)
    assert isinstance(inputs, PackedTokens)
    # window [0, 6): docs at 0, 3, 4; window [7, 13): docs at 9, 11 (and the window start)
    assert inputs.cu_seqlens.tolist() == [0, 3, 4, 6, 8, 10, 12]
    assert inputs.tokens[0].tolist() == tokens[0:6].tolist() + tokens[7:13].tolist()
    ignored = (target[0] == IGNORE).nonzero().flatten().tolist()
    assert ignored == [2, 3, 7, 9]   # ends of docs 0, 1 (window 1), docs 2 (ends at 8), 3 (ends at 10)


def test_packed_step_equals_sum_over_documents():
    lengths = [3, 1, 5, 2, 4, 6]
    tokens, starts = stream(lengths, seed=1)
    model = make_model()
    inputs, target = packed_windows(tokens, starts, [0], len(tokens) - 1)   # every document whole
    n_targets = int((target != IGNORE).sum())
    assert n_targets == sum(n - 1 for n in lengths)
    ref_loss, ref_grads = 0.0, [torch.zeros_like(p) for p in model.parameters()]
    for a, n in zip(starts, lengths):
        loss = doc_loss_sum(model, tokens, int(a), int(a) + n)
        if loss is None:
            continue
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        ref_loss += loss.item()
        ref_grads = [r + (0 if gr is None else gr) for r, gr in zip(ref_grads, grads)]
    before = [p.detach().clone() for p in model.parameters()]
    out = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [(inputs, target)], lm_loss, lr=1.0,
                     precision="fp32")
    assert out.loss.item() == pytest.approx(ref_loss / n_targets, rel=1e-6)
    for p, b, r in zip(model.parameters(), before, ref_grads):
        # the loss is taken in float32 (lm_loss): agreement to ~1e-8
        torch.testing.assert_close(b - p.detach(), r / n_targets, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("slstm_at", [(), (1,)])
def test_packed_validation_equals_each_document_alone(slstm_at):
    lengths = [7, 1, 12, 3, 9, 5]    # seq_len 4: documents span up to 3 windows
    tokens, starts = stream(lengths, seed=2)
    model = make_model(slstm_at, seed=3)
    m = evaluate(model, tokens, seq_len=4, batch_size=2, max_batches=None, token_bytes=np.ones(VOCAB), doc_starts=starts)
    total, count = 0.0, 0
    with torch.no_grad():
        for a, n in zip(starts, lengths):
            loss = doc_loss_sum(model, tokens, int(a), int(a) + n)
            if loss is not None:
                total += loss.item()
                count += n - 1
    assert m.tokens == count
    assert m.batches == m.split_batches == 5    # 9 windows of 4 tokens in batches of 2: all of them
    assert m.loss == pytest.approx(total / count, rel=1e-6)
    plain = evaluate(model, tokens, seq_len=4, batch_size=2, max_batches=None, token_bytes=np.ones(VOCAB))
    assert abs(plain.loss - m.loss) > 1e-4   # the resets matter


def test_sampler_and_documents_from_files(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    texts = ["first document " * 9, "second", "third one, a bit longer " * 7]
    for j, t in enumerate(texts):
        (corpus / f"{j}.txt").write_text(t)
    data = load_data(str(corpus), "byte", val_fraction=0.2, cache_dir=tmp_path / "cache", documents=True)
    lens = [len(t.encode()) for t in texts]
    full = np.concatenate([data.train, data.val])
    assert full.astype(np.uint8).tobytes() == "".join(texts).encode()
    split = len(data.train)
    want = [s for s in np.cumsum([0] + lens[:-1]) if s < split]
    assert data.train_docs.tolist() == want
    assert data.val_docs[0] == 0 and all(d > 0 for d in data.val_docs[1:])
    plain = load_data(str(corpus), "byte", val_fraction=0.2, cache_dir=tmp_path / "cache")
    assert plain.train_docs is None
    sampler = PackedSampler(data.train, data.train_docs, 16, 4, seed=0)
    inputs, target = sampler.batch(3)
    assert inputs.tokens.shape == (1, 64) and target.shape == (1, 64)
    cu = inputs.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 64 and all(c in cu for c in (16, 32, 48))
    starts = sampler.window_starts(12, 4)
    for j, s in enumerate(starts):   # inputs are the plain sampler's windows, in its order
        assert inputs.tokens[0, 16 * j:16 * (j + 1)].tolist() == data.train[s:s + 16].tolist()


def test_eos_documents_and_split():
    ids = np.array([5, 6, 0, 7, 0, 8, 9, 0], dtype=np.uint16)
    assert document_starts_from_eos(ids, 0).tolist() == [0, 3, 5]
    assert document_starts_from_eos(ids, None) is None
    assert document_starts_from_eos(ids, 3) is None
    train, val = split_documents(np.array([0, 3, 5]), 4)
    assert train.tolist() == [0, 3] and val.tolist() == [0, 1]


def test_train_pack_runs_and_refuses_without_documents(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for j in range(4):
        (corpus / f"{j}.txt").write_text(f"document number {j} " * (3 + 4 * j))
    data = load_data(str(corpus), "byte", cache_dir=tmp_path / "cache", documents=True)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, chunk_size=8,
                                           slstm_at=[1]))
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=0, eval_interval=0, eval_batches=2,
                      checkpoint_interval=0, eval_at_start=False)
    result = train(model, data, cfg, handle_signals=False)
    assert result.step == 2 and np.isfinite(result.evals[-1][1].loss)
    plain = load_data(str(corpus), "byte", cache_dir=tmp_path / "cache")
    with pytest.raises(XLSTMKitError, match="needs data with documents"):
        train(model, plain, TrainConfig(**{**cfg.to_dict(), "pack": True}), handle_signals=False)


def test_cli_train_packs_a_folder_of_documents(tmp_path, monkeypatch, capsys):
    from xlstm_kit.cli import app as cli

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for j in range(5):
        (corpus / f"{j}.txt").write_text(f"text of document {j}. " * (4 + 3 * j))
    fast = ["--steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
            "--data", str(corpus)]
    assert cli.main(["train", "--out", str(tmp_path / "packed"), *fast]) == 0
    assert "documents packed (state reset at each)" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "plain"), "--no-pack", *fast]) == 0
    assert "documents packed" not in capsys.readouterr().err
    # eval follows the run: documents alone for the packed run, plain windows for the other
    assert cli.main(["eval", str(tmp_path / "packed"), "--batch-size", "2"]) == 0
    assert "each document alone" in capsys.readouterr().out
    assert cli.main(["eval", str(tmp_path / "plain"), "--batch-size", "2"]) == 0
    assert "each document alone" not in capsys.readouterr().out


def test_train_config_pack_values():
    assert TrainConfig().pack is None and TrainConfig(pack=False).pack is False
    with pytest.raises(XLSTMKitError, match="pack must be None, True or False"):
        TrainConfig(pack="auto")
