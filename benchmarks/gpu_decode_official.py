"""Generation speed of the official `xlstm.xlstm_large` model (xlstm 2.0.6 + mlstm_kernels 2.0.6)
at the size of our 125m preset, for issue 5's comparison with benchmarks/gpu_decode.py: tokens/s of
greedy generation (16-token prompt, then one step at a time with the model's recurrent state) at
batch 1 and 32, weights in bfloat16 and float32, for each official step kernel ("triton",
"native"). Eager only: the official model has no CUDA-graph path of its own, and wrapping its
Python step loop ourselves would measure our wrapper, not their package.

    PYTHONPATH=.:/tmp/site OUT=$OUT python3 benchmarks/gpu_decode_official.py
Each (kernel, weights) configuration runs in its own child process under a timeout, so a Triton
crash or hang is recorded (with the exception text) instead of ending the script. BUDGET_S
(default 85) caps the whole run. Writes $OUT/decode_official.json and prints a markdown table.
DRY=1 runs a tiny model on the CPU with the native kernels only, to smoke-test the script.

Size mapping (ours -> official): d_model 768 -> embedding_dim 768; 24 blocks -> num_blocks 24;
4 heads -> num_heads 4; vocab 50257 -> vocab_size 50257; our mLSTM inner width 2 x 768 split into
4 heads of 384 for q, k and v -> qk_dim_factor = v_dim_factor = 2.0 (so the step kernel updates
the same 4 x 384 x 384 state per block); ffn_proj_factor 1.3 (our sLSTM blocks' feed-forward).
Differences that remain: the official model has no sLSTM blocks (all 24 are mLSTM; ours are
xLSTM[7:1] with 3 sLSTM blocks), its q/k/v are dense maps of the embedding (ours: up-projection,
causal convolution, block-diagonal q/k/v), every official block has a feed-forward, and it uses
RMSNorm and soft-capped gates and logits. The parameter counts are printed side by side.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DRY = os.environ.get("DRY") == "1"
OUT = os.environ.get("OUT", ".")
BUDGET_S = float(os.environ.get("BUDGET_S", "85"))
PROMPT, N_NEW, N_WARM = 16, (8 if DRY else 128), 4
BATCHES = (1, 32)
N_AGREE = 32  # generated tokens of batch row 0 kept to compare kernels with each other


def official_config(kernel: str, dtype_name: str):
    from xlstm.xlstm_large.model import xLSTMLargeConfig

    dims = dict(embedding_dim=32, num_heads=2, num_blocks=2, vocab_size=64) if DRY else \
        dict(embedding_dim=768, num_heads=4, num_blocks=24, vocab_size=50257)
    kernels = dict(chunkwise_kernel="chunkwise--triton_limit_chunk", sequence_kernel="native_sequence__triton",
                   step_kernel="triton") if kernel == "triton" else \
        dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
             step_kernel="native")
    # the kernels autocast their inputs to this dtype only under torch.autocast, which we do not
    # enable; set it to the weights' dtype anyway so no path silently rounds float32 to bf16
    return xLSTMLargeConfig(**dims, qk_dim_factor=2.0, v_dim_factor=2.0, ffn_proj_factor=1.3,
                            mode="inference", return_last_states=True, inference_state_dtype="float32",
                            autocast_kernel_dtype=dtype_name, **kernels)


def ours_params() -> int:
    import torch
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

    cfg = XLSTMConfig(vocab_size=64, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1]) if DRY else \
        XLSTMConfig.from_name("125m")
    with torch.device("meta"):
        return sum(p.numel() for p in XLSTMLanguageModel(cfg).parameters())


def child(kernel: str, dtype_name: str) -> None:
    """One configuration: prints one `ROW {json}` line per batch size as soon as it is measured."""
    import torch
    from xlstm.xlstm_large.model import xLSTMLarge

    dev = "cpu" if DRY else "cuda"
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    cfg = official_config(kernel, dtype_name)
    with torch.device(dev):  # initialise on the GPU: 0.3 G parameters take seconds on the CPU
        model = xLSTMLarge(cfg).to(dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    for B in BATCHES:
        gen = torch.Generator().manual_seed(B)
        prompt = torch.randint(0, cfg.vocab_size, (B, PROMPT), generator=gen).to(dev)
        t0 = time.perf_counter()
        model.generate(prompt, N_WARM)  # compiles the kernels, allocates
        sync()
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens, _ = model.generate(prompt, N_NEW)  # 1 prefill forward + N_NEW - 1 steps
        sync()
        dt = time.perf_counter() - t0
        row = dict(kernel=kernel, dtype=dtype_name, B=B, tok_s=B * N_NEW / dt, s=dt, n_new=N_NEW,
                   warmup_s=warm_s, params=params, tokens0=tokens[0, :N_AGREE].tolist())
        print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    t_start = time.time()
    os.makedirs(OUT, exist_ok=True)
    configs = [("native", "float32")] if DRY else \
        [(k, d) for k in ("triton", "native") for d in ("bfloat16", "float32")]
    rows, failures = [], []
    for kernel, dtype_name in configs:
        left = BUDGET_S - (time.time() - t_start)
        if left < 8:
            failures.append(dict(kernel=kernel, dtype=dtype_name, error="skipped: out of time"))
            continue
        # a share of what is left, so that one hanging compile cannot eat the others' time
        limit = max(8.0, left / (len(configs) - configs.index((kernel, dtype_name)))) if kernel == "native" \
            else min(left - 4, max(30.0, left * 0.45))
        try:
            r = subprocess.run([sys.executable, __file__, "child", kernel, dtype_name],
                               capture_output=True, text=True, timeout=limit)
            out, err, status = r.stdout, r.stderr, (f"exit {r.returncode}" if r.returncode else "ok")
        except subprocess.TimeoutExpired as e:
            dec = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            out, err, status = dec(e.stdout), dec(e.stderr), f"timeout after {limit:.0f} s"
        got = [json.loads(l[4:]) for l in out.splitlines() if l.startswith("ROW ")]
        rows += got
        if status != "ok" or len(got) < len(BATCHES):
            # the last lines of stderr carry the exception (or the compiler's message)
            failures.append(dict(kernel=kernel, dtype=dtype_name, status=status,
                                 measured_B=[g["B"] for g in got], error=err.strip()[-1500:]))
    # agreement of greedy tokens between the two step kernels (same seed, same weights)
    for r in rows:
        other = next((o for o in rows if o["kernel"] != r["kernel"] and o["dtype"] == r["dtype"]
                      and o["B"] == r["B"]), None)
        r["agree_with_other_kernel"] = None if other is None else \
            sum(a == b for a, b in zip(r["tokens0"], other["tokens0"])) / len(r["tokens0"])
    cfg = official_config("native", "float32")
    mapping = dict(embedding_dim=cfg.embedding_dim, num_heads=cfg.num_heads, num_blocks=cfg.num_blocks,
                   vocab_size=cfg.vocab_size, qk_dim_factor=cfg.qk_dim_factor, v_dim_factor=cfg.v_dim_factor,
                   ffn_proj_factor=cfg.ffn_proj_factor, head_dim_qk=int(cfg.embedding_dim * cfg.qk_dim_factor) // cfg.num_heads,
                   head_dim_v=int(cfg.embedding_dim * cfg.v_dim_factor) // cfg.num_heads)
    import torch

    result = dict(device=torch.cuda.get_device_name() if not DRY else "cpu", torch=torch.__version__,
                  official_config=mapping, official_params=rows[0]["params"] if rows else None,
                  ours_params=ours_params(), prompt=PROMPT, n_new=N_NEW, eager_only=True,
                  rows=rows, failures=failures, seconds=time.time() - t_start)
    with open(os.path.join(OUT, "decode_official.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"official xLSTMLarge {mapping}; params {result['official_params']} (ours, same preset: {result['ours_params']})")
    print("| step kernel | weights | B | tok/s (eager) | ms/token | greedy tokens = other kernel |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        agree = "-" if r["agree_with_other_kernel"] is None else f"{r['agree_with_other_kernel']:.0%}"
        print(f"| {r['kernel']} | {r['dtype']} | {r['B']} | {r['tok_s']:.0f} | {1e3 * r['s'] / r['n_new']:.2f} | {agree} |")
    for f in failures:
        print(f"FAILED {f['kernel']} {f['dtype']}: {f.get('status', '')} {f['error'][-400:]}")
    print(f"total {result['seconds']:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2], sys.argv[3])
    else:
        main()
