"""HuggingFace-format xLSTM folders: loading (lazily, shard by shard) and saving.

A **HuggingFace xLSTM folder** is what transformers' ``xLSTMForCausalLM.save_pretrained`` writes
and what NX-AI/xLSTM-7b ships: ``config.json`` with ``"model_type": "xlstm"`` (the fields of
transformers' ``xLSTMConfig``), the weights in ``model.safetensors`` or in shards listed by
``model.safetensors.index.json``, and usually a ``tokenizer.json`` (the ``tokenizers`` format).
Such a model is a large-family ``XLSTMLanguageModel``; the weight names differ only by prefix::

    HF backbone.embeddings.weight   <-> embedding.weight
    HF backbone.blocks.{i}.…        <-> blocks.{i}.…        (same names below the block)
    HF backbone.out_norm.weight     <-> norm.weight
    HF lm_head.weight               <-> lm_head.weight

Checkpoints saved with ``weight_mode="fused"`` (q|k|v|o-gate, i|f-gate and the two SwiGLU
up-projections stored as one matrix each) are split into the single matrices while they are read.

Loading builds the model on the meta device, reads each tensor from the memory-mapped
safetensors file(s), converts it to the requested dtype and device one tensor at a time and
assigns it into the model: a 7B model loads in bf16 with one bf16 copy in memory (never a
float32 copy of the whole model, never two copies). Shapes, names and dtypes are checked against
the config from the file headers before any weight is read.

A ``tokenizer.json`` in a folder is either ours (``{"name": "byte"}`` or ``"gpt2"``, see
``xlstm_kit.checkpoint``) or a ``tokenizers`` tokenizer (it has a ``"model"`` entry), which
:class:`HFTokenizer` wraps; it prepends the BOS token to every text, as NX-AI/xLSTM-7b's model card
asks (without it the model generates poorly).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from . import checkpoint
from ._extras import require
from .errors import XLSTMKitError

HF_MODEL_TYPE = "xlstm"
HF_ARCHITECTURE = "xLSTMForCausalLM"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# config.json key through which an HF folder written by us names one of our own tokenizers
# ("byte", "gpt2"); transformers keeps unknown config keys and ignores them.
TOKENIZER_NAME_KEY = "xlstm_kit_tokenizer"
MLSTM_EPS = 1e-6  # the eps of the mLSTM normaliser, fixed in the large family


# =============================================================================================
# Config mapping
# =============================================================================================
@dataclass
class HFSpecialTokens:
    """Token ids config.json records (None when unknown)."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None


def is_hf_config(d: Any) -> bool:
    """Whether a parsed config.json is a HuggingFace xLSTM config (not one of ours)."""
    return isinstance(d, dict) and d.get("model_type") == HF_MODEL_TYPE


def _one_of(d: dict, names: tuple[str, str], default, source) -> Any:
    """The value of the first of two synonymous keys present (both present: they must agree)."""
    present = [(n, d[n]) for n in names if d.get(n) is not None]
    if len(present) == 2 and present[0][1] != present[1][1]:
        raise XLSTMKitError(f"{source}: {names[0]}={present[0][1]!r} and {names[1]}={present[1][1]!r} disagree")
    return present[0][1] if present else default


def _token_id(d: dict, name: str, source) -> int | None:
    v = d.get(name)
    if isinstance(v, list):  # transformers allows several eos ids; the first one ends our texts
        v = v[0] if v else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise XLSTMKitError(f"{source}: {name} must be a non-negative integer, got {v!r}")
    return v


def config_from_hf(d: dict, source: str | Path = "config.json"):
    """(XLSTMConfig of family "large", HFSpecialTokens, weight_mode) from a HuggingFace
    ``xLSTMConfig`` dict. Missing fields take transformers' defaults; settings the large family
    cannot represent (no output norm, norms reduced in low precision, another mLSTM eps) are
    refused with a one-line XLSTMKitError naming ``source``."""
    from .model import XLSTMConfig

    if not is_hf_config(d):
        raise XLSTMKitError(f"{source} is not a HuggingFace xLSTM config (model_type {d.get('model_type')!r}, "
                            f"expected {HF_MODEL_TYPE!r})")
    refuse = {"add_out_norm": (True, "a model without the final RMSNorm"),
              "norm_reduction_force_float32": (True, "norms reduced in low precision")}
    for key, (want, what) in refuse.items():
        if d.get(key, want) != want:
            raise XLSTMKitError(f"{source}: {key}={d[key]!r} ({what}) is not supported by xlstm_kit's large family")
    eps = d.get("eps", MLSTM_EPS)
    if not isinstance(eps, (int, float)) or not math.isclose(eps, MLSTM_EPS, rel_tol=1e-9):
        raise XLSTMKitError(f"{source}: eps={eps!r} (the mLSTM normaliser's) is not supported; xlstm_kit uses {MLSTM_EPS}")
    weight_mode = d.get("weight_mode", "single")
    if weight_mode not in ("single", "fused"):
        raise XLSTMKitError(f"{source}: weight_mode {weight_mode!r} is not 'single' or 'fused'")
    soft = {}
    for hf_key, ours in (("gate_soft_cap", "gate_soft_cap"), ("output_logit_soft_cap", "logit_soft_cap")):
        if hf_key in d and d[hf_key] is None:
            raise XLSTMKitError(f"{source}: {hf_key}=null (no soft cap) is not supported by xlstm_kit's large family")
        if hf_key in d:
            soft[ours] = d[hf_key]
    fields = dict(
        family="large",
        vocab_size=d.get("vocab_size", 50304),
        d_model=_one_of(d, ("embedding_dim", "hidden_size"), 4096, source),
        n_blocks=_one_of(d, ("num_blocks", "num_hidden_layers"), 32, source),
        n_heads=d.get("num_heads", 8),
        qk_dim_factor=d.get("qk_dim_factor", 0.5),
        v_dim_factor=d.get("v_dim_factor", 1.0),
        ffn_proj_factor=d.get("ffn_proj_factor", 2.667),
        round_proj_to=d.get("ffn_round_up_to_multiple_of", 64),
        norm_eps=d.get("norm_eps", 1e-6),
        bias=d.get("use_bias", False),
        tie_embeddings=d.get("tie_word_embeddings", False),
        chunk_size=d.get("chunk_size", 64),
        **soft,
    )
    if isinstance(d.get("max_position_embeddings"), int):
        fields["context_length"] = d["max_position_embeddings"]
    try:
        config = XLSTMConfig(**fields)
    except (ValueError, TypeError) as e:
        raise XLSTMKitError(f"{source} describes a model xlstm_kit cannot build: {e}") from None
    special = HFSpecialTokens(*(_token_id(d, n, source) for n in ("bos_token_id", "eos_token_id", "pad_token_id")))
    return config, special, weight_mode


def config_to_hf(config, special: HFSpecialTokens | None = None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The config.json transformers' ``xLSTMForCausalLM`` needs for a large-family XLSTMConfig
    (weight_mode "single", pure-PyTorch kernels, inference mode; token ids when known)."""
    if config.family != "large":
        raise XLSTMKitError(
            f"format='hf' needs a large-family model (transformers' xLSTMForCausalLM is the xLSTM-7B "
            f"architecture); this model has family {config.family!r}, which HuggingFace has no model type "
            f"for: save it with format='xlstm_kit'")
    special = special or HFSpecialTokens()
    out = {
        "model_type": HF_MODEL_TYPE,
        "architectures": [HF_ARCHITECTURE],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "embedding_dim": config.d_model,
        "num_hidden_layers": config.n_blocks,
        "num_blocks": config.n_blocks,
        "num_heads": config.n_heads,
        "use_bias": config.bias,
        "norm_reduction_force_float32": True,
        "tie_word_embeddings": config.tie_embeddings,
        "add_out_norm": True,
        "norm_eps": config.norm_eps,
        "qk_dim_factor": config.qk_dim_factor,
        "v_dim_factor": config.v_dim_factor,
        "chunkwise_kernel": "chunkwise--native_autograd",
        "sequence_kernel": "native_sequence__native",
        "step_kernel": "native",
        "mode": "inference",
        "chunk_size": config.chunk_size,
        "return_last_states": True,
        "autocast_kernel_dtype": "bfloat16",
        "eps": MLSTM_EPS,
        "inference_state_dtype": "float32",
        "ffn_proj_factor": config.ffn_proj_factor,
        "ffn_round_up_to_multiple_of": config.round_proj_to,
        "gate_soft_cap": config.gate_soft_cap,
        "output_logit_soft_cap": config.logit_soft_cap,
        "weight_mode": "single",
        "use_cache": True,
        "max_inference_chunksize": 16384,
        "bos_token_id": special.bos_token_id,
        "eos_token_id": special.eos_token_id,
        "pad_token_id": special.pad_token_id,
    }
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


# =============================================================================================
# Weight names
# =============================================================================================
_OURS_TO_HF_FIXED = {"embedding.weight": "backbone.embeddings.weight", "norm.weight": "backbone.out_norm.weight",
                     "norm.bias": "backbone.out_norm.bias", "lm_head.weight": "lm_head.weight"}
_HF_TO_OURS_FIXED = {v: k for k, v in _OURS_TO_HF_FIXED.items()}
# fused HF weight -> the single weights it concatenates along dim 0, in order
_FUSED = {"mlstm_layer.qkv_opreact": ("mlstm_layer.q", "mlstm_layer.k", "mlstm_layer.v", "mlstm_layer.ogate_preact"),
          "mlstm_layer.ifgate_preact": ("mlstm_layer.igate_preact", "mlstm_layer.fgate_preact"),
          "ffn.proj_up_gate_z": ("ffn.proj_up_gate", "ffn.proj_up")}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")


def our_key_to_hf(key: str) -> str:
    """HF name of one of our large-family state_dict keys."""
    if key in _OURS_TO_HF_FIXED:
        return _OURS_TO_HF_FIXED[key]
    if key.startswith("blocks."):
        return "backbone." + key
    raise XLSTMKitError(f"{key!r} is not a weight of a large-family model; it has no HuggingFace name")


def hf_key_to_ours(key: str) -> str | None:
    """Our state_dict key for an HF weight name (single weight mode), None for a foreign name."""
    if key in _HF_TO_OURS_FIXED:
        return _HF_TO_OURS_FIXED[key]
    if key.startswith("backbone.blocks."):
        return key[len("backbone."):]
    return None


def _fused_parts(key: str, shape: list[int], config) -> list[tuple[str, int, int]] | None:
    """For an HF fused weight (our key form, blocks.i.…), its single parts as (our key, start,
    end) rows along dim 0; None when `key` is not a fused weight."""
    m = _BLOCK_KEY.fullmatch(key)
    if not m or m[2] not in _FUSED:
        return None
    qk, v = config.qk_dim, config.v_dim
    sizes = {"mlstm_layer.qkv_opreact": (qk, qk, v, v),
             "mlstm_layer.ifgate_preact": (config.n_heads,) * 2,
             "ffn.proj_up_gate_z": (config.ffn_dim,) * 2}[m[2]]
    if not shape or shape[0] != sum(sizes):
        return None  # the shape check reports it under the fused name
    rows, start = [], 0
    for name, size in zip(_FUSED[m[2]], sizes):
        rows.append((f"blocks.{m[1]}.{name}.{m[3]}", start, start + size))
        start += size
    return rows


# =============================================================================================
# Reading weights lazily
# =============================================================================================
@dataclass
class _Source:
    """Where one of our tensors lives: file, its name there, optional row range (fused)."""

    file: Path
    name: str
    shape: list[int]
    dtype: str  # safetensors dtype name ("F32", "BF16", ...)
    rows: tuple[int, int] | None = None


_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def weight_files(folder: Path) -> tuple[list[Path], Path, dict[str, str] | None]:
    """The safetensors files of a folder, the file errors should name (index or single file),
    and the index's weight map (None for a single file)."""
    index, single = folder / INDEX_FILE, folder / checkpoint.WEIGHTS_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a map of names to files")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise XLSTMKitError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        files = []
        for name in dict.fromkeys(weight_map.values()):
            f = folder / name
            if Path(name).name != name or not f.is_file():
                raise XLSTMKitError(f"{index} lists the shard {name!r}, which is not a file in {folder}")
            files.append(f)
        return files, index, weight_map
    if single.is_file():
        return [single], single, None
    raise FileNotFoundError(f"{folder} has neither {checkpoint.WEIGHTS_FILE} nor {INDEX_FILE}; "
                            f"is it a model folder?")


def _read_headers(folder: Path, hf: bool, config, weight_mode: str) -> tuple[dict[str, _Source], Path]:
    """Map each of our state_dict keys to where it lives, from the safetensors headers only."""
    from safetensors import SafetensorError, safe_open

    files, named, weight_map = weight_files(folder)
    sources: dict[str, _Source] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                names = list(handle.keys())
                meta = {n: (handle.get_slice(n).get_shape(), handle.get_slice(n).get_dtype()) for n in names}
        except (SafetensorError, OSError, ValueError) as e:
            raise XLSTMKitError(f"{f} is not a readable safetensors file ({e})") from None
        for name in names:
            if weight_map is not None and weight_map.get(name) != f.name:
                raise XLSTMKitError(f"{f} holds {name!r}, which {INDEX_FILE} does not assign to it")
            ours = hf_key_to_ours(name) if hf else name
            if ours is None:
                raise XLSTMKitError(f"{f}: unexpected weight {name!r} (not a name of transformers' xLSTMForCausalLM)")
            shape, dtype = meta[name]
            parts = _fused_parts(ours, shape, config) if hf and weight_mode == "fused" else None
            for key, rows in ([(k, (a, b)) for k, a, b in parts] if parts else [(ours, None)]):
                if key in sources:
                    raise XLSTMKitError(f"{f}: {key!r} is stored twice (also in {sources[key].file.name})")
                part_shape = [rows[1] - rows[0], *shape[1:]] if rows else list(shape)
                sources[key] = _Source(f, name, part_shape, dtype, rows)
    if weight_map is not None:
        absent = sorted(set(weight_map) - {s.name for s in sources.values()})
        if absent:
            raise XLSTMKitError(f"{named} lists {absent[:5]}, which its shards do not hold")
    return sources, named


def _check_sources(sources: dict[str, _Source], expected: dict[str, torch.Tensor], named: Path, hf: bool) -> None:
    """Refuse (one line, naming the file) missing, unexpected, mis-shaped or non-float weights."""
    name = hf_name if hf else (lambda k: k)
    missing = sorted(set(expected) - set(sources))
    extra = sorted(set(sources) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {[name(k) for k in missing[:5]]}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if extra:
            files = sorted({sources[k].file.name for k in extra})
            parts.append(f"unexpected {[sources[k].name for k in extra[:5]]}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
                         + f" in {', '.join(files)}")
        raise XLSTMKitError(f"{named} does not match its config.json: {', '.join(parts)}")
    for key, src in sources.items():
        want = list(expected[key].shape)
        if src.shape != want:
            where = f"{src.name}[{src.rows[0]}:{src.rows[1]}]" if src.rows else src.name
            raise XLSTMKitError(f"{src.file}: {where} has shape {src.shape}, config.json implies {want}")
        if src.dtype not in _FLOAT_DTYPES:
            raise checkpoint.CheckpointError(f"{src.file}: {src.name} has dtype {src.dtype}, expected a floating-point tensor")


def hf_name(key: str) -> str:
    """HF name of our key for error messages (never raises)."""
    try:
        return our_key_to_hf(key)
    except XLSTMKitError:
        return key


def _materialise(sources: dict[str, _Source], dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the tensors file by file, each converted on its own (never a whole-model copy in
    another dtype), refusing NaN or infinite values."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key, src in sources.items():
        by_file.setdefault(src.file, []).append(key)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for key in keys:
                src = sources[key]
                t = handle.get_slice(src.name)[src.rows[0]:src.rows[1]] if src.rows else handle.get_tensor(src.name)
                t = t.to(device=device, dtype=dtype)
                if not bool(torch.isfinite(t).all()):
                    raise checkpoint.CheckpointError(f"{f}: {src.name} holds NaN or infinite values; the weights are unusable")
                yield key, t.contiguous()


def _target_dtype(sources: dict[str, _Source], dtype) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise XLSTMKitError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
        return dtype
    stored = {s.dtype for s in sources.values()}
    return _FLOAT_DTYPES[stored.pop()] if len(stored) == 1 else torch.float32


def _check_device(device) -> torch.device:
    try:
        return torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise XLSTMKitError(f"device {device!r} is not a torch device: {e}") from None


def _json_object(path: Path) -> dict:
    """A JSON file holding an object; one-line XLSTMKitError otherwise."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XLSTMKitError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise XLSTMKitError(f"{path} must hold a JSON object")
    return d


def load_pretrained(cls, path: str | Path, dtype=None, device=None):
    """See ``XLSTMLanguageModel.from_pretrained``."""
    from .model import XLSTMConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no model folder at {str(path)!r}")
    if not (path / checkpoint.CONFIG_FILE).is_file():
        if not (path / checkpoint.LATEST_FILE).is_file():
            raise XLSTMKitError(f"{path} has no {checkpoint.CONFIG_FILE}: it is neither a HuggingFace xLSTM folder, "
                                f"an xlstm_kit checkpoint nor a training run folder")
        path = checkpoint.resolve_checkpoint(path)
    cfg_path = path / checkpoint.CONFIG_FILE
    raw = _json_object(cfg_path)
    hf = is_hf_config(raw)
    special, weight_mode = HFSpecialTokens(), "single"
    if hf:
        config, special, weight_mode = config_from_hf(raw, cfg_path)
    elif "model_type" in raw:
        raise XLSTMKitError(f"{cfg_path} has model_type {raw['model_type']!r}; xlstm_kit reads HuggingFace "
                            f"folders of model_type {HF_MODEL_TYPE!r} only")
    else:
        try:
            config = XLSTMConfig.from_dict(raw)
        except (ValueError, TypeError) as e:
            raise XLSTMKitError(f"{cfg_path} does not describe a valid XLSTMConfig: {e}") from None
        checkpoint.verify_checksum(path, checkpoint.WEIGHTS_FILE)
    target = _check_device(device)
    if config.backend == "triton" and target.type != "cuda":
        warnings.warn(f"{path} was saved with backend='triton', which needs CUDA; loading it on "
                      f"{target.type} with the automatic backend", stacklevel=3)
        config = dataclasses.replace(config, backend=None)

    sources, named = _read_headers(path, hf, config, weight_mode)
    if hf and config.tie_embeddings and "lm_head.weight" in sources:
        # transformers' xLSTMForCausalLM never ties its head (it has no tied-weights keys): a
        # stored head is the one it computes with, whatever tie_word_embeddings says
        config = dataclasses.replace(config, tie_embeddings=False)
    with torch.device("meta"):  # shapes only: nothing is allocated until a tensor is read
        model = cls(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    _check_sources(sources, expected, named, hf)
    state = dict(_materialise(sources, _target_dtype(sources, dtype), target))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embedding.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a parameter the file does not hold and the check above missed
        raise XLSTMKitError(f"{named} leaves {left[:5]} unset")
    named_tokenizer = raw.get(TOKENIZER_NAME_KEY) if hf else checkpoint.read_tokenizer_name(path)
    model.tokenizer_name = named_tokenizer if isinstance(named_tokenizer, str) else None
    model.hf_tokenizer = find_tokenizer(path, special)
    model.hf_special_tokens = special
    model.eval()
    return model


# =============================================================================================
# Saving
# =============================================================================================
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9), "500MiB" (2^20) or "10KB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise XLSTMKitError(f"max_shard_size must be a number of bytes or a size like '5GB', got {size!r}")
        base = 1024 if m[3] else 1000
        value = int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))
    if value < 1:
        raise XLSTMKitError(f"max_shard_size must be positive, got {size!r}")
    return value


def _shard(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive groups of keys of at most `limit` bytes each (a larger tensor is a shard alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for k in keys:
        if shards[-1] and used + sizes[k] > limit:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str,
                      metadata: dict[str, str]) -> list[str]:
    """Write `tensors` as model.safetensors, or as shards with model.safetensors.index.json when
    they exceed `max_shard_size`; one shard's tensors at a time are copied to the CPU. Returns
    the names written."""
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    shards = _shard(list(tensors), sizes, limit)
    names = [checkpoint.WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: tensors[k].detach().to("cpu").contiguous() for k in keys}, str(folder / name), metadata=metadata)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX_FILE)
    return names


def _stale_weight_files(folder: Path, keep: set[str]) -> list[Path]:
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(INDEX_FILE))
    return [p for p in folder.iterdir() if pattern.fullmatch(p.name) and p.name not in keep] if folder.is_dir() else []


def save_pretrained(model: nn.Module, path: str | Path, format: str = "hf",
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """See ``XLSTMLanguageModel.save_pretrained``."""
    if format == "xlstm_kit":
        return model.save(path)
    if format != "hf":
        raise XLSTMKitError(f"format must be 'hf' or 'xlstm_kit', got {format!r}")
    parse_size(max_shard_size)
    tok = getattr(model, "hf_tokenizer", None)
    special = getattr(model, "hf_special_tokens", None) or HFSpecialTokens()
    if tok is not None:
        special = HFSpecialTokens(tok.bos_token_id, tok.eos_token_id if special.eos_token_id is None else special.eos_token_id,
                                  special.pad_token_id)
    elif model.tokenizer_name == "gpt2" and special.eos_token_id is None:
        special = HFSpecialTokens(None, 50256, None)
    state = model.state_dict()
    dtypes = {t.dtype for t in state.values()}
    hf_config = config_to_hf(model.config, special, dtypes.pop() if len(dtypes) == 1 else None)
    if tok is None and model.tokenizer_name is not None:
        hf_config[TOKENIZER_NAME_KEY] = model.tokenizer_name
    tensors = {our_key_to_hf(k): v for k, v in state.items()}
    if model.config.tie_embeddings:
        # transformers' xLSTMForCausalLM does not tie its head: it needs it stored (safetensors
        # refuses two names for one tensor, hence a copy)
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise XLSTMKitError(f"cannot save to {str(path)!r}: it exists and is not a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint._make_hidden_dir(path.parent, f".{path.name}.tmp-")
    try:
        names = write_safetensors(tensors, tmp, max_shard_size, {"format": "pt"})
        for name in names:
            if name.endswith(".safetensors"):
                os.chmod(tmp / name, 0o666 & ~checkpoint._umask())
        (tmp / checkpoint.CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        names.append(checkpoint.CONFIG_FILE)
        if tok is not None:
            names += tok.save(tmp)
        checkpoint.fsync_tree(tmp)
        if path.exists():
            # an existing folder keeps its other files; weight files of an earlier save that this
            # one does not overwrite (other shard counts) would be read as part of the model
            stale = _stale_weight_files(path, set(names))
            for name in names:
                os.replace(tmp / name, path / name)
            for p in stale:
                p.unlink(missing_ok=True)
        else:
            os.rename(tmp, path)
        checkpoint.fsync_dir(path)
        checkpoint.fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# =============================================================================================
# Tokenizers from tokenizer.json
# =============================================================================================
def is_hf_tokenizer_file(path: Path) -> bool:
    """Whether `path` is a ``tokenizers`` tokenizer.json (ours only names a tokenizer)."""
    if not path.is_file():
        return False
    with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError):
        d = json.loads(path.read_text(encoding="utf-8"))
        return isinstance(d, dict) and isinstance(d.get("model"), dict)
    return False


class HFTokenizer:
    """A ``tokenizers`` tokenizer read from a tokenizer.json, with the BOS token prepended to
    every encoded text (NX-AI/xLSTM-7b generates poorly without it). Same interface as
    ``xlstm_kit.data``'s tokenizers: name, vocab_size, eos_token_id, encode, encode_array,
    decode, token_byte_lengths. The ``tokenizers`` package is imported at the first encode or
    decode: a model folder loads without it."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None):
        self.path = Path(path)
        self._bytes = self.path.read_bytes()
        try:
            spec = json.loads(self._bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise XLSTMKitError(f"{self.path} is not valid JSON ({e})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise XLSTMKitError(f"{self.path} is not a tokenizers tokenizer.json (it has no 'model')")
        self._spec = spec
        self._tokenizer = None
        self.name = "hf-" + hashlib.sha256(self._bytes).hexdigest()[:16]
        self.bos_token_id: int | None = None
        self.eos_token_id: int | None = None
        self.set_special_tokens(bos_token_id, eos_token_id)

    @property
    def _tok(self):
        if self._tokenizer is None:
            hf = require("tokenizers", "the tokenizer.json of a model folder")
            try:
                self._tokenizer = hf.Tokenizer.from_str(self._bytes.decode("utf-8"))
            except Exception as e:  # the tokenizers package raises its own exception type
                raise XLSTMKitError(f"{self.path} is not a readable tokenizers file: {e}") from None
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _json_vocab(self) -> dict[str, int]:
        """token -> id from the file itself: the model's vocabulary (a map, or Unigram's list of
        [token, score] rows) and the added tokens."""
        vocab = self._spec["model"].get("vocab")
        ids = dict(vocab) if isinstance(vocab, dict) else {
            row[0]: i for i, row in enumerate(vocab) if isinstance(row, list) and row} if isinstance(vocab, list) else {}
        for t in self._spec.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
                ids[t["content"]] = t["id"]
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._json_vocab().get(token)

    def set_special_tokens(self, bos_token_id: int | None, eos_token_id: int | None) -> None:
        """Set the BOS id (prepended to every text; None: nothing) and the EOS id (ends texts)."""
        ids = set(self._json_vocab().values())
        for what, v in (("bos", bos_token_id), ("eos", eos_token_id)):
            if v is not None and ids and v not in ids:
                raise XLSTMKitError(f"{self.path}: {what} token id {v} is not in its vocabulary of "
                                    f"{max(ids) + 1} tokens")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def encode_array(self, text: str) -> np.ndarray:
        """A corpus as one document: BOS once at its start."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes each token stands for (0 for special tokens), for bits per byte."""
        from .data import _gpt2_byte_alphabet

        decoder = self._spec.get("decoder") or {}
        alphabet = _gpt2_byte_alphabet() if decoder.get("type") == "ByteLevel" else None
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            lengths[idx] = (sum(1 for c in token if c in alphabet) if alphabet is not None
                            else len(token.replace("\u2581", " ").encode("utf-8")))
        return lengths

    def save(self, folder: Path) -> list[str]:
        """Write tokenizer.json (as read) and tokenizer_config.json (BOS/EOS) into `folder`."""
        (folder / checkpoint.TOKENIZER_FILE).write_bytes(self._bytes)
        cfg = {"add_bos_token": self.bos_token_id is not None, "bos_token_id": self.bos_token_id,
               "eos_token_id": self.eos_token_id}
        names = {i: t for t, i in self._json_vocab().items()}
        for what, v in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if v in names:
                cfg[what] = names[v]
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        return [checkpoint.TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]


def _tokenizer_config_id(folder: Path, tok: HFTokenizer, what: str) -> int | None:
    """`what`_token_id from tokenizer_config.json (an id, or a token string to look up)."""
    f = folder / TOKENIZER_CONFIG_FILE
    if not f.is_file():
        return None
    d = _json_object(f)
    if isinstance(d.get(f"{what}_token_id"), int):
        return d[f"{what}_token_id"]
    token = d.get(f"{what}_token")
    token = token.get("content") if isinstance(token, dict) else token  # transformers' AddedToken form
    return tok.token_to_id(token) if isinstance(token, str) else None


def find_tokenizer(folder: str | Path, special: HFSpecialTokens | None = None) -> HFTokenizer | None:
    """The HFTokenizer of a folder's tokenizers-format tokenizer.json, None when it has none (or
    has one of ours). BOS/EOS ids: config.json's (`special`), else tokenizer_config.json's."""
    folder = Path(folder)
    f = folder / checkpoint.TOKENIZER_FILE
    if not is_hf_tokenizer_file(f):
        return None
    special = special or HFSpecialTokens()
    tok = HFTokenizer(f)
    bos = special.bos_token_id if special.bos_token_id is not None else _tokenizer_config_id(folder, tok, "bos")
    eos = special.eos_token_id if special.eos_token_id is not None else _tokenizer_config_id(folder, tok, "eos")
    tok.set_special_tokens(bos, eos)
    return tok
