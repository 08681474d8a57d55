"""Saved-activation bytes per token and op counts of one 125M mLSTM and sLSTM block, on the CPU
under bf16 autocast (exact: see xlstm_kit.bench.memory). Run from the repository root:

    PYTHONPATH=. python benchmarks/saved_bytes.py
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/saved_bytes.py --kernels   # op counts, Triton pieces

"op": what the sequence op (mlstm_chunkwise / slstm_recurrent) saves plus its inputs and outputs
(the Triton kernels save those); "rest": what the layer adds around it. Op counts: aten ops
(about one kernel each on a GPU, views excluded) of the forward outside the sequence op and of
the whole backward (the torch sequence op's backward included: compare before/after only).
"""
import torch

import xlstm_kit.layers.mlstm as mlstm_mod
import xlstm_kit.layers.slstm as slstm_mod
from xlstm_kit import XLSTMConfig
from xlstm_kit.bench.memory import op_counts, saved_bytes_per_token
from xlstm_kit.layers import MLSTMBlock, SLSTMBlock


def blocks():
    cfg = XLSTMConfig.from_name("125M")
    m = MLSTMBlock(cfg.d_model, cfg.mlstm_inner_dim, cfg.n_heads, conv_kernel_size=cfg.conv_kernel_size,
                   qkv_block_size=cfg.qkv_block_size, n_blocks=cfg.n_blocks, chunk_size=cfg.chunk_size)
    s = SLSTMBlock(cfg.d_model, cfg.slstm_num_heads, cfg.ffn_dim, conv_kernel_size=cfg.conv_kernel_size,
                   n_blocks=cfg.n_blocks)
    return cfg, {"mLSTM": (m, (mlstm_mod, "mlstm_chunkwise")), "sLSTM": (s, (slstm_mod, "slstm_recurrent"))}


def kernel_counts():
    """Op counts of the layers around their sequence ops, with the torch and the Triton pieces
    (on the CPU under TRITON_INTERPRET=1, float32, small widths: counts do not depend on widths).
    The sequence op is replaced by a one-op stub so that both directions count only the layer;
    a custom op counts as one."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| block (pieces), sequence op stubbed | autograd nodes | fwd ops | bwd ops |")
    print("|---|---|---|---|")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases = {
        "mLSTM": (MLSTMBlock(64, 128, 4, chunk_size=16, backend="triton"), (mlstm_mod, "mlstm_chunkwise")),
        "sLSTM": (SLSTMBlock(64, 4, 96, backend="triton"), (slstm_mod, "slstm_recurrent")),
    }
    stubs = {"mLSTM": lambda q, k, v, i, f, **_: (v * 1.0, None),
             "sLSTM": lambda gates, r, b, **_: (gates[:, :, 2] * 1.0, None)}
    for name, (block, (ns, attr)) in cases.items():
        real = getattr(ns, attr)
        setattr(ns, attr, stubs[name])
        try:
            for backend in ("torch", "triton"):
                block.layer.backend = backend
                c = op_counts(block.to(dev), torch.randn(2, 32, 64, device=dev, requires_grad=True))
                print(f"| {name} ({backend}) | {c['nodes']} | {c['fwd_ops']} | {c['bwd_ops']} |", flush=True)
        finally:
            setattr(ns, attr, real)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg, bl = blocks()
    print("| block | op B/token | rest B/token | total B/token | fixed bytes | autograd nodes | fwd ops | bwd ops |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (block, target) in bl.items():
        make = lambda n: torch.randn(2, n // 2, cfg.d_model, requires_grad=True)  # noqa: E731
        r = saved_bytes_per_token(make, block, tokens=(128, 256), autocast=torch.bfloat16, exclude=[target])
        c = op_counts(block, make(128), autocast=torch.bfloat16, exclude=[target])
        print(f"| {name} | {r['op'][0]:.0f} | {r['rest'][0]:.0f} | {r['total'][0]:.0f} | {r['total'][1]:.0f} "
              f"| {c['nodes']} | {c['fwd_ops']} | {c['bwd_ops']} |", flush=True)


if __name__ == "__main__":
    import sys
    kernel_counts() if "--kernels" in sys.argv else main()
