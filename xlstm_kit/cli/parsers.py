"""The parsers of the ``generate``, ``experiment``, ``serve`` and ``export`` commands: argparse
only, no torch, so that ``xlstm-kit --help`` and a mistyped argument answer at once (the commands
themselves are `generate.py`, `experiment.py`, `serve.py` and `export.py`, imported when they run)."""
from __future__ import annotations

import argparse

from .args import (DTYPES, THREADS_HELP, Formatter, Parser, device_name, nonneg_float, nonneg_int, positive_float,
                   positive_int, seed_int, thread_count)


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


def add_generate_parser(sub) -> argparse.ArgumentParser:
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
    gen.add_argument("--repetition-penalty", type=repetition_penalty, default=1.0, metavar="X",
                     help="divide the positive logits (multiply the negative ones) of tokens already in the "
                     "text by X (1: off; 1.1-1.3 curbs loops)")
    gen.add_argument("--stop", action="append", default=None, metavar="STR",
                     help="end a continuation where this text appears, cutting it (repeatable; in bash "
                     "$'\\n' is a newline)")
    gen.add_argument("--seed", type=seed_int, default=None, help="sampling seed (default: random)")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                     help="print tokens as they are produced (default: when stdout is a terminal; not with "
                     "--prompts)")
    gen.add_argument("--device", type=device_name, default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    gen.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype (default: the file's)")
    gen.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    gen.add_argument("--compile", action="store_true",
                     help="torch.compile the decode step (model.compile_step: fused kernels per block; "
                     "compiles once per batch size, so it pays for long generations on a GPU)")
    gen.set_defaults(run=("generate", "cmd_generate"))
    return gen


# generation.sampling.MAX_REPETITION_PENALTY, known here without importing torch
# (tests/test_cli_startup.py holds the two equal)
MAX_REPETITION_PENALTY = 1e6


def repetition_penalty(text: str) -> float:
    v = positive_float(text)
    if not 1 / MAX_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY:
        raise argparse.ArgumentTypeError(f"must be in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                                         f"(1: off), got {text}")
    return v


DEFAULT_OUT = "runs/experiments"
MODEL_HELP = ("xlstm[0:1], xlstm[1:0], xlstm[1:1], transformer, lstm, lstm-plain, dplr, or the ablation "
              "transformer-conv (the Transformer with the mLSTM block's causal conv in front of q and k)")
"""experiment.MODEL_NAMES in words (the parser does not import torch)."""


def add_experiment_parser(sub) -> None:
    """Register ``experiment`` (with kinds formal, mqar, sweep) on the top-level subparsers."""
    ex = sub.add_parser(
        "experiment",
        help="formal-language tasks and MQAR: xLSTM against a Transformer and an LSTM",
        description="Train small models (2 blocks, same width) on the paper's synthetic tasks and "
        "report scaled accuracy on longer test sequences (formal: 0 = chance, 1 = perfect) or "
        "recall accuracy (MQAR). Models: " + MODEL_HELP + ".",
    )
    kinds = ex.add_subparsers(dest="experiment", metavar="KIND", parser_class=Parser)
    kinds.required = True
    fo = kinds.add_parser("formal", help="one model on one formal-language task", formatter_class=Formatter)
    fo.add_argument("--task", required=True, help="parity, even_pairs, cycle_navigation, modular_arithmetic, "
                    "reverse_string, stack_manipulation, bucket_sort or majority")
    fo.add_argument("--model", required=True, help=MODEL_HELP)
    mq = kinds.add_parser("mqar", help="one model on multi-query associative recall", formatter_class=Formatter)
    mq.add_argument("--model", required=True, help=MODEL_HELP)
    sw = kinds.add_parser("sweep", help="every task x model; writes table.md and heatmap.png", formatter_class=Formatter)
    sw.add_argument("--tasks", default=None, help="comma-separated formal tasks (default: all; 'none': MQAR only)")
    sw.add_argument("--models", default=None, help="comma-separated models (default: all but the ablation transformer-conv)")
    sw.add_argument("--no-mqar", action="store_true", help="formal tasks only")
    sw.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                    help="runs in parallel processes (with --protocol: per GPU)")
    sw.add_argument("--mqar-time-limit", type=positive_float, default=None, metavar="S",
                    help="time limit of each MQAR run (default: --time-limit)")
    sw.add_argument("--mqar-steps", type=positive_int, default=None, metavar="N",
                    help="most optimizer steps of each MQAR run (default: --steps)")
    sw.add_argument("--mqar-lr", default=None, metavar="X[,Y...]",
                    help="peak learning rate(s) of the MQAR runs; several: one MQAR column per rate "
                    "(default: --lr if given, else 1e-3)")
    sw.add_argument("--steps-for", default=None, metavar="TASK=N,...",
                    help="per-task step counts for the formal tasks, e.g. parity=4000,majority=1500")
    sw.add_argument("--report-only", action="store_true", help="only rebuild the report from OUT/runs/*.json")
    for p in (mq, sw):
        p.add_argument("--setting", choices=["zoology", "fig5"], default=None,
                       help="with --protocol: the MQAR setting (zoology: (64,4) (128,8) (256,16); fig5: T=2048 "
                       "with 48, 96, 256 pairs); default zoology")
        p.add_argument("--widths", default=None, metavar="D[,D...]", help="with --protocol: MQAR widths (default: the setting's)")
        p.add_argument("--shapes", default=None, metavar="TxN[,TxN...]",
                       help="with --protocol: the MQAR shapes (sequence length x pairs) to run instead of the "
                       "setting's, e.g. 256x48,2048x16 (--seq-len/--pairs: one shape)")
    for p in (fo, mq, sw):
        p.add_argument("--protocol", choices=["paper", "quick"], default=None,
                       help="run the paper's grid (learning rates x seeds, best lr reported as mean ± std); "
                       "quick: its tiny CPU version")
        p.add_argument("--lrs", default=None, metavar="X[,Y...]", help="with --protocol: the learning-rate grid")
        p.add_argument("--seeds", default=None, metavar="N[,N...]", help="with --protocol: the seeds")
        p.add_argument("--quick", action="store_true", help="tiny CPU smoke run (tests use it)")
        p.add_argument("--steps", type=positive_int, default=None, metavar="N", help="most optimizer steps")
        p.add_argument("--time-limit", type=positive_float, default=None, metavar="S",
                       help="seconds per run, training and evaluation (the schedule fits itself to it)")
        p.add_argument("--batch-size", type=positive_int, default=None, metavar="N")
        p.add_argument("--lr", type=positive_float, default=None, metavar="X",
                       help="peak learning rate (default: 3e-3 formal, 1e-3 MQAR)")
        p.add_argument("--d-model", type=positive_int, default=None, metavar="N", help="width of every model")
        p.add_argument("--heads", type=positive_int, default=None, metavar="N",
                       help="heads of every model (attention, mLSTM and sLSTM heads; default 4); with --protocol: "
                            "MQAR runs only, labelled T..-N..-hN")
        p.add_argument("--seq-len", type=positive_int, default=None, metavar="N",
                       help="MQAR sequence length (with --protocol and --pairs: the one shape to run, "
                            "instead of every shape of the setting)")
        p.add_argument("--pairs", type=positive_int, default=None, metavar="N", help="MQAR key-value pairs")
        p.add_argument("--seed", type=seed_int, default=None, metavar="N")
        p.add_argument("--eval-samples", type=positive_int, default=None, metavar="N",
                       help="test sequences per test length (formal; MQAR: 64 x N sequences)")
        p.add_argument("--precision", choices=["fp32", "bf16"], default=None)
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="train through a compiled step (torch.compile of forward, loss and backward; CUDA "
                       "graphs on CUDA; evaluation stays eager). Default: on with --protocol paper on CUDA, "
                       "else off")
        p.add_argument("--backend", choices=["torch", "triton"], default=None, help="xLSTM ops backend (default: by device)")
        p.add_argument("--device", type=device_name, default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
        p.add_argument("--threads", type=thread_count, default=None, metavar="N", help="CPU threads")
        p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="output folder")
        p.set_defaults(run=("experiment", "cmd_experiment"))
    for p in (fo, mq):
        p.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                       help="with --protocol: grid points run in parallel per GPU")
    for p in (fo, mq, sw):
        p.add_argument("--stop-after", type=positive_float, default=None, metavar="SECONDS",
                       help="with --protocol: after SECONDS the running grid points save a checkpoint and the "
                            "command ends; the same command later continues them (a machine lent for a while)")
        p.add_argument("--score-paused", action="store_true",
                       help="with --stop-after: score the paused grid points as they stand too (into "
                            "runs/<id>.progress and the report), for a last call whose checkpoints will be lost")


SERVE_EXAMPLES = """Examples:
  xlstm-kit serve runs/tiny --port 8000
  xlstm-kit serve xLSTM-7b/ --dtype bf16 --max-batch 64 --api-key $(cat key.txt) --host 0.0.0.0
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (when the folder has a chat \
template), GET /v1/models, GET /health, GET /metrics (Prometheus). Any OpenAI client works: \
base_url http://HOST:PORT/v1. SIGTERM or Ctrl-C lets running requests finish for \
--shutdown-grace seconds, then ends them."""


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` (the OpenAI-compatible HTTP server) on the top-level subparsers."""
    sv = sub.add_parser(
        "serve",
        help="serve a model over HTTP with the OpenAI API (needs the [serve] extra)",
        description="An OpenAI-compatible HTTP server: requests join the running batch at token "
        "boundaries into free state slots, long prompts are read in chunks between decode steps, and "
        "the state after a shared prompt prefix is cached and reused.",
        epilog=SERVE_EXAMPLES,
        formatter_class=Formatter,
    )
    sv.add_argument("checkpoint", metavar="MODEL_DIR", help="a training output folder, a checkpoint folder or a "
                    "HuggingFace xLSTM folder")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=nonneg_int, default=8000, help="port (0: any free port; the line printed at "
                    "start names it)")
    sv.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                    help="requests generating at once (state slots)")
    sv.add_argument("--max-queue", type=nonneg_int, default=256, metavar="N",
                    help="requests that may wait for a slot; beyond, 429 with Retry-After")
    sv.add_argument("--max-prompt-tokens", type=positive_int, default=32768, metavar="N",
                    help="longest prompt accepted (longer: 400)")
    sv.add_argument("--max-tokens", type=positive_int, default=4096, metavar="N",
                    help="most new tokens a request may ask for (and the default of chat requests)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1/* (else 401)")
    sv.add_argument("--model-name", default=None, metavar="NAME",
                    help="the model id clients name (default: the folder's name)")
    sv.add_argument("--prefix-cache-mb", type=nonneg_int, default=1024, metavar="MB",
                    help="memory for cached prefix states, on the model's device (0: no cache)")
    sv.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N",
                    help="tokens of each prompt read between two decode steps")
    sv.add_argument("--shutdown-grace", type=nonneg_float, default=30.0, metavar="S",
                    help="seconds the running requests get after SIGTERM before they are ended")
    sv.add_argument("--device", default=None, metavar="DEV", help="cpu, cuda ... (default: cuda if available)")
    sv.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype (default: the file's)")
    sv.add_argument("--threads", type=thread_count, default=None, help=THREADS_HELP)
    sv.add_argument("--compile", action="store_true",
                    help="torch.compile the decode step (model.compile_step; once per batch-size bucket at start) "
                    "and the prompt reads (model.compile_prefill: dynamic shapes, compiled on the first prompts)")
    sv.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="replay the decode step as CUDA graphs, one per batch-size bucket (default: on CUDA)")
    sv.set_defaults(run=("serve", "cmd_serve"))
    return sv


def add_export_parser(sub) -> argparse.ArgumentParser:
    """Register ``export`` (a model folder from a run or checkpoint) on the top-level subparsers."""
    ex = sub.add_parser(
        "export",
        help="write a HuggingFace xLSTM folder (or an xlstm_kit model folder) from a run or checkpoint",
        description="Read a model whole (a training run's newest checkpoint, also the sharded one of an "
        "FSDP run; a checkpoint folder; a HuggingFace folder), fold LoRA adapters into its weights and "
        "write it to --out: --format hf gives the folder transformers' xLSTMForCausalLM loads (xLSTM-7B "
        "block family only), --format xlstm_kit our own model folder. The write is atomic.",
        epilog="Examples:\n"
        "  xlstm-kit export runs/large --format hf --out large-hf/\n"
        "  xlstm-kit export runs/ft --format hf --dtype bf16 --max-shard-size 5GB --out ft-hf/\n"
        "  xlstm-kit export runs/fsdp --format xlstm_kit --out model/     # one model.safetensors",
        formatter_class=Formatter,
    )
    ex.add_argument("checkpoint", metavar="DIR", help="a training output folder, a checkpoint folder or a "
                    "HuggingFace xLSTM folder")
    ex.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or an earlier export)")
    ex.add_argument("--format", choices=["hf", "xlstm_kit"], default="hf",
                    help="hf: transformers' xLSTMForCausalLM folder; xlstm_kit: config.json + model.safetensors "
                    "(default: hf)")
    ex.add_argument("--dtype", choices=list(DTYPES), default=None, help="weights' dtype (default: the checkpoint's)")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="--format hf: largest weight file, e.g. 5GB or 500MB (default: 5GB)")
    ex.set_defaults(run=("export", "cmd_export"))
    return ex
