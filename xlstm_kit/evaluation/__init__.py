"""Evaluation with EleutherAI's lm-evaluation-harness (lm-eval).

- `scoring.score_continuations`: log-likelihoods of continuations, packed (``cu_seqlens``) and
  with shared contexts read once; needs only torch.
- `lm_eval_backend.XLSTMKitLM`: the lm-eval model backend ``xlstm_kit`` (the ``eval`` extra).
- `harness.evaluate_tasks`: run lm-eval tasks on a model folder (what ``xlstm-kit eval --tasks``
  calls).
- ``python -m xlstm_kit.evaluation``: lm-eval's own command line with the backend registered,
  e.g. ``python -m xlstm_kit.evaluation --model xlstm_kit --model_args pretrained=DIR --tasks arc_easy``.
"""
from .scoring import Score, score_continuations

__all__ = ["Score", "score_continuations"]
