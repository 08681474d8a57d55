"""Chat templates: the Jinja template a HuggingFace tokenizer folder ships (`chat_template.jinja`,
or `chat_template` in tokenizer_config.json), rendered as transformers renders it (a sandboxed
Jinja environment, trim_blocks and lstrip_blocks, `raise_exception`, the generation prompt
added). Without a template the server answers /v1/chat/completions with an error."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .._extras import require
from ..errors import XLSTMKitError
from ..io.jsonfile import MAX_TOKENIZER_CONFIG_BYTES, read_bytes  # noqa: F401 - its bound, named here too
from ..io.tokenizers import TOKENIZER_CONFIG_FILE, read_tokenizer_config

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = TOKENIZER_CONFIG_FILE
# tokenizer_config.json: read by loading's reader (io.tokenizers.read_tokenizer_config, bound
# MAX_TOKENIZER_CONFIG_BYTES); templates themselves are a few kB.
MAX_TEMPLATE_BYTES = 1 << 20


class ChatTemplate:
    """A compiled chat template; render(messages) -> the prompt text."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, origin: str = ""):
        jinja2 = require("jinja2", "a chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise XLSTMKitError(f"the chat template of {origin or 'the model'} does not compile: {e}") from None
        self._error = jinja2.exceptions.TemplateError
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        """The prompt; ValueError with the template's message when it refuses the messages."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                        eos_token=self.eos_token or "", tools=None)
        except self._error as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def _token_text(value) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value  # transformers' AddedToken form
    return value if isinstance(value, str) else None


def find_chat_template(*folders: Path) -> ChatTemplate | None:
    """The chat template of the first folder that has one (None: no folder has)."""
    for folder in folders:
        folder = Path(folder)
        # loading's reader: a FIFO, a folder or JSON other than an object of that name is refused
        # in one line (not passed over: serving without the template the folder means to have)
        config = read_tokenizer_config(folder) or {}
        source = None
        if (folder / TEMPLATE_FILE).exists():
            raw = read_bytes(folder / TEMPLATE_FILE, MAX_TEMPLATE_BYTES, error=XLSTMKitError)
            try:
                source = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise XLSTMKitError(f"{folder / TEMPLATE_FILE} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one
                source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                              None)
        if isinstance(source, str) and source.strip():
            return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                                origin=str(folder))
    return None
