"""Saved-activation budget per 125M block (bytes per token), counted exactly on the CPU under
bf16 autocast with xlstm_kit.bench.memory; a change that makes the layers save more fails here.

"rest" is what the layer saves around its sequence op (the op's own saves and its inputs and
outputs are the kernels' business). Budgets: the mLSTM block saves its input (float32 residual
stream, 4 B x d; its normalised form is recomputed in the backward), x_m and z (bf16, 2 x 2 B x
inner; SiLU(conv(x_m)) is recomputed by its readers) and float32 norm statistics: 9.3 KB at d 768, inner 1536 (unfused: 36.9 KB on the CPU, 50 KB on the H200,
where autocast also runs the head-wise norm in float32). The sLSTM block: its input, the bf16
input of the gates, the feed-forward's input and up-projection output: 11.8 KB (unfused: 26.7 KB).
"""
import pytest
import torch

import xlstm_kit.layers.mlstm as mlstm_mod
import xlstm_kit.layers.slstm as slstm_mod
from xlstm_kit.bench.memory import saved_bytes_per_token
from xlstm_kit.layers import MLSTMBlock, SLSTMBlock

D, INNER, HEADS = 768, 1536, 4  # the 125M preset


def _per_token(block, target):
    make = lambda n: torch.randn(1, n, D, requires_grad=True)  # noqa: E731
    return saved_bytes_per_token(make, block, tokens=(64, 128), autocast=torch.bfloat16, exclude=[target])


# float32 mean and rstd per token (layer norm) and per token and head (head-wise norm)
STATS = 8 + 8 * HEADS


FFN = 1024
BUDGETS = {
    "mlstm": 4 * D + 2 * 2 * INNER + STATS,
    # input (float32) and its bf16 copy for the gates; the feed-forward: its norm's float32
    # input and the up-projection's bf16 output (the normalised input, GELU output and gated
    # product are recomputed)
    "slstm": 4 * D + 2 * D + 4 * D + 2 * 2 * FFN + 2 * 8 + 8 * HEADS,
}


@pytest.mark.parametrize("kind", ["mlstm", "slstm"])
def test_saved_bytes_per_token_within_budget(kind):
    budget = BUDGETS[kind]
    torch.manual_seed(0)
    if kind == "mlstm":
        block = MLSTMBlock(D, INNER, HEADS, n_blocks=24, chunk_size=64, backend="torch")
        target = (mlstm_mod, "mlstm_chunkwise")
    else:
        block = SLSTMBlock(D, HEADS, FFN, n_blocks=24, backend="torch")
        target = (slstm_mod, "slstm_recurrent")
    parts = _per_token(block, target)
    rest, fixed = parts["rest"]
    assert parts["op"][0] > 0  # the sequence op was found and set apart
    assert rest <= budget, f"{kind} block saves {rest:.0f} B/token beside its sequence op (budget {budget})"
    # the fixed part is weight copies: a few MB, not activations mislabelled
    assert 0 <= fixed < 32 * 2**20


def test_saved_bytes_counts_each_storage_once():
    """A tensor saved by several ops (and its views) counts once; parameters are not counted."""
    from xlstm_kit.bench.memory import saved_bytes
    lin = torch.nn.Linear(8, 8)

    class TwoUses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            h = torch.tanh(self.lin(x))  # tanh saves its output h
            return (h * h[:, :4].repeat(1, 2)).sum(-1)  # mul saves h again and the repeat

    x = torch.randn(5, 8, requires_grad=True)
    got = saved_bytes(TwoUses(), x)
    # x (saved by the linear), h and the repeated half: three [5, 8] float32 tensors
    assert got["total"] == 3 * 5 * 8 * 4, got
