"""Conversion to and from the official xLSTM-7B model, `xlstm.xlstm_large.model.xLSTMLarge`
(xlstm 2.0.6), used through `xlstm_kit.io.compat.from_official_xlstm` / `to_official_xlstm`.

Our large-family state_dict is the official one with `backbone.` dropped from the block names
and `backbone.out_norm` called `norm`. Official models with weight_mode "fused" (q, k, v and the
output gate in one matrix, the two gates in another, the two feed-forward up maps in a third)
are split on the way in; `to_official_large` writes weight_mode "single" unless told otherwise.
The `xlstm` package is imported only when a function here is called.
"""
from __future__ import annotations

import torch

from ..errors import XLSTMKitError
from ..models import XLSTMConfig, XLSTMLanguageModel


def _large_module():
    try:
        from xlstm.xlstm_large import model as large
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the official package is needed: pip install --no-deps xlstm==2.0.6 "
                          "mlstm-kernels==2.0.6 (plus pyyaml, safetensors, einops)") from e
    return large


def is_official_large(obj) -> bool:
    """Whether `obj` is an official xLSTMLarge (without importing xlstm unless it is loaded)."""
    try:
        return isinstance(obj, _large_module().xLSTMLarge)
    except ImportError:  # pragma: no cover
        return False


def config_from_official_large(oc) -> XLSTMConfig:
    """XLSTMConfig equal to an official xLSTMLargeConfig (XLSTMKitError for what we lack)."""
    if not oc.add_out_norm:
        raise XLSTMKitError("official xLSTMLarge models without the final norm (add_out_norm=False) are not supported")
    for name in ("gate_soft_cap", "output_logit_soft_cap"):
        if getattr(oc, name) is None:
            raise XLSTMKitError(f"official xLSTMLarge models without {name} are not supported")
    if oc.eps != 1e-6:
        raise XLSTMKitError(f"the mLSTM normaliser eps is 1e-6 here; the official model has eps={oc.eps}")
    return XLSTMConfig(
        family="large", vocab_size=oc.vocab_size, d_model=oc.embedding_dim, n_blocks=oc.num_blocks,
        n_heads=oc.num_heads, qk_dim_factor=float(oc.qk_dim_factor), v_dim_factor=float(oc.v_dim_factor),
        ffn_proj_factor=float(oc.ffn_proj_factor), round_proj_to=oc.ffn_round_up_to_multiple_of,
        bias=bool(oc.use_bias), norm_eps=float(oc.norm_eps), gate_soft_cap=float(oc.gate_soft_cap),
        logit_soft_cap=float(oc.output_logit_soft_cap), chunk_size=oc.chunk_size,
    )


def config_to_official_large(cfg: XLSTMConfig, **options):
    """The official xLSTMLargeConfig of a large-family XLSTMConfig; `options` override its
    fields (default: the package's PyTorch kernels in mode "inference")."""
    large = _large_module()
    fields = dict(
        embedding_dim=cfg.d_model, num_heads=cfg.n_heads, num_blocks=cfg.n_blocks, vocab_size=cfg.vocab_size,
        use_bias=cfg.bias, norm_eps=cfg.norm_eps, qk_dim_factor=cfg.qk_dim_factor, v_dim_factor=cfg.v_dim_factor,
        ffn_proj_factor=cfg.ffn_proj_factor, ffn_round_up_to_multiple_of=cfg.round_proj_to,
        gate_soft_cap=cfg.gate_soft_cap, output_logit_soft_cap=cfg.logit_soft_cap, chunk_size=cfg.chunk_size,
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", mode="inference", return_last_states=False, weight_mode="single",
    )
    unknown = sorted(set(options) - set(large.xLSTMLargeConfig.__dataclass_fields__))
    if unknown:
        raise XLSTMKitError(f"unknown xLSTMLargeConfig fields {unknown}")
    return large.xLSTMLargeConfig(**{**fields, **options})


# fused official matrices -> our (single) module names, in their row order
def _fused_parts(cfg: XLSTMConfig) -> dict[str, list[tuple[str, int]]]:
    qk, v, H = cfg.qk_dim, cfg.v_dim, cfg.n_heads
    return {
        "mlstm_layer.qkv_opreact": [("mlstm_layer.q", qk), ("mlstm_layer.k", qk), ("mlstm_layer.v", v),
                                    ("mlstm_layer.ogate_preact", v)],
        "mlstm_layer.ifgate_preact": [("mlstm_layer.igate_preact", H), ("mlstm_layer.fgate_preact", H)],
        "ffn.proj_up_gate_z": [("ffn.proj_up_gate", cfg.ffn_dim), ("ffn.proj_up", cfg.ffn_dim)],
    }


def _official_name(ours: str) -> str:
    if ours.startswith("blocks."):
        return "backbone." + ours
    return {"norm.weight": "backbone.out_norm.weight"}.get(ours, ours)


@torch.no_grad()
def from_official_large(official) -> XLSTMLanguageModel:
    """An XLSTMLanguageModel with the config and weights of an official xLSTMLarge."""
    cfg = config_from_official_large(official.config)
    src = dict(official.state_dict())
    bias = src.pop("backbone.out_norm.bias", None)
    if bias is not None and bool(bias.any()):
        raise XLSTMKitError("the official model's final norm has a non-zero bias, which XLSTMLanguageModel "
                            "has no place for (transformers' xLSTM has none either)")
    for t in range(cfg.n_blocks):  # weight_mode "fused": split into the single maps
        for fused, parts in _fused_parts(cfg).items():
            for suffix in ("weight", "bias"):
                key = f"backbone.blocks.{t}.{fused}.{suffix}"
                if key in src:
                    pieces = src.pop(key).split([n for _, n in parts])
                    for (name, _), piece in zip(parts, pieces):
                        src[f"backbone.blocks.{t}.{name}.{suffix}"] = piece
    model = XLSTMLanguageModel(cfg).to(official.embedding.weight.dtype)
    target = model.state_dict()
    new = {}
    for name, ref in target.items():
        off = _official_name(name)
        if off not in src:  # pragma: no cover - guards the mapping against new parameters
            raise RuntimeError(f"compat mapping: the official model has no {off}")
        if src[off].shape != ref.shape:
            raise XLSTMKitError(f"official weight {off} has shape {list(src[off].shape)} but the converted "
                                f"config implies {list(ref.shape)}; this official configuration cannot be expressed")
        new[name] = src.pop(off)
    if src:  # pragma: no cover
        raise RuntimeError(f"compat mapping leaves official weights unused: {sorted(src)}")
    model.load_state_dict(new)
    model.train(official.training)
    return model.to(official.embedding.weight.device)


@torch.no_grad()
def to_official_large(model: XLSTMLanguageModel, **options):
    """An official xLSTMLarge with the config and weights of a large-family `model`."""
    large = _large_module()
    cfg = model.config
    oc = config_to_official_large(cfg, **options)
    official = large.xLSTMLarge(oc).to(device=model.embedding.weight.device, dtype=model.embedding.weight.dtype)
    dst = official.state_dict()
    ours = model.state_dict()
    fused = oc.weight_mode == "fused"
    for name, t in ours.items():
        off = _official_name(name)
        if off in dst:
            dst[off].copy_(t)
        elif not fused:  # pragma: no cover
            raise RuntimeError(f"compat mapping: the official model has no {off}")
    if fused:
        for t in range(cfg.n_blocks):
            for f, parts in _fused_parts(cfg).items():
                for suffix in ("weight", "bias"):
                    key = f"backbone.blocks.{t}.{f}.{suffix}"
                    if key in dst:
                        dst[key].copy_(torch.cat([ours[f"blocks.{t}.{n}.{suffix}"] for n, _ in parts]))
    if "backbone.out_norm.bias" in dst:
        dst["backbone.out_norm.bias"].zero_()
    official.train(model.training)
    return official
