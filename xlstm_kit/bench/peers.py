"""Other implementations timed against our cases: torch SDPA, mlstm_kernels (TFLA chunkwise
kernels, native chunkwise, step kernel), flash-linear-attention (DPLR, KDA), flashrnn (sLSTM)
and the official `xlstm` package (training step, `xlstm_large` generation).

Each peer is imported only when its package is installed, and each measurement runs in its own
child process (`python -m xlstm_kit.bench.peers PEER CASE SHAPE DEVICE DTYPE QUICK`) under a
time limit: a peer that crashes its compiler, hangs or runs out of memory costs its own row
only. The child builds the same inputs as our case (same shapes, same value ranges, the peer's
layout), times them with the same `timing.measure_case` and prints one `RESULT {json}` line.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..io.compat import config_to_official
from . import registry, timing
from .registry import Env, Shape, Timed


@dataclass(frozen=True)
class Peer:
    """label: how the table names it; package: the import name that must be installed; pip: what
    to install; devices: the device types it is timed on (GPU kernels on "cuda"; a PyTorch
    reference that only makes a CPU baseline on "cpu"); build(case, shape, env) -> Timed, or
    raises `Skip` when the peer cannot run this shape."""

    name: str
    label: str
    package: str
    pip: str
    build: Callable[[str, Shape, Env], Timed]
    devices: tuple[str, ...] = ("cuda", "cpu")

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


class Skip(Exception):
    """The peer does not support this shape (reported in its row, not an error)."""


def _rnd(*shape, env: Env, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, device=env.device) * scale + shift).to(env.dtype).requires_grad_()


def _fwbw(fwd, grad_out):
    def run():
        out = fwd()
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.backward(grad_out)

    return run


# ------------------------------------------------------------------------------ torch SDPA
def _sdpa(case: str, shape: Shape, env: Env) -> Timed:
    """Causal softmax attention through torch's scaled_dot_product_attention (FlashAttention on
    the GPU): the quadratic baseline every linear-time op should beat at long T."""
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    if K != V:
        raise Skip("K ≠ V")
    torch.manual_seed(0)
    q, k, v = (_rnd(B, H, T, K, env=env) for _ in range(3))
    do = torch.randn(B, H, T, V, device=env.device).to(env.dtype)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return Timed(fwd, _fwbw(fwd, do))


# ------------------------------------------------------------------------------ mlstm_kernels
def _mlstm_kernels_chunk(kernel: str):
    def build(case: str, shape: Shape, env: Env) -> Timed:
        from mlstm_kernels.torch import get_mlstm_kernel

        fn = get_mlstm_kernel(f"chunkwise--{kernel}")
        (q, k, v, i, f), dh = registry.mlstm_inputs(shape, env, layout="BHTD")
        kw = dict(autocast_kernel_dtype=env.dtype) if kernel == "triton_xl_chunk" else {}
        fwd = lambda: fn(q=q, k=k, v=v, i=i, f=f, **kw)  # noqa: E731
        return Timed(fwd, _fwbw(fwd, dh))

    return build


def _mlstm_kernels_native(case: str, shape: Shape, env: Env) -> Timed:
    from mlstm_kernels.torch.chunkwise.native import fwbw

    (q, k, v, i, f), dh = registry.mlstm_inputs(shape, env, layout="BHTD")
    fwd = lambda: fwbw.mlstm_chunkwise__native_custbw(q, k, v, i, f, chunk_size=64)  # noqa: E731
    return Timed(fwd, _fwbw(fwd, dh))


def _mlstm_kernels_step(case: str, shape: Shape, env: Env) -> Timed:
    from mlstm_kernels.torch import get_mlstm_step_kernel

    step = get_mlstm_step_kernel("triton")
    B, H, K, V = (shape[x] for x in "BHKV")
    torch.manual_seed(0)
    d = env.device
    q, k = torch.randn(B, H, K, device=d).to(env.dtype), torch.randn(B, H, K, device=d).to(env.dtype)
    v = torch.randn(B, H, V, device=d).to(env.dtype)
    i, f = torch.randn(B, H, 1, device=d), torch.randn(B, H, 1, device=d) + 3.0
    c, n, m = torch.randn(B, H, K, V, device=d), torch.randn(B, H, K, device=d), torch.randn(B, H, 1, device=d)

    def fwd():
        with torch.no_grad():
            return step(q=q, k=k, v=v, i=i, f=f, c=c, n=n, m=m)

    return Timed(fwd)


# ------------------------------------------------------------------------------ flashrnn
def _flashrnn(backend: str):
    def build(case: str, shape: Shape, env: Env) -> Timed:
        from flashrnn import flashrnn

        (x, r, b), dh = registry.slstm_inputs(shape, env)  # flashrnn takes our layout
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(env.dtype, "float32")

        def fwd():
            h, _ = flashrnn(x, r, b, function="slstm", backend=backend, dtype=dtype)
            return h[0] if h.dim() == 5 else h  # its h carries the state index first

        return Timed(fwd, _fwbw(fwd, dh))

    return build


# ------------------------------------------------------------------------------ fla
def _fla_dplr(case: str, shape: Shape, env: Env) -> Timed:
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

    B, T, H, K, V = (shape[x] for x in "BTHKV")
    torch.manual_seed(0)
    d = env.device
    q, v = _rnd(B, T, H, K, env=env), _rnd(B, T, H, V, env=env)
    k = _rnd(B, T, H, K, env=env, scale=K ** -0.5)
    # fla's additive convention (its a = −α⊙b, its b = a of ours): the same contraction as our inputs
    unit = F.normalize(torch.randn(B, T, H, K, device=d), dim=-1)
    leaf = lambda x: x.detach().to(env.dtype).clone().requires_grad_()  # noqa: E731
    a, b = leaf(-unit), leaf(unit * torch.rand(B, T, H, 1, device=d))
    gk = torch.rand(B, T, H, K, device=d) * -0.1
    gk = gk.requires_grad_() if case.endswith(registry.F32_GATES) else leaf(gk)
    do = torch.randn(B, T, H, V, device=d).to(env.dtype)
    fwd = lambda: chunk_dplr_delta_rule(q, k, v, a, b, gk)  # noqa: E731
    return Timed(fwd, _fwbw(fwd, do))


def _fla_kda(case: str, shape: Shape, env: Env) -> Timed:
    from fla.ops.kda import chunk_kda

    xs, do = registry.kda_inputs(shape, env, case.endswith(registry.F32_GATES))  # same as ours
    fwd = lambda: chunk_kda(*xs)  # noqa: E731
    return Timed(fwd, _fwbw(fwd, do))


# ------------------------------------------------------------------------------ official xlstm
def _official_xlstm(case: str, shape: Shape, env: Env) -> Timed:
    """The official xLSTMLMModel of the same configuration (sLSTM backend "vanilla": its CUDA
    backend compiles C++ at first use), trained by the same step function."""
    import xlstm

    torch.manual_seed(0)
    official = xlstm.xLSTMLMModel(config_to_official(registry.model_config(shape), slstm_backend="vanilla"))
    official.reset_parameters()
    return Timed(registry.train_step_fn(official.to(env.device), shape, env))


def _official_xlstm_large(case: str, shape: Shape, env: Env) -> Timed:
    """The official xLSTM-7B architecture (`xlstm.xlstm_large`) at our preset's width, depth,
    heads and head sizes (qk/v factor = our mLSTM up-projection), greedy generation. Its blocks
    differ (all mLSTM, dense q/k/v, a feed-forward in every block): same state size per step,
    not the same model."""
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    cfg = registry.model_config(shape)
    triton = env.device.type == "cuda"
    kernels = dict(chunkwise_kernel="chunkwise--triton_limit_chunk", sequence_kernel="native_sequence__triton",
                   step_kernel="triton") if triton else \
        dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
             step_kernel="native")
    dtype_name = str(env.dtype).split(".")[-1]
    ocfg = xLSTMLargeConfig(embedding_dim=cfg.d_model, num_heads=cfg.n_heads, num_blocks=cfg.n_blocks,
                            vocab_size=cfg.vocab_size, qk_dim_factor=cfg.mlstm_proj_factor,
                            v_dim_factor=cfg.mlstm_proj_factor, ffn_proj_factor=cfg.ffn_proj_factor,
                            mode="inference", return_last_states=True, inference_state_dtype="float32",
                            autocast_kernel_dtype=dtype_name, **kernels)
    torch.manual_seed(0)
    with torch.device(env.device):
        model = xLSTMLarge(ocfg).to(dtype=env.dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (shape["batch"], shape["prompt"]), generator=g).to(env.device)

    def fwd():
        with torch.no_grad():
            return model.generate(prompt, shape["new"])

    return Timed(fwd)


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("sdpa", "torch SDPA causal", "torch", "torch", _sdpa),
    Peer("mlstm_kernels_limit_chunk", "mlstm_kernels triton_limit_chunk", "mlstm_kernels", "mlstm-kernels",
         _mlstm_kernels_chunk("triton_limit_chunk"), devices=("cuda",)),
    Peer("mlstm_kernels_xl_chunk", "mlstm_kernels triton_xl_chunk", "mlstm_kernels", "mlstm-kernels",
         _mlstm_kernels_chunk("triton_xl_chunk"), devices=("cuda",)),
    Peer("mlstm_kernels_native", "mlstm_kernels native_custbw (chunk 64)", "mlstm_kernels", "mlstm-kernels",
         _mlstm_kernels_native, devices=("cpu",)),
    Peer("mlstm_kernels_step", "mlstm_kernels triton step", "mlstm_kernels", "mlstm-kernels",
         _mlstm_kernels_step, devices=("cuda",)),
    Peer("flashrnn_triton_fused", "flashrnn triton_fused", "flashrnn", "flashrnn", _flashrnn("triton_fused"),
         devices=("cuda",)),
    Peer("flashrnn_vanilla", "flashrnn vanilla", "flashrnn", "flashrnn", _flashrnn("vanilla"), devices=("cuda",)),
    Peer("fla_dplr", "fla chunk_dplr_delta_rule", "fla", "flash-linear-attention", _fla_dplr, devices=("cuda",)),
    Peer("fla_kda", "fla chunk_kda", "fla", "flash-linear-attention", _fla_kda, devices=("cuda",)),
    Peer("official_xlstm", "official xlstm (sLSTM vanilla)", "xlstm", "xlstm", _official_xlstm),
    Peer("official_xlstm_large", "official xlstm_large", "xlstm", "xlstm", _official_xlstm_large),
)}


def applicable(case: registry.Case, device: torch.device) -> list[Peer]:
    """The peers of `case` that are timed on `device`'s type."""
    return [PEERS[n] for n in case.peers if device.type in PEERS[n].devices]


def time_peer(peer: Peer, case: registry.Case, shape: Shape, env: Env, quick: bool,
              timeout_s: float) -> dict:
    """Time one peer at one shape in a child process. Returns the measurement, or
    {"status": reason} when it was not measured (not installed, unsupported, error, timeout)."""
    if not peer.installed():
        return {"status": f"not installed (pip install {peer.pip})"}
    dtype = str(env.dtype).split(".")[-1]
    cmd = [sys.executable, "-m", "xlstm_kit.bench.peers", peer.name, case.name, json.dumps(shape),
           str(env.device), dtype, "1" if quick else "0"]
    # the child imports the same xlstm_kit as this process, wherever that comes from
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout_s:.0f} s"}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    err = " ".join((r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1:])
    return {"status": f"error: {err[:200]}"}


def _child(peer_name: str, case_name: str, shape_json: str, device: str, dtype: str, quick: str) -> None:
    peer, case = PEERS[peer_name], registry.get(case_name)
    env = Env(torch.device(device), getattr(torch, dtype))
    if env.device.type == "cuda" and env.device.index is not None:
        torch.cuda.set_device(env.device)  # Triton launches on the current device, not the tensors'
    try:
        timed = peer.build(case.name, json.loads(shape_json), env)
    except Skip as e:
        print("RESULT " + json.dumps({"status": f"skipped: {e}"}), flush=True)
        return
    budget = timing.QUICK if quick == "1" else timing.Budget()
    res = timing.measure_case(timed.fwd, timed.fwbw, env.device, budget, flush_cache=case.suite == "ops")
    res = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in res.items()}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:7])
