"""Helpers the ``xlstm-kit`` commands share: device, output folder, model and tokenizer loading,
threads, memory checks, the progress bar."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import XLSTMKitError
from ..io.checkpoint import clear_run as clear_run_folder, read_train_meta, resolve_checkpoint
from ..io.loading import load_pretrained
from ..io.tokenizers import get_tokenizer
from ..training import (CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, PLOT_FILE, CompileEvent, EvalEvent,
                        StepEvent)
from ..training.data import name_some
from ..training import resources
from ..training.compiling import compile_unavailable
from .args import DTYPES, LARGE_DEFAULTS, TRAIN_DEFAULTS, UsageError


def pick_device(name: str | None):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name} asked for, but no CUDA GPU is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA GPUs "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {name} asked for, but MPS is not available")
    elif device.type != "cpu" or device.index not in (None, 0):
        # meta, xla, ...: torch knows them, but nothing can be trained or sampled there
        raise UsageError(f"--device {name} cannot run xlstm-kit; use cpu, cuda or cuda:N")
    return device


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """Refuses, in one line and before any work, an output folder that cannot be written: an
    existing file, a path below a file, or a folder without write permission. Creates it."""
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{flag} {out}: {parent} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {out}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out}: the folder is not writable")


def normalise_data_spec(spec: str) -> str:
    """Paths become absolute: the spec is recorded in checkpoints, and --resume or eval may run
    from another folder."""
    if spec.startswith("builtin:") or not Path(spec).expanduser().exists():
        return spec
    return str(Path(spec).expanduser().resolve())


def train_defaults(preset: str) -> dict[str, Any]:
    return dict(TRAIN_DEFAULTS.get(preset.lower(), LARGE_DEFAULTS))


def open_checkpoint(path: str, device, dtype: str | None = None):
    """(checkpoint folder, its training metadata, the model) for a DIR argument."""
    ckpt = resolve_checkpoint(path)
    model = load_pretrained(ckpt, device=device, dtype=DTYPES.get(dtype))
    return ckpt, read_train_meta(ckpt), model


def init_tokenizer(model, requested: str | None, source: str):
    """The tokenizer of a fine-tuning run: the folder's (a tokenizers object or a name), else
    --tokenizer, else bytes for a 256-token model."""
    known = model.hf_tokenizer or model.tokenizer_name
    if requested is not None and known is not None and requested != known:
        raise UsageError(f"--tokenizer {requested}: {source} comes with its own tokenizer; leave --tokenizer out")
    if known is None and requested is None and model.config.vocab_size != 256:
        raise UsageError(f"{source} does not record its tokenizer; pass --tokenizer (byte or gpt2)")
    return known or requested or "byte"


def tokenizer_for(meta: dict[str, Any], model):
    if model.hf_tokenizer is not None:  # the folder's own tokenizer.json
        tok = model.hf_tokenizer
        if tok.vocab_size > model.config.vocab_size:
            raise UsageError(f"{tok.path} has {tok.vocab_size} tokens but the model only {model.config.vocab_size}")
        return tok
    name = meta.get("tokenizer") or model.tokenizer_name
    if name is None:  # a bare model checkpoint: a byte vocabulary is the only safe guess
        if model.config.vocab_size != 256:
            raise UsageError("the checkpoint does not record its tokenizer and is not byte-level")
        name = "byte"
    tok = get_tokenizer(name)
    if tok.vocab_size > model.config.vocab_size:
        raise UsageError(
            f"tokenizer {name} has {tok.vocab_size} tokens but the model only {model.config.vocab_size}"
        )
    return tok


def use_threads(requested: int | None, device) -> str:
    """Set torch's CPU threads (--threads, else a load-aware default for CPU runs); returns
    words for the start line, e.g. "1 thread (other processes keep the cores busy)"."""
    n, why = requested, ""
    if n is None and device is not None and device.type == "cpu":
        n = resources.default_threads(torch.get_num_threads())
        if n is not None and n < torch.get_num_threads():
            why = " (other processes keep the cores busy; --threads to choose)"
    if n is not None:
        torch.set_num_threads(n)
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}{why}"


def decode_device(args):
    """The device of a decoding command (generate, serve) with its CPU threads set; a one-line
    refusal of --compile where torch.compile cannot run."""
    device = pick_device(args.device)
    use_threads(args.threads, device)
    if args.compile:
        why = compile_unavailable(device)
        if why:
            raise UsageError(f"--compile: torch.compile cannot run here: {why}")
    return device


def out_of_memory(needed: int, available: int, what: str, shrink: str) -> UsageError:
    """The one-line refusal of a CPU run that would outgrow the memory (the kernel would kill it
    with a bare "Killed", without a checkpoint); ``shrink`` suggests smaller settings."""
    return UsageError(f"{what} needs about {resources.format_gib(needed)} of memory on the CPU, "
                      f"{resources.format_gib(available)} is available: {shrink}, or use a GPU (--device cuda)")


def check_training_memory(model_config, config, preset: str) -> None:
    available = resources.available_memory()
    n_params = resources.count_parameters(model_config)
    micro = max(1, config.batch_size // config.grad_accum)
    need = lambda b: resources.training_bytes(model_config, n_params, b, config.seq_len)  # noqa: E731
    if available is None or need(micro) <= available:
        return
    fits = resources.largest_batch(need, available, micro)
    if fits:
        accum = next(k for k in range(-(-config.batch_size // fits), config.batch_size + 1)
                     if config.batch_size % k == 0)
        shrink = (f"use --batch-size {fits} (or keep the batch of {config.batch_size} with "
                  f"--grad-accum {accum}) or a smaller --preset")
    else:
        shrink = "use a shorter --seq-len or a smaller --preset (e.g. tiny)"
    raise out_of_memory(need(micro), available, f"training {preset} ({n_params / 1e6:.0f}M parameters, "
                         f"{micro}x{config.seq_len} tokens per pass)", shrink)


def check_eval_memory(model, batch_size: int, seq_len: int) -> None:
    available = resources.available_memory()
    n_params = sum(p.numel() for p in model.parameters())
    need = lambda b: resources.evaluation_bytes(model.config, n_params, b, seq_len)  # noqa: E731
    if available is None or need(batch_size) <= available:
        return
    fits = resources.largest_batch(need, available, batch_size)
    raise out_of_memory(need(batch_size), available, f"evaluating {batch_size}x{seq_len} tokens per batch",
                         f"use --batch-size {fits}" if fits else "use a shorter --seq-len")


def report_skipped(data) -> None:
    if data.skipped:
        print(f"skipped {len(data.skipped)} file{'s' if len(data.skipped) > 1 else ''} that "
              f"{'are' if len(data.skipped) > 1 else 'is'} not UTF-8 text: {name_some(data.skipped)}",
              file=sys.stderr, flush=True)


class Progress:
    """Turns training events into a tqdm bar and printed validation lines."""

    def __init__(self, total: int | None, initial: int, enabled: bool, stream) -> None:
        self.stream = stream
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not enabled, file=stream, smoothing=0.1)
        self.tok_s = None
        self.first_eval = None
        self.last_eval = None

    def write(self, line: str) -> None:
        if self.bar.disable:
            print(line, file=self.stream, flush=True)
        else:
            self.bar.write(line, file=self.stream)

    def __call__(self, event) -> None:
        if isinstance(event, CompileEvent):
            then = f", then {event.step_s:.2f} s per step" if event.step_s is not None else ""
            self.write(f"compiled: the first step took {event.first_step_s:.1f} s, about "
                       f"{event.compile_s:.1f} s of it compiling{then}")
        elif isinstance(event, StepEvent):
            self.tok_s = event.tokens_per_s if self.tok_s is None else 0.9 * self.tok_s + 0.1 * event.tokens_per_s
            self.bar.set_postfix_str(f"loss {event.loss:.3f}  lr {event.lr:.2e}  {self.tok_s:,.0f} tok/s", refresh=False)
            self.bar.update(event.step - self.bar.n)
        elif isinstance(event, EvalEvent):
            m = event.metrics
            self.first_eval = self.first_eval or (event.step, m)
            self.last_eval = (event.step, m)
            self.write(f"step {event.step:>6}  val loss {m.loss:.4f}  bpb {m.bits_per_byte:.4f}  ppl {m.perplexity:.2f}"
                       f"  ({m.describe()})")

    def close(self) -> None:
        self.bar.close()


def is_demo_run(out: Path) -> bool:
    """True when the training run in `out` was written by `demo` (its checkpoints say so)."""
    try:
        return read_train_meta(resolve_checkpoint(out)).get("demo") is True
    except (XLSTMKitError, OSError):
        return False


def prepare_demo_out(out: Path, overwrite: bool) -> None:
    """The demo replaces an earlier demo's run in `out`; any other training run (or a file or
    folder with a run's name) stays unless --overwrite. Files of other names are never touched."""
    check_out_dir(out)
    present = [n for n in (CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, PLOT_FILE) if os.path.lexists(out / n)]
    if not present:
        return
    if not overwrite and not is_demo_run(out):
        raise UsageError(f"{out} already holds {', '.join(present)} that no earlier demo wrote; choose "
                         f"another --out, or add --overwrite to replace that training run")
    clear_run(out)


def clear_run(out: Path) -> None:
    """Delete the training run in `out`, as far as xlstm_kit wrote it (xlstm_kit.io.checkpoint.clear_run)."""
    clear_run_folder(out, (METRICS_FILE, PLOT_FILE))
