"""Generation speed on one GPU against its memory-bandwidth floor, in one call.

    python3 benchmarks/generate_speed.py --wheels .whl --out $OUT [--only JOB,...] [--quick]

Every job runs in its own child process (a crash or out-of-memory costs its row only), bf16,
random weights, greedy:
- x125 (the `125M` preset, xLSTM[7:1]), l13b (`large-1.3B`), x7b (`xlstm-7b`): `model.generate`,
  one decode row as it comes (eager step, CUDA graph), the others after `model.compile_step()`
  ("decode compiled"; on CUDA at batch <= 8 with the fused block-step kernels of
  ops/blocks/), and an A/B: "decode compiled unfused", the compiled PyTorch block steps;
- off13b, off7b: the official `xlstm.xlstm_large.xLSTMLarge` at the sizes of l13b and x7b, its
  own `generate` (mode "inference", return_last_states=True, its default kernels);
- tf125, tf13b: the Llama-style Transformer of `xlstm_kit.experiments.baselines` at d 768 x 12 and
  d 2048 x 24 (16 heads), decoding with a static KV cache, its step compiled as ours and
  replayed as a CUDA graph.
Per job: prefill tokens/s at 32 x 2048 (no_grad forward returning the state, ours with the last
position's logits only as `generate` runs it / filling the cache; median of 3 after a warm-up); decode tokens/s at batch 1 and 32 after a 16-token prompt; decode tokens/s at batch 1
after prompts of 2,048 and 16,384 tokens; time to first token at 1 x 16,384. Decode tokens/s
come from two runs (each the median of 1-5 timed runs after a warm-up, as many as fit in
about 3 s) that differ only in the number of new tokens (n and n + 512): the difference excludes the prefill and one-off costs (graph capture); 512 tokens, not 128 as on 2026-12-02, so that the
prefill's run-to-run spread (a few ms at 16k tokens) stays near 1 % of the difference. The floor of a decode step
is (weight bytes + the batch's state or KV-cache bytes read per step) / the copy rate measured
in the same call; each decode row shows its fraction of the floor's tokens/s.

Writes DIR/generate_speed.jsonl and DIR/generate_speed.md (DIR = --out, else $OUT, else .).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from xlstm_kit.bench.scripts import child_env, run_child

JOBS = ("x125", "l13b", "x7b", "tf125", "tf13b", "off13b", "off7b")
VOCAB = 50304
EXTRA = 512  # the second run's additional new tokens (--extra)
CHUNK = 0  # --chunk-size: the mLSTM chunk length of ours (0: the preset's)


# ------------------------------------------------------------------------------ models
def _module_base():
    import torch

    return torch.nn.Module


class KVCacheTransformer(_module_base()):
    """Greedy decoding of a baselines.TransformerLM with a static KV cache [L, 2, B, H, Tmax, hd]:
    `prefill(tokens)` fills positions 0..T-1, `step(token, pos)` attends over the cache with a
    mask beyond `pos` (static shapes, so one CUDA graph serves every position).

    On CUDA the step is compiled as ours is by `compile_step` (fullgraph, static shapes,
    coordinate-descent tuning) and recorded once as a CUDA graph by hand, as `generate` records
    ours: mode="reduce-overhead" skipped its graphs here (the cache is an input it mutates)
    and decoded at 16 ms per token after a 2k prompt (2026-12-02)."""

    def __init__(self, lm, batch: int, max_len: int):
        import torch

        super().__init__()
        self.lm, self.B, self.T = lm, batch, max_len
        blk = lm.blocks[0].attn
        self.H, self.hd = blk.n_heads, lm.d_model // blk.n_heads
        w = lm.embedding.weight
        # a buffer: CUDA graphs keep its address, so the in-place cache writes stay in the graph
        self.register_buffer("cache", torch.zeros(len(lm.blocks), 2, batch, self.H, max_len, self.hd,
                                                  device=w.device, dtype=w.dtype))
        from xlstm_kit.experiments.baselines import rope_tables

        self.cos, self.sin = rope_tables(max_len, self.hd, w.device)
        self.graph = None
        self.compiled = torch.compile(self._step, fullgraph=True, dynamic=False,
                                      options={"coordinate_descent_tuning": True}) if w.is_cuda else self._step

    def step(self, token, pos):
        """token [B], pos [1] (the position written) -> logits [B, V]; a graph replay on CUDA
        (its logits buffer is overwritten by the next call)."""
        import torch

        if not token.is_cuda:
            return self._step(token, pos)
        if self.graph is None:
            self._tok, self._pos = token.clone(), pos.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles, and writes cache slots the decode overwrites
                for _ in range(2):
                    self.compiled(self._tok, self._pos)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._logits = self.compiled(self._tok, self._pos)
        self._tok.copy_(token)
        self._pos.copy_(pos)
        self.graph.replay()
        return self._logits

    def _attend(self, i, x, pos, causal_prefill):
        import torch.nn.functional as F

        from xlstm_kit.experiments.baselines import apply_rope

        blk = self.lm.blocks[i]
        B, T, C = x.shape
        q, k, v = blk.attn.qkv(blk.attn_norm(x)).view(B, T, 3, self.H, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = (self.cos[:T], self.sin[:T]) if causal_prefill else (self.cos[pos], self.sin[pos])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if causal_prefill:
            self.cache[i, 0, :, :, :T] = k
            self.cache[i, 1, :, :, :T] = v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            import torch

            self.cache[i, 0].index_copy_(2, pos, k)
            self.cache[i, 1].index_copy_(2, pos, v)
            mask = (torch.arange(self.T, device=x.device) <= pos)[None]  # [1, Tmax]
            y = F.scaled_dot_product_attention(q, self.cache[i, 0], self.cache[i, 1], attn_mask=mask)
        x = x + blk.attn.out(y.transpose(1, 2).reshape(B, T, C))
        return x + blk.ffn(blk.ffn_norm(x))

    def prefill(self, tokens):
        x = self.lm.embedding(tokens)
        for i in range(len(self.lm.blocks)):
            x = self._attend(i, x, None, True)
        return self.lm.lm_head(self.lm.norm(x[:, -1]))

    def _step(self, token, pos):
        x = self.lm.embedding(token)[:, None]
        for i in range(len(self.lm.blocks)):
            x = self._attend(i, x, pos, False)
        return self.lm.lm_head(self.lm.norm(x[:, 0]))

    def generate(self, prompt, n):
        import torch

        tok = self.prefill(prompt).argmax(-1)
        out = [tok]
        # the position lives on the device: a host tensor per token would be a synchronous copy
        pos = torch.full((1,), prompt.shape[1], device=prompt.device, dtype=torch.long)
        for _ in range(n - 1):
            tok = self.step(tok, pos).argmax(-1)
            out.append(tok)
            pos += 1
        return torch.stack(out, 1)


def build(job: str, quick: bool):
    """-> (generate(prompt [B, T], n) -> tokens, prefill(tokens), weight bytes, state bytes per row
    per step (a function of the context length), label)."""
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the official torch path is float32-only on a CPU
    V = 256 if quick else VOCAB
    torch.manual_seed(0)
    if job in ("x125", "l13b", "x7b"):
        from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
        from xlstm_kit.ops.backend import KERNEL_MODULES

        name = dict(x125="125M", l13b="large-1.3B", x7b="xlstm-7b")[job]
        over = dict(d_model=64, n_blocks=2) if quick else {}
        if CHUNK:
            over["chunk_size"] = CHUNK
        cfg = XLSTMConfig.from_name(name, vocab_size=V, **over)
        with dev:
            model = XLSTMLanguageModel(cfg).to(dt).eval()
        state = sum(t.numel() * t.element_size() for s in model.init_state(1, device=dev) for t in s)
        gen = lambda p, n: model.generate(p, n, temperature=0)  # noqa: E731
        gen.compile = lambda: model.compile_step(**({} if dev.type == "cuda" else dict(backend="aot_eager")))

        def unfuse():
            """The A/B of the fused block steps (ops/blocks/*decode.py): their kernel modules
            refuse every call, so the compiled step is the blocks' PyTorch step again."""
            import importlib

            for op in ("mlstm_block_step", "slstm_block_step", "large_block_step"):
                if op in KERNEL_MODULES:
                    importlib.import_module(KERNEL_MODULES[op]).supports = lambda op, **_: "unfused A/B"
            torch._dynamo.reset()   # the kernels' answer is a traced constant: trace anew
            gen.compile()
        gen.unfuse = unfuse

        def step_inputs(p):
            """(last tokens [B], the state after p) for profiling `model._step`."""
            _, st = model(p, return_state=True, logits_to_keep=1)
            return p[:, -1], st
        gen.step_inputs = step_inputs
        gen.step = lambda tok, st: model.step(tok, st, inplace=True, check=False)
        # prefill as generate runs it: the state and the last position's logits (the official
        # forward has no such option and computes every position's)
        return (gen, lambda p: model(p, return_state=True, logits_to_keep=1), _bytes(model), lambda ctx: state,
                f"xlstm_kit {name}" + (f", chunk {CHUNK}" if CHUNK else ""))
    if job in ("off13b", "off7b"):
        from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

        d, L, H = (2048, 24, 4) if job == "off13b" else (4096, 32, 8)
        if quick:
            d, L, H = 64, 2, 2
        cpu = {} if dev.type == "cuda" else dict(  # a --quick smoke run on a CPU: the package's torch kernels
            chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native", step_kernel="native")
        cfg = xLSTMLargeConfig(embedding_dim=d, num_heads=H, num_blocks=L, vocab_size=V, mode="inference",
                               return_last_states=True, **cpu)
        with dev:
            model = xLSTMLarge(cfg).to(dt).eval()
        k, v = int(d * cfg.qk_dim_factor) // H, int(d * cfg.v_dim_factor) // H
        state = L * H * (k * v + k + 1) * 4
        return (lambda p, n: model.generate(p, max_length=n)[0], lambda p: model(p), _bytes(model),
                lambda ctx: state, f"official xLSTMLarge d {d}, {L} blocks, {H} heads, {cfg.chunkwise_kernel}")
    from xlstm_kit.experiments.baselines import TransformerLM

    d, L, H = (768, 12, 12) if job == "tf125" else (2048, 24, 16)
    if quick:
        d, L, H = 64, 2, 2
    with dev:
        lm = TransformerLM(V, d, L, H).to(dt).eval()
    cache = {}

    def generate(p, n):
        # room for the longest run of a row (n0 + EXTRA new tokens): both runs of a decode row
        # share one cache, so one compilation and graph
        key = (p.shape[0], p.shape[1] + 2 * EXTRA)
        if key not in cache:  # one cache (and graph) per batch and prompt length
            cache.clear()
            cache[key] = KVCacheTransformer(lm, *key)
        return cache[key].generate(p, n)

    def prefill(p):
        return KVCacheTransformer(lm, p.shape[0], p.shape[1]).prefill(p)

    return (generate, prefill, _bytes(lm), lambda ctx: 2 * L * ctx * d * 2,
            f"TransformerLM d {d}, {L} layers, {H} heads, static KV cache, compiled step, CUDA graph")


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _time(fn, reps: int | None = 3) -> float:
    """Median seconds of fn() after one warm-up call; reps None: as many (1-5) as fit in about
    3 s by the warm-up's time (a decode run of a small model is short and noisy, of the 7B
    seconds long)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t = time.perf_counter()
    fn()
    sync()
    if reps is None:
        reps = max(1, min(5, int(3.0 / max(time.perf_counter() - t, 1e-3))))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_rate() -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.empty(1 << (29 if dev == "cuda" else 22), dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / _time(lambda: y.copy_(x), 5)


def child(job: str, quick: bool, kinds: list[str] | None = None) -> None:
    import torch

    if quick and not torch.cuda.is_available():
        # a smoke run, often beside other busy processes (the test suite's): a second thread made
        # each of the tiny models' many small ops wait for it at a barrier (on 2 cores with the
        # other one busy: 100 s for l13b and tf125 instead of 16), as serve_speed's --threads 1
        torch.set_num_threads(1)
    rate = copy_rate()
    generate, prefill, wbytes, sbytes, label = build(job, quick)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    toks = lambda b, t: torch.randint(0, 256 if quick else VOCAB, (b, t), device=dev, generator=g)  # noqa: E731
    base = dict(job=job, model=label, weight_gib=wbytes / 2**30, copy_tb_s=rate / 1e12,
                device=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    n0 = 8 if quick else 32
    extra = 8 if quick else EXTRA
    cases = [("prefill", 32, 2048), ("ttft", 1, 16384)]
    if hasattr(generate, "compile"):  # ours: the default (eager, CUDA graph) once, then the
        # decode rows after model.compile_step() (fused step kernels)
        cases += [("decode", 1, 16), ("compile", 0, 0)]
        kind = "decode compiled"
    else:
        kind = "decode"
    cases += [(kind, 1, 16), (kind, 32, 16), (kind, 1, 2048), (kind, 1, 16384)]
    if kinds and "profile" in kinds and hasattr(generate, "step"):  # only when asked: where the time goes
        cases += [("profile prefill", 32, 2048), ("profile decode", 1, 16)]
    if hasattr(generate, "unfuse"):  # the same step without the fused block kernels (batch <= 8)
        cases += [(kind, 4, 16), ("unfuse", 0, 0), ("decode compiled unfused", 1, 16),
                  ("decode compiled unfused", 4, 16)]
    if kinds:  # "decode" also selects "decode compiled" (and the compilation before it)
        cases = [c for c in cases if c[0].split()[0] in kinds or (c[0] == "compile" and {"decode", "profile"} & set(kinds))
                 or (c[0] == "unfuse" and "decode" in kinds)]
    if quick:
        cases = [(k, min(b, 2), min(t, 64)) for k, b, t in cases]
    # --quick is a smoke run of every case (a CPU's milliseconds of a tiny model mean nothing):
    # one timed call after the warm-up, where up to 5 filled about 3 s per run of a decode row
    reps, decode_reps = (1, 1) if quick else (3, None)
    for kind, B, T in cases:
        if kind in ("compile", "unfuse"):
            getattr(generate, kind)()
            continue
        row = dict(base, case=kind, batch=B, prompt=T)
        try:
            p = toks(B, T)
            with torch.no_grad():
                if kind.startswith("profile"):
                    row.update(kernels=_profile(generate, prefill, p, kind == "profile decode"))
                elif kind == "prefill":
                    s = _time(lambda: prefill(p), reps)
                    row.update(ms=s * 1e3, tok_s=B * T / s)
                elif kind == "ttft":
                    s = _time(lambda: generate(p, 1), reps)
                    row.update(ms=s * 1e3)
                else:  # "decode", "decode compiled"
                    a = _time(lambda: generate(p, n0), decode_reps)
                    b = _time(lambda: generate(p, n0 + extra), decode_reps)
                    step = (b - a) / extra
                    floor = (wbytes + B * sbytes(T + n0)) / rate
                    row.update(step_ms=step * 1e3, tok_s=B / step, floor_tok_s=B / floor, of_floor=floor / step)
        except Exception as e:  # noqa: BLE001 - reported in the row
            row["status"] = f"{type(e).__name__}: {str(e)[:200]}"
        if dev == "cuda":
            torch.cuda.empty_cache()
        print("RESULT " + json.dumps(row), flush=True)


def _profile(generate, prefill, p, decode: bool, top: int = 25) -> list:
    """The GPU kernels of one prefill of p, or of 16 compiled decode steps after it (not graphed,
    so each kernel shows): [[name, launches, total ms, % of the kernel time], ...], largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.no_grad():
        if decode:
            tok, state = generate.step_inputs(p)
            for _ in range(3):   # compile and warm up outside the profile
                generate.step(tok, state)
            sync()
        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            if decode:
                for _ in range(16):
                    _, state = generate.step(tok, state)
            else:
                prefill(p)
            sync()
    attr = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"   # (a CPU smoke run)
    rows = [(e.key, e.count, getattr(e, attr) / 1e3) for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(r[2] for r in rows) or 1.0
    rows.sort(key=lambda r: -r[2])
    return [[k[:90], n, round(ms, 3), round(100 * ms / total, 1)] for k, n, ms in rows[:top]]


def render(rows: list[dict]) -> str:
    lines = ["| job | model | case | batch x prompt | tokens/s | ms | floor tokens/s | of floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "kernels" in r:
            continue
        if "case" not in r:
            lines.append(f"| {r.get('job')} | {r.get('status', '')[:200]} | | | | | | |")
            continue
        ms = r.get("step_ms", r.get("ms"))
        cells = [r["job"], r["model"], r["case"], f"{r['batch']} x {r['prompt']}",
                 f"{r['tok_s']:,.0f}" if "tok_s" in r else "—", f"{ms:.3f}" if ms is not None else "—",
                 f"{r['floor_tok_s']:,.0f}" if "floor_tok_s" in r else "—",
                 f"{100 * r['of_floor']:.0f} %" if "of_floor" in r else r.get("status", "—")[:120]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    global EXTRA, CHUNK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--wheels", help="folder with the xlstm and mlstm-kernels wheels (official rows)")
    ap.add_argument("--only", help="comma-separated jobs of " + ",".join(JOBS))
    ap.add_argument("--quick", action="store_true", help="tiny models and shapes (a smoke run)")
    ap.add_argument("--cases", help="comma-separated kinds to run of prefill,ttft,decode,profile (default: all "
                                    "but profile: the kernels of one prefill and of 16 decode steps, ours only)")
    ap.add_argument("--limit-s", type=float, default=240, help="time limit per job")
    ap.add_argument("--extra", type=int, default=EXTRA,
                    help="new tokens by which a decode row's two runs differ (the official 7B decodes at ~30 "
                         "tokens/s: 128 keeps its rows inside a call)")
    ap.add_argument("--chunk-size", type=int, default=0,
                    help="the mLSTM chunk length of our models (default: the preset's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        EXTRA, CHUNK = a.extra, a.chunk_size
        child(a.child, a.quick, a.cases.split(",") if a.cases else None)
        return 0
    os.makedirs(a.out, exist_ok=True)
    env = child_env(a.wheels)
    rows = []
    for job in (a.only.split(",") if a.only else JOBS):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", job] + (["--quick"] if a.quick else []) \
            + (["--cases", a.cases] if a.cases else []) + ["--extra", str(a.extra), "--chunk-size", str(a.chunk_size)]
        res = run_child(cmd, a.limit_s, env)
        rows += res["results"] or [dict(job=job, status=f"failed (rc {res['rc']}): {res['stderr'][-300:]}")]
        if res["rc"] != 0 and res["results"]:
            rows.append(dict(job=job, status=f"ended early (rc {res['rc']}): {res['stderr'][-200:]}"))
    with open(os.path.join(a.out, "generate_speed.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    profiles = [r for r in rows if "kernels" in r]
    if profiles:
        with open(os.path.join(a.out, "generate_profile.md"), "w") as f:
            for r in profiles:
                f.write(f"## {r['model']}: {r['case']} {r['batch']} x {r['prompt']}\n\n| kernel | launches | ms | % |\n"
                        "|---|---|---|---|\n" + "".join(f"| `{k}` | {n} | {ms} | {pc} |\n" for k, n, ms, pc in r["kernels"])
                        + "\n")
    table = render(rows)
    with open(os.path.join(a.out, "generate_speed.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
