"""`xlstm-kit generate`: continue one prompt (streamed to a terminal) or a file of prompts as one
batch (JSON lines out)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import XLSTMKitError
from ..generation.generate import complete_texts
from ..io.jsonfile import read_bytes
from .args import UsageError
from .common import decode_device, open_checkpoint, tokenizer_for

# A prompts file larger than this is not prompts (and /dev/zero would be read until memory ends)
MAX_PROMPTS_BYTES = 64 * 2**20


def _read_prompts(path: str) -> list[str]:
    """The non-empty lines of `path` ("-": standard input): a regular file or a pipe of at most
    MAX_PROMPTS_BYTES of UTF-8 text."""
    if path == "-":
        raw = sys.stdin.buffer.read(MAX_PROMPTS_BYTES + 1)
    else:
        # read_bytes opens without blocking and checks the open descriptor: a check of the name
        # before opening let a FIFO put there in between block the open for ever
        try:
            raw = read_bytes(path, MAX_PROMPTS_BYTES, error=UsageError)
        except XLSTMKitError as e:
            hint = " (give a text file, or - for standard input)" if "not a regular file" in str(e) else ""
            raise UsageError(f"--prompts {e}{hint}") from None
    if len(raw) > MAX_PROMPTS_BYTES:
        raise UsageError(f"--prompts {path}: more than the {MAX_PROMPTS_BYTES:,} bytes a prompts file may hold")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts {path}: the file holds no prompt (one per line)")
    return prompts


def _check_output(path: str) -> Path:
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--output {path} is a folder; name a file")
    if not out.parent.is_dir():
        raise UsageError(f"--output {path}: the folder {out.parent} does not exist")
    return out


def _report_speed(n_tokens: int, n_prompts: int, seconds: float) -> None:
    rows = f" over {n_prompts} prompts" if n_prompts > 1 else ""
    rate = n_tokens / seconds if seconds > 0 else float("inf")
    print(f"{n_tokens} tokens{rows} in {seconds:.2f} s: {rate:.1f} tokens/s (prompt reading included)",
          file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.top_p is not None and args.top_p > 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.stop is not None and not all(args.stop):
        raise UsageError("--stop needs a non-empty text")
    if args.output is not None and args.prompts is None:
        raise UsageError("--output goes with --prompts (the single --prompt prints to stdout)")
    if args.prompts is not None and args.stream:
        raise UsageError("--stream prints one prompt's text; --prompts writes JSON lines once the batch is done")
    prompts = _read_prompts(args.prompts) if args.prompts is not None else ["\n" if args.prompt is None else args.prompt]
    out_file = _check_output(args.output) if args.output is not None else None
    stream = args.prompts is None and (sys.stdout.isatty() if args.stream is None else args.stream)

    device = decode_device(args)
    _, meta, model = open_checkpoint(args.checkpoint, device, args.dtype)
    if args.compile:
        model.compile_step()
    tok = tokenizer_for(meta, model)
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   repetition_penalty=args.repetition_penalty, stop=args.stop, seed=args.seed)

    start = time.perf_counter()
    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
        done = complete_texts(model, tok, prompts, args.max_new_tokens, streamer=_write_piece, **options)
        text = prompts[0] + done[0].text
        sys.stdout.write("" if text.endswith("\n") else "\n")
        sys.stdout.flush()
    else:
        done = complete_texts(model, tok, prompts, args.max_new_tokens, **options)
    seconds = time.perf_counter() - start

    if args.prompts is None and not stream:
        text = prompts[0] + done[0].text
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    elif args.prompts is not None:
        lines = "".join(json.dumps({"prompt": c.prompt, "completion": c.text, "tokens": c.tokens},
                                   ensure_ascii=False) + "\n" for c in done)
        if out_file is not None:
            out_file.write_text(lines, encoding="utf-8")
        else:
            sys.stdout.write(lines)
    sys.stdout.flush()
    _report_speed(sum(c.tokens for c in done), len(done), seconds)
    return 0


def _write_piece(row: int, piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()
