"""The lm-evaluation-harness model backend ``xlstm_kit`` (needs the ``eval`` extra: lm-eval 0.4.x).

Importing this module registers the backend with lm-eval, so ``simple_evaluate(model="xlstm_kit",
model_args="pretrained=DIR,...")`` and ``python -m xlstm_kit.evaluation --model xlstm_kit ...``
find it (the ``lm_eval`` command itself discovers no backends outside lm-eval). Or pass an
instance: ``simple_evaluate(model=XLSTMKitLM(pretrained=DIR), tasks=[...])``.

How each request type runs:

- ``loglikelihood`` (multiple choice, ...): `scoring.score_continuations`: contexts and
  continuations packed with ``cu_seqlens`` (no padding), each context read once and every
  continuation of it continued from its recurrent state.
- ``loglikelihood_rolling`` (perplexity): lm-eval's windows of ``max_length`` tokens, scored
  the same way.
- ``generate_until``: `xlstm_kit.generation.generate` on a batch of prompts of mixed lengths
  (read packed), with the stop strings and the end token ending each row.

Tokens are lm-eval's usual ones (its context/continuation split, its left truncation to
``max_length``), so the numbers equal those of lm-eval's ``hf`` backend over transformers'
``xLSTMForCausalLM`` on the same folder and token sequences. BOS: a HuggingFace folder whose
config names a BOS token (NX-AI/xLSTM-7b) gets it in front of every context, as the model was
trained; the byte and GPT-2 tokenizers of our own runs have none (``add_bos_token`` overrides).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from ..errors import XLSTMKitError
from ..generation.generate import generate
from ..io.loading import load_pretrained
from ..io.tokenizers import TOKENIZERS, HFTokenizer, get_tokenizer, model_tokenizer
from .scoring import score_continuations

__all__ = ["XLSTMKitLM", "DEFAULT_MAX_LENGTH", "DEFAULT_MAX_BATCH_TOKENS"]

# lm-eval's hf backend reads at most this many tokens per request from a model whose config names
# no length (transformers' xLSTMConfig names none); the same default keeps the two comparable.
# A recurrent model has no hard limit: raise it to read longer texts whole.
DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until
# Tokens per packed forward: bounds the activations of a batch and its continuation logits.
DEFAULT_MAX_BATCH_TOKENS = 32768
# Recurrent states a batch may hold at once, in GiB: one per context and per continuation when
# scoring, per prompt (twice, with the CUDA graph's buffers) when generating. The xLSTM-7B's state
# is 0.13 GB, so a token budget alone would let short requests fill the memory with states.
DEFAULT_STATE_MEMORY_GIB = 8.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# generation options of lm-eval tasks that `generate` takes (the others would be silently ignored)
_GEN_OPTIONS = {"do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "until", "max_gen_toks"}


def _positive_int(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise XLSTMKitError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _batch_size(value) -> int | None:
    """lm-eval's batch_size: an int, its digits, or "auto" / "auto:N" (here: only the token
    budget limits a batch; the packed forward has no padding to tune a batch size against)."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        return None
    return _positive_int("batch_size", value)


def _state_row_bytes(model) -> int | None:
    """Bytes of one sequence's recurrent state (None: a model without init_state)."""
    if not hasattr(model, "init_state"):
        return None
    return sum(t.numel() * t.element_size() for s in model.init_state(1, device="meta") for t in s)


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # lm_eval's command line passes cuda:0 unless told otherwise; its hf backend then runs
        # on the CPU too
        warnings.warn(f"device {device!r} asked for, but CUDA is not available: running on the CPU", stacklevel=3)
        return torch.device("cpu")
    return dev


@register_model("xlstm_kit", "xlstm-kit")
class XLSTMKitLM(TemplateLM):
    """An xlstm_kit language model for lm-eval.

    pretrained: a training run folder, an xlstm_kit checkpoint or a HuggingFace xLSTM folder, or
    a loaded XLSTMLanguageModel. tokenizer: "byte" / "gpt2" or a tokenizer object (default: the
    model's own). dtype: float32, bfloat16, float16 or auto (the file's). device: cpu, cuda, ...
    (default: cuda if available). batch_size: requests per packed forward ("auto": as many as the
    other limits allow). max_batch_tokens: tokens per packed forward. state_memory_gib: recurrent
    states held at once. max_length: tokens read per request, as in lm-eval's hf backend (default
    2048). add_bos_token: put the BOS token in front of each context (default: when the model's
    tokenizer has one).
    """

    def __init__(self, pretrained, tokenizer=None, dtype: str | torch.dtype | None = None, device=None,
                 batch_size: int | str = 1, max_batch_size: int | None = None,
                 max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
                 state_memory_gib: float = DEFAULT_STATE_MEMORY_GIB, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None, **kwargs: Any):
        super().__init__()
        if kwargs:
            raise XLSTMKitError(f"the xlstm_kit backend does not take {', '.join(sorted(kwargs))} (model_args: "
                                f"pretrained, tokenizer, dtype, device, batch_size, max_batch_tokens, "
                                f"state_memory_gib, max_length, max_gen_toks, add_bos_token)")
        self._device = _device(device)
        if isinstance(pretrained, (str, Path)):
            torch_dtype = self._dtype(dtype)
            self.model = load_pretrained(pretrained, dtype=torch_dtype, device=self._device)
            self.pretrained = str(pretrained)
        elif isinstance(pretrained, torch.nn.Module):
            if dtype is not None:
                raise XLSTMKitError("dtype applies to a model loaded from a folder; convert the model itself instead")
            self.model = pretrained
            p = next(iter(pretrained.parameters()), None)
            self._device = p.device if p is not None else self._device
            self.pretrained = type(pretrained).__name__
        else:
            raise XLSTMKitError(f"pretrained must be a model folder or a loaded model, got {type(pretrained).__name__}")
        self.model.eval()
        self.tokenizer = self._tokenizer(tokenizer)
        self.batch_size_per_call = _batch_size(batch_size)
        if max_batch_size is not None and self.batch_size_per_call is None:
            self.batch_size_per_call = _positive_int("max_batch_size", max_batch_size)
        self.max_batch_tokens = _positive_int("max_batch_tokens", max_batch_tokens, allow_none=True)
        if isinstance(state_memory_gib, bool) or not isinstance(state_memory_gib, (int, float)) \
                or not state_memory_gib > 0:
            raise XLSTMKitError(f"state_memory_gib must be a number > 0, got {state_memory_gib!r}")
        row = _state_row_bytes(self.model)
        # at least a context and one continuation (scoring), one prompt and its graph copy (generating)
        self.max_batch_rows = None if not row else max(2, int(state_memory_gib * 2**30 // row))
        self._max_length = _positive_int("max_length", DEFAULT_MAX_LENGTH if max_length is None else max_length)
        self._max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if add_bos_token is None:
            add_bos_token = bos is not None
        elif add_bos_token and bos is None:
            raise XLSTMKitError(f"add_bos_token=True, but the tokenizer {self.tokenizer.name} has no BOS token")
        self.add_bos_token = bool(add_bos_token)

    # ------------------------------------------------------------------ setup
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm_eval's command line always passes its own batch_size (default 1) and device (default
        # cuda:0) beside --model_args; lm-eval's base class then fails on a batch_size given in
        # both ("got multiple values"). Here what --model_args says wins.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @staticmethod
    def _dtype(dtype) -> torch.dtype | None:
        if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
            return None if dtype == "auto" else dtype
        if dtype not in _DTYPES:
            raise XLSTMKitError(f"dtype must be one of {', '.join(['auto', *_DTYPES])}, got {dtype!r}")
        return _DTYPES[dtype]

    def _tokenizer(self, tokenizer):
        if isinstance(tokenizer, str):
            if tokenizer not in TOKENIZERS:
                raise XLSTMKitError(f"tokenizer must be one of {', '.join(TOKENIZERS)} (or left out for the "
                                    f"model's own), got {tokenizer!r}")
            tok = get_tokenizer(tokenizer)
        elif tokenizer is not None:
            tok = tokenizer
        else:
            tok = model_tokenizer(self.model, required=False)
            if tok is None:
                if self.model.config.vocab_size != 256:
                    raise XLSTMKitError("the model does not record its tokenizer; pass tokenizer=byte or "
                                        "tokenizer=gpt2")
                tok = get_tokenizer("byte")  # a bare checkpoint of a byte-level model
        if tok.vocab_size > self.model.config.vocab_size:
            raise XLSTMKitError(f"the tokenizer has {tok.vocab_size} tokens but the model only "
                                f"{self.model.config.vocab_size}")
        return tok

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a perplexity window's first token) is conditioned on: BOS
        where the model takes one, else the end-of-text token, else a newline (as `generate`
        starts an empty prompt)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if self.add_bos_token and bos is not None:
            return bos
        if self.eot_token_id is not None:
            return self.eot_token_id
        return self._plain_encode("\n")[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self):
        return self.batch_size_per_call if self.batch_size_per_call is not None else "auto"

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def get_model_info(self) -> dict:
        return {"model_source": "xlstm_kit", "model_name": self.pretrained,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype), "add_bos_token": self.add_bos_token,
                "max_length": self.max_length}

    def _plain_encode(self, text: str) -> list[int]:
        """The ids of `text` alone: HFTokenizer puts its BOS token before every text it encodes."""
        ids = list(self.tokenizer.encode(text))
        return ids[1:] if isinstance(self.tokenizer, HFTokenizer) and self.tokenizer.bos_token_id is not None else ids

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """The ids of `string`, with the BOS token in front when add_special_tokens (None: when the
        model takes one and the text does not already start with it), the last
        `left_truncate_len` of them when given."""
        ids = self._plain_encode(string)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        add = self.add_bos_token and ids[:1] != [bos] if add_special_tokens is None else add_special_tokens
        if add and bos is not None:
            ids = [bos, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([tokens] if isinstance(tokens, int) else list(tokens))

    # ------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = []
        for n, (_, context_enc, continuation_enc) in enumerate(requests):
            if len(continuation_enc) > self.max_length:
                raise XLSTMKitError(f"request {n}: its continuation has {len(continuation_enc)} tokens, more than "
                                    f"max_length={self.max_length}; raise max_length")
            # lm-eval's truncation: the last max_length + 1 tokens, the continuation whole
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            pairs.append((whole[: len(whole) - len(continuation_enc)], list(continuation_enc)))
        bar = tqdm(total=len(pairs), disable=disable_tqdm, desc="Running loglikelihood requests")
        scores = score_continuations(self.model, pairs, batch_size=self.batch_size_per_call,
                                     max_batch_tokens=self.max_batch_tokens, max_batch_rows=self.max_batch_rows,
                                     progress=bar.update)
        bar.close()
        out = [(s.logprob, s.greedy) for s in scores]
        for (request_str, _, _), answer in zip(requests, out):
            if request_str is not None:  # rolling windows come without; their sums are cached below
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            # the text without BOS: the first window's prefix token is the BOS (lm-eval's hf backend
            # encodes the text with it too, and a model whose tokenizer adds one then reads two)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        by_options: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            by_options.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for indices in by_options.values():
            options = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            unknown = set(options) - _GEN_OPTIONS
            if unknown:
                raise XLSTMKitError(f"generation option{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(sorted(unknown))} not supported by the xlstm_kit backend "
                                    f"(it takes {', '.join(sorted(_GEN_OPTIONS))})")
            until = [s for s in options["until"] if s]
            max_new = int(options["max_gen_toks"])
            if max_new >= self.max_length:
                raise XLSTMKitError(f"max_gen_toks={max_new} leaves no room for a prompt in "
                                    f"max_length={self.max_length}")
            sampling = dict(temperature=float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0,
                            top_k=options.get("top_k"), top_p=options.get("top_p"),
                            repetition_penalty=float(options.get("repetition_penalty", 1.0)))
            # longest prompts first, as lm-eval orders them: a batch too large fails at once
            # an empty prompt (no BOS to add) starts from the prefix token, as an empty context does
            prompts = {n: self.tok_encode(requests[n].args[0], left_truncate_len=self.max_length - max_new)
                       or [self.prefix_token_id] for n in indices}
            order = sorted(indices, key=lambda n: -len(prompts[n]))
            step = min(self.batch_size_per_call or len(order), (self.max_batch_rows or 2 * len(order)) // 2)
            for s in range(0, len(order), step):
                chunk = order[s:s + step]
                for n, text in zip(chunk, self._generate([prompts[n] for n in chunk], max_new, until, sampling)):
                    results[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def _generate(self, prompts: list[list[int]], max_new: int, until: list[str], sampling: dict) -> list[str]:
        rows = [torch.tensor(p, dtype=torch.long, device=self._device) for p in prompts]
        eos = self.eot_token_id
        out = generate(self.model, rows, max_new, eos_token_id=eos, stop=until or None, tokenizer=self.tokenizer,
                       **sampling)
        texts = []
        for prompt, full in zip(prompts, out):
            new = full[len(prompt):].tolist()
            if eos is not None and eos in new:
                new = new[: new.index(eos)]
            texts.append(postprocess_generated_text(self.tok_decode(new), stop=until, think_end_token=None))
        return texts
