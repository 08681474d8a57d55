"""`xlstm-kit generate`: continue one prompt (streamed to a terminal) or a file of prompts as one
batch (JSON lines out)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .args import (DTYPES, THREADS_HELP, Formatter, UsageError, nonneg_float, nonneg_int, positive_float,
                   positive_int)
from .common import open_checkpoint, pick_device, tokenizer_for, use_threads

EXAMPLES = """Examples:
  xlstm-kit generate runs/tiny --prompt 'ROMEO:' --max-new-tokens 200
  xlstm-kit generate runs/tiny --prompt 'ROMEO:' --temperature 0        # greedy
  xlstm-kit generate runs/tiny --prompt 'ROMEO:' --top-p 0.9 --seed 1   # reproducible
  xlstm-kit generate runs/tiny --prompt 'ROMEO:' --stop $'\\n\\n' --repetition-penalty 1.2
  xlstm-kit generate runs/tiny --prompts prompts.txt --temperature 0 --output out.jsonl
  xlstm-kit generate xLSTM-7b/ --prompt 'The capital of France is' --dtype bf16 --temperature 0
  xlstm-kit generate xLSTM-7b/ --prompt 'Once upon a time' --dtype bf16 --compile --max-new-tokens 2000

With --prompts, each line of the file is a prompt (empty lines are skipped); they run as one batch \
and each gives a JSON line {"prompt": ..., "completion": ..., "tokens": N} (tokens: generated \
tokens, an end token not counted). Speed (tokens/s) goes to stderr, so stdout stays clean."""


def add_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="continue a prompt (or a file of prompts) with a trained model",
        description="Print the prompt and its continuation, sampled token by token from the "
        "recurrent state (memory does not grow with the length). On a terminal the tokens are "
        "printed as they are produced.",
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    gen.add_argument("checkpoint", metavar="DIR", help="a training output folder (--out of train), a checkpoint "
                     "folder or a HuggingFace xLSTM folder (its tokenizer.json is used, BOS prepended)")
    what = gen.add_mutually_exclusive_group()
    what.add_argument("--prompt", default=None, metavar="TEXT", help="text to continue (default: a newline)")
    what.add_argument("--prompts", default=None, metavar="FILE",
                      help="a UTF-8 file with one prompt per line (-: stdin): generated as one batch, written as JSON lines")
    gen.add_argument("--output", default=None, metavar="FILE", help="with --prompts: write the JSON lines "
                     "here instead of stdout")
    gen.add_argument("--max-new-tokens", type=nonneg_int, default=200, help="tokens to generate (per prompt)")
    gen.add_argument("--temperature", type=nonneg_float, default=0.8, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-k", type=positive_int, default=None, help="sample among the K most likely tokens")
    gen.add_argument("--top-p", type=positive_float, default=None, help="nucleus sampling threshold in (0, 1]")
    gen.add_argument("--repetition-penalty", type=positive_float, default=1.0, metavar="X",
                     help="divide the positive logits (multiply the negative ones) of tokens already in the "
                     "text by X (1: off; 1.1-1.3 curbs loops)")
    gen.add_argument("--stop", action="append", default=None, metavar="STR",
                     help="end a continuation where this text appears, cutting it (repeatable; in bash "
                     "$'\\n' is a newline)")
    gen.add_argument("--seed", type=nonneg_int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                     help="print tokens as they are produced (default: when stdout is a terminal; not with "
                     "--prompts)")
    gen.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    gen.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype (default: the file's)")
    gen.add_argument("--threads", type=positive_int, default=None, help=THREADS_HELP)
    gen.add_argument("--compile", action="store_true",
                     help="torch.compile the decode step (model.compile_step: fused kernels per block; "
                     "compiles once per batch size, so it pays for long generations on a GPU)")
    gen.set_defaults(func=cmd_generate)
    return gen


def _read_prompts(path: str) -> list[str]:
    try:
        text = (sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()).decode("utf-8")
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
    from ..generation.generate import complete_texts

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

    device = pick_device(args.device)
    use_threads(args.threads, device)
    if args.compile:
        from ..training.compiling import compile_unavailable

        why = compile_unavailable(device)
        if why:
            raise UsageError(f"--compile: torch.compile cannot run here: {why}")
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
