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
``xlstm_kit.io.checkpoint``) or a ``tokenizers`` tokenizer (it has a ``"model"`` entry), which
:class:`HFTokenizer` wraps; it prepends the BOS token to every text, as NX-AI/xLSTM-7b's model card
asks (without it the model generates poorly).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import MissingFileError, XLSTMKitError
from ..layers.lora import has_adapters
from ..models.config import XLSTMConfig
from . import checkpoint
from .jsonfile import MAX_INDEX_BYTES, checked_path, read_json, regular_file_exists
from .paths import check_writable
from .tokenizers import HFSpecialTokens

HF_MODEL_TYPE = "xlstm"
HF_ARCHITECTURE = "xLSTMForCausalLM"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# config.json key through which an HF folder written by us names one of our own tokenizers
# ("byte", "gpt2"); transformers keeps unknown config keys and ignores them.
TOKENIZER_NAME_KEY = "xlstm_kit_tokenizer"
MLSTM_EPS = 1e-6  # the eps of the mLSTM normaliser, fixed in the large family


# =============================================================================================
# Config mapping
# =============================================================================================
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


def weight_files(folder: Path, sharded: bool = True) -> tuple[list[Path], Path, dict[str, str] | None]:
    """The safetensors files of a folder, the file errors should name (index or single file),
    and the index's weight map (None for a single file). ``sharded=False`` (our own checkpoint
    format, never sharded): model.safetensors only, whatever index lies beside it."""
    index, single = folder / INDEX_FILE, folder / checkpoint.WEIGHTS_FILE
    # not is_file(): a FIFO or a folder at either name is refused in one line, not passed over
    # (an index beside model.safetensors) nor reported missing
    if not sharded:
        if regular_file_exists(single):
            return [single], single, None
        raise MissingFileError(f"{folder} has no {checkpoint.WEIGHTS_FILE}, which its {checkpoint.CONFIG_FILE} "
                               f"(an xlstm_kit config, not a HuggingFace one) needs")
    if regular_file_exists(index):
        try:
            weight_map = read_json(index, MAX_INDEX_BYTES, expect=None)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a map of names to files")
        except (KeyError, TypeError) as e:
            raise XLSTMKitError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        files = []
        for name in dict.fromkeys(weight_map.values()):
            f = folder / name
            if Path(name).name != name or not regular_file_exists(f):
                raise XLSTMKitError(f"{index} lists the shard {name!r}, which is not a file in {folder}")
            files.append(f)
        return files, index, weight_map
    if regular_file_exists(single):
        return [single], single, None
    raise MissingFileError(f"{folder} has neither {checkpoint.WEIGHTS_FILE} nor {INDEX_FILE}; "
                            f"is it a model folder?")


def read_headers(folder: Path, hf: bool, config, weight_mode: str) -> tuple[dict[str, _Source], Path]:
    """Map each of our state_dict keys to where it lives, from the safetensors headers only."""
    files, named, weight_map = weight_files(folder, sharded=hf)
    sources: dict[str, _Source] = {}
    for f in files:
        # weight_files checked the name, which may be a FIFO by now
        with checked_path(f, XLSTMKitError) as opened:
            try:
                with safe_open(opened, framework="pt") as handle:
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


def check_sources(sources: dict[str, _Source], expected: dict[str, torch.Tensor], named: Path, hf: bool) -> None:
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


def materialise(sources: dict[str, _Source], dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the tensors file by file, each converted on its own (never a whole-model copy in
    another dtype), refusing NaN or infinite values."""
    by_file: dict[Path, list[str]] = {}
    for key, src in sources.items():
        by_file.setdefault(src.file, []).append(key)
    for f, keys in by_file.items():
        # opened again, by a name that may be a FIFO since read_headers
        with checked_path(f, XLSTMKitError) as opened:
            try:
                handle = safe_open(opened, framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise XLSTMKitError(f"{f} is not a readable safetensors file ({e}); was it replaced while loading?") from None
            with handle:
                for key in keys:
                    src = sources[key]
                    t = _read(handle, f, src).to(device=device, dtype=dtype)
                    if not bool(torch.isfinite(t).all()):
                        raise checkpoint.CheckpointError(f"{f}: {src.name} holds NaN or infinite values; the weights are unusable")
                    yield key, t.contiguous()


def _read(handle, f: Path, src: _Source) -> torch.Tensor:
    # The file was opened again after read_headers, and a regular file put at its name in between
    # (checked_path refuses anything else) need not hold what the headers checked: safetensors'
    # error would be a traceback, a tensor of another shape torch's multi-line one.
    try:
        t = handle.get_slice(src.name)[src.rows[0]:src.rows[1]] if src.rows else handle.get_tensor(src.name)
    except (SafetensorError, OSError, ValueError) as e:
        raise XLSTMKitError(f"{f} is not a readable safetensors file ({e}); was it replaced while loading?") from None
    if list(t.shape) != src.shape or t.dtype != _FLOAT_DTYPES.get(src.dtype):
        raise XLSTMKitError(f"{f}: {src.name} is {t.dtype} {list(t.shape)}, its header said {src.dtype} {src.shape}; "
                            f"was it replaced while loading?")
    return t


def target_dtype(sources: dict[str, _Source], dtype) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if dtype not in _FLOAT_DTYPES.values():  # float8 and complex types cannot run the model
            raise XLSTMKitError(f"dtype must be torch.float32, torch.bfloat16, torch.float16 or torch.float64, "
                                f"got {dtype!r}")
        return dtype
    stored = {s.dtype for s in sources.values()}
    return _FLOAT_DTYPES[stored.pop()] if len(stored) == 1 else torch.float32


def check_device(device) -> torch.device:
    """The torch.device a model is loaded onto, refused (XLSTMKitError) when it cannot hold one:
    not a device, the meta device (no values), a CUDA or MPS device this machine lacks."""
    try:
        d = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise XLSTMKitError(f"device {device!r} is not a torch device: {str(e).splitlines()[0]}") from None
    if d.type == "meta":
        raise XLSTMKitError("device 'meta' holds no values; load onto cpu or cuda (to see shapes only, build "
                            "the model from its config under torch.device('meta'))")
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise XLSTMKitError(f"device {str(d)!r} asked for, but this machine has no CUDA GPU that torch can use")
        if d.index is not None and d.index >= count:
            raise XLSTMKitError(f"device {str(d)!r} asked for, but there are {count} CUDA GPUs (cuda:0 to cuda:{count - 1})")
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise XLSTMKitError(f"device {str(d)!r} asked for, but MPS is not available")
    elif d.type not in ("cpu", "cuda", "mps"):
        raise XLSTMKitError(f"device {str(d)!r}: xlstm_kit loads models onto cpu, cuda or mps")
    return d


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
    limit = parse_size(max_shard_size)
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    shards = _shard(list(tensors), sizes, limit)
    names = [checkpoint.WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        safetensors.torch.save_file({k: tensors[k].detach().to("cpu").contiguous() for k in keys}, str(folder / name), metadata=metadata)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX_FILE)
    return names


def save_pretrained(model: nn.Module, path: str | Path, format: str = "hf",
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """See ``XLSTMLanguageModel.save_pretrained``."""
    if format == "xlstm_kit":
        return checkpoint.save_model(model, path, tokenizer=model.tokenizer_name)
    if format != "hf":
        raise XLSTMKitError(f"format must be 'hf' or 'xlstm_kit', got {format!r}")
    if has_adapters(model):
        raise XLSTMKitError("a HuggingFace folder holds plain weights: fold the LoRA adapters in first "
                            "(xlstm_kit.lora.merge_lora(model)), or save them alone with save_adapters")
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

    path = check_writable(path, "cannot save to", folder=True, extra_bytes=checkpoint.STAGING_NAME_BYTES)

    def write(folder: Path) -> list[str]:
        names = write_safetensors(tensors, folder, max_shard_size, {"format": "pt"})
        for name in names:
            if name.endswith(".safetensors"):
                os.chmod(folder / name, 0o666 & ~checkpoint._umask())
        (folder / checkpoint.CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        names.append(checkpoint.CONFIG_FILE)
        if tok is not None:
            names += tok.save(folder)
        return names

    # atomic over an earlier save, whose shards and index this one does not write are removed
    # with it (they would be read as part of the model); files xlstm_kit did not write stay
    return checkpoint.save_folder(path, write)


# =============================================================================================
# Tokenizers from tokenizer.json
# =============================================================================================
