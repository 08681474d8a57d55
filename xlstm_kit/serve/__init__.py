"""Serving a model over HTTP with the OpenAI API (`xlstm-kit serve`): continuous batching over
fixed-size recurrent state slots (`engine`), a prefix-state cache (`prefix_cache`), the
Starlette app (`app`), chat templates (`chat`) and the uvicorn runner (`server`).

`engine` and `prefix_cache` need only torch; the HTTP modules need the `serve` extra
(`pip install 'xlstm-kit[serve]'`) and are imported by `xlstm-kit serve` when it runs."""
from .engine import Engine, EngineBusy, EngineClosed
from .request import Request, SamplingParams, Update
from .prefix_cache import PrefixCache

__all__ = ["Engine", "EngineBusy", "EngineClosed", "Request", "SamplingParams", "Update", "PrefixCache"]
