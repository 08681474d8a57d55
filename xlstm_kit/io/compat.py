"""Conversion to and from the official `xlstm` package (PyPI xlstm 2.0.6, Apache-2.0).

    model = from_official_xlstm(official)      # xlstm.xLSTMLMModel or xlstm_large xLSTMLarge -> ours
    official = to_official_xlstm(model)        # and back (sLSTM backend "vanilla" by default;
                                               # large-family models give an xLSTMLarge)

Both directions copy every weight, so the two models compute the same logits. Layout
differences handled here:
- The official LayerNorms store weight - 1 ("residual weight"); ours store the scale itself.
- The official causal conv weight is nn.Conv1d's [C, 1, K]; ours is [C, K].
- In the official sLSTM layer the module named `fgate` feeds the *input* gate and `igate` the
  *forget* gate (its call is cell(cat(fgate(x), igate(x), zgate(x), ogate(x))) with gate order
  i, f, z, o). We store the four maps as gate_weight[i, f, z, o].
- The official sLSTM cell keeps its recurrent kernel and bias in a backend-specific internal
  layout; we go through its external layout (kernel [H, D_in, 4, D_out], bias [H, 4, D]).
The `xlstm` package is imported only when a function here is called.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..errors import XLSTMKitError
from ..models import XLSTMConfig, XLSTMLanguageModel
from .compat_large import from_official_large, is_official_large, to_official_large

_Fn = Callable[[torch.Tensor], torch.Tensor]
_same: _Fn = lambda t: t  # noqa: E731


def _import_xlstm():
    try:
        import xlstm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the official package is needed: pip install --no-deps xlstm==2.0.6 mlstm-kernels==2.0.6 "
            "(plus pyyaml, safetensors, einops)"
        ) from e
    return xlstm


# ------------------------------------------------------------------------------ configs
def config_from_official(oc) -> XLSTMConfig:
    """XLSTMConfig equal to an official xLSTMLMModelConfig (ValueError for what we lack)."""
    positions = sorted(int(p) for p in oc.slstm_at)
    n_s = len(positions)
    has_m, has_s = n_s < oc.num_blocks, n_s > 0
    if not oc.add_post_blocks_norm:
        raise XLSTMKitError("official models without the final norm (add_post_blocks_norm=False) are not supported")
    m = oc.mlstm_block.mlstm if has_m else None
    s = oc.slstm_block.slstm if has_s else None
    ff = oc.slstm_block.feedforward if has_s else None
    if has_s and ff is None:
        raise XLSTMKitError("official sLSTM blocks without a feed-forward (feedforward=None) are not supported")
    if has_s and (s.function != "slstm" or s.num_gates != 4):
        raise XLSTMKitError(f"only the sLSTM cell function 'slstm' is supported, got {s.function!r}")
    if has_s and (ff.act_fn != "gelu" or ff.ff_type != "ffn_gated"):
        raise XLSTMKitError(f"only the gated GELU feed-forward is supported, got {ff.ff_type}/{ff.act_fn}")
    kernels = {c.conv1d_kernel_size for c in (m, s) if c is not None}
    if len(kernels) != 1 or min(kernels) < 1:
        raise XLSTMKitError(f"mLSTM and sLSTM blocks must share one conv1d kernel size >= 1, got {sorted(kernels)}")
    biases = ({oc.bias} if has_m else set()) | ({ff.bias} if has_s else set())
    if len(biases) != 1:
        raise XLSTMKitError("the official model's mLSTM projections and feed-forward disagree on biases; not supported")
    ref = m if has_m else ff
    slstm_heads = s.num_heads if has_s else None
    cfg = XLSTMConfig(
        vocab_size=oc.vocab_size,
        d_model=oc.embedding_dim,
        n_blocks=oc.num_blocks,
        n_heads=m.num_heads if has_m else slstm_heads,
        slstm_at=positions,
        slstm_heads=None if not has_s or (has_m and slstm_heads == m.num_heads) else slstm_heads,
        mlstm_proj_factor=float(m.proj_factor) if has_m else 2.0,
        ffn_proj_factor=float(ff.proj_factor) if has_s else 1.3,
        round_proj_to=ref.round_proj_up_to_multiple_of,
        conv_kernel_size=kernels.pop(),
        qkv_block_size=m.qkv_proj_blocksize if has_m else 4,
        bias=biases.pop(),
        dropout=float(oc.dropout),
        tie_embeddings=bool(oc.tie_weights),
        context_length=oc.context_length if oc.context_length > 0 else 256,
    )
    if has_m and cfg.mlstm_inner_dim != m._inner_embedding_dim:
        raise XLSTMKitError(f"official mLSTM inner width {m._inner_embedding_dim} cannot be expressed "
                         f"(ours would be {cfg.mlstm_inner_dim}); round_proj_up_dim_up=False is not supported")
    return cfg


def config_to_official(cfg: XLSTMConfig, slstm_backend: str = "vanilla"):
    """The official xLSTMLMModelConfig of an XLSTMConfig."""
    if list(cfg.dplr_positions):
        raise XLSTMKitError("the official xlstm package has no DPLR blocks; remove dplr_at to convert this model")
    x = _import_xlstm()
    positions = list(cfg.slstm_positions)
    has_m, has_s = len(positions) < cfg.n_blocks, len(positions) > 0
    mlstm_block = x.mLSTMBlockConfig(mlstm=x.mLSTMLayerConfig(
        conv1d_kernel_size=cfg.conv_kernel_size,
        qkv_proj_blocksize=cfg.qkv_block_size,
        num_heads=cfg.n_heads,
        proj_factor=cfg.mlstm_proj_factor,
        round_proj_up_to_multiple_of=cfg.round_proj_to,
    )) if has_m else None
    slstm_block = x.sLSTMBlockConfig(
        slstm=x.sLSTMLayerConfig(
            backend=slstm_backend,
            num_heads=cfg.slstm_num_heads,
            conv1d_kernel_size=cfg.conv_kernel_size,
            bias_init="powerlaw_blockdependent",
        ),
        feedforward=x.FeedForwardConfig(
            proj_factor=cfg.ffn_proj_factor, act_fn="gelu", bias=cfg.bias, dropout=cfg.dropout,
            round_proj_up_to_multiple_of=cfg.round_proj_to,
        ),
    ) if has_s else None
    return x.xLSTMLMModelConfig(
        mlstm_block=mlstm_block,
        slstm_block=slstm_block,
        context_length=cfg.context_length,
        num_blocks=cfg.n_blocks,
        embedding_dim=cfg.d_model,
        slstm_at=positions,
        bias=cfg.bias,
        dropout=cfg.dropout,
        vocab_size=cfg.vocab_size,
        tie_weights=cfg.tie_embeddings,
    )


# ------------------------------------------------------------------------------ weights
def _param_map(cfg: XLSTMConfig) -> Iterator[tuple[str, str, _Fn, _Fn]]:
    """(our name, official name, official->ours, ours->official) for every plain tensor.

    The sLSTM cell's recurrent kernel and bias are not listed (see _slstm_cell_*).
    """
    ln_in: _Fn = lambda w: w + 1.0  # noqa: E731  official residual weight -> scale
    ln_out: _Fn = lambda w: w - 1.0  # noqa: E731
    conv_in: _Fn = lambda w: w[:, 0, :]  # noqa: E731  [C, 1, K] -> [C, K]
    conv_out: _Fn = lambda w: w[:, None, :]  # noqa: E731

    yield "embedding.weight", "token_embedding.weight", _same, _same
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight", _same, _same
    yield "norm.weight", "xlstm_block_stack.post_blocks_norm.weight", ln_in, ln_out
    for t, kind in enumerate(cfg.block_types):
        ours, off = f"blocks.{t}.", f"xlstm_block_stack.blocks.{t}."
        yield ours + "norm.weight", off + "xlstm_norm.weight", ln_in, ln_out
        yield ours + "layer.conv.weight", off + "xlstm.conv1d.conv.weight", conv_in, conv_out
        yield ours + "layer.conv.bias", off + "xlstm.conv1d.conv.bias", _same, _same
        if kind == "m":
            plain = ["up_proj", "down_proj", "q_proj", "k_proj", "v_proj"]
            names = {"up_proj": "proj_up", "down_proj": "proj_down"}
            for p in plain:
                for suffix in ("weight", "bias") if cfg.bias else ("weight",):
                    yield f"{ours}layer.{p}.{suffix}", f"{off}xlstm.{names.get(p, p)}.{suffix}", _same, _same
            for g in ("igate", "fgate"):
                for suffix in ("weight", "bias"):
                    yield f"{ours}layer.{g}.{suffix}", f"{off}xlstm.mlstm_cell.{g}.{suffix}", _same, _same
            yield ours + "layer.out_norm.weight", off + "xlstm.mlstm_cell.outnorm.weight", ln_in, ln_out
            yield ours + "layer.skip", off + "xlstm.learnable_skip", _same, _same
        else:
            yield ours + "layer.out_norm.weight", off + "xlstm.group_norm.weight", ln_in, ln_out
            yield ours + "ffn_norm.weight", off + "ffn_norm.weight", ln_in, ln_out
            for p in ("up_proj", "down_proj"):
                o = {"up_proj": "proj_up", "down_proj": "proj_down"}[p]
                for suffix in ("weight", "bias") if cfg.bias else ("weight",):
                    yield f"{ours}ffn.{p}.{suffix}", f"{off}ffn.{o}.{suffix}", _same, _same


# official module names of the sLSTM input maps in our gate order (i, f, z, o)
_SLSTM_GATE_MODULES = ("fgate", "igate", "zgate", "ogate")


def _slstm_cell_to_ours(layer) -> dict[str, torch.Tensor]:
    cell = layer.slstm_cell
    kernel = cell._recurrent_kernel_int2ext(cell._recurrent_kernel)  # [H, D_in, 4, D_out]
    bias = cell._bias_int2ext(cell._bias)  # [H, 4, D]
    gates = torch.stack([getattr(layer, name).weight for name in _SLSTM_GATE_MODULES])  # [4, H, D, D]
    return {
        "layer.recurrent": kernel.permute(2, 0, 1, 3),  # [4, H, D_in, D_out]
        "layer.bias": bias.permute(1, 0, 2),  # [4, H, D]
        "layer.gate_weight": gates,
    }


def _slstm_cell_from_ours(layer, ours_block) -> None:
    cell = layer.slstm_cell
    r, b = ours_block.layer.recurrent.detach(), ours_block.layer.bias.detach()
    cell._recurrent_kernel.data.copy_(cell._recurrent_kernel_ext2int(r.permute(1, 2, 0, 3)))
    cell._bias.data.copy_(cell._bias_ext2int(b.permute(1, 0, 2)))
    for g, name in enumerate(_SLSTM_GATE_MODULES):
        getattr(layer, name).weight.data.copy_(ours_block.layer.gate_weight.detach()[g])


@torch.no_grad()
def from_official_xlstm(official) -> XLSTMLanguageModel:
    """An XLSTMLanguageModel with the config and weights of an official `xlstm.xLSTMLMModel`
    (NeurIPS blocks) or `xlstm.xlstm_large.model.xLSTMLarge` (the xLSTM-7B architecture)."""
    x = _import_xlstm()

    if is_official_large(official):
        return from_official_large(official)
    if not isinstance(official, x.xLSTMLMModel):
        raise XLSTMKitError(f"expected an xlstm.xLSTMLMModel or xlstm_large xLSTMLarge, got {type(official).__name__}")
    cfg = config_from_official(official.config)
    model = XLSTMLanguageModel(cfg).to(official.token_embedding.weight.dtype)
    src = official.state_dict()
    new = {ours: to_ours(src[off]) for ours, off, to_ours, _ in _param_map(cfg)}
    for t, kind in enumerate(cfg.block_types):
        if kind == "s":
            layer = official.xlstm_block_stack.blocks[t].xlstm
            new.update({f"blocks.{t}.{k}": v for k, v in _slstm_cell_to_ours(layer).items()})
    target = model.state_dict()
    if cfg.tie_embeddings:
        target.pop("lm_head.weight")
    missing = set(target) - set(new)
    if missing:  # pragma: no cover - guards the mapping against new parameters
        raise RuntimeError(f"compat mapping misses {sorted(missing)}")
    for name, t in new.items():
        if t.shape != target[name].shape:
            raise XLSTMKitError(
                f"official weight for {name} has shape {list(t.shape)} but the converted config implies "
                f"{list(target[name].shape)}; this official configuration cannot be expressed"
            )
    model.load_state_dict(new, strict=not cfg.tie_embeddings)
    model.train(official.training)
    return model.to(official.token_embedding.weight.device)


@torch.no_grad()
def to_official_xlstm(model: XLSTMLanguageModel, slstm_backend: str = "vanilla", **large_options):
    """An official `xlstm.xLSTMLMModel` with the config and weights of `model`; for a
    large-family model an `xlstm_large` `xLSTMLarge`.

    slstm_backend "vanilla" runs anywhere; "cuda" needs the official CUDA kernels.
    large_options (large family only): xLSTMLargeConfig fields to set, e.g. mode="train",
    chunkwise_kernel="chunkwise--triton_limit_chunk"; the default is the official package's
    PyTorch kernels in mode "inference" (any length, any device).
    """
    x = _import_xlstm()
    if not isinstance(model, XLSTMLanguageModel):
        raise XLSTMKitError(f"expected an XLSTMLanguageModel, got {type(model).__name__}")
    cfg = model.config
    if cfg.family == "large":
        return to_official_large(model, **large_options)
    if large_options:
        raise XLSTMKitError(f"options {sorted(large_options)} apply to large-family models only")
    official = x.xLSTMLMModel(config_to_official(cfg, slstm_backend))
    official = official.to(device=model.embedding.weight.device, dtype=model.embedding.weight.dtype)
    ours = model.state_dict()
    dst = official.state_dict()
    for name, off, _, to_official in _param_map(cfg):
        dst[off].copy_(to_official(ours[name]))
    for t, kind in enumerate(cfg.block_types):
        if kind == "s":
            _slstm_cell_from_ours(official.xlstm_block_stack.blocks[t].xlstm, model.blocks[t])
    official.train(model.training)
    return official
