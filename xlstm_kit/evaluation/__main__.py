"""``python -m xlstm_kit.evaluation ARGS``: lm-eval's command line (``lm_eval ARGS``) with the
``xlstm_kit`` backend registered. lm-eval 0.4 finds model backends only among its own or those
imported before its command line runs; it has no plug-in entry point that the plain ``lm_eval``
command would load."""
from __future__ import annotations

import sys

from .._extras import MissingExtraError, require


def main() -> int:
    try:
        require("lm_eval", "python -m xlstm_kit.evaluation")
    except MissingExtraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval_backend  # noqa: F401  (registers the backend "xlstm_kit")

    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
