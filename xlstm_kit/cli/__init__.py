"""The ``xlstm-kit`` command line: argument parsing and printing over the library (see `app`)."""
from .app import build_parser, main

__all__ = ["build_parser", "main"]
