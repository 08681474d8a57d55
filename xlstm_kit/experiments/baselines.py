"""Baseline sequence models for the synthetic experiments, with the xLSTM models' interface
(tokens [B, T] -> logits [B, T, vocab], `logits_to_keep` as XLSTMLanguageModel.forward's) and
initialisation scheme.

- ``TransformerLM``: Llama-style: pre-RMSNorm, causal multi-head attention with rotary position
  embeddings (RoPE) through ``scaled_dot_product_attention``, SwiGLU feed-forward; optionally
  (``qk_conv``) the mLSTM block's causal convolution in front of q and k.
- ``LSTMLM``: torch ``nn.LSTM`` in the sLSTM block's residual frame: x + LSTM(LN(x)), then
  x + GatedFeedForward(LN(x)) — the same block as xLSTM's sLSTM block with the cell swapped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import XLSTMKitError
from ..layers.common import CausalConv1d, GatedFeedForward, round_up, small_init_, wang_init_
from ..layers.fused import conv_silu
from ..models.xlstm import keep_positions


def _check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise XLSTMKitError(f"tokens must be an integer tensor [B, T], got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} {list(getattr(tokens, 'shape', []))}")
    if not tokens.numel():
        return
    if torch.compiler.is_compiling():  # no host read under torch.compile (see generate.check_token_ids)
        torch._assert_async((tokens.min().long() >= 0) & (tokens.max().long() < vocab_size),
                            f"tokens must lie in [0, {vocab_size - 1}]")
    elif int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise XLSTMKitError(f"tokens must lie in [0, {vocab_size - 1}]")


# ============================================================================ Transformer
def rope_tables(T: int, head_dim: int, device, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2] (float32) of rotary embeddings at positions 0 .. T-1."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv  # [T, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated pairwise (first half with second half, as Llama's rotate_half)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE; with `qk_conv` = K > 0, q and k read
    SiLU(causal depthwise conv_K(x)) instead of x (v reads x), as in the mLSTM block."""

    def __init__(self, d_model: int, n_heads: int, n_blocks: int, qk_conv: int = 0):
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise XLSTMKitError(f"d_model={d_model} must split into {n_heads} heads of even size")
        self.d_model, self.n_heads, self.n_blocks = d_model, n_heads, n_blocks
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.conv = CausalConv1d(d_model, qk_conv) if qk_conv else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        small_init_(self.qkv.weight, self.d_model)
        wang_init_(self.out.weight, self.d_model, self.n_blocks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        if self.conv is None:
            qkv = self.qkv(x)
        else:
            w_qk, w_v = self.qkv.weight.split([2 * C, C])
            c = conv_silu(x, None, self.conv.weight, self.conv.bias)  # one fused kernel where Triton runs
            qkv = torch.cat([F.linear(c, w_qk), F.linear(x, w_v)], dim=-1)
        q, k, v = qkv.view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)  # 3x [B,H,T,hd]
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, n_blocks: int):
        super().__init__()
        self.d_model, self.n_blocks = d_model, n_blocks
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        small_init_(self.up.weight, self.d_model)
        wang_init_(self.down.weight, self.d_model, self.n_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_dim: int, n_blocks: int, qk_conv: int = 0):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.attn = Attention(d_model, n_heads, n_blocks, qk_conv)
        self.ffn_norm = nn.RMSNorm(d_model, eps=1e-6)
        self.ffn = SwiGLU(d_model, ffn_dim, n_blocks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    """Llama-style causal Transformer: tokens [B, T] -> logits [B, T, vocab_size].

    SwiGLU hidden width 8/3 · d_model rounded up to a multiple of 64 (Llama's choice, which
    keeps the feed-forward parameter count of a 4× GELU MLP). `qk_conv` = K > 0 puts the mLSTM
    block's short causal convolution (kernel K, + SiLU) in front of every attention's q and k: an
    ablation for MQAR, where it hands attention the previous tokens that its lookup needs.
    `rope=False` drops the rotary embedding (no position signal but causality): the faster
    speed reference of the training benchmark.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, n_blocks: int = 2, n_heads: int = 4,
                 qk_conv: int = 0, rope: bool = True):
        super().__init__()
        self.vocab_size, self.d_model, self.rope = vocab_size, d_model, rope
        self.embedding = nn.Embedding(vocab_size, d_model)
        ffn_dim = round_up(8 * d_model / 3, 64)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, ffn_dim, n_blocks, qk_conv) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.head_dim = d_model // n_heads
        small_init_(self.embedding.weight, d_model)
        small_init_(self.lm_head.weight, d_model)

    def forward(self, tokens: torch.Tensor, logits_to_keep: "int | torch.Tensor" = 0) -> torch.Tensor:
        _check_tokens(tokens, self.vocab_size)
        x = self.embedding(tokens.long())
        cos, sin = rope_tables(tokens.shape[1], self.head_dim, tokens.device) if self.rope else (None, None)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(keep_positions(x, logits_to_keep)))


# ============================================================================ LSTM
class LSTMBlock(nn.Module):
    """x + LSTM(LN(x)), then x + GatedFeedForward(LN(x)) (the sLSTM block's frame)."""

    def __init__(self, d_model: int, ffn_dim: int, n_blocks: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.lstm = nn.LSTM(d_model, d_model, batch_first=True)
        self.ffn_norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.ffn = GatedFeedForward(d_model, ffn_dim, n_blocks=n_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.norm(x))  # [B, T, d_model]
        x = x + h
        return x + self.ffn(self.ffn_norm(x))


class LSTMLM(nn.Module):
    """Residual LSTM language model: tokens [B, T] -> logits [B, T, vocab_size]. The LSTM keeps
    torch's default initialisation; feed-forward width 1.3 · d_model as in the sLSTM blocks."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_blocks: int = 2):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, d_model)
        ffn_dim = round_up(1.3 * d_model, 64)
        self.blocks = nn.ModuleList(LSTMBlock(d_model, ffn_dim, n_blocks) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        small_init_(self.embedding.weight, d_model)
        small_init_(self.lm_head.weight, d_model)

    def forward(self, tokens: torch.Tensor, logits_to_keep: "int | torch.Tensor" = 0) -> torch.Tensor:
        _check_tokens(tokens, self.vocab_size)
        x = self.embedding(tokens.long())
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(keep_positions(x, logits_to_keep)))


class PlainLSTMLM(nn.Module):
    """The classic LSTM language model: embedding -> `n_layers`-layer ``nn.LSTM`` (torch's
    default init) -> linear head; tokens [B, T] -> logits [B, T, vocab_size]. No residual
    connections, norms or feed-forward (the paper's "LSTM" row; LSTMLM is its "LSTM (Block)")."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 2):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.lstm = nn.LSTM(d_model, d_model, num_layers=n_layers, batch_first=True)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor, logits_to_keep: "int | torch.Tensor" = 0) -> torch.Tensor:
        _check_tokens(tokens, self.vocab_size)
        h, _ = self.lstm(self.embedding(tokens.long()))
        return self.lm_head(keep_positions(h, logits_to_keep))
