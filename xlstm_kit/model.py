"""The public language model: `xlstm_kit.models.XLSTMLanguageModel` with checkpoints, HuggingFace
folders, its tokenizer and text generation as methods (what `from xlstm_kit import
XLSTMLanguageModel` gives). The pieces live below it: the nn.Module in `xlstm_kit.models`,
loading and saving in `xlstm_kit.io`, decoding in `xlstm_kit.generation`; this class only
joins them, so that none of them imports another layer's user-facing conveniences."""
from __future__ import annotations

from pathlib import Path

import torch

from .generation.generate import generate as _generate, generate_text
from .io import checkpoint, hf
from .io.loading import load_model, load_pretrained
from .io.tokenizers import model_tokenizer
from .models import PRESETS, ModelState, XLSTMConfig, xlstm as models_xlstm
from .models.config import CHECKPOINT_BLOCKS, CheckpointBlocks, checkpoint_blocks

__all__ = ["XLSTMConfig", "XLSTMLanguageModel", "PRESETS", "ModelState", "CHECKPOINT_BLOCKS",
           "CheckpointBlocks", "checkpoint_blocks"]


class XLSTMLanguageModel(models_xlstm.XLSTMLanguageModel):
    """xLSTM language model.

    model(tokens [B, T]) -> logits [B, T, vocab_size]
    model(tokens, state=s, return_state=True) -> (logits, state): feed a long text in pieces
    model.step(token [B], state) -> (logits [B, vocab_size], state): one token
    model.generate(prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id): prompt [T], [B, T],
        a list of 1-D prompts of any lengths, a str or a list of str
    model.save(dir) / XLSTMLanguageModel.load(dir), from_pretrained / save_pretrained (HuggingFace)
    The state is a list with one MLSTMState / SLSTMState / DPLRState per block (`init_state(batch)`;
    large-family blocks use MLSTMState with an empty conv field).
    """

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
        list; None: the model's `eos_token_ids`, which a HuggingFace folder's config sets as
        transformers reads it, and for text prompts else the tokenizer's end token; []: none)
        or at a stop string (`stop`: cut from text results). streamer(row, piece) receives each new token id (token prompts) or each
        new piece of text (text prompts: whole characters, never a stop string) as it comes.
        Text needs `tokenizer` (default: the model's, known when it was loaded from a checkpoint
        that records it). On CUDA the decode step replays a CUDA graph (cuda_graph=None: when
        possible). See `xlstm_kit.generation`.
        """
        options = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                       eos_token_id=eos_token_id, stop=stop, seed=seed, generator=generator, streamer=streamer,
                       cuda_graph=cuda_graph)
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                       and all(isinstance(p, str) for p in prompt)):
            return generate_text(self, tokenizer if tokenizer is not None else self.tokenizer, prompt,
                                 max_new_tokens, **options)
        return _generate(self, prompt, max_new_tokens, tokenizer=tokenizer, **options)

    @property
    def tokenizer(self):
        """The folder's tokenizer.json in the `tokenizers` format (`hf_tokenizer`, BOS prepended),
        else the tokenizer named by `tokenizer_name` (both set by `load` / `from_pretrained`).
        A model that knows none raises UnknownTokenizer (an XLSTMKitError and an AttributeError:
        ``getattr(model, "tokenizer", None)`` is None)."""
        return model_tokenizer(self)

    def __getattr__(self, name: str):
        if name == "tokenizer":
            # the property raised UnknownTokenizer, an AttributeError, so Python asks here: raise
            # it again, instead of nn.Module's "object has no attribute 'tokenizer'"
            return model_tokenizer(self)
        return super().__getattr__(name)

    def save(self, directory: str | Path, tokenizer: str | None = None) -> Path:
        """Write `directory`/config.json + model.safetensors, and tokenizer.json naming
        `tokenizer` (default: `tokenizer_name`, when set; a model with `hf_tokenizer` writes that
        tokenizers-format tokenizer.json and tokenizer_config.json instead). Atomic, also over
        an earlier save (the old model or the new one, never a mix); files xlstm_kit did not
        write stay. See xlstm_kit.io.files."""
        return checkpoint.save_model(self, directory, tokenizer=tokenizer or self.tokenizer_name)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device | None = None) -> "XLSTMLanguageModel":
        """Read a model written by `save`, or the newest checkpoint of a `train --out` run folder
        (through its `latest` file). Returns it in eval mode, with `tokenizer_name` set when the
        checkpoint records its tokenizer. MissingFileError (an XLSTMKitError and a FileNotFoundError)
        if missing, XLSTMKitError if corrupt."""
        return load_model(path, device, model_class=cls)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None) -> "XLSTMLanguageModel":
        """Load a HuggingFace xLSTM folder (config.json with model_type "xlstm", model.safetensors
        or shards listed in model.safetensors.index.json; NX-AI/xLSTM-7b, transformers'
        save_pretrained) as a large-family model, or an xlstm_kit checkpoint / `train --out` run.
        Lazy and tensor by tensor in `dtype`; a tokenizer.json in the folder becomes
        `model.tokenizer`. Returns the model in eval mode. See xlstm_kit.io.loading."""
        return load_pretrained(path, dtype=dtype, device=device, model_class=cls)

    def save_pretrained(self, path: str | Path, format: str = "hf",
                        max_shard_size: int | str = hf.DEFAULT_MAX_SHARD_SIZE) -> Path:
        """format="hf": write a folder transformers' `xLSTMForCausalLM.from_pretrained` loads
        (config.json, HF weight names, shards of at most `max_shard_size` such as "5GB" with
        model.safetensors.index.json, the tokenizer when known); large family only.
        format="xlstm_kit": our checkpoint format (= `save`). Atomic: a new folder appears
        complete or not at all, and over an earlier save the folder loads as the old model or
        the new one, never a mix; files xlstm_kit did not write there stay (one that loading
        would read makes it refuse). Returns the folder. See xlstm_kit.io.files."""
        return hf.save_pretrained(self, path, format=format, max_shard_size=max_shard_size)
