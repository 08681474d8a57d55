"""``python -m xlstm_kit ...`` is the ``xlstm-kit`` command (also what torchrun runs with -m)."""
from .cli import main

raise SystemExit(main())
