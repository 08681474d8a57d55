"""A whole model's one-token steps on the fused block kernels (ops/blocks/decode.py and
slstm_decode.py) against its PyTorch steps in float64, under the Triton interpreter on CPU."""
import importlib.util

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.ops.blocks import decode, large_decode, slstm_decode

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
              pytest.mark.interpret]


FAMILIES = {
    "xlstm": dict(vocab_size=64, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], context_length=64),
    "large": dict(family="large", vocab_size=64, d_model=32, n_blocks=2, n_heads=2, qk_dim_factor=0.5,
                  context_length=64),
}


def _models(family):
    cfg = FAMILIES[family]
    ref = XLSTMLanguageModel(XLSTMConfig(**cfg, backend="torch"))
    with torch.no_grad():   # off the init (zero gate and recurrent weights, unit norms)
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    fused = XLSTMLanguageModel(XLSTMConfig(**cfg, backend="triton"))
    fused.load_state_dict(ref.state_dict())
    return ref.double().eval(), fused.eval()


@pytest.mark.parametrize("family,compiled", [("xlstm", False), ("xlstm", True), ("large", False)])
def test_model_steps_on_the_fused_blocks_equal_the_float64_steps(monkeypatch, family, compiled):
    ref, fused = _models(family)
    calls = []
    for mod, name in ((decode, "mlstm_block_step"), (slstm_decode, "slstm_block_step"),
                      (large_decode, "large_block_step")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    if compiled:
        fused.compile_step(backend="aot_eager")
    B = 2
    prompt = torch.randint(0, 64, (B, 6))
    with torch.no_grad():
        _, st = ref(prompt, return_state=True)
        st32 = [type(s)(*(t.float() for t in s)) for s in st]
        tokens = torch.randint(0, 64, (2, B))   # two steps: the second reads the first's in-place state
        for tok in tokens:
            want, st = ref.step(tok, st, check=False)
            got, st32 = fused.step(tok, st32, inplace=True, check=False)
            assert (got.double() - want).norm() / want.norm() < 1e-5
    if family == "large":
        assert calls == ["large_block_step"] * 4
    elif not compiled:   # (compiled, the calls happen at trace time)
        assert calls.count("mlstm_block_step") == 4 and calls.count("slstm_block_step") == 2
