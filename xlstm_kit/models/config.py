"""The xLSTM language model's configuration: sizes, block layout (xLSTM[a:b], `slstm_at`,
`dplr_at`), the two block families ("neurips", the paper's blocks; "large", the xLSTM-7B
blocks), presets, and the activation-checkpointing choice."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from ..errors import XLSTMKitError
from ..layers.common import round_up


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
    """Which blocks are DPLR (KDA-style, xlstm_kit.layers.dplr) blocks: 0-based positions such as [0, 2],
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

        for name in ("mlstm_inner_dim", "ffn_dim") + (("qk_dim", "v_dim") if self.family == "large" else ()):
            width = getattr(self, name)
            if width > _MAX_WIDTH:
                raise XLSTMKitError(f"{name} = {width:,} (from d_model and its factor) must be at most {_MAX_WIDTH:,}")
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
        if self.family == "large":
            # xLSTM-7B's own rounding (its package and transformers' xLSTMConfig): (x + m - 1) // m
            # on the unrounded float, which is not a ceiling (768 x 2.667 = 2048.3 gives 2048, not
            # 2112); HF folders must match it to the entry
            m = self.round_proj_to
            return int((self.ffn_proj_factor * self.d_model + m - 1) // m * m)
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
_SIZE_LIMITS = {"vocab_size": 2**24, "d_model": 2**16, "n_blocks": 4096, "n_heads": 2**16, "round_proj_to": 2**16,
                "qkv_block_size": 2**16, "conv_kernel_size": 1024, "context_length": 2**31}
# The widest up-projection a config may derive (fields that pass one by one can still multiply
# into a width no machine holds: refused here rather than at allocation, or in a loop over it)
_MAX_WIDTH = 2**20


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
