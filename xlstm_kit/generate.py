"""Sampling from a recurrent language model with a constant-size state.

`generate` reads the prompt with one parallel forward pass (which returns the recurrent state),
then produces tokens one at a time with `model.step`. Only the state and the list of produced
ids are kept, so memory does not depend on how many tokens are generated.

Works with any model that has `forward(tokens, state=None, return_state=True)` and
`step(tokens [B], state)` (XLSTMLanguageModel does).

On CUDA, one decode step of a small model is hundreds of tiny kernel launches, so Python and
launch overhead (not the GPU) set the speed. `generate` therefore records the step once as a CUDA
graph (models with a check-free `_step`, like XLSTMLanguageModel) and replays it per token: the
state lives in fixed buffers that the graph updates in place. If recording fails, it warns once
and decodes eagerly.
"""
from __future__ import annotations

import math
import warnings

import torch

from .errors import XLSTMKitError


def _check_sampling(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise XLSTMKitError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise XLSTMKitError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise XLSTMKitError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V] -> [B] (int64).

    temperature 0: argmax. Otherwise softmax(logits / temperature) restricted to the `top_k`
    most likely tokens and then to the smallest set whose probability reaches `top_p` (nucleus).
    """
    _check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted so that the best logit is 0, and divided in float64: a tiny temperature (1e-45)
    # then sends the others to -inf (greedy in effect) instead of overflowing to inf - inf = NaN.
    logits = (logits - logits.amax(dim=-1, keepdim=True)).double() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# torch has no min/max (nor embedding lookup) for these; their ids would need a lossy cast
_UNSUPPORTED_ID_DTYPES = (torch.uint16, torch.uint32, torch.uint64)


def check_token_ids(tokens: torch.Tensor, vocab: int | None, what: str = "tokens") -> None:
    """Integer ids in [0, vocab), compared as Python ints: a uint8 or int8 comparison with the
    vocabulary size would wrap it (256 -> 0)."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise XLSTMKitError(f"{what} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dtype in _UNSUPPORTED_ID_DTYPES:
        raise XLSTMKitError(f"{what} of dtype {tokens.dtype} are not supported; use int64, int32, int16, "
                            f"int8 or uint8")
    if tokens.numel() == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        bound = f"[0, {vocab - 1}]" if vocab is not None else "[0, vocab_size)"
        known = f" but vocab_size is {vocab}" if vocab is not None else ""
        raise XLSTMKitError(f"{what} contain ids in [{lo}, {hi}]{known}; ids must lie in {bound}")


@torch.no_grad()
def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    cuda_graph: bool | None = None,
) -> torch.Tensor:
    """Continue `prompt` ([T] or [B, T] ids, T >= 1) by up to `max_new_tokens` tokens.

    Returns prompt + continuation, [T + n] or [B, T + n] with n <= max_new_tokens, in the
    prompt's dtype when that holds every id of the model's vocabulary, else int64. After a
    sequence emits `eos_token_id` it is padded with it; generation stops once all have.
    The model runs in eval mode (no dropout) and is restored to its mode afterwards.
    cuda_graph: replay the decode step as a CUDA graph (None: on CUDA when the model allows it;
    True: required, errors if it cannot; False: eager steps).
    """
    _check_sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise XLSTMKitError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() not in (1, 2):
        shape = list(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise XLSTMKitError(f"prompt must be a tensor of token ids of shape [T] or [B, T], got {shape}")
    if prompt.shape[-1] < 1:
        raise XLSTMKitError("prompt must hold at least one token (T >= 1)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    check_token_ids(prompt, vocab, "prompt ids")
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or eos_token_id < 0 or (vocab is not None and eos_token_id >= vocab)):
        raise XLSTMKitError(f"eos_token_id must be None or a token id in [0, {vocab}), got {eos_token_id!r}")

    squeeze = prompt.dim() == 1
    tokens = prompt.unsqueeze(0) if squeeze else prompt
    # New ids keep the prompt's dtype only when it can hold every id of the vocabulary (a uint8
    # prompt of a 300-token model would wrap 299 to 43): otherwise the result is int64.
    out_dtype = tokens.dtype if vocab is not None and vocab - 1 <= torch.iinfo(tokens.dtype).max else torch.int64
    was_training = model.training
    model.eval()
    try:
        out = []
        if max_new_tokens > 0:
            logits, state = model(tokens, return_state=True)  # parallel prefill
            finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            next_logits = logits[:, -1]
            # one check per call, not per token: NaN weights (or an overflow) show here, and
            # sampling would otherwise fail deep in torch or argmax would pick at random
            if not bool(torch.isfinite(next_logits).all()):
                raise XLSTMKitError("the model's logits for the prompt are not finite (NaN or inf); "
                                    "are its weights finite?")
            step = _pick_stepper(model, tokens, state, cuda_graph, max_new_tokens)
            for n in range(max_new_tokens):
                nxt = sample_next(next_logits, temperature, top_k, top_p, generator).to(out_dtype)
                if eos_token_id is not None:
                    nxt = nxt.masked_fill(finished, eos_token_id)
                    finished |= nxt == eos_token_id
                out.append(nxt)
                if n + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
                    break
                next_logits, state = step(nxt, state)
    finally:
        model.train(was_training)
    result = torch.cat([tokens.to(out_dtype), torch.stack(out, dim=1)], dim=1) if out else tokens.clone()
    return result.squeeze(0) if squeeze else result


class GraphedStep:
    """`model._step` recorded once as a CUDA graph and replayed per token.

    The graph reads the token and the state from fixed buffers and writes the new state back into
    them, so a replay is one launch whatever the number of blocks. Call it like model.step:
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
                model._step(self._tokens, self._state)
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._logits, new = model._step(self._tokens, self._state)
            self._load(new)  # recorded: each replay writes the new state into the buffers
        self._load(state)  # the warm-up moved the buffers on

    def _load(self, state) -> None:
        for old_s, new_s in zip(self._state, state):
            for o, n in zip(old_s, new_s):
                o.copy_(n)

    def __call__(self, tokens: torch.Tensor, state):
        if state is not self._state:
            self._load(state)
        self._tokens.copy_(tokens)
        self.graph.replay()
        return self._logits, self._state


_warned = False


def _pick_stepper(model, tokens: torch.Tensor, state, cuda_graph: bool | None, n_new: int):
    """model.step, or a GraphedStep when cuda_graph asks for it (None: on CUDA, if it records)."""
    global _warned
    if cuda_graph is False or (cuda_graph is None and (not tokens.is_cuda or n_new < 3)):
        return model.step
    if not hasattr(model, "_step"):
        if cuda_graph:
            raise XLSTMKitError(f"cuda_graph=True needs a model with a check-free _step(); {type(model).__name__} has none")
        return model.step
    if cuda_graph and not tokens.is_cuda:
        raise XLSTMKitError(f"cuda_graph=True needs a model on a CUDA device, got tokens on {tokens.device}")
    try:
        return GraphedStep(model, tokens[:, -1], state)
    except Exception as e:  # a step that cannot be recorded still decodes, just slower
        if cuda_graph:
            raise
        if not _warned:
            warnings.warn(f"decoding without a CUDA graph ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
            _warned = True
        return model.step



def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None,
                  generator: torch.Generator | None = None, cuda_graph: bool | None = None) -> str:
    """Continue the text `prompt` with `tokenizer` (encode/decode/eos_token_id): returns prompt +
    continuation, cut at the tokenizer's end-of-text token. An empty prompt starts from the
    end-of-text token (or a newline when the tokenizer has none)."""
    if not isinstance(prompt, str):
        raise XLSTMKitError(f"prompt must be a str here, got {type(prompt).__name__}")
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = tokenizer.encode(prompt) or ([eos] if eos is not None else tokenizer.encode("\n"))
    device = next(model.parameters()).device
    out = generate(model, torch.tensor(ids, dtype=torch.long, device=device), max_new_tokens,
                   temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos,
                   generator=generator, cuda_graph=cuda_graph)
    new = out[len(ids):].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos)]
    return prompt + tokenizer.decode(new)
