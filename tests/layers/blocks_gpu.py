"""One 125M mLSTM / sLSTM block on the GPU: forward+backward time, peak memory and saved bytes
per token, fused (this branch) against the unfused reference path (tests/layers/reference_layers.py),
bf16 autocast, float32 parameters, B x T = 16 x 2048. It lives beside the reference it times
(benchmarks/ scripts import only xlstm_kit). Run from the repository root:

    PYTHONPATH=. OUT=$OUT python tests/layers/blocks_gpu.py [B T]

Writes one JSON line per case to $OUT/blocks_gpu.jsonl and prints them.
"""
import json
import os
import sys
import time

import torch

import xlstm_kit.layers.mlstm as mlstm_mod
import xlstm_kit.layers.slstm as slstm_mod
import tests.layers.reference_layers as reference
from tests.layers.reference_layers import mlstm_layer, slstm_layer
from xlstm_kit import XLSTMConfig
from xlstm_kit.bench.memory import saved_bytes
from xlstm_kit.layers import MLSTMBlock, SLSTMBlock


class Unfused(torch.nn.Module):
    """The same block's parameters through the unfused reference layer."""

    def __init__(self, block, ref):
        super().__init__()
        self.block, self.ref = block, ref

    def forward(self, x):
        b = self.block
        x = x + self.ref(b.layer, b.norm(x), backend=None)[0]
        return x + b.ffn(b.ffn_norm(x)) if hasattr(b, "ffn") else x


def timed(fn, iters=10):
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # a CPU smoke run: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(iters):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / iters


def main():
    B, T = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (16, 2048)
    cfg = XLSTMConfig.from_name("125M")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    blocks = {
        "mLSTM": (MLSTMBlock(cfg.d_model, cfg.mlstm_inner_dim, cfg.n_heads, n_blocks=24).to(dev), mlstm_layer,
                  (mlstm_mod, "mlstm_chunkwise")),
        "sLSTM": (SLSTMBlock(cfg.d_model, cfg.slstm_num_heads, cfg.ffn_dim, n_blocks=24).to(dev), slstm_layer,
                  (slstm_mod, "slstm_recurrent")),
    }
    out = open(os.path.join(os.environ.get("OUT", "."), "blocks_gpu.jsonl"), "a")
    x = torch.randn(B, T, cfg.d_model, device=dev, requires_grad=True)
    dy = torch.randn_like(x)
    for name, (block, ref, target) in blocks.items():
        ref_target = (reference, target[1])  # the reference module's own import of the op
        for variant, mod, tgt in (("fused", block, target), ("unfused", Unfused(block, ref), ref_target)):
            res = dict(block=name, variant=variant, B=B, T=T)
            try:
                def step():
                    with torch.autocast(dev, torch.bfloat16):
                        y = mod(x)
                    y.backward(dy)
                res["ms_fwd_bwd"] = timed(step)
                if dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    res["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                sb = saved_bytes(mod, x, autocast=torch.bfloat16, exclude=[tgt])
                res.update({f"saved_{k}_B_per_token": v / (B * T) for k, v in sb.items()})
            except Exception as e:  # one failing case does not end the call
                res["error"] = repr(e)[-800:]
            line = json.dumps(res)
            print(line, flush=True)
            out.write(line + "\n")


if __name__ == "__main__":
    main()
