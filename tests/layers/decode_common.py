"""What the tests of the three fused block steps (test_decode_step, test_slstm_decode_step,
test_large_decode_step) share: the error measure, the continuation of a parallel forward, and
the calls the fused steps must refuse."""
import importlib.util
import os

import pytest
import torch

needs_kernels = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

FALLBACKS = ["batch", "bias", "float64", "grad", "torch"]


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def steps_after_prefill_error(blk, layer, state_cls, d: int) -> float:
    """Prefill 7 tokens with the block's sequence path (float64), then 5 fused steps in float32:
    the relative error of the steps' outputs against one float64 forward over all 12."""
    x = torch.randn(1, 12, d, dtype=torch.float64)
    with torch.no_grad():
        full = blk.double()(x)
        _, st = blk(x[:, :7], return_state=True)
        blk.float()
        st = state_cls(*(s.float() for s in st))
        layer.backend = "triton"
        ys = []
        for t in range(7, 12):
            assert blk._fused_step(x[:, t].float(), st)
            y, st = blk.step(x[:, t].float(), st, inplace=True)
            ys.append(y)
    return rel_err(torch.stack(ys, 1), full[:, 7:])


def check_fallback(why: str, make_block, add_bias, make_state, d: int, step_in_float64: bool = True,
                   max_batch: int = 8) -> None:
    """A call the fused step refuses (`why` of FALLBACKS) takes the block's PyTorch step.
    make_block(backend) -> block; add_bias(block) gives it a projection bias; make_state(block, B).
    step_in_float64: the PyTorch step of a block forced to "triton" runs in float64 too.
    max_batch: the largest batch the fused step takes."""
    blk = make_block("torch" if why == "torch" else "triton")
    if why == "bias":
        add_bias(blk)
    B = max_batch + 1 if why == "batch" else 1
    st = make_state(blk, B)
    x = torch.randn(B, d)
    if why == "float64":
        blk.double()
        st, x = type(st)(*(s.double() for s in st)), x.double()
    with torch.set_grad_enabled(why == "grad"):
        assert not blk._fused_step(x, st)
        if why != "float64" or step_in_float64:
            y, _ = blk.step(x, st)
            assert y.shape == x.shape
