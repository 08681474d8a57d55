"""What one piece of a server's prompt read costs: the engine reads each request's next tokens
(up to --max-piece) in one piece, its rows padded to the shortest power-of-two length L >= 16
that holds them, each (batch bucket b, L) one CUDA graph (`xlstm_kit/serve/prefill.py`), so a
prompt's time to its first token is about the sum of its pieces. This times one replay per
(b, L) and counts the kernels of a piece, to tell a fixed cost per piece (kernels that take
microseconds whatever their work) from a cost per token; beside them, reads of a few tokens as
decode steps in one graph (`L as steps`), and the server's decode step (one token, the fused
step, a graph per bucket) per batch.

    python3 benchmarks/prompt_pieces.py [--model 125M] [--max-batch 8] [--max-piece 512] [--compile] [--out DIR]

A preset's random weights, bf16 on CUDA (float32 on the CPU, where pieces run eagerly: --quick
takes a tiny model). Writes prompt_pieces.{jsonl,md} and prints the table.
"""
import argparse
import json
import os
import statistics
import time


def _time(fn, device, reps: int) -> float:
    """Median ms of fn() over reps calls (CUDA events on a GPU)."""
    import torch

    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def _kernels(fn, device) -> int | None:
    """Kernels one call of fn launches (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125M", help="a preset name (random weights)")
    ap.add_argument("--max-batch", type=int, default=8, help="the reader's rows (batch buckets up to it)")
    ap.add_argument("--max-piece", type=int, default=512, help="the longest piece")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per (batch, length)")
    ap.add_argument("--step-below", type=int, default=8,
                    help="also time pieces of up to this many tokens read as decode steps (0: no)")
    ap.add_argument("--compile", action="store_true",
                    help="as `xlstm-kit serve --compile`: model.compile_prefill() and compile_step() before recording")
    ap.add_argument("--quick", action="store_true", help="a tiny model, few shapes (the tests)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for prompt_pieces.{jsonl,md}")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.serve.prefill import PromptReader
    from xlstm_kit.serve.slots import SlotStep

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.quick:
        cfg = XLSTMConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=2, slstm_at=[1])
        args.max_batch, args.max_piece, args.reps, args.step_below = 2, 8, 3, 2
    else:
        cfg = XLSTMConfig.from_name(args.model)
    with device:
        model = XLSTMLanguageModel(cfg)
    model = (model.to(torch.bfloat16) if device.type == "cuda" else model).eval()
    if args.compile:
        model.compile_step()
        model.compile_prefill()
    rows = []
    with torch.no_grad():
        # on the CPU the pieces run eagerly, as the engine's tests run them
        reader = PromptReader(model, args.max_batch, args.max_piece, device, pieces=True, step_below=args.step_below)
        if not reader.padded:
            raise SystemExit(f"{args.model}: its blocks do not read padded rows; this benchmark times padded pieces")
        reader.capture()
        buckets = reader.buckets or [b for b in (1, 2, 4, 8, 16, 32) if b <= args.max_batch]
        rng = np.random.default_rng(0)
        for b in buckets:
            idx = torch.arange(b, device=device)
            # a padded piece costs the same whatever its rows' lengths: timed full
            shapes = [(L, L, True) for L in reader.lengths] + [(L, f"{L} as steps", False) for L in reader.step_lengths]
            for L, label, padded in shapes:
                ids = torch.as_tensor(rng.integers(0, cfg.vocab_size, (b, L)), device=device)
                lens = torch.full((b,), L, device=device) if padded else None
                fn = lambda: reader._run(L, idx, ids, lens)  # noqa: E731
                fn()
                ms = _time(fn, device, args.reps)
                count = L in (reader.lengths[0], reader.lengths[-1]) if padded else L == reader.step_lengths[-1]
                rows.append({"batch": b, "length": label, "ms": ms, "us_per_token": 1e3 * ms / (b * L),
                             "kernels": _kernels(fn, device) if count else None,
                             "graph": bool(reader.graphs)})
                print(json.dumps(rows[-1]), flush=True)
        tokens = torch.as_tensor(rng.integers(0, cfg.vocab_size, (args.max_batch,)), device=device)
        step = SlotStep(model, model.init_state(args.max_batch, device=device), tokens)
        for b in buckets:
            fn = lambda: step(b)  # noqa: E731
            fn()
            ms = _time(fn, device, args.reps)
            rows.append({"batch": b, "length": "step", "ms": ms, "us_per_token": 1e3 * ms / b,
                         "kernels": _kernels(fn, device), "graph": bool(step.graphs)})
            print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lengths = (sorted({r["length"] for r in rows if isinstance(r["length"], int)})
               + sorted({r["length"] for r in rows if isinstance(r["length"], str) and r["length"] != "step"},
                        key=lambda x: int(x.split()[0])) + ["step"])
    lines = [f"# prompt_pieces: {'tiny' if args.quick else args.model}{', compiled' if args.compile else ''} on {name} ({time.strftime('%Y-%m-%d')})", "",
             f"One piece of a prompt read, median ms ({'CUDA graph replays' if rows[0]['graph'] else 'eager'}); "
             "rows: batch, columns: piece length (`L as steps`: read as L decode steps in one graph); "
             "`step`: the decode step (one token) over the engine's slots.", "",
             "| batch | " + " | ".join(str(L) for L in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
    for b in sorted({r["batch"] for r in rows}):
        by = {r["length"]: r["ms"] for r in rows if r["batch"] == b}
        lines.append(f"| {b} | " + " | ".join(f"{by[L]:.2f}" if L in by else "–" for L in lengths) + " |")
    counted = [r for r in rows if r["kernels"] is not None]
    if counted:
        lines += ["", "Kernels per piece: " + ", ".join(f"{r['kernels']} at (batch {r['batch']}, L {r['length']})"
                                                        for r in counted) + "."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prompt_pieces.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "prompt_pieces.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
