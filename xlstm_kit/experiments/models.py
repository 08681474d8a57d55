"""The models the synthetic experiments compare, by name: xLSTM[a:b] (the paper's block ratios),
the DPLR stack, the Transformer and LSTM baselines."""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..errors import XLSTMKitError
from ..layers.slstm import SLSTMBlock, SLSTMLayer
from ..models import XLSTMConfig, XLSTMLanguageModel
from .baselines import LSTMLM, PlainLSTMLM, TransformerLM


MQAR_LR = 1e-3
"""Default peak learning rate of MQAR runs: in an H200 probe (width 128, T=256, 64 pairs) xLSTM[1:1]
reached 0.99 accuracy by step ~1300 at 1e-3 and stayed at chance for 2900 steps at 3e-3."""

MODEL_NAMES = ("xlstm[0:1]", "xlstm[1:0]", "xlstm[1:1]", "dplr", "transformer", "lstm", "lstm-plain",
               "transformer-conv")
ABLATION_MODELS = ("transformer-conv",)
"""Models for one question each, run when named only: "transformer-conv" is the Transformer with
the mLSTM block's kernel-4 causal convolution in front of q and k (MQAR: is that what its lookup
lacks?)."""
DEFAULT_MODELS = tuple(m for m in MODEL_NAMES if m not in ABLATION_MODELS)
"""The models of a sweep that names none."""
_XLSTM = re.compile(r"^xlstm\[(\d+):(\d+)\]$")


def check_model_name(name: str) -> str:
    """The canonical model name (lower case, no spaces); ValueError listing the known names."""
    key = str(name).strip().lower().replace(" ", "")
    if key not in MODEL_NAMES:
        raise XLSTMKitError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return key


SLSTM_PRESETS: dict[str, dict[str, Any]] = {
    "lm": dict(conv_kernel_size=4, recurrent_init="zeros", bias_init="powerlaw_blockdependent", heads=None),
    "paper": dict(conv_kernel_size=0, recurrent_init="standard", bias_init="standard", heads=1),
}
"""sLSTM block settings of the experiments. "lm": the language-model blocks (kernel-4 convolution
in front of the i/f gates, zero recurrent weights, power-law forget bias, n_heads heads).
"paper": the paper's formal-language sLSTM (official parity configuration): no convolution,
the official "standard" init (recurrent weights and all gate biases uniform(+-1/sqrt(d_model))),
one head. In an H200 probe only this combination let xLSTM[1:1] extrapolate parity (docs/experiments.md)."""


def _paper_slstm_blocks(model: XLSTMLanguageModel, preset: dict[str, Any], backend: str | None) -> None:
    # The preset is an experiment choice, not an XLSTMConfig field: swap the sLSTM layers in place.

    cfg = model.config
    for index, block in enumerate(model.blocks):
        if isinstance(block, SLSTMBlock):
            block.layer = SLSTMLayer(
                cfg.d_model, cfg.slstm_num_heads, conv_kernel_size=preset["conv_kernel_size"], block_index=index,
                n_blocks=cfg.n_blocks, dropout=cfg.dropout, backend=backend,
                recurrent_init=preset["recurrent_init"], bias_init=preset["bias_init"],
            )


def build_model(name: str, vocab_size: int, *, d_model: int = 128, n_heads: int = 4,
                n_blocks: int = 2, backend: str | None = None, slstm: str = "lm") -> nn.Module:
    """A model called `name` (see MODEL_NAMES): tokens [B, T] -> logits [B, T, vocab_size].
    `slstm` names the sLSTM block settings (SLSTM_PRESETS; xLSTM models with sLSTM blocks only)."""
    key = check_model_name(name)
    if slstm not in SLSTM_PRESETS:
        raise XLSTMKitError(f"unknown sLSTM preset {slstm!r}; choose one of {', '.join(SLSTM_PRESETS)}")
    match = _XLSTM.match(key)
    if match:
        preset = SLSTM_PRESETS[slstm]
        cfg = XLSTMConfig(vocab_size=vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                          slstm_at=f"{match[1]}:{match[2]}", slstm_heads=preset["heads"], backend=backend)
        model = XLSTMLanguageModel(cfg)
        if slstm != "lm":
            _paper_slstm_blocks(model, preset, backend)
        return model
    if key == "dplr":  # every block a KDA-style DPLR block (xlstm_kit.layers.dplr)
        cfg = XLSTMConfig(vocab_size=vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                          dplr_at=list(range(n_blocks)), backend=backend)
        return XLSTMLanguageModel(cfg)
    if key in ("transformer", "transformer-conv"):
        return TransformerLM(vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                             qk_conv=4 if key == "transformer-conv" else 0)
    if key == "lstm-plain":
        return PlainLSTMLM(vocab_size, d_model=d_model, n_layers=n_blocks)
    return LSTMLM(vocab_size, d_model=d_model, n_blocks=n_blocks)


def model_slug(name: str) -> str:
    """File-name form of a model name: "xlstm[1:0]" -> "xlstm-1-0"."""
    return re.sub(r"[^a-z0-9]+", "-", check_model_name(name)).strip("-")
