"""Serving speed: a seeded load generator against `xlstm-kit serve`, beside `model.generate`.

    python benchmarks/serve_speed.py --model 125M --out DIR            (random weights, GPT-2 vocabulary)
    python benchmarks/serve_speed.py --model xlstm-7b --compile --out DIR
    python benchmarks/serve_speed.py --model path/to/xLSTM-7b --out DIR  (a model folder)
    python benchmarks/serve_speed.py --quick --out DIR                  (a tiny model on the CPU: the tests)

A preset name builds the model with random weights (seed 0, --dtype, bf16 by default on CUDA)
and saves it to a temporary folder first (the `gpt2` extra is needed for vocabularies other than
bytes). Then, each against a fresh server process (`xlstm-kit serve ... --port 0`) that first
gets a few requests not measured (warm_up):

- load: for each concurrency c of --concurrency (1, 8, 32, 128), --requests-per-level x c
  requests (at least 16) with prompt and output lengths drawn uniformly from --prompt-len and
  --output-len (seeded: the same requests every run), greedy, end token ignored (every request
  runs its full length), streamed; c of them in flight at any time from --clients client
  processes, each with its connections open before the first one is sent. Per level: output
  tokens/s over the wall time, time to first token (TTFT: from sending the request to the first
  event that carries a token) p50/p99, inter-token latency (ITL: gaps between streamed tokens)
  p50/p99.
- generate: the same requests of the c = 32 level (or the largest level below) through
  `model.generate` in this process, in batches of c (each batch runs to its longest output; only
  the requested tokens count), after the server is stopped: the target is the server at
  c = 32 reaching >= 80 % of this.
- prefix: --prefix-requests requests sharing a --system-len-token system prompt (1,000) before
  a short random question (8-32 tokens; 8 new tokens), at concurrency 1 and 8, with the prefix
  cache on (the load levels' server) and off (--prefix-cache-mb 0): TTFT p50/p99 of each; the
  target is >= 5x lower with the cache.

Writes DIR/serve_speed.jsonl (one row per measurement) and DIR/serve_speed.md (the tables).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 3600  # a 7B model's load and compiled, graphed steps take minutes
PREFIX_QUESTION = (8, 32)  # tokens of the short question after the shared system prompt


# ------------------------------------------------------------------------------ the workload
def workload(n: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int,
             prefix: list[int] | None = None) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, the same for the same arguments."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        out.append(((prefix or []) + p, rng.randint(*output_len)))
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# ------------------------------------------------------------------------------ the server
class Server:
    def __init__(self, folder: str, args: list[str]):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "xlstm_kit", "serve", folder, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        started = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                if " on http://" in line:
                    started.set()
            started.set()

        threading.Thread(target=drain, daemon=True).start()
        # the drain thread also sets `started` when the server's stderr closes (it exited), which
        # can come before poll() sees the exit: the address line is what tells a start
        ready = started.wait(START_TIMEOUT_S)
        line = next((x for x in self.log if " on http://" in x), None)
        if not ready or line is None or self.proc.poll() is not None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))
        self.url = re.search(r"(http://\S+)", line)[1]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client, url: str, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    t0 = time.monotonic()
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.monotonic()
            for c in event["choices"]:
                times += [now] * len(c.get("token_ids") or [])
    return {"start": t0, "times": times, "n": n}


def _client(url: str, jobs: list[tuple[list[int], int]], concurrency: int, start_at: float) -> list[dict]:
    """One client process: `jobs` with at most `concurrency` in flight, from `start_at` on."""
    import httpx

    async def main():
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            # the connections opened first: a fresh process's first request pays for them and for
            # the client's own first-use code (~25 ms here), a cost of the client, not the server
            await asyncio.gather(*(client.get(url + "/health") for _ in range(min(concurrency, len(jobs)))))
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))

            async def run(job):
                async with sem:
                    return await _one(client, url, *job)

            return await asyncio.gather(*(run(j) for j in jobs))

    return asyncio.run(main())


def load(url: str, jobs: list[tuple[list[int], int]], concurrency: int, clients: int) -> dict:
    """Run `jobs` at `concurrency`, spread over client processes (one Python process cannot
    parse the events of 128 fast streams without becoming the bottleneck)."""
    k = max(1, min(clients, concurrency))
    shares = [concurrency // k + (i < concurrency % k) for i in range(k)]
    parts = [jobs[i::k] for i in range(k)]
    if k == 1:
        results = [_client(url, jobs, concurrency, time.monotonic())]
    else:
        start_at = time.monotonic() + 1.0 + 0.1 * k  # the processes start together
        with mp.get_context("spawn").Pool(k) as pool:
            results = pool.starmap(_client, [(url, part, share, start_at) for part, share in zip(parts, shares)])
    done = [r for part in results for r in part]
    first, last = min(r["start"] for r in done), max(r["times"][-1] for r in done)
    tokens = sum(len(r["times"]) for r in done)
    ttft = [r["times"][0] - r["start"] for r in done]
    # the first `concurrency` requests arrive together and are read together; the others
    # arrive one by one into a running batch
    later = [r["times"][0] - r["start"] for r in sorted(done, key=lambda r: r["start"])[concurrency:]]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]
    return {"requests": len(done), "tokens": tokens, "wall_s": last - first, "tok_s": tokens / (last - first),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "ttft_p99_later_ms": 1e3 * (percentile(later, 99) or 0),
            "itl_p50_ms": 1e3 * (percentile(itl, 50) or 0), "itl_p99_ms": 1e3 * (percentile(itl, 99) or 0),
            "short": sum(len(r["times"]) != r["n"] for r in done)}


def warm_up(url: str, vocab: int, lengths: list[int], seed: int) -> None:
    """Requests of these prompt lengths (2 new tokens each), one at a time and then together,
    before anything is measured, as generate_baseline runs a batch first: a server's first
    prompts pay one-time costs (the prefill's kernels compiled or loaded for their shapes,
    allocations) that its decode step paid before it started listening."""
    rng = random.Random(seed)
    jobs = [([rng.randrange(vocab) for _ in range(n)], 2) for n in lengths]
    load(url, jobs, 1, 1)
    load(url, jobs, len(jobs), 1)


# ------------------------------------------------------------------------------ the model
def model_folder(spec: str, dtype: str | None, device: str, work: Path, quick: bool) -> tuple[str, int]:
    """(folder, vocabulary size): a folder as given, or a preset with random weights saved."""
    import torch

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

    if Path(spec).is_dir():
        return spec, int(json.loads((Path(spec) / "config.json").read_text())["vocab_size"])
    torch.manual_seed(0)
    cfg = XLSTMConfig(vocab_size=256, d_model=64, n_blocks=2, n_heads=2, slstm_at=[1]) if quick \
        else XLSTMConfig.from_name(spec)
    with torch.device(device):
        model = XLSTMLanguageModel(cfg)
    model = model.to(getattr(torch, dtype)) if dtype else model
    folder = work / "model"
    model.save(folder, tokenizer="byte" if cfg.vocab_size == 256 else "gpt2")
    return str(folder), cfg.vocab_size


def generate_baseline(folder: str, jobs: list[tuple[list[int], int]], batch: int, device: str, dtype: str | None,
                      compile: bool) -> dict:
    """`model.generate` on the same requests in batches of `batch` (each to its longest output)."""
    import torch

    from xlstm_kit import XLSTMLanguageModel

    if device == "cpu":
        torch.set_num_threads(1)  # as the server runs (--threads 1)
    model = XLSTMLanguageModel.from_pretrained(folder, dtype=dtype and getattr(torch, dtype), device=device)
    if compile:  # as the server's --compile
        model.compile_step()
        model.compile_prefill()
    batches = [jobs[i:i + batch] for i in range(0, len(jobs), batch)]

    def once(b):
        prompts = [torch.tensor(p, device=device) for p, _ in b]
        model.generate(prompts, max_new_tokens=max(n for _, n in b), temperature=0)

    once(batches[0])  # warm-up: graph capture, compilation
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for b in batches:
        once(b)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    useful = sum(n for _, n in jobs)
    ran = sum(len(b) * max(n for _, n in b) for b in batches)
    return {"batch": batch, "requests": len(jobs), "tokens": useful, "wall_s": seconds, "tok_s": useful / seconds,
            "all_rows_tok_s": ran / seconds}


def prefill_latency(folder: str, lengths: list[int], device: str, dtype: str | None,
                    **compile_options) -> list[dict]:
    """One prompt's read (`generate`'s prefill: the state and the last position's logits), eager
    and after `compile_prefill`, per prompt length: median ms of 5 after 2 warm-ups, the device
    synchronised around each (what a request's first token waits for beside the queue), and
    the first call's ms (a new length: kernels compiled or specialised for it)."""
    import statistics

    import torch

    from xlstm_kit import XLSTMLanguageModel
    from xlstm_kit.generation.generate import _prefill

    model = XLSTMLanguageModel.from_pretrained(folder, dtype=dtype and getattr(torch, dtype), device=device)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    vocab = min(model.config.vocab_size, 50257)
    rows = []
    for compiled in (False, True):
        if compiled:
            model.compile_prefill(**compile_options)
        for n in lengths:
            prompt = [torch.randint(0, vocab, (n,), generator=gen).to(device)]
            times, first = [], None
            with torch.no_grad():
                for i in range(7):
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    _prefill(model, prompt)
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    if i == 0:
                        first = (time.perf_counter() - t) * 1e3
                    if i >= 2:
                        times.append((time.perf_counter() - t) * 1e3)
            rows.append({"case": "prefill", "compiled": compiled, "length": n, "ms": statistics.median(times),
                         "first_ms": first})
    return rows


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125M", help="a preset name (random weights) or a model folder")
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU, few requests (the tests)")
    ap.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--compile", action="store_true", help="serve (and generate) with model.compile_step() and compile_prefill()")
    ap.add_argument("--concurrency", default="1,8,32,128", help="levels, comma-separated")
    ap.add_argument("--requests-per-level", type=int, default=4, help="requests per level, x concurrency")
    ap.add_argument("--prompt-len", default="16,512", help="MIN,MAX prompt tokens")
    ap.add_argument("--output-len", default="64,256", help="MIN,MAX output tokens")
    ap.add_argument("--system-len", type=int, default=1000, help="shared system prompt of the prefix runs")
    ap.add_argument("--prefix-requests", type=int, default=32, help="requests of each prefix run (0: no prefix runs)")
    ap.add_argument("--max-batch", type=int, default=None, help="server slots (default: the largest level)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="the server's prompt tokens per pass (default: the server's own)")
    ap.add_argument("--clients", type=int, default=8, help="client processes of the load generator")
    ap.add_argument("--prefill-lens", default="16,128,200,512,777,1024",
                    help="prompt lengths of the prompt-read timings (eager and compiled); empty: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for serve_speed.{jsonl,md}")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.model, args.concurrency, args.requests_per_level = "tiny-random", "1,4", 2
        args.prompt_len, args.output_len, args.system_len = "4,24", "4,12", 200
        args.prefix_requests, args.clients, args.prefill_lens = 4, 1, "5,9"
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else None)
    levels = [int(c) for c in args.concurrency.split(",")]
    plen, olen = (tuple(int(x) for x in s.split(",")) for s in (args.prompt_len, args.output_len))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    common = ["--device", device, "--max-tokens", str(max(olen[1], 16)), "--max-queue", "100000",
              "--max-prompt-tokens", str(args.system_len + max(plen[1], PREFIX_QUESTION[1]) + 16)]
    if dtype:
        common += ["--dtype", {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]]
    if args.compile:
        common.append("--compile")
    if args.prefill_chunk:
        common += ["--prefill-chunk", str(args.prefill_chunk)]
    if device == "cpu":
        common += ["--threads", "1"]
    with tempfile.TemporaryDirectory(dir=out) as work:
        folder, vocab = model_folder(args.model, dtype, device, Path(work), args.quick)
        per_level = {c: workload(max(16, args.requests_per_level * c) if not args.quick else
                                 args.requests_per_level * c, min(vocab, 50257), plen, olen, args.seed + c)
                     for c in levels}
        rng = random.Random(args.seed)
        system = [rng.randrange(min(vocab, 50257)) for _ in range(args.system_len)]

        def prefix_runs(server, cache: bool):
            for c in (1, 8):
                jobs = workload(args.prefix_requests, min(vocab, 50257), PREFIX_QUESTION, (8, 8),
                                args.seed + 1000 + c, prefix=system)
                record({"case": "prefix", "cache": cache, "concurrency": c, "system_len": args.system_len,
                        **split_load(server.url, jobs, c, min(args.clients, c))})

        # random prompts that share no prefix with the measured ones, up to the prefix runs' length
        warm_lengths = [plen[0], plen[1], args.system_len + PREFIX_QUESTION[1]]
        # one server for the load levels and the prefix runs with the cache (the levels' prompts
        # share no prefix with the system prompt), one without the cache
        server = Server(folder, [*common, "--max-batch", str(args.max_batch or max(levels))])
        try:
            warm_up(server.url, min(vocab, 50257), warm_lengths, args.seed + 2000)
            record({"case": "server", "prompt_read_graphs": server_metric(server.url, "prompt_read_graphs")})
            for c in levels:
                record({"case": "load", "concurrency": c, **split_load(server.url, per_level[c], c, args.clients)})
            if args.prefix_requests:
                prefix_runs(server, cache=True)
        finally:
            server.stop()
        if args.prefix_requests:
            server = Server(folder, [*common, "--max-batch", str(args.max_batch or max(levels)),
                                     "--prefix-cache-mb", "0"])
            try:
                warm_up(server.url, min(vocab, 50257), warm_lengths, args.seed + 2000)
                prefix_runs(server, cache=False)
            finally:
                server.stop()
        ref_level = max([c for c in levels if c <= 32] or levels[:1])
        record({"case": "generate", "concurrency": ref_level,
                **generate_baseline(folder, per_level[ref_level], ref_level, device, dtype, args.compile)})
        if args.prefill_lens:
            # --quick: Dynamo without Inductor (a C++ compile per graph would take minutes)
            for row in prefill_latency(folder, [int(n) for n in args.prefill_lens.split(",")], device, dtype,
                                       **({"backend": "eager"} if args.quick else {})):
                record(row)
    meta = {"model": args.model, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dtype": dtype or "float32", "compile": args.compile, "date": time.strftime("%Y-%m-%d")}
    (out / "serve_speed.jsonl").write_text("".join(json.dumps({**meta, **r}) + "\n" for r in rows))
    (out / "serve_speed.md").write_text(report(rows, meta))
    print(report(rows, meta))
    return 0


def server_metric(url: str, name: str) -> float:
    """One value of the server's /metrics (xlstm_kit_<name>)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(rf"^xlstm_kit_{name} (\S+)$", text, re.M).group(1))


SPLIT = ("request_queue_seconds_sum", "request_prefill_seconds_sum", "time_to_first_token_seconds_sum",
         "time_to_first_token_seconds_count")


def split_load(url: str, jobs, concurrency: int, clients: int) -> dict:
    """`load`, and the server's own mean split of the time to first token over the same
    requests (waiting for a slot, reading the prompt; the rest of the client's is the HTTP side)."""
    before = [server_metric(url, m) for m in SPLIT]
    row = load(url, jobs, concurrency, clients)
    queue, read, ttft, n = (b - a for a, b in zip(before, [server_metric(url, m) for m in SPLIT]))
    if n > 0:
        row.update(srv_queue_ms=1e3 * queue / n, srv_read_ms=1e3 * read / n, srv_ttft_ms=1e3 * ttft / n)
    return row


def _f(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def _split(r: dict) -> str:
    """The server's mean wait for a slot and prompt read (ms), from its /metrics."""
    return f"{_f(r.get('srv_queue_ms'), 2)} / {_f(r.get('srv_read_ms'), 2)}"


def targets(rows: list[dict]) -> list[str]:
    """The benchmark's three targets as measured: the server's throughput as a share of
    `model.generate` (>= 80 % at concurrency 32), the time to first token's p99 at concurrency 8
    (or the largest level up to 8) over a lone request's p50 (<= 2x), and how many times lower
    the prefix runs' TTFT p50 is with the cache than without (>= 5x)."""
    load = {r["concurrency"]: r for r in rows if r["case"] == "load"}
    out = []
    gen = next((r for r in rows if r["case"] == "generate"), None)
    if gen and gen["concurrency"] in load:
        out.append(f"throughput at concurrency {gen['concurrency']}: "
                   f"{load[gen['concurrency']]['tok_s'] / gen['tok_s']:.0%} of `model.generate` (target >= 80 %)")
    busy = max((c for c in load if 1 < c <= 8), default=None)
    if 1 in load and busy is not None:
        lone = load[1]["ttft_p50_ms"]
        later = load[busy].get("ttft_p99_later_ms")
        out.append(f"TTFT p99 at concurrency {busy}: {load[busy]['ttft_p99_ms'] / lone:.1f}x a lone request's p50 "
                   f"(target <= 2x)" + (f"; {later / lone:.1f}x without the first {busy}, which arrive together"
                                        if later else ""))
    prefix = {(r["cache"], r["concurrency"]): r for r in rows if r["case"] == "prefix"}
    for c in sorted({c for _, c in prefix}):
        if (True, c) in prefix and (False, c) in prefix:
            out.append(f"prefix cache at concurrency {c}: TTFT p50 "
                       f"{prefix[False, c]['ttft_p50_ms'] / prefix[True, c]['ttft_p50_ms']:.1f}x lower with it "
                       f"(target >= 5x)")
    return out


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"# serve_speed: {meta['model']} on {meta['device']}, {meta['dtype']}"
             f"{', compiled' if meta['compile'] else ''} ({meta['date']})", "",
             "| concurrency | requests | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| server: queue / read ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["case"] == "load":
            lines.append(f"| {r['concurrency']} | {r['requests']} | {_f(r['tok_s'])} | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['ttft_p99_ms'])} | {_f(r['itl_p50_ms'], 2)} | {_f(r['itl_p99_ms'], 2)} | "
                         f"{_split(r)} |")
    srv = next((r for r in rows if r["case"] == "server"), None)
    if srv:
        n = int(srv["prompt_read_graphs"])
        lines += ["", f"Prompt reads: {f'{n} CUDA graphs' if n else 'eager (no CUDA graphs)'}."]
    gen = next((r for r in rows if r["case"] == "generate"), None)
    if gen:
        served = next((r for r in rows if r["case"] == "load" and r["concurrency"] == gen["concurrency"]), None)
        share = f"; the server at concurrency {gen['concurrency']}: {served['tok_s'] / gen['tok_s']:.0%} of it" \
            if served else ""
        lines += ["", f"`model.generate`, the same requests in batches of {gen['batch']}: {_f(gen['tok_s'])} requested "
                  f"tokens/s ({_f(gen['all_rows_tok_s'])} counting every row to its batch's longest){share}."]
    prefix = [r for r in rows if r["case"] == "prefix"]
    if prefix:
        lines += ["", f"Shared system prompt of {prefix[0]['system_len']} tokens:", "",
                  "| prefix cache | concurrency | TTFT p50 ms | TTFT p99 ms | tokens/s | server: queue / read ms |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in prefix:
            lines.append(f"| {'on' if r['cache'] else 'off'} | {r['concurrency']} | {_f(r['ttft_p50_ms'])} | "
                         f"{_f(r['ttft_p99_ms'])} | {_f(r['tok_s'])} | {_split(r)} |")
    measured = targets(rows)
    if measured:
        lines += ["", "Targets:", "", *(f"- {t}" for t in measured)]
    reads = [r for r in rows if r["case"] == "prefill"]
    if reads:
        lens = sorted({r["length"] for r in reads})
        lines += ["", "One prompt's read (`generate`'s prefill), median ms:", "",
                  "| prompt tokens | " + " | ".join(str(n) for n in lens) + " |",
                  "| --- |" + " --- |" * len(lens)]
        for compiled in (False, True):
            ms = {r["length"]: r["ms"] for r in reads if r["compiled"] == compiled}
            lines.append(f"| {'compiled' if compiled else 'eager'} | " + " | ".join(_f(ms.get(n), 1) for n in lens) + " |")
            first = {r["length"]: r["first_ms"] for r in reads if r["compiled"] == compiled}
            lines.append(f"| {'compiled' if compiled else 'eager'}, first call | "
                         + " | ".join(_f(first.get(n), 1) for n in lens) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
