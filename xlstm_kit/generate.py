"""Sampling from a recurrent language model with a constant-size state.

`generate` reads the prompt with one parallel forward pass (which returns the recurrent state),
then produces tokens one at a time with `model.step`. Only the state and the list of produced
ids are kept, so memory does not depend on how many tokens are generated.

Works with any model that has `forward(tokens, state=None, return_state=True)` and
`step(tokens [B], state)` (XLSTMLanguageModel does).
"""
from __future__ import annotations

import math

import torch


def _check_sampling(temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


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
    logits = logits / temperature
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
) -> torch.Tensor:
    """Continue `prompt` ([T] or [B, T] ids, T >= 1) by up to `max_new_tokens` tokens.

    Returns prompt + continuation, [T + n] or [B, T + n] with n <= max_new_tokens. After a
    sequence emits `eos_token_id` it is padded with it; generation stops once all have.
    The model runs in eval mode (no dropout) and is restored to its mode afterwards.
    """
    _check_sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(prompt, torch.Tensor) or prompt.dim() not in (1, 2):
        shape = list(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"prompt must be a tensor of token ids of shape [T] or [B, T], got {shape}")
    if prompt.shape[-1] < 1:
        raise ValueError("prompt must hold at least one token (T >= 1)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or eos_token_id < 0 or (vocab is not None and eos_token_id >= vocab)):
        raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab}), got {eos_token_id!r}")

    squeeze = prompt.dim() == 1
    tokens = prompt.unsqueeze(0) if squeeze else prompt
    was_training = model.training
    model.eval()
    try:
        out = []
        if max_new_tokens > 0:
            logits, state = model(tokens, return_state=True)  # parallel prefill
            finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            next_logits = logits[:, -1]
            for n in range(max_new_tokens):
                nxt = sample_next(next_logits, temperature, top_k, top_p, generator).to(tokens.dtype)
                if eos_token_id is not None:
                    nxt = nxt.masked_fill(finished, eos_token_id)
                    finished |= nxt == eos_token_id
                out.append(nxt)
                if n + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
                    break
                next_logits, state = model.step(nxt, state)
    finally:
        model.train(was_training)
    result = torch.cat([tokens, torch.stack(out, dim=1)], dim=1) if out else tokens.clone()
    return result.squeeze(0) if squeeze else result
