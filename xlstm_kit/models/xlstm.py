"""xLSTM language model: its configuration and the model itself, top to bottom.

    tokens [B, T] -> embedding -> n_blocks residual blocks (mLSTM or sLSTM, as `slstm_at` says)
                  -> LayerNorm -> LM head -> logits [B, T, vocab_size]

Family "large" (the xLSTM-7B architecture, xlstm_kit.nn.large): large blocks (RMSNorm -> mLSTM
layer -> residual, RMSNorm -> SwiGLU -> residual) -> RMSNorm -> LM head -> soft-capped logits.

Training runs every block in parallel over time (chunkwise mLSTM, sLSTM time loop); generation
runs the same weights one token at a time on a state whose size does not grow with the text.
The architecture and initialisation are those of the official `xlstm` package (2.0.6);
`xlstm_kit.compat` converts models both ways.
"""
from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _recompute

from . import checkpoint, hub
from .nn.common import round_up, small_init_
from .nn.dplr import DPLRBlock, DPLRState
from .nn.large import LargeBlock, RMSNorm, at_least_float32, soft_cap
from .nn.mlstm import MLSTMBlock, MLSTMState
from .nn.slstm import SLSTMBlock, SLSTMState
from .nn.varlen import block_varlen
from .ops._checks import check_cu_seqlens
from .errors import XLSTMKitError

BlockState = Union[MLSTMState, SLSTMState, DPLRState]
ModelState = list  # one BlockState per block, in block order

_RATIO = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")

CheckpointBlocks = Literal["none", "all", "mlstm", "slstm", "dplr"]
CHECKPOINT_BLOCKS: tuple[str, ...] = ("none", "all", "mlstm", "slstm", "dplr")
_BLOCK_KIND = {"mlstm": "m", "slstm": "s", "dplr": "d"}


def checkpoint_blocks(spec: "CheckpointBlocks | bool") -> str:
    """The activation-checkpointing choice as one of CHECKPOINT_BLOCKS (True: "all", False: "none")."""
    if spec is True or spec is False:
        return "all" if spec else "none"
    if not isinstance(spec, str) or spec.strip().lower() not in CHECKPOINT_BLOCKS:
        raise XLSTMKitError(f"activation checkpointing must be one of {', '.join(CHECKPOINT_BLOCKS)} "
                            f"(or True / False), got {spec!r}")
    return spec.strip().lower()


# =============================================================================================
# Configuration
# =============================================================================================
@dataclass
class XLSTMConfig:
    """Everything that defines an xLSTM language model (saved as config.json in checkpoints).

    Presets: `XLSTMConfig.from_name("tiny" | "125M" | "350M" | "760M" | "1.3B", **overrides)`.
    """

    vocab_size: int = 256
    """Number of token ids; inputs must lie in [0, vocab_size). 256 = raw bytes."""

    d_model: int = 128
    """Width of the residual stream (the paper's embedding dimension)."""

    n_blocks: int = 4
    """Number of residual blocks, mLSTM, sLSTM and DPLR together."""

    n_heads: int = 4
    """mLSTM heads; they split the mLSTM inner width (see mlstm_proj_factor), which they must
    divide. Also the sLSTM heads unless slstm_heads is set."""

    slstm_at: Union[list, str] = field(default_factory=list)
    """Which blocks are sLSTM blocks: 0-based positions such as [1], or a ratio "a:b" meaning a
    mLSTM blocks per b sLSTM blocks, spread evenly with the sLSTM blocks last in each group
    ("7:1" = xLSTM[7:1]; "1:0" all mLSTM; "0:1" all sLSTM). Default: no sLSTM block."""

    slstm_heads: Union[int, None] = None
    """sLSTM heads (None: same as n_heads). Must divide d_model."""

    mlstm_proj_factor: float = 2.0
    """mLSTM up-projection: inner width = mlstm_proj_factor * d_model rounded up to a multiple of
    round_proj_to."""

    ffn_proj_factor: float = 1.3
    """Hidden width factor of the gated feed-forward in sLSTM blocks (the paper's 4/3; the
    official code uses 1.3), rounded up to a multiple of round_proj_to."""

    round_proj_to: int = 64
    """Up-projected widths are rounded up to a multiple of this (hardware-friendly sizes)."""

    conv_kernel_size: int = 4
    """Kernel size of the causal depthwise convolutions in both block types."""

    qkv_block_size: int = 4
    """Block size of the block-diagonal q/k/v projections of the mLSTM."""

    bias: bool = False
    """Biases in the up/down projections, q/k/v maps and feed-forward (gates always have them)."""

    dropout: float = 0.0
    """Dropout inside every mLSTM, sLSTM and feed-forward layer, where the official package puts it
    (training only)."""

    tie_embeddings: bool = False
    """Share the token embedding matrix with the LM head."""

    context_length: int = 256
    """Training sequence length. The model itself accepts any length; this is the default for
    training and the official model's causal-mask size in compat conversions."""

    chunk_size: int = 64
    """Chunk length of the chunkwise-parallel mLSTM (a speed knob; results do not depend on it)."""

    backend: Union[str, None] = None
    """Force the ops' backend, "torch" or "triton"; None lets each op pick for the device."""

    recompute_mlstm_states: bool = True
    """A memory knob of training: the Triton mLSTM kernels recompute their per-chunk states in
    the backward instead of keeping them (B·H·T/L·K·V values per mLSTM block: 0.56 GiB per block
    for the 125M model at batch 16 x 2048) at ~15 % more mLSTM kernel time. The gradients are
    the same either way."""

    family: str = "neurips"
    """Block family: "neurips" (the paper's mLSTM / sLSTM / DPLR blocks, LayerNorm) or "large"
    (the xLSTM-7B architecture of NX-AI's `xlstm_large` and transformers' `xLSTMForCausalLM`:
    RMSNorm → dense-projection mLSTM layer → residual, RMSNorm → SwiGLU → residual; final RMSNorm,
    untied head, soft-capped logits). Large models use n_heads, qk_dim_factor, v_dim_factor,
    ffn_proj_factor, round_proj_to, bias, norm_eps and the soft caps; not slstm_at, dplr_at,
    mlstm_proj_factor, conv_kernel_size or qkv_block_size."""

    qk_dim_factor: float = 0.5
    """Large family: q and k width = qk_dim_factor * d_model (split over n_heads)."""

    v_dim_factor: float = 1.0
    """Large family: v and output-gate width = v_dim_factor * d_model (split over n_heads)."""

    gate_soft_cap: float = 15.0
    """Large family: input/forget gate pre-activations become cap * tanh(x / cap)."""

    logit_soft_cap: float = 30.0
    """Large family: logits become cap * tanh(x / cap)."""

    norm_eps: float = 1e-6
    """Large family: epsilon of the RMSNorms and the per-head LayerNorm."""

    dplr_at: list = field(default_factory=list)
    """Which blocks are DPLR (KDA-style, xlstm_kit.nn.dplr) blocks: 0-based positions such as [0, 2],
    none of them in slstm_at. They use n_heads heads of d_model / n_heads. Default: none."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_blocks", "n_heads", "round_proj_to",
                     "conv_kernel_size", "qkv_block_size", "context_length", "chunk_size"):
            _check_positive_int(name, getattr(self, name))
        if self.slstm_heads is not None:
            _check_positive_int("slstm_heads", self.slstm_heads)
        for name, limit in _SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                raise XLSTMKitError(f"{name} must be at most {limit:,}, got {getattr(self, name):,}")
        for name in ("mlstm_proj_factor", "ffn_proj_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise XLSTMKitError(f"{name} must be a positive finite number, got {v!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise XLSTMKitError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise XLSTMKitError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.family not in ("neurips", "large"):
            raise XLSTMKitError(f"family must be 'neurips' or 'large', got {self.family!r}")
        for name in ("qk_dim_factor", "v_dim_factor", "gate_soft_cap", "logit_soft_cap", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise XLSTMKitError(f"{name} must be a positive finite number, got {v!r}")
        if self.family == "large":
            if self.slstm_at not in ([], "1:0") or self.dplr_at:
                raise XLSTMKitError("large-family models have mLSTM blocks only; leave slstm_at and dplr_at empty")
            for name, factor in (("qk_dim_factor", self.qk_dim_factor), ("v_dim_factor", self.v_dim_factor)):
                width = factor * self.d_model
                if width != int(width) or int(width) % self.n_heads:
                    raise XLSTMKitError(f"{name} * d_model = {width:g} must be an integer divisible by "
                                        f"n_heads={self.n_heads}")
        if self.chunk_size > 1024:
            raise XLSTMKitError(f"chunk_size must be at most 1024, got {self.chunk_size}; 64 is a good default")
        if self.backend not in (None, "torch", "triton"):
            raise XLSTMKitError(f"backend must be None, 'torch' or 'triton', got {self.backend!r}")
        if isinstance(self.slstm_at, (list, tuple)):
            # a list keeps the config equal to itself after a JSON round trip
            self.slstm_at = list(self.slstm_at)
        if isinstance(self.dplr_at, tuple):
            self.dplr_at = list(self.dplr_at)
        positions = self.slstm_positions  # validates slstm_at
        dplr = self.dplr_positions  # validates dplr_at

        if "m" in self.block_types:  # there is an mLSTM block: its heads split the inner width
            inner = self.mlstm_inner_dim
            for name, div in (("n_heads", self.n_heads), ("qkv_block_size", self.qkv_block_size)):
                if inner % div:
                    raise XLSTMKitError(
                        f"mLSTM inner width {inner} (mlstm_proj_factor * d_model rounded up to a "
                        f"multiple of {self.round_proj_to}) is not divisible by {name}={div}; "
                        f"choose {name} dividing {inner}"
                    )
        if positions and self.d_model % self.slstm_num_heads:  # sLSTM heads split d_model
            name = "n_heads" if self.slstm_heads is None else "slstm_heads"
            raise XLSTMKitError(
                f"d_model={self.d_model} is not divisible by {name}={self.slstm_num_heads} (the sLSTM "
                f"heads split d_model); choose a d_model that is a multiple of {self.slstm_num_heads}"
                + (" or set slstm_heads" if self.slstm_heads is None else "")
            )

        if dplr and self.d_model % self.n_heads:
            raise XLSTMKitError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads} (the DPLR "
                             f"heads split d_model); choose a d_model that is a multiple of {self.n_heads}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def dplr_positions(self) -> tuple[int, ...]:
        """Sorted 0-based indices of the DPLR blocks."""
        spec = self.dplr_at
        if not isinstance(spec, (list, tuple)):
            raise XLSTMKitError(f"dplr_at must be a list of block positions, got {spec!r}")
        for p in spec:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.n_blocks:
                raise XLSTMKitError(f"dplr_at position {p!r} is not a block index 0..{self.n_blocks - 1}")
        if len(set(spec)) != len(spec):
            raise XLSTMKitError(f"dplr_at lists a position twice: {list(spec)}")
        both = sorted(set(spec) & set(self.slstm_positions))
        if both:
            raise XLSTMKitError(f"blocks {both} are in both slstm_at and dplr_at; a block has one type")
        return tuple(sorted(spec))

    @property
    def slstm_positions(self) -> tuple[int, ...]:
        """Sorted 0-based indices of the sLSTM blocks."""
        spec = self.slstm_at
        if isinstance(spec, str):
            match = _RATIO.match(spec)
            if not match or int(match[1]) + int(match[2]) == 0:
                raise XLSTMKitError(
                    f"slstm_at={spec!r} is not a ratio 'a:b' (a mLSTM per b sLSTM blocks, e.g. '7:1'); "
                    f"or give a list of block positions"
                )
            a, b = int(match[1]), int(match[2])
            # block t is sLSTM when the running count of sLSTM blocks, b/(a+b) per block, steps up
            return tuple(t for t in range(self.n_blocks) if ((t + 1) * b) // (a + b) > (t * b) // (a + b))
        if not isinstance(spec, (list, tuple)):
            raise XLSTMKitError(f"slstm_at must be a list of block positions or a ratio string like '7:1', got {spec!r}")
        for p in spec:
            if isinstance(p, bool) or not isinstance(p, int):
                raise XLSTMKitError(f"slstm_at positions must be integers, got {p!r}")
            if not 0 <= p < self.n_blocks:
                raise XLSTMKitError(
                    f"slstm_at position {p} is out of range for n_blocks={self.n_blocks}; "
                    f"use positions 0..{self.n_blocks - 1}"
                )
        if len(set(spec)) != len(spec):
            raise XLSTMKitError(f"slstm_at lists a position twice: {list(spec)}")
        return tuple(sorted(spec))

    @property
    def block_types(self) -> tuple[str, ...]:
        """"m", "s" or "d" (DPLR) per block."""
        s, d = set(self.slstm_positions), set(self.dplr_positions)
        return tuple("s" if t in s else "d" if t in d else "m" for t in range(self.n_blocks))

    @property
    def slstm_num_heads(self) -> int:
        return self.n_heads if self.slstm_heads is None else self.slstm_heads

    @property
    def mlstm_inner_dim(self) -> int:
        return round_up(self.mlstm_proj_factor * self.d_model, self.round_proj_to)

    @property
    def qk_dim(self) -> int:
        """Large family: width of q and k (all heads)."""
        return int(self.qk_dim_factor * self.d_model)

    @property
    def v_dim(self) -> int:
        """Large family: width of v and the output gate (all heads)."""
        return int(self.v_dim_factor * self.d_model)

    @property
    def ffn_dim(self) -> int:
        return round_up(self.ffn_proj_factor * self.d_model, self.round_proj_to)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "XLSTMConfig":
        if not isinstance(d, dict):
            raise XLSTMKitError(f"an XLSTMConfig needs a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise XLSTMKitError(f"unknown XLSTMConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "XLSTMConfig":
        """A preset by name, with fields overridden by keyword.

        "tiny": byte-level, d_model 128, 4 blocks (one sLSTM), trains on a laptop CPU in minutes.
        "125M", "350M", "760M", "1.3B": the paper's xLSTM[7:1] language models (GPT-2 vocabulary
        50257, context 2048, 4 heads; 24 blocks at d_model 768, 48 blocks at 1024 / 1536 / 2048 —
        163.7M / 409.3M / 840.4M / 1420.4M parameters in the paper's count with [7:1]).
        Pass slstm_at="1:0" for the paper's xLSTM[1:0] variants.
        "xlstm-7b" (or "7b"): the large family with exactly NX-AI/xLSTM-7b's shapes (d_model 4096,
        32 blocks, 8 heads, vocabulary 50304, qk 0.5, v 1.0, SwiGLU 2.667 → 10944); "large-125M"
        (d 768, 12 blocks, 4 heads), "large-350M" (d 1024, 24 blocks), "large-1.3B" (d 2048, 24
        blocks): the same family at the sizes of GPT-2-style Transformers, for experiments.
        """
        key = str(name).strip().lower()
        for prefix in ("xlstm-", "xlstm_"):
            key = key[len(prefix):] if key.startswith(prefix) else key
        if key not in PRESETS:
            raise XLSTMKitError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[key], **overrides})


# Far above any real model (the largest vocabularies hold ~256K ids, the widest models ~16K
# channels), far below sizes whose embedding or projections could not be allocated: a corrupt
# config.json or a typo gets one line instead of an allocator traceback.
_SIZE_LIMITS = {"vocab_size": 2**24, "d_model": 2**16, "n_blocks": 4096}


def _check_positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise XLSTMKitError(f"{name} must be a positive integer, got {v!r}")


_PAPER = dict(vocab_size=50257, n_heads=4, slstm_at="7:1", context_length=2048)
_LARGE = dict(family="large", vocab_size=50304, qk_dim_factor=0.5, v_dim_factor=1.0, ffn_proj_factor=2.667,
              round_proj_to=64, context_length=2048)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, d_model=128, n_blocks=4, n_heads=4, slstm_at=[1], context_length=256),
    "125m": dict(_PAPER, d_model=768, n_blocks=24),
    "350m": dict(_PAPER, d_model=1024, n_blocks=48),
    "760m": dict(_PAPER, d_model=1536, n_blocks=48),
    "1.3b": dict(_PAPER, d_model=2048, n_blocks=48),
    # the xLSTM-7B architecture: "7b" has exactly the shapes of NX-AI/xLSTM-7b
    "7b": dict(_LARGE, d_model=4096, n_blocks=32, n_heads=8, context_length=8192),
    "large-125m": dict(_LARGE, d_model=768, n_blocks=12, n_heads=4),
    "large-350m": dict(_LARGE, d_model=1024, n_blocks=24, n_heads=4),
    "large-1.3b": dict(_LARGE, d_model=2048, n_blocks=24, n_heads=4),
}


# =============================================================================================
# Model
# =============================================================================================
def keep_positions(x: torch.Tensor, logits_to_keep: "int | torch.Tensor") -> torch.Tensor:
    """The hidden states [B, T, d] at the positions `logits_to_keep` names (see
    XLSTMLanguageModel.forward), so that the head runs there only: 0 keeps all, an int n the
    last n, a 1-D tensor those positions of every row, a 2-D [B, n] tensor n positions per row."""
    if isinstance(logits_to_keep, torch.Tensor):
        idx = logits_to_keep.to(x.device)
        if idx.dim() == 2:
            return x.gather(1, idx.long()[..., None].expand(-1, -1, x.shape[-1]))
        return x.index_select(1, idx)
    return x[:, -logits_to_keep:] if logits_to_keep else x


class XLSTMLanguageModel(nn.Module):
    """xLSTM language model.

    model(tokens [B, T]) -> logits [B, T, vocab_size]
    model(tokens, state=s, return_state=True) -> (logits, state): feed a long text in pieces
    model.step(token [B], state) -> (logits [B, vocab_size], state): one token
    model.generate(prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id): prompt [T], [B, T],
        a list of 1-D prompts of any lengths, a str or a list of str
    The state is a list with one MLSTMState / SLSTMState / DPLRState per block (`init_state(batch)`;
    large-family blocks use MLSTMState with an empty conv field).
    """

    # From the folder a model was loaded from (xlstm_kit.hub): a tokenizers-format tokenizer.json
    # (BOS prepended) and the token ids a HuggingFace config.json records.
    hf_tokenizer = None
    hf_special_tokens = None

    def __init__(self, config: XLSTMConfig):
        super().__init__()
        if not isinstance(config, XLSTMConfig):
            raise XLSTMKitError(f"config must be an XLSTMConfig, got {type(config).__name__}")
        self.config = cfg = config
        if cfg.family == "large" and cfg.dropout > 0:
            raise XLSTMKitError("large-family models have no dropout (as the official xLSTM-7B); set dropout=0")
        self.tokenizer_name: str | None = None  # set by load() from the checkpoint
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self._make_block(t, kind) for t, kind in enumerate(cfg.block_types))
        if cfg.family == "large":
            self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        else:
            self.norm = nn.LayerNorm(cfg.d_model, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.reset_parameters()
        self._recomputed: frozenset[int] = frozenset()  # blocks under activation checkpointing
        self._compiled: tuple | None = None  # (compiled blocks, compiled head) from compile_blocks
        self._compiled_step: tuple | None = None  # (compiled block steps, compiled head) from compile_step

    def _make_block(self, index: int, kind: str) -> nn.Module:
        cfg = self.config
        if cfg.family == "large":
            return LargeBlock(
                cfg.d_model, cfg.n_heads, cfg.qk_dim, cfg.v_dim, cfg.ffn_dim, n_blocks=cfg.n_blocks,
                bias=cfg.bias, norm_eps=cfg.norm_eps, gate_soft_cap=cfg.gate_soft_cap, chunk_size=cfg.chunk_size, backend=cfg.backend,
                recompute_states=cfg.recompute_mlstm_states,
            )
        if kind == "d":
            return DPLRBlock(
                cfg.d_model, cfg.n_heads, conv_kernel_size=cfg.conv_kernel_size, n_blocks=cfg.n_blocks,
                bias=cfg.bias, dropout=cfg.dropout, chunk_size=cfg.chunk_size, backend=cfg.backend,
            )
        if kind == "m":
            return MLSTMBlock(
                cfg.d_model, cfg.mlstm_inner_dim, cfg.n_heads,
                conv_kernel_size=cfg.conv_kernel_size, qkv_block_size=cfg.qkv_block_size,
                n_blocks=cfg.n_blocks, bias=cfg.bias, dropout=cfg.dropout,
                chunk_size=cfg.chunk_size, backend=cfg.backend,
                recompute_states=cfg.recompute_mlstm_states,
            )
        return SLSTMBlock(
            cfg.d_model, cfg.slstm_num_heads, cfg.ffn_dim,
            conv_kernel_size=cfg.conv_kernel_size, block_index=index, n_blocks=cfg.n_blocks,
            bias=cfg.bias, dropout=cfg.dropout, backend=cfg.backend,
        )

    def reset_parameters(self) -> None:
        """The official initialisation (blocks re-initialise themselves; see nn/)."""
        for block in self.blocks:
            block.reset_parameters()
        self.norm.reset_parameters()
        small_init_(self.embedding.weight, self.config.d_model)
        if not self.config.tie_embeddings:
            small_init_(self.lm_head.weight, self.config.d_model)

    # ------------------------------------------------------------------ training speed and memory
    def set_activation_checkpointing(self, blocks: "CheckpointBlocks | bool" = "all") -> None:
        """Recompute the forward of the chosen blocks during the backward instead of keeping
        their activations: "all", "mlstm", "slstm", "dplr" (blocks of that type), "none" (or
        True / False). Each chosen block then keeps only its input [B, T, d_model] for the
        backward, at the cost of one more forward of it. Gradients are unchanged (dropout masks
        are replayed: torch's RNG state is restored for the recomputation). Applies only where
        gradients are recorded; works with autocast and with :meth:`compile_blocks`.
        """
        kind = checkpoint_blocks(blocks)
        self._recomputed = frozenset(
            t for t, k in enumerate(self.config.block_types) if kind == "all" or _BLOCK_KIND.get(kind) == k)

    @property
    def activation_checkpointing(self) -> tuple[int, ...]:
        """Indices of the blocks whose forward is recomputed in the backward."""
        return tuple(sorted(self._recomputed))

    def compile_blocks(self, **options) -> None:
        """torch.compile the model for training, one region per block plus one for the head.

        Regional rather than whole-model compilation: blocks of one type are the same code with
        other parameters, so Dynamo traces and Inductor compiles each block type once and every
        further block reuses that graph (compile time does not grow with depth, also once the
        blocks trace without graph breaks, where a whole-model graph would unroll every block),
        the parameters and state_dict keys stay those of the plain model (checkpoints load into
        uncompiled models), and activation checkpointing wraps whole compiled blocks. On CPU
        (aot_eager, a d_model 32 model, 1 and 4 mLSTM blocks) whole-model torch.compile(model) was
        no better: both reuse their graphs across blocks today (the graph breaks in the blocks'
        hand-written backwards split the graph per block), with compile times within the noise
        of a shared 2-core machine (20-35 s). `options` go to torch.compile (e.g.
        backend="aot_eager", fullgraph=True, mode="max-autotune").

        The compiled blocks are kept beside the plain ones (not `block.compile()` in place) and
        run where gradients are recorded (training). Under torch.no_grad — validation,
        `generate`, `step` — the model runs eagerly: other batch shapes, prompt lengths and the
        recurrent step then cost no recompilation, and compile time goes to the training step
        only. Compilation itself happens lazily at the first training forward.
        """
        blocks = tuple(torch.compile(block, **options) for block in self.blocks)
        self._compiled = (blocks, torch.compile(self._head, **options))

    def compile_step(self, **options) -> None:
        """torch.compile the one-token step (`step`, and so the decode of `generate`), one region
        per block plus the head, each traced whole: a block's projections, gates, state update and
        norms become a few fused kernels instead of dozens of small ones, and on CUDA `generate`
        records those in its CUDA graph. Blocks of one type share one compiled graph (their
        parameters are its inputs). A new batch size compiles again, once. `options` go to
        torch.compile over the defaults fullgraph=True, dynamic=False (e.g. backend="aot_eager")
        and, for the default backend without a `mode`, Inductor's coordinate-descent tuning: it
        turns a one-token matrix product into a reduction fused with its neighbours and tunes
        it to the memory bandwidth (on an H200: up to 3.6 TB/s, where cuBLAS's one-row kernels
        reached 1-2.6; benchmarks/results/2026-12-02-h200-generate.md)."""
        opts = {"fullgraph": True, "dynamic": False, **options}
        if opts.get("backend", "inductor") == "inductor" and "mode" not in opts:
            opts["options"] = {"coordinate_descent_tuning": True, **opts.get("options", {})}
        self._compiled_step = (tuple(torch.compile(block.step, **opts) for block in self.blocks),
                               torch.compile(self._head, **opts))

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        if self.config.family != "large":
            return logits
        return soft_cap(at_least_float32(logits), self.config.logit_soft_cap).to(logits.dtype)

    # ------------------------------------------------------------------ state
    def init_state(self, batch: int, device=None) -> ModelState:
        """The zero state for `batch` sequences: one state per block, float32 (float64 models: float64)."""
        _check_positive_int("batch", batch)
        return [block.init_state(batch, device=device) for block in self.blocks]

    def _check_state(self, state, batch: int, packed: bool = False) -> None:
        if not isinstance(state, (list, tuple)) or len(state) != len(self.blocks):
            raise XLSTMKitError(
                f"state must be a list of {len(self.blocks)} block states from this model's "
                f"init_state() or forward(..., return_state=True), got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, (list, tuple)) else "")
            )
        for t, (block, s) in enumerate(zip(self.blocks, state)):
            ref = block.init_state(1, device="meta")
            if type(s) is not type(ref):
                raise XLSTMKitError(
                    f"state[{t}] is a {type(s).__name__} but block {t} takes a {type(ref).__name__}; "
                    f"the state comes from a model with another config"
                )
            for name, x, r in zip(ref._fields, s, ref):
                if not isinstance(x, torch.Tensor) or x.shape[1:] != r.shape[1:]:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise XLSTMKitError(
                        f"state[{t}].{name} has shape {got}, expected [{batch}, "
                        f"{', '.join(map(str, r.shape[1:]))}]; the state comes from a model with another config"
                    )
                if x.shape[0] != batch:
                    raise XLSTMKitError(
                        f"state[{t}].{name} is for batch size {x.shape[0]} but the tokens have "
                        + (f"{batch} documents (cu_seqlens)" if packed else f"batch size {batch}")
                        + f"; use model.init_state({batch}) or the state of a {batch}-sequence call"
                    )

    def _check_tokens(self, tokens, dims: int, what: str) -> None:
        from .generate import check_token_ids

        if not isinstance(tokens, torch.Tensor):
            raise XLSTMKitError(f"{what} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.dim() != dims:
            want = "[B, T]" if dims == 2 else "[B]"
            raise XLSTMKitError(f"{what} must have shape {want}, got {list(tokens.shape)}")
        check_token_ids(tokens, self.config.vocab_size, what)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, state: ModelState | None = None, return_state: bool = False,
                *, cu_seqlens: torch.Tensor | None = None, logits_to_keep: "int | torch.Tensor" = 0):
        """tokens [B, T] (T >= 1) -> logits [B, T, vocab] (float in the parameters' dtype),
        or (logits, state) with return_state=True. `state` continues from an earlier call.

        logits_to_keep (as in transformers): 0 = every position; an int n > 0 = the last n
        positions (logits [B, n, vocab]); a 1-D tensor of positions = those (logits
        [B, len, vocab]); a 2-D [B, n] tensor = n positions per row (logits [B, n, vocab]). A prefill needs one position per prompt, and the head's output over
        a long prompt would be the largest tensor of the call (T x vocab).

        cu_seqlens: None, or int32/int64 [N+1] (0 = cu[0] < ... < cu[N] = T) with tokens [1, T]:
        N documents packed in one row, each read as if alone (every block's state, the causal
        convolutions' included, resets at each boundary). `state` then has N rows (one per
        document; None: zeros) and so has the returned state."""
        self._check_tokens(tokens, 2, "tokens")
        B, T = tokens.shape
        if T < 1 or B < 1:
            raise XLSTMKitError(f"tokens must have shape [B, T] with B, T >= 1, got {list(tokens.shape)}")
        bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, tokens.device)
        if state is not None:
            self._check_state(state, B if bounds is None else len(bounds) - 1, packed=bounds is not None)
        x = self.embedding(tokens if tokens.dtype in (torch.int32, torch.int64) else tokens.long())
        training = torch.is_grad_enabled()
        # packed documents take the eager blocks: their per-document shapes would recompile
        use_compiled = training and self._compiled is not None and bounds is None
        blocks, head = self._compiled if use_compiled else (self.blocks, self._head)
        new_state = []
        for t, block in enumerate(blocks):
            s = None if state is None else state[t]
            recompute = training and t in self._recomputed

            def call(blk, x_, s_, rs, **kw):
                if recompute:
                    return _recompute(blk, x_, s_, return_state=rs, use_reentrant=False, **kw)
                return blk(x_, s_, return_state=rs, **kw)

            if bounds is None:
                out = call(block, x, s, return_state)
            else:
                out = block_varlen(block, x, s, return_state, bounds, cu_seqlens, call)
            if return_state:
                x, s = out
                new_state.append(s)
            else:
                x = out
        logits = head(keep_positions(x, logits_to_keep))
        return (logits, new_state) if return_state else logits

    def step(self, tokens: torch.Tensor, state: ModelState | None = None):
        """One token per sequence: tokens [B] -> (logits [B, vocab], new state)."""
        self._check_tokens(tokens, 1, "tokens")
        B = tokens.shape[0]
        state = self.init_state(B) if state is None else state
        self._check_state(state, B)
        return self._step(tokens, state)

    def _step(self, tokens: torch.Tensor, state: ModelState, inplace: bool = False):
        """step() without the input checks: no host-device sync, so a CUDA graph can capture it.
        inplace: the caller gives `state` up; the blocks may update its large tensors in place."""
        x = self.embedding(tokens if tokens.dtype in (torch.int32, torch.int64) else tokens.long())
        steps, head = self._compiled_step or ([b.step for b in self.blocks], self._head)
        new_state = []
        for block_step, s in zip(steps, state):
            x, s = block_step(x, s, inplace=inplace)
            new_state.append(s)
        return head(x), new_state

    @torch.no_grad()
    def generate(
        self,
        prompt: "torch.Tensor | str | list",
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: "int | list[int] | None" = None,
        generator: torch.Generator | None = None,
        cuda_graph: bool | None = None,
        *,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: "str | list[str] | None" = None,
        streamer=None,
        tokenizer=None,
    ):
        """Continue prompts by up to `max_new_tokens` tokens each.

        prompt: [T] or [B, T] token ids, a list of 1-D id tensors of any lengths (one batch; each
        row gets exactly the tokens it gets alone), a str, or a list of str. Returns prompt +
        continuation in the same form (a list for a list).

        The prompts are read in parallel (chunkwise), then tokens are produced one at a time from
        the recurrent state, so memory does not grow with the number of generated tokens.
        temperature 0 picks the most likely token; top_k, top_p, repetition_penalty (CTRL rule)
        shape the sampling; seed makes it reproducible. A row ends at `eos_token_id` (an id or a
        list; text prompts: also the tokenizer's end token) or at a stop string (`stop`: cut from
        text results). streamer(row, piece) receives each new token id (token prompts) or each
        new piece of text (text prompts: whole characters, never a stop string) as it comes.
        Text needs `tokenizer` (default: the model's, known when it was loaded from a checkpoint
        that records it). On CUDA the decode step replays a CUDA graph (cuda_graph=None: when
        possible). See `xlstm_kit.generate`.
        """
        from .generate import generate, generate_text

        options = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                       eos_token_id=eos_token_id, stop=stop, seed=seed, generator=generator, streamer=streamer,
                       cuda_graph=cuda_graph)
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                       and all(isinstance(p, str) for p in prompt)):
            return generate_text(self, tokenizer if tokenizer is not None else self.tokenizer, prompt,
                                 max_new_tokens, **options)
        return generate(self, prompt, max_new_tokens, tokenizer=tokenizer, **options)

    @property
    def tokenizer(self):
        """The folder's tokenizer.json in the `tokenizers` format (`hf_tokenizer`, BOS prepended),
        else the tokenizer named by `tokenizer_name` (both set by `load` / `from_pretrained`)."""
        if self.hf_tokenizer is not None:
            return self.hf_tokenizer
        if self.tokenizer_name is None:
            raise XLSTMKitError(
                "this model does not know its tokenizer (its checkpoint records none); set "
                "model.tokenizer_name = 'byte' (or 'gpt2') or pass token ids"
            )
        from .data import get_tokenizer

        return get_tokenizer(self.tokenizer_name)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path, tokenizer: str | None = None) -> Path:
        """Write `directory`/config.json + model.safetensors, and tokenizer.json naming
        `tokenizer` (default: `tokenizer_name`, when set; a model with `hf_tokenizer` writes that
        tokenizers-format tokenizer.json and tokenizer_config.json instead). Atomic; see
        xlstm_kit.checkpoint."""
        return checkpoint.save_model(self, directory, tokenizer=tokenizer or self.tokenizer_name)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device | None = None) -> "XLSTMLanguageModel":
        """Read a model written by `save`, or the newest checkpoint of a `train --out` run folder
        (through its `latest` file). Returns it in eval mode, with `tokenizer_name` set when the
        checkpoint records its tokenizer. FileNotFoundError if missing, ValueError if corrupt."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint folder at {str(path)!r}")
        if not (path / checkpoint.CONFIG_FILE).exists() and (path / checkpoint.LATEST_FILE).is_file():
            path = checkpoint.resolve_checkpoint(path)
        config_dict, tensors = checkpoint.read_model_files(path)
        n_blocks = config_dict.get("n_blocks") if isinstance(config_dict, dict) else None
        in_file = {k.split(".")[1] for k in tensors if k.startswith("blocks.")}
        if isinstance(n_blocks, int) and n_blocks != len(in_file):
            # before the config is even validated: that walks all n_blocks positions
            raise XLSTMKitError(f"{path / checkpoint.WEIGHTS_FILE} holds {len(in_file)} blocks, its "
                                f"{checkpoint.CONFIG_FILE} says n_blocks={n_blocks}")
        try:
            config = XLSTMConfig.from_dict(config_dict)
        except (ValueError, TypeError) as e:
            raise XLSTMKitError(f"{path / checkpoint.CONFIG_FILE} does not describe a valid XLSTMConfig: {e}") from None
        try:
            target = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as e:
            raise XLSTMKitError(f"device {device!r} is not a torch device: {e}") from None
        if config.backend == "triton" and target.type != "cuda":
            # A model trained with the Triton kernels forced is still the same model elsewhere.
            warnings.warn(f"{path} was saved with backend='triton', which needs CUDA; loading it on "
                          f"{target.type} with the automatic backend", stacklevel=2)
            config = dataclasses.replace(config, backend=None)
        source = path / checkpoint.WEIGHTS_FILE
        with torch.device("meta"):  # the config's shapes, checked against the file before allocating
            checkpoint.check_state(cls(config), tensors, source)
        model = checkpoint.load_state_checked(cls(config), tensors, source, checked=True)
        model.tokenizer_name = checkpoint.read_tokenizer_name(path)
        model.hf_tokenizer = hub.find_tokenizer(path)
        model.eval()
        return model if device is None else model.to(device)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None) -> "XLSTMLanguageModel":
        """Load a HuggingFace xLSTM folder (config.json with model_type "xlstm", model.safetensors
        or shards listed in model.safetensors.index.json; NX-AI/xLSTM-7b, transformers'
        save_pretrained) as a large-family model, or an xlstm_kit checkpoint / `train --out` run.

        Lazy: built on the meta device, then each tensor is read (memory-mapped), converted to
        `dtype` (default: the file's, float32 if mixed) and placed on `device` (default: cpu) on
        its own, so a 7B model loads in bf16 without a float32 or second copy. Names and shapes
        are checked against config.json first. A tokenizer.json in the folder becomes
        `model.tokenizer`. Returns the model in eval mode. See xlstm_kit.hub.
        """
        return hub.load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, format: str = "hf",
                        max_shard_size: int | str = hub.DEFAULT_MAX_SHARD_SIZE) -> Path:
        """format="hf": write a folder transformers' `xLSTMForCausalLM.from_pretrained` loads
        (config.json, HF weight names, shards of at most `max_shard_size` such as "5GB" with
        model.safetensors.index.json, the tokenizer when known); large family only.
        format="xlstm_kit": our checkpoint format (= `save`). Atomic: a new folder appears
        complete or not at all. Returns the folder."""
        return hub.save_pretrained(self, path, format=format, max_shard_size=max_shard_size)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
