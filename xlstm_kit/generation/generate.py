"""Sampling from a recurrent language model with a constant-size state.

`generate` reads each prompt with a parallel (chunkwise) forward pass that returns the recurrent
state, then produces tokens one at a time with `model.step`. Only the state and the produced ids
are kept, so memory does not depend on how many tokens are generated.

Prompts of different lengths (a list of 1-D tensors) are read in one packed call (`cu_seqlens`:
each prompt as if alone, one state row each; models without packed input: one call per
length), so no padding token ever enters a state; the rows are then decoded together. A row that finished (end token, stop string) is decoded
along with the others but its tokens are ignored: the batch keeps its shape, which a CUDA graph
needs.

Works with any model that has `forward(tokens, state=None, return_state=True)` and
`step(tokens [B], state)` (XLSTMLanguageModel does), its state being a list of per-block tuples
of tensors with the batch first.

On CUDA, one decode step of a small model is hundreds of tiny kernel launches, so Python and
launch overhead (not the GPU) set the speed. `generate` therefore records the step once as a CUDA
graph (models with a check-free `_step`, like XLSTMLanguageModel) and replays it per token: the
state lives in fixed buffers that the graph updates in place. If recording fails, it warns once
and decodes eagerly.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import XLSTMKitError
from ..io.tokenizers import model_tokenizer
from ..models.tokens import check_token_ids
from .sampling import apply_repetition_penalty, check_sampling, sample_next
from .textstream import TextRow

__all__ = ["generate", "generate_text", "complete_texts", "Completion", "sample_next", "check_token_ids",
           "GraphedStep"]

_check_sampling = check_sampling  # the old private name


@dataclass
class _Options:
    """Checked generation options (see `generate`)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float
    eos: tuple[int, ...]
    stop: tuple[str, ...]
    seed: int | None
    generator: torch.Generator | None
    streamer: Callable | None
    cuda_graph: bool | None


def _options(model, max_new_tokens, temperature, top_k, top_p, repetition_penalty, eos_token_id, stop,
             seed, generator, streamer, cuda_graph) -> _Options:
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise XLSTMKitError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if eos_token_id is None:
        eos_token_id = list(model_end_tokens(model))
    eos = (eos_token_id,) if not isinstance(eos_token_id, (list, tuple)) else tuple(eos_token_id)
    for e in eos:
        if isinstance(e, bool) or not isinstance(e, int) or e < 0 or (vocab is not None and e >= vocab):
            raise XLSTMKitError(f"eos_token_id must be None, a token id in [0, {vocab}) or a list of them, "
                                f"got {eos_token_id!r}")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise XLSTMKitError(f"stop must be None, a non-empty str or a list of them, got {stop!r}")
    for s in stops:
        check_text(s, "stop string")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise XLSTMKitError(f"seed must be None or an integer in [0, 2**64) (torch's generators take 64 bits), "
                                f"got {seed!r}")
        if generator is not None:
            raise XLSTMKitError("pass seed or generator, not both")
    if streamer is not None and not callable(streamer):
        raise XLSTMKitError(f"streamer must be a callable (row, piece), got {type(streamer).__name__}")
    return _Options(max_new_tokens, float(temperature), top_k, top_p, float(repetition_penalty), eos,
                    tuple(stops), seed, generator, streamer, cuda_graph)


def model_end_tokens(model) -> tuple[int, ...]:
    """The end tokens generation stops at when eos_token_id is None: the model's own
    (`eos_token_ids`, set from a HuggingFace folder's config as transformers reads it)."""
    ids = getattr(model, "eos_token_ids", None)
    return tuple(ids) if isinstance(ids, (list, tuple)) else ()


def check_text(text: str, what: str) -> None:
    """XLSTMKitError when ``text`` cannot be encoded as UTF-8: it holds a lone surrogate, which
    is how Python keeps bytes that were not UTF-8 (in file names, command-line arguments)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise XLSTMKitError(f"{what} is not valid text: {text[e.start]!r} at position {e.start} is a lone "
                            f"surrogate (bytes that were not UTF-8?)") from None


def _model_device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _prompt_rows(model, prompt, vocab) -> list[torch.Tensor]:
    """A list of 1-D id tensors (checked, on the model's device) from a list or a [T] / [B, T] tensor."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() not in (1, 2):
            raise XLSTMKitError(f"prompt must be a tensor of token ids of shape [T] or [B, T], got {list(prompt.shape)}")
        if prompt.shape[-1] < 1 or prompt.numel() == 0:
            raise XLSTMKitError(f"prompt must hold at least one token (T >= 1), got shape {list(prompt.shape)}")
        check_token_ids(prompt, vocab, "prompt ids")
        return list(prompt.reshape(-1, prompt.shape[-1]).unbind(0))
    if not isinstance(prompt, (list, tuple)):
        raise XLSTMKitError(f"prompt must be a tensor of token ids, a list of 1-D tensors or a str, "
                            f"got {type(prompt).__name__}")
    if not prompt:
        raise XLSTMKitError("the list of prompts is empty")
    device = _model_device(model)
    rows = []
    for n, p in enumerate(prompt):
        if not isinstance(p, torch.Tensor) or p.dim() != 1:
            got = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise XLSTMKitError(f"prompt {n} of the list must be a 1-D tensor of token ids, got {got}")
        if p.numel() == 0:
            raise XLSTMKitError(f"prompt {n} of the list is empty; every prompt needs at least one token")
        check_token_ids(p, vocab, f"prompt {n} ids")
        rows.append(p.to(device))
    return rows


def _prefill(model, rows: list[torch.Tensor]):
    """Read every prompt: (logits of each prompt's last position [B, V], batch state).

    Prompts of one length run as one batch. Prompts of different lengths run as one packed
    call (`cu_seqlens`: each read as if alone, one state row each, no padding token in any
    state) where the model takes packed documents, else as one batch per length with the
    states put back in the prompts' order. Only the last positions go through the head.
    """
    lengths = [r.numel() for r in rows]
    params = _forward_params(model)
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    if len(set(lengths)) == 1:
        out, state = model(torch.stack([r.long() for r in rows]), return_state=True, **last)
        return out[:, -1], state
    # one packed (eager) call, even where compile_prefill compiled the unpacked reads: one call
    # per length cost more at 32 prompts of distinct lengths on an H100 (serve_speed.py)
    if {"cu_seqlens", "logits_to_keep"} <= params:
        device = rows[0].device
        cu = torch.tensor([0] + lengths, device=device).cumsum(0)
        out, state = model(torch.cat([r.long() for r in rows])[None], return_state=True, cu_seqlens=cu,
                           logits_to_keep=cu[1:] - 1)
        return out[0], state
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        groups.setdefault(n, []).append(b)
    logits, states, order = [], [], []
    for idx in groups.values():
        out, state = model(torch.stack([rows[b].long() for b in idx]), return_state=True, **last)
        logits.append(out[:, -1])
        states.append(state)
        order += idx
    back = torch.argsort(torch.tensor(order, device=logits[0].device))
    state = [type(parts[0])(*(torch.cat(fields).index_select(0, back) for fields in zip(*parts)))
             for parts in zip(*states)]
    return torch.cat(logits).index_select(0, back), state


def _forward_params(model) -> set[str]:
    """The keyword names of model.forward: xlstm_kit's models read packed prompts (`cu_seqlens`)
    and keep only the logits asked for (`logits_to_keep`); another model may not."""
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _decode_in_eval(model, rows, o, texts):
    """_decode with the model in eval mode (dropout off), its mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        return _decode(model, rows, o, texts)
    finally:
        model.train(was_training)


def _decode(model, rows: list[torch.Tensor], o: _Options, texts: list[TextRow] | None = None) -> list[torch.Tensor]:
    """The continuation of each row (int64 on the model's device, up to o.max_new_tokens ids; with
    an end token: through it). `texts` (one per row, built by the caller when there are stop
    strings or text to stream) receive the new ids, an end token excepted, and end their rows at
    stop strings.
    """
    B = len(rows)
    device = rows[0].device
    if o.max_new_tokens == 0:
        return [r.new_empty(0, dtype=torch.long) for r in rows]
    next_logits, state = _prefill(model, rows)
    # one check per call, not per token: NaN weights (or an overflow) show here, and sampling
    # would otherwise fail deep in torch or argmax would pick at random
    if not bool(torch.isfinite(next_logits).all()):
        raise XLSTMKitError("the model's logits for the prompt are not finite (NaN or inf); are its weights finite?")
    generator = o.generator
    if o.seed is not None and o.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(o.seed)
    present = None
    if o.repetition_penalty != 1:
        present = torch.zeros(B, next_logits.shape[-1], dtype=torch.bool, device=device)
        for b, r in enumerate(rows):
            present[b, r.long()] = True
    eos = torch.tensor(o.eos, device=device) if o.eos else None
    # Streaming and stop strings look at every token on the host. Otherwise the ids stay on the
    # device and the end-token check syncs only every few tokens on a GPU (the rows that finished
    # in between are masked, so the result is the same).
    on_host = texts is not None or o.streamer is not None
    check_every = 1 if on_host or device.type == "cpu" else 8
    done = [False] * B
    host_len = [0] * B
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    length = torch.zeros(B, dtype=torch.long, device=device)
    step = _pick_stepper(model, torch.zeros(B, dtype=torch.long, device=device), state, o.cuda_graph,
                         o.max_new_tokens)
    out = []
    for n in range(o.max_new_tokens):
        logits = next_logits if present is None else apply_repetition_penalty(next_logits, present, o.repetition_penalty)
        nxt = sample_next(logits, o.temperature, o.top_k, o.top_p, generator)
        out.append(nxt)
        if present is not None:
            present.scatter_(1, nxt[:, None], True)
        if on_host:
            for b, t in enumerate(nxt.tolist()):
                if done[b]:
                    continue
                host_len[b] += 1
                if o.streamer is not None:
                    o.streamer(b, t)
                if t in o.eos:
                    done[b] = True
                    if texts is not None:
                        texts[b].finish()
                elif texts is not None and texts[b].push(t):
                    done[b] = True
            all_done = all(done)
        else:
            length += ~finished
            if eos is not None:
                finished |= torch.isin(nxt, eos)
            all_done = eos is not None and (n + 1) % check_every == 0 and bool(finished.all())
        if n + 1 == o.max_new_tokens or all_done:
            break
        next_logits, state = step(nxt, state)
    new = torch.stack(out, dim=1)
    lengths = host_len if on_host else length.tolist()
    if texts is not None:
        for row in texts:
            row.finish()
    return [new[b, : lengths[b]] for b in range(B)]


@torch.no_grad()
def generate(
    model,
    prompt: torch.Tensor | Sequence[torch.Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    tokenizer=None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    streamer: Callable[[int, int], None] | None = None,
    cuda_graph: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Continue token prompts by up to `max_new_tokens` tokens each.

    prompt: [T] or [B, T] ids (T >= 1), or a list of 1-D id tensors of any lengths. Returns
    prompt + continuation in the same form: [T + n], [B, T + n], or a list of 1-D tensors (on the
    model's device). New ids keep the prompt's dtype when it holds every id of the vocabulary,
    else they are int64. Each row of a batch gets exactly the tokens it gets alone (greedy).

    temperature 0 picks the most likely token; otherwise sampling from softmax(logits /
    temperature) limited to the `top_k` most likely tokens and the `top_p` nucleus.
    repetition_penalty (> 0, 1 = none): logits of the tokens already in a row (its prompt
    included) are divided by it when positive, multiplied by it when negative (CTRL).
    seed: sampling from a torch.Generator seeded for this call (same seed, same tokens);
    generator: your own instead.
    eos_token_id (an id or a list of ids): a row ends with the first of them it produces;
    None: the model's end tokens (`model.eos_token_ids`: those of the HuggingFace folder it was
    loaded from, generation_config.json's else config.json's, as transformers; none otherwise);
    []: none.
    stop (a str or a list, needs `tokenizer`, default model.tokenizer): a row ends with the token
    that makes its decoded continuation contain a stop string. A list result then ends each row
    there; a [B, T] result pads the rows that ended early with eos_token_id. Generation stops
    once every row has ended.
    streamer(row, token_id) is called for each new token of each row still running, as soon as
    it is produced (ids go to the host every step).
    cuda_graph: replay the decode step as a CUDA graph (None: on CUDA when the model allows it;
    True: required, errors if it cannot; False: eager steps).
    The model runs in eval mode (no dropout) and is restored to its mode afterwards.
    """
    o = _options(model, max_new_tokens, temperature, top_k, top_p, repetition_penalty, eos_token_id, stop,
                 seed, generator, streamer, cuda_graph)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = _prompt_rows(model, prompt, vocab)
    is_list = not isinstance(prompt, torch.Tensor)
    if o.stop and not is_list and prompt.dim() == 2 and not o.eos:
        raise XLSTMKitError("stop strings with a [B, T] prompt need eos_token_id to pad the rows that stop "
                            "early; or pass a list of 1-D prompts")
    texts = None
    if o.stop:
        tok = tokenizer if tokenizer is not None else model_tokenizer(model, required=hasattr(model, "tokenizer_name"))
        if tok is None:
            raise XLSTMKitError("stop strings need a tokenizer (pass tokenizer=...)")
        texts = [TextRow(tok, o.stop) for _ in rows]
    new = _decode_in_eval(model, rows, o, texts)
    results = [torch.cat([r.to(_out_dtype(r, vocab)), c.to(_out_dtype(r, vocab))]) for r, c in zip(rows, new)]
    if is_list:
        return results
    if prompt.dim() == 1:
        return results[0]
    width = max(r.numel() for r in results)
    pad = o.eos[0] if o.eos else 0
    return torch.stack([torch.cat([r, r.new_full((width - r.numel(),), pad)]) for r in results])


def _out_dtype(row: torch.Tensor, vocab: int | None) -> torch.dtype:
    # A uint8 prompt of a 300-token model would wrap 299 to 43: new ids keep the prompt's dtype
    # only when it can hold every id of the vocabulary.
    ok = vocab is not None and vocab - 1 <= torch.iinfo(row.dtype).max
    return row.dtype if ok else torch.int64


class GraphedStep:
    """`model.step(..., check=False)` recorded once as a CUDA graph and replayed per token.

    The graph reads the token and the state from fixed buffers and writes the new state back into
    them (the mLSTM's C in place: no copy of the largest state), so a replay is one launch
    whatever the number of blocks. Call it like model.step:
    (tokens [B], state) -> (logits [B, vocab], state); the state it returns is its own buffers
    (valid until the next call), and a state it did not return is first copied in.
    """

    def __init__(self, model, tokens: torch.Tensor, state):
        if not tokens.is_cuda:
            raise XLSTMKitError("CUDA graphs need CUDA tensors; the tokens are on " + str(tokens.device))
        self._tokens = tokens.clone()
        self._state = [type(s)(*(x.clone() for x in s)) for s in state]
        side = torch.cuda.Stream(device=tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):  # warm-up (compiles kernels, lazy allocations) off the capture
            for _ in range(2):
                model.step(self._tokens, self._state, inplace=True, check=False)
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._logits, new = model.step(self._tokens, self._state, inplace=True, check=False)
            self._load(new)  # recorded: each replay writes the new state into the buffers
        self._load(state)  # the warm-up moved the buffers on

    def _load(self, state) -> None:
        # a tensor the step updated in place is its own new value; the others (a few small
        # tensors per block: 57 at the 125M preset) are copied by one multi-tensor kernel, not
        # one launch each
        pairs = [(o, n) for old_s, new_s in zip(self._state, state) for o, n in zip(old_s, new_s)
                 if o is not n and o.numel()]
        if pairs:
            torch._foreach_copy_([o for o, _ in pairs], [n for _, n in pairs])

    def __call__(self, tokens: torch.Tensor, state):
        if state is not self._state:
            self._load(state)
        self._tokens.copy_(tokens)
        self.graph.replay()
        return self._logits, self._state


_warned = False


def _pick_stepper(model, tokens: torch.Tensor, state, cuda_graph: bool | None, n_new: int):
    """model.step, or a GraphedStep when cuda_graph asks for it (None: on CUDA, if it records).
    tokens: [B], a stand-in for the ids the step will take."""
    global _warned
    if cuda_graph is False or (cuda_graph is None and (not tokens.is_cuda or n_new < 3)):
        return model.step
    if "check" not in inspect.signature(model.step).parameters:
        if cuda_graph:
            raise XLSTMKitError(f"cuda_graph=True needs a model whose step() takes check=False; "
                                f"{type(model).__name__}'s does not")
        return model.step
    if cuda_graph and not tokens.is_cuda:
        raise XLSTMKitError(f"cuda_graph=True needs a model on a CUDA device, got tokens on {tokens.device}")
    try:
        return GraphedStep(model, tokens, state)
    except Exception as e:  # a step that cannot be recorded still decodes, just slower
        if cuda_graph:
            raise
        if not _warned:
            warnings.warn(f"decoding without a CUDA graph ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
            _warned = True
        return model.step


@dataclass
class Completion:
    """One text prompt's result: `text` is the continuation (cut at the end token or stop string),
    `tokens` how many tokens it took (an end token not counted)."""

    prompt: str
    text: str
    tokens: int


@torch.no_grad()
def complete_texts(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
                   eos_token_id: int | Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                   seed: int | None = None, generator: torch.Generator | None = None,
                   streamer: Callable[[int, str], None] | None = None,
                   cuda_graph: bool | None = None) -> list[Completion]:
    """Continue each text of `prompts` as one batch (see `generate` for the options).

    `tokenizer` has encode / decode / eos_token_id; the end tokens are eos_token_id, else the
    model's (`generate`), else the tokenizer's (eos_token_id=[]: none). An empty prompt starts from the end-of-text token (or a newline when the
    tokenizer has none). streamer(row, text) receives each row's continuation as it becomes
    final: whole characters only (a multi-byte character split over byte tokens comes out once
    complete), never a stop string; the pieces of a row add up to its `text`.
    """
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts \
            or not all(isinstance(p, str) for p in prompts):
        raise XLSTMKitError("prompts must be a non-empty list of str")
    if eos_token_id is None:
        eos_token_id = list(model_end_tokens(model)) or getattr(tokenizer, "eos_token_id", None)
        eos_token_id = [] if eos_token_id is None else eos_token_id
    o = _options(model, max_new_tokens, temperature, top_k, top_p, repetition_penalty, eos_token_id, stop,
                 seed, generator, streamer, cuda_graph)
    for n, p in enumerate(prompts):
        check_text(p, f"prompt {n}" if len(prompts) > 1 else "the prompt")
    device = _model_device(model)
    ids = [tokenizer.encode(p) or ([o.eos[0]] if o.eos else tokenizer.encode("\n")) for p in prompts]
    rows = _prompt_rows(model, [torch.tensor(i, dtype=torch.long, device=device) for i in ids],
                        getattr(getattr(model, "config", None), "vocab_size", None))
    streamer = o.streamer
    emit = (lambda b: (lambda piece: streamer(b, piece))) if streamer is not None else (lambda b: None)
    texts = [TextRow(tokenizer, o.stop, emit(b)) for b in range(len(rows))]
    o = dataclasses.replace(o, streamer=None)
    new = _decode_in_eval(model, rows, o, texts)
    return [Completion(p, row.text, sum(1 for t in c.tolist() if t not in o.eos))
            for p, row, c in zip(prompts, texts, new)]


def generate_text(model, tokenizer, prompt: str | Sequence[str], max_new_tokens: int, **options) -> str | list[str]:
    """Continue the text `prompt` (or each text of a list, as one batch) with `tokenizer`:
    returns prompt + continuation (a list for a list), cut at the end token or a stop string.
    Options as in `complete_texts`."""
    if isinstance(prompt, str):
        return prompt + complete_texts(model, tokenizer, [prompt], max_new_tokens, **options)[0].text
    if not isinstance(prompt, (list, tuple)):
        raise XLSTMKitError(f"prompt must be a str or a list of str here, got {type(prompt).__name__}")
    return [c.prompt + c.text for c in complete_texts(model, tokenizer, prompt, max_new_tokens, **options)]
