"""Text out of token ids, one token at a time: complete characters only, and stop strings.

A byte-level or BPE token can end in the middle of a multi-byte UTF-8 character (one emoji is
four byte tokens), so decoding each token on its own would print replacement characters.
`IncrementalDecoder` decodes a short window of recent tokens and hands out new text only once it
ends in a complete character. `TextRow` adds stop strings on top: it finds the first occurrence
of any of them in the continuation, cuts it there, and when streaming holds back a tail that may
still grow into one, so that the streamed text always equals the final text.
"""
from __future__ import annotations

from typing import Callable, Sequence

_INCOMPLETE = "\ufffd"  # what decoders put for a byte sequence that is not (yet) a whole character


class IncrementalDecoder:
    """Decode token ids as they come: push(id) -> the text they complete ("" while a character is
    still partial). `text` is everything handed out so far; flush() hands out the rest.

    It decodes ids[prefix:] and ids[prefix:read] and hands out the difference: decoders that treat
    the first token of a text specially (SentencePiece drops its leading space) treat both the
    same, so the pieces concatenate to the decoding of all ids (the scheme of vLLM's detokenizer).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] were decoded already (the context of the next piece)
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (a partial character at the end decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        now = self.tokenizer.decode(self.ids[self._prefix:])
        if not final and (len(now) <= len(before) or now.endswith(_INCOMPLETE)):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


class TextRow:
    """The continuation of one prompt as text, with stop strings.

    push(id) -> True when the text now contains a stop string (the row is done); `text` is the
    continuation, cut before the first stop string. `emit(piece)`, when given, receives the text
    as it becomes final: complete characters, never a stop string or the start of one.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), emit: Callable[[str], None] | None = None):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(stop)
        self.emit = emit
        self.cut: int | None = None
        self._sent = 0

    @property
    def text(self) -> str:
        return self.decoder.text if self.cut is None else self.decoder.text[: self.cut]

    def push(self, token_id: int) -> bool:
        start = len(self.decoder.text)
        self.decoder.push(token_id)
        return self._check(start, final=False)

    def finish(self) -> None:
        """The row ended (end token or length limit): flush the decoder and what was held back."""
        if self.cut is None:
            start = len(self.decoder.text)
            self.decoder.flush()
            self._check(start, final=True)

    def _check(self, start: int, final: bool) -> bool:
        text = self.decoder.text
        if self.stop and len(text) > start:
            # an occurrence not found before must end in the new text
            longest = max(map(len, self.stop))
            lo = max(0, start - longest + 1)
            hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
            if hits:
                self.cut = min(hits)
                self._send(self.cut)
                return True
        self._send(len(text) if final else len(text) - self._held_back(text))
        return False

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _send(self, upto: int) -> None:
        if self.emit is not None and upto > self._sent:
            self.emit(self.decoder.text[self._sent:upto])
            self._sent = upto
