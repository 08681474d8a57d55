"""``xlstm-kit train``, ``eval`` and ``demo``: argument handling and printing around
`xlstm_kit.training` and `xlstm_kit.generation`."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as torch_dist

from ..errors import XLSTMKitError
from ..generation.generate import generate_text
from ..io.loading import load_model, load_pretrained
from ..io.sharded import resumes_from_shards
from ..io.tokenizers import TOKENIZERS, get_tokenizer
from ..models import PRESETS, XLSTMConfig, XLSTMLanguageModel
from ..models.lora import lora_settings, use_lora
from ..training import (RESUME_FROZEN, StepEvent, TimeBudget, TrainConfig, continue_schedule, evaluate,
                        init_distributed, load_training_state, lr_at, read_train_meta, resolve_checkpoint,
                        train, val_batch_count)
from ..training.compiling import CPU_COMPILE_NOTE, SlowCompileWarning
from ..training.data import load_data
from ..training.distributed import builds_on_meta
from .args import (DEFAULT_DATA, DEFAULT_PRESET, EVAL_WHOLE_SPLIT_UP_TO, EXIT_INTERRUPTED, FINETUNE_DEFAULTS,
                   PROG, UsageError, preset_key)
from .common import (Progress, check_eval_memory, check_out_dir, check_training_memory, clear_run,
                     init_tokenizer, normalise_data_spec, open_checkpoint, pick_device, prepare_demo_out,
                     report_skipped, tokenizer_for, train_defaults, use_threads)


def _in_flags(message: str) -> str:
    """A TrainConfig error in the words of the command line (TrainConfig.min_lr -> --min-lr)."""
    return re.sub(r"TrainConfig\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), message)


def _train_config(make, *args):
    try:
        return make(*args)
    except XLSTMKitError as e:
        raise UsageError(_in_flags(str(e))) from None


def _parallel(args: argparse.Namespace, out: Path) -> str:
    """--parallel, else on --resume the checkpoint's: it decides how the processes join up, so a
    --parallel that differs from the checkpoint's is refused before they do."""
    if not args.resume:
        return args.parallel or "ddp"
    try:
        saved = str(load_training_state(resolve_checkpoint(out))["train_config"].get("parallel", "ddp"))
    except (XLSTMKitError, OSError, AttributeError):
        return args.parallel or "ddp"  # the resume below reports what is wrong with the checkpoint
    if args.parallel is not None and args.parallel != saved:
        raise UsageError(f"--parallel {args.parallel} cannot resume a run trained with --parallel {saved} "
                         f"(its checkpoints are {'sharded' if saved == 'fsdp' else 'whole'}); leave --parallel out")
    return saved


def cmd_train(args: argparse.Namespace) -> int:
    for flag in ("preset", "tokenizer", "data", "out"):  # an empty value would quietly mean the default
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag} is empty; leave it out for the default")
    out = Path(args.out or f"runs/{(args.preset or DEFAULT_PRESET).lower()}")
    parallel = _parallel(args, out)
    dist = init_distributed(parallel=parallel)
    # FSDP ranks other than 0 take their shards of rank 0's weights, and on a resume from a sharded
    # checkpoint every rank reads its shards from it: they build shapes only
    shapes = builds_on_meta(dist, parallel, sharded_resume=args.resume and resumes_from_shards(out))
    device = pick_device(args.device) if args.device or not dist.enabled else None
    threads = use_threads(args.threads, device)
    overrides = {
        k: getattr(args, k)
        for k in ("steps", "batch_size", "seq_len", "grad_accum", "lr", "min_lr", "warmup_steps",
                  "weight_decay", "grad_clip", "seed", "precision", "eval_interval", "eval_batches",
                  "checkpoint_interval", "compile", "activation_checkpointing", "pack", "lora", "lora_alpha",
                  "on_nonfinite", "parallel")
        if getattr(args, k) is not None
    }
    if args.lora_targets is not None:
        overrides["lora_targets"] = tuple(t.strip() for t in args.lora_targets.split(","))
    if args.lora is None and (args.lora_alpha is not None or args.lora_targets is not None):
        raise UsageError("--lora-alpha and --lora-targets shape LoRA adapters; add --lora RANK")
    if args.lora is not None and args.init_from is None and not args.resume:
        raise UsageError("--lora fine-tunes a trained model: add --init-from DIR (a checkpoint, a training run or "
                         "a HuggingFace xLSTM folder)")
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
        data_arg = normalise_data_spec(args.data) if args.data is not None else None
        for key, value in (("preset", args.preset), ("data", data_arg), ("tokenizer", args.tokenizer)):
            if value is not None and str(value).lower() != str(meta.get(key)).lower():
                raise UsageError(f"--{key} {value} differs from the checkpoint's ({meta.get(key)}); "
                                 f"leave it out when resuming")
        saved = load_training_state(ckpt)["train_config"]
        saved_config = TrainConfig.from_dict(saved)
        for key in RESUME_FROZEN:
            if key in overrides and overrides[key] != getattr(saved_config, key):
                raise UsageError(f"--{key.replace('_', '-')} cannot change on --resume "
                                 f"(the checkpoint used {getattr(saved_config, key)})")
        config = continue_schedule(saved_config, _train_config(TrainConfig.from_dict, {**saved, **overrides}),
                                   int(meta["step"]))
        missing = [key for key in ("data", "tokenizer") if not meta.get(key)]
        if missing:
            raise UsageError(f"{ckpt} does not record the {' and '.join(missing)} it trained on; cannot --resume it")
        preset, data_spec, tok_name = meta.get("preset"), meta["data"], meta["tokenizer"]
        val_fraction = meta.get("val_fraction", args.val_fraction)
        model = load_model(ckpt, weights=not shapes)
        tok_name = model.hf_tokenizer or tok_name  # a tokenizers-format tokenizer.json travels with the checkpoint
        start = int(meta["step"])
    elif args.init_from is not None:
        preset = None
        model = load_pretrained(args.init_from, dtype=torch.float32, weights=not shapes)  # fp32 master weights
        tok_name = init_tokenizer(model, args.tokenizer, args.init_from)
    else:
        preset = (args.preset or DEFAULT_PRESET)
        if preset_key(preset) not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        tok_name = args.tokenizer or "byte"
    if not args.resume:
        if isinstance(tok_name, str) and tok_name not in TOKENIZERS:
            raise UsageError(f"unknown tokenizer {tok_name!r}; choose one of {', '.join(TOKENIZERS)}")
        data_spec = normalise_data_spec(args.data or DEFAULT_DATA)
        val_fraction = args.val_fraction
        if (out / "latest").exists() and not args.overwrite:
            raise UsageError(f"{out} already holds a training run; add --resume to continue it "
                             f"or --overwrite to start afresh")
        defaults = {"steps": 1000, **(train_defaults(preset) if preset else FINETUNE_DEFAULTS)}
        steps = overrides.get("steps", defaults["steps"])
        # A short run still needs its cosine decay: warm up for at most a fifth of it.
        defaults["warmup_steps"] = min(defaults["warmup_steps"], steps // 5)
        config = _train_config(TrainConfig.from_dict, {**defaults, **overrides})
        start = 0
        if config.lora:  # here (the model is --init-from's): a target it lacks stops the run before any work
            use_lora(model, config.lora, config.lora_alpha, config.lora_targets, seed=config.seed)
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if config.batch_size % (dist.world_size * config.grad_accum):
        raise UsageError(f"--batch-size {config.batch_size} (the global batch) does not divide into {dist.world_size} "
                         f"process{'es' if dist.world_size > 1 else ''} x --grad-accum {config.grad_accum}: "
                         f"make it a multiple of {dist.world_size * config.grad_accum}")
    if config.steps <= start:
        raise UsageError(f"the checkpoint is already at step {start}; pass --steps larger than that to train on")
    init_from = args.init_from or (meta.get("init_from") if args.resume else None)
    label = preset or (f"the model of {init_from}" if init_from else "the model")
    model_config = model.config if args.resume or args.init_from else XLSTMConfig.from_name(
        preset, vocab_size=get_tokenizer(tok_name).vocab_size)
    if device is not None and device.type == "cpu":
        check_training_memory(model_config, config, label)
    if dist.is_main:
        check_out_dir(out)
    data = load_data(data_spec, tok_name, val_fraction=val_fraction, documents=config.pack is not False)
    if dist.is_main:
        report_skipped(data)
    if config.pack and data.train_docs is None:
        raise UsageError(f"--pack needs data made of documents (several files, or texts that end with the "
                         f"tokenizer's end token); {data_spec} is one text: leave out --pack")
    if not args.resume:
        torch.manual_seed(config.seed)
        if args.init_from is None:
            with torch.device("meta") if shapes else contextlib.nullcontext():
                model = XLSTMLanguageModel(model_config)
        if args.overwrite and dist.is_main:
            clear_run(out)

    tok_label = getattr(tok_name, "name", tok_name)
    meta_out = {"preset": preset, "data": data_spec, "tokenizer": tok_label, "val_fraction": val_fraction}
    if init_from is not None:
        meta_out["init_from"] = str(Path(init_from).resolve())
    progress = None
    if dist.is_main:
        size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
        lora = lora_settings(model)
        if lora is not None:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            size += (f", {trainable / 1e6:.3g}M of them trainable: LoRA adapters of rank {lora['rank']}, alpha "
                     f"{lora['alpha']:g} on {', '.join(lora['targets'])}")
        where = f"{dist.world_size} processes" if dist.enabled else str(device)
        if device is not None and device.type == "cpu":
            where += f" ({threads})"
        if config.compile:
            where += ", compiled"
        if config.compile and (device.type == "cpu" if device is not None else not torch.cuda.is_available()):
            print(f"{PROG} train: warning: --compile: {CPU_COMPILE_NOTE}", file=sys.stderr, flush=True)
        if config.activation_checkpointing != "none":
            where += f", recomputing {config.activation_checkpointing} blocks in the backward"
        if data.train_docs is not None and config.pack is not False:
            where += f", {len(data.train_docs):,} documents packed (state reset at each)"
        print(
            f"{'resuming' if args.resume else 'training'} {label} ({size}) on "
            f"{data_spec} ({len(data.train):,} training tokens, tokenizer {tok_label}) for "
            f"{config.steps} steps of {config.batch_size}x{config.seq_len} tokens on {where} -> {out}",
            file=sys.stderr, flush=True,
        )
        if args.resume and config.steps != saved_config.steps:
            print(f"the learning-rate schedule continues: {lr_at(start, config):.3g} at step {start + 1}, "
                  f"cosine decay to {config.min_lr:.3g} at step {config.steps} (stretched from the "
                  f"checkpoint's {saved_config.steps} steps, not restarted)", file=sys.stderr, flush=True)
        progress = Progress(config.steps, start, not args.no_progress, sys.stderr)
    # the start line above said it, in one line (and only rank 0)
    warnings.filterwarnings("ignore", category=SlowCompileWarning)
    try:
        # threads=None: use_threads above applied the command line's choice
        result = train(model, data, config, out, resume=args.resume, callback=progress,
                       device=device, dist=dist, meta=meta_out, threads=None)
    finally:
        if progress is not None:
            progress.close()
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    if dist.is_main:
        if result.interrupted:
            where = result.checkpoint or "the last periodic checkpoint"
            print(f"interrupted at step {result.step}; saved {where}. Continue with: "
                  f"xlstm-kit train --out {out} --resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        skipped = (f"; skipped the update of {result.skipped_steps} step{'s' if result.skipped_steps > 1 else ''} "
                   f"with a non-finite loss") if result.skipped_steps else ""
        print(f"done: step {result.step}; checkpoint {result.checkpoint}; "
              + (f"loss curve {result.plot}" if result.plot else result.plot_note or "no loss curve") + skipped,
              file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if any(getattr(args, k) is not None for k in ("tasks", "include_path", "limit", "num_fewshot", "output")):
        from .harness import cmd_eval_tasks  # lm-eval's tasks: their own module, imported for them only

        return cmd_eval_tasks(args)
    args.batch_size = args.batch_size or 16
    device = pick_device(args.device)
    use_threads(args.threads, device)
    ckpt, meta, model = open_checkpoint(args.checkpoint, device, args.dtype)
    tok = tokenizer_for(meta, model)
    spec = args.data or meta.get("data") or DEFAULT_DATA
    val_fraction = args.val_fraction or meta.get("val_fraction", 0.1)
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    seq_len = args.seq_len or meta.get("train_config", {}).get("seq_len") or model.config.context_length
    if device.type == "cpu":
        check_eval_memory(model, args.batch_size, seq_len)
    pack = meta.get("train_config", {}).get("pack")  # as the run trained: None packs where there are documents
    data = load_data(spec, tok, val_fraction=val_fraction, documents=pack is not False)
    report_skipped(data)
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
    device = pick_device(args.device)
    threads = use_threads(args.threads, device)
    out = Path(args.out)
    prepare_demo_out(out, args.overwrite)
    budget = TimeBudget(args.minutes * 60, skip_steps=2, device=device)
    print(f"xlstm_kit demo: the 'tiny' xLSTM (three mLSTM blocks, one sLSTM block) learns Shakespeare "
          f"on {device} for about {args.minutes:g} minutes.", flush=True)
    data = load_data(DEFAULT_DATA, "byte")
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig.from_name("tiny", vocab_size=data.vocab_size))
    # "demo" marks the run as the demo's own: the next demo may replace it without --overwrite
    meta = {"preset": "tiny", "data": DEFAULT_DATA, "tokenizer": "byte", "val_fraction": 0.1, "demo": True}
    defaults = train_defaults("tiny")
    warmup = defaults["warmup_steps"]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, batches of "
          f"{defaults['batch_size']}x{defaults['seq_len']} bytes, {threads}; "
          f"output in {out}/", flush=True)

    # Two phases: the warmup steps measure this machine's speed, then the run resumes with as
    # many steps as fit the budget. The learning rate during warmup does not depend on the total,
    # so this is exactly one run of the final length. The bar has no total until the speed is
    # known (a total of the warmup steps, then of the run, read as a jump).
    progress = Progress(None, 0, True, sys.stderr)

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
                       time_limit_s=budget.remaining() + slack, threads=None)
        if not (result.interrupted or result.time_limited):
            # ~8% of what is left goes to validation (4 batches, 3 times) and the checkpoint.
            steps = budget.steps_that_fit(warmup, reserve=0.08) or warmup
            progress.bar.total = steps
            progress.bar.refresh()
            config = dataclasses.replace(config, steps=steps, eval_interval=max(1, -(-steps // 3)))
            if steps > warmup:
                result = train(model, data, config, out, resume=True, device=device, callback=on_event,
                               meta=meta, time_limit_s=max(1.0, budget.remaining() + slack), threads=None)
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
