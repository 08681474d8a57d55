"""`xlstm-kit serve`: load a model and serve it over HTTP with the OpenAI API (xlstm_kit.serve)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._extras import require
from .args import UsageError
from .common import decode_device, open_checkpoint, tokenizer_for

PROG = "xlstm-kit serve"


def cmd_serve(args: argparse.Namespace) -> int:
    # the extra first: a missing one is said in one line before a model is loaded
    for module in ("starlette", "uvicorn"):
        require(module, PROG)
    from ..serve.app import App
    from ..serve.chat import find_chat_template
    from ..serve.engine import Engine
    from ..serve.server import run

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    device = decode_device(args)
    if args.cuda_graph and device.type != "cuda":
        raise UsageError(f"--cuda-graph needs a CUDA device, the model runs on {device}")
    folder, meta, model = open_checkpoint(args.checkpoint, device, args.dtype)
    tokenizer = tokenizer_for(meta, model)
    if args.compile:
        model.compile_step()
        model.compile_prefill()  # eager, a prompt read is bound by the host's launches
        import torch._dynamo

        # the step compiles once per batch-size bucket (up to 9 for --max-batch 256): more than
        # torch's default limit of recompilations, past which it would run eagerly
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    template = find_chat_template(Path(folder), Path(args.checkpoint))
    name = args.model_name or Path(args.checkpoint).resolve().name
    if device.type == "cuda" or args.compile:  # Engine.start records and compiles before it returns
        print(f"{PROG}: preparing the decode step and the prompt reads (compiled on first use: up to a "
              "few minutes)...", file=sys.stderr, flush=True)
    engine = Engine(model, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefix_cache_bytes=args.prefix_cache_mb << 20,
                    cuda_graph=args.cuda_graph).start()
    app = App(engine, tokenizer, name, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
              api_key=args.api_key, chat_template=template)
    return run(engine, app, args.host, args.port, args.shutdown_grace, prog=PROG)
