"""``python -m xlstm_kit ...`` is the ``xlstm-kit`` command (also what torchrun runs with -m)."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C at once: no traceback of a half-done import
    print("xlstm-kit: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
