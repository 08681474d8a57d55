"""`model(tokens, lengths=...)`: rows of one fixed-shape batch that are only their first
lengths[b] tokens, the rest padding. The state after a padded row must be the state after its
real tokens alone, and so must the logits at its last real token (float64, both block families,
padding that fills whole chunks, a row continuing from a state)."""
from __future__ import annotations

import os

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    "neurips": dict(vocab_size=97, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], chunk_size=8),
    "neurips-conv2": dict(vocab_size=97, d_model=32, n_blocks=2, n_heads=2, slstm_at=[0], chunk_size=8,
                          conv_kernel_size=2),
    "large": dict(family="large", vocab_size=97, d_model=32, n_blocks=2, n_heads=2, qk_dim_factor=1.0,
                  chunk_size=8),
}


def model_for(name):
    torch.manual_seed(0)
    cfg = XLSTMConfig(**CONFIGS[name])
    m = XLSTMLanguageModel(cfg).double().eval()
    with torch.no_grad():  # gates and biases away from their input-independent init
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def flat(state):
    return torch.cat([x.reshape(x.shape[0], -1) for s in state for x in s], 1)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_padded_rows_reach_the_state_and_logits_of_their_real_tokens(name):
    m = model_for(name)
    g = torch.Generator().manual_seed(1)
    T = 29  # chunks of 8: row 2's padding covers three whole chunks
    lengths = torch.tensor([29, 13, 3, 1])
    tokens = torch.randint(0, 97, (4, T), generator=g)
    # rows 1 and 3 continue from a state, rows 0 and 2 start from zeros
    _, start = m(torch.randint(0, 97, (4, 11), generator=g), return_state=True)
    zero = m.init_state(4)
    init = [type(s)(*(torch.stack([z[0], a[1], z[2], a[3]]) for z, a in zip(zs, st)))
            for s, zs, st in zip(start, zero, start)]
    logits, state = m(tokens, state=init, return_state=True, lengths=lengths,
                      logits_to_keep=(lengths - 1)[:, None])
    for b, n in enumerate(lengths.tolist()):
        row_init = [type(s)(*(x[b:b + 1] for x in s)) for s in init]
        want, want_state = m(tokens[b:b + 1, :n], state=row_init, return_state=True)
        torch.testing.assert_close(logits[b, 0], want[0, -1], rtol=0, atol=1e-10)
        torch.testing.assert_close(flat(state)[b], flat(want_state)[0], rtol=0, atol=1e-10)


@torch.no_grad()
def test_padding_changes_nothing_even_where_its_tokens_differ():
    """The state must not depend on what the padding holds."""
    m = model_for("neurips")
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 97, (2, 20), generator=g)
    other = tokens.clone()
    other[:, 7:] = torch.randint(0, 97, (2, 13), generator=g)
    lengths = torch.tensor([7, 7])
    _, a = m(tokens, return_state=True, lengths=lengths)
    _, b = m(other, return_state=True, lengths=lengths)
    assert not torch.equal(tokens, other)
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=1e-12)


@torch.no_grad()
def test_bad_lengths_are_one_line_errors():
    m = model_for("large")
    tokens = torch.zeros(2, 5, dtype=torch.long)
    for bad, match in [(torch.tensor([1, 6]), r"lie in \[1, 5\]"), (torch.tensor([0, 2]), r"lie in \[1, 5\]"),
                       (torch.tensor([1.0, 2.0]), "integer tensor of shape"), (torch.tensor([3]), r"shape \[2\]"),
                       ([1, 2], "integer tensor")]:
        with pytest.raises(XLSTMKitError, match=match):
            m(tokens, lengths=bad)
    with pytest.raises(XLSTMKitError, match="cannot be combined"):
        m(torch.zeros(1, 5, dtype=torch.long), lengths=torch.tensor([5]), cu_seqlens=torch.tensor([0, 2, 5]))
    torch.manual_seed(0)
    dplr = XLSTMLanguageModel(XLSTMConfig(vocab_size=97, d_model=32, n_blocks=2, n_heads=2, dplr_at=[1]))
    assert not dplr.supports_lengths and m.supports_lengths
    with pytest.raises(XLSTMKitError, match="not supported by DPLRBlock"):
        dplr(tokens, lengths=torch.tensor([1, 2]))


TRITON_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.mark.skipif(not TRITON_HERE, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["neurips", "large"])
@torch.no_grad()
def test_the_kernels_take_the_no_op_gates(name):
    """The Triton kernels (float32) see gates of ±1e4 on padded steps and whole padded chunks."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(**CONFIGS[name], backend="triton")).to(dev).eval()
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([21, 4])
    tokens = torch.randint(0, 97, (2, 21), generator=g)
    logits, state = m(tokens.to(dev), return_state=True, lengths=lengths.to(dev),
                      logits_to_keep=(lengths - 1)[:, None].to(dev))
    for b, n in enumerate(lengths.tolist()):
        want, want_state = m(tokens[b:b + 1, :n].to(dev), return_state=True)
        torch.testing.assert_close(logits[b, 0], want[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(flat(state)[b], flat(want_state)[0], rtol=1e-4, atol=1e-4)


def test_the_large_block_reads_the_same_with_and_without_autograd():
    """Without autograd the large block maps its input with one GEMM per weight (no
    concatenated copy), and its feed-forward unfused at few tokens: the same outputs."""
    m = model_for("large")
    block = m.blocks[0]
    g = torch.Generator().manual_seed(4)
    for T in (3, 40):  # the feed-forward's unfused path up to d_model (32) tokens
        x = torch.randn(2, T, 32, generator=g, dtype=torch.float64)
        with torch.no_grad():
            y0, s0 = block(x, return_state=True)
        y1, s1 = block(x, return_state=True)
        assert y1.requires_grad and not y0.requires_grad
        torch.testing.assert_close(y0, y1, rtol=0, atol=1e-12)
        torch.testing.assert_close(flat([s0]), flat([s1]), rtol=0, atol=1e-12)
