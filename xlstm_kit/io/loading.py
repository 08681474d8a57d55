"""Loading models: our checkpoints (`load_model`: a checkpoint folder or a `train --out` run
folder, through its `latest` file) and, through the same entry, HuggingFace xLSTM folders
(`load_pretrained`: lazy, tensor by tensor, in the dtype asked for). Both set the model's
tokenizer fields (`tokenizer_name`, `hf_tokenizer`) from the folder."""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from ..errors import MissingFileError, XLSTMKitError
from ..models import XLSTMConfig, XLSTMLanguageModel
from ..models.meta import shapes_only
from . import checkpoint, sharded
from ..models.lora import merge_lora
from .lora import adapters_from_folder
from .files import finish_interrupted_save
from .jsonfile import MAX_CONFIG_BYTES, read_json, regular_file_exists
from .hf import (HF_MODEL_TYPE, TOKENIZER_NAME_KEY, check_device, check_sources, config_from_hf, is_hf_config,
                 materialise, read_headers, target_dtype)
from .tokenizers import HFSpecialTokens, find_tokenizer, hf_end_tokens, json_object


def _model_folder(path: str | Path, what: str) -> Path:
    """The checkpoint folder `path` names: itself, or a run folder's newest checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"no {what} folder at {str(path)!r}")
    finish_interrupted_save(path)
    # not is_file(): a FIFO or a folder of either name is refused, not reported missing
    if not regular_file_exists(path / checkpoint.CONFIG_FILE):
        if not regular_file_exists(path / checkpoint.LATEST_FILE):
            raise XLSTMKitError(f"{path} has no {checkpoint.CONFIG_FILE}: it is neither a HuggingFace xLSTM folder, "
                                f"an xlstm_kit checkpoint nor a training run folder")
        path = checkpoint.resolve_checkpoint(path)
    return path


def _config(raw, source: Path) -> XLSTMConfig:
    try:
        return XLSTMConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise XLSTMKitError(f"{source} does not describe a valid XLSTMConfig: {e}") from None


def _runnable_on(config: XLSTMConfig, target: torch.device, path: Path) -> XLSTMConfig:
    if config.backend == "triton" and target.type != "cuda":
        # A model trained with the Triton kernels forced is still the same model elsewhere.
        warnings.warn(f"{path} was saved with backend='triton', which needs CUDA; loading it on "
                      f"{target.type} with the automatic backend", stacklevel=4)
        return dataclasses.replace(config, backend=None)
    return config


def load_model(path: str | Path, device: str | torch.device | None = None,
               model_class: type = XLSTMLanguageModel, *, weights: bool = True) -> XLSTMLanguageModel:
    """Read a model written by `checkpoint.save_model`, or the newest checkpoint of a `train --out`
    run folder (through its `latest` file). Returns it (a `model_class`) in eval mode, with
    `tokenizer_name` set when the checkpoint records its tokenizer; a model saved with LoRA
    adapters comes back with them, unmerged (a resumable LoRA run). FileNotFoundError if
    missing, XLSTMKitError if corrupt. A save into the folder that a kill interrupted after it
    was complete is carried out first (xlstm_kit.io.files). ``weights=False``: the model on the
    meta device (its shapes, adapters and tokenizer, no weights read), for an FSDP rank that
    gets its shards from rank 0 or, on a resume, from the sharded checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"no checkpoint folder at {str(path)!r}")
    finish_interrupted_save(path)  # a save into it killed after it was complete: carried out first
    config, latest = (regular_file_exists(path / name, checkpoint.CheckpointError)
                      for name in (checkpoint.CONFIG_FILE, checkpoint.LATEST_FILE))
    if not config and latest:
        path = checkpoint.resolve_checkpoint(path)
    if checkpoint.is_sharded(path):  # an FSDP run's checkpoint: its shards, assembled here
        config_dict = read_json(path / checkpoint.CONFIG_FILE, MAX_CONFIG_BYTES)
        names = sharded.stored_weight_names(path)
    elif not weights:  # the names come with the tensors in this format: rank 0 reads and checks them
        config_dict = read_json(path / checkpoint.CONFIG_FILE, MAX_CONFIG_BYTES)
        names = None
    else:
        config_dict, tensors = checkpoint.read_model_files(path)
        names = set(tensors)
    n_blocks = config_dict.get("n_blocks") if isinstance(config_dict, dict) else None
    in_file = {k.split(".")[1] for k in names or () if k.startswith("blocks.")}
    if names is not None and isinstance(n_blocks, int) and n_blocks != len(in_file):
        # before the config is even validated: that walks all n_blocks positions
        raise XLSTMKitError(f"{path} holds the weights of {len(in_file)} blocks, its "
                            f"{checkpoint.CONFIG_FILE} says n_blocks={n_blocks}")
    config = _runnable_on(_config(config_dict, path / checkpoint.CONFIG_FILE), check_device(device), path)
    if not weights:
        with shapes_only():
            model = adapters_from_folder(model_class(config), path)
        model.tokenizer_name = checkpoint.read_tokenizer_name(path)
        model.hf_tokenizer = find_tokenizer(path)
        return model.eval()
    if checkpoint.is_sharded(path):
        with shapes_only():
            expected = adapters_from_folder(model_class(config), path).state_dict()
        if config.tie_embeddings:
            expected.pop("lm_head.weight")
        tensors, source = sharded.read_sharded_weights(path, {k: v.shape for k, v in expected.items()}), path
    else:
        source = path / checkpoint.WEIGHTS_FILE
    with shapes_only():  # the config's shapes, checked against the file before allocating
        checkpoint.check_state(adapters_from_folder(model_class(config), path), tensors, source)
    model = checkpoint.load_state_checked(adapters_from_folder(model_class(config), path), tensors, source,
                                          checked=True)
    model.tokenizer_name = checkpoint.read_tokenizer_name(path)
    model.hf_tokenizer = find_tokenizer(path)
    model.eval()
    return model if device is None else model.to(device)


def load_pretrained(path: str | Path, dtype=None, device=None, model_class: type = XLSTMLanguageModel, *,
                    weights: bool = True):
    """A HuggingFace xLSTM folder (config.json with model_type "xlstm", model.safetensors or
    shards listed in model.safetensors.index.json; NX-AI/xLSTM-7b, transformers'
    save_pretrained) as a large-family model, or an xlstm_kit checkpoint / `train --out` run.

    Lazy: built on the meta device, then each tensor is read (memory-mapped), converted to
    `dtype` (default: the file's, float32 if mixed) and placed on `device` (default: cpu) on
    its own, so a 7B model loads in bf16 without a float32 or second copy. Names and shapes
    are checked against config.json first. A tokenizer.json in the folder becomes
    `model.hf_tokenizer`; the end tokens of a HuggingFace folder (`hf_end_tokens`) become
    `model.eos_token_ids`. A checkpoint with LoRA adapters (adapter_config.json) loads with the
    adapters merged into its weights. A save into the folder that a kill interrupted after it
    was complete is carried out first (xlstm_kit.io.files). Returns the model (a `model_class`)
    in eval mode. ``weights=False``: the same model on the meta device, no weight read (nor
    checksummed), for an FSDP rank that gets its shards from rank 0."""
    path = _model_folder(path, "model")
    cfg_path = path / checkpoint.CONFIG_FILE
    raw = json_object(cfg_path)
    hf = is_hf_config(raw)
    special, weight_mode = HFSpecialTokens(), "single"
    if hf:
        config, special, weight_mode = config_from_hf(raw, cfg_path)
    elif "model_type" in raw:
        raise XLSTMKitError(f"{cfg_path} has model_type {raw['model_type']!r}; xlstm_kit reads HuggingFace "
                            f"folders of model_type {HF_MODEL_TYPE!r} only")
    elif checkpoint.is_sharded(path):  # an FSDP run's checkpoint: assembled whole, as load_model reads it
        target = check_device(device)
        cast = target_dtype({}, dtype) if dtype is not None else None
        model = load_model(path, model_class=model_class, weights=weights)
        merge_lora(model)
        model.hf_special_tokens = special
        return model.to(device=target, dtype=cast) if weights else model.to(dtype=cast)
    else:
        config = _config(raw, cfg_path)
        if weights:
            checkpoint.verify_checksum(path, checkpoint.WEIGHTS_FILE)
    target = check_device(device)
    config = _runnable_on(config, target, path)

    sources, named = read_headers(path, hf, config, weight_mode)
    if hf and config.tie_embeddings and "lm_head.weight" in sources:
        # transformers' xLSTMForCausalLM never ties its head (it has no tied-weights keys): a
        # stored head is the one it computes with, whatever tie_word_embeddings says
        config = dataclasses.replace(config, tie_embeddings=False)
    with shapes_only():  # shapes only: nothing is allocated until a tensor is read
        model = model_class(config) if hf else adapters_from_folder(model_class(config), path)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    check_sources(sources, expected, named, hf)
    if weights:
        state = dict(materialise(sources, target_dtype(sources, dtype), target))
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_embeddings:
            model.lm_head.weight = model.embedding.weight
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:  # a parameter the file does not hold and the check above missed
            raise XLSTMKitError(f"{named} leaves {left[:5]} unset")
    else:
        model.to(dtype=target_dtype(sources, dtype))
    merge_lora(model)  # a model to use: adapters folded in, as fast as the base model
    named_tokenizer = raw.get(TOKENIZER_NAME_KEY) if hf else checkpoint.read_tokenizer_name(path)
    model.tokenizer_name = named_tokenizer if isinstance(named_tokenizer, str) else None
    model.hf_tokenizer = find_tokenizer(path, special)
    model.hf_special_tokens = special
    if hf:
        model.eos_token_ids = hf_end_tokens(path, raw, config.vocab_size)
    model.eval()
    return model
