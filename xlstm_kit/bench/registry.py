"""The benchmark cases: what is timed, at which shapes, and how much work one call does.

A `Case` is one operation or model path, timed through the public API only (`xlstm_kit.ops.*`
with `backend=`, `XLSTMLanguageModel`), never through kernel-private names, so that the kernel
files can change underneath. Each case lists the shapes of the committed result tables
(`benchmarks/results/`) for the GPU and for the CPU, and one tiny shape for `--quick`.

Suites:
- ops: the sequence ops forward and forward+backward, the decode steps forward;
- model: one training step of the language model (forward, cross-entropy, backward, gradient
  clipping, AdamW), in tokens/s;
- generate: greedy generation with `xlstm_kit.generation.generate`, in tokens/s.

FLOP and byte counts are the work of the algorithm at that shape (not what a kernel happens to
execute), so the same count serves every implementation of a case, peers included: a rate is
then a speed, comparable across rows.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..errors import XLSTMKitError
from ..generation.generate import generate
from ..models import XLSTMConfig, XLSTMLanguageModel
from ..models.meta import shapes_only
from ..ops import dplr_step, mlstm_step, slstm_recurrent
from ..training import lm_loss, train_step
from .options import SUITES

Shape = dict  # name -> int (or list / str for model settings); JSON-serialisable


@dataclass(frozen=True)
class Env:
    """Where and how a case runs: device, the floating dtype of its inputs, the `backend=`
    passed to ops that take one (None: the library's choice)."""

    device: torch.device
    dtype: torch.dtype
    backend: str | None = None


@dataclass(frozen=True)
class Timed:
    """What a builder returns: `fwd()` runs the forward (or the whole step / generation),
    `fwbw()` forward and backward (None where there is no backward to time)."""

    fwd: Callable[[], Any]
    fwbw: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Work:
    """Work of one call of the timed mode (fwd+bwd when the case has a backward, else fwd):
    FLOPs, bytes that must cross the memory interface, tokens processed (None: not counted)."""

    flop: float | None = None
    bytes: float | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class Case:
    """One benchmark case.

    build(shape, env) -> Timed; work(shape, env) -> Work.
    gpu_shapes / cpu_shapes: the shapes timed on each device; quick_shape: a tiny shape that
    runs in well under a second on a CPU (`--quick`).
    takes_backend: whether the op accepts `backend=` (the others always run the PyTorch path).
    peers: names in `xlstm_kit.bench.peers.PEERS` timed against this case with `--peers`.
    """

    name: str
    suite: str
    doc: str
    build: Callable[[Shape, Env], Timed]
    work: Callable[[Shape, Env], Work]
    gpu_shapes: tuple[Shape, ...]
    cpu_shapes: tuple[Shape, ...]
    quick_shape: Shape
    takes_backend: bool = False
    peers: tuple[str, ...] = ()
    gpu_dtype: torch.dtype = torch.bfloat16

    def shapes(self, device: torch.device, quick: bool) -> tuple[Shape, ...]:
        if quick:
            return (self.quick_shape,)
        return self.gpu_shapes if device.type == "cuda" else self.cpu_shapes

    def dtype(self, device: torch.device) -> torch.dtype:
        """bfloat16 on the GPU (what the committed GPU tables time), float32 on the CPU."""
        return self.gpu_dtype if device.type == "cuda" else torch.float32


def shape_label(shape: Shape) -> str:
    """"B=8 T=2048 H=16 K=128 V=128"; lists as [1, 3]."""
    return " ".join(f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in shape.items())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _randn(*shape, env: Env, scale: float = 1.0, shift: float = 0.0, grad: bool = True,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    x = torch.randn(*shape, device=env.device) * scale + shift
    return x.to(dtype or env.dtype).requires_grad_(grad)


def _leaf(x: torch.Tensor, env: Env) -> torch.Tensor:
    """A fresh leaf in the run's dtype that requires grad (`.to` alone may return `x` itself)."""
    return x.detach().to(env.dtype).clone().requires_grad_()


def _backward_of(fwd: Callable[[], Any], grad_out: torch.Tensor) -> Callable[[], None]:
    """Forward then `backward(grad_out)` of the first output; gradients accumulate into `.grad`
    (the same harness for our ops and the peers, as in the committed GPU tables)."""

    def fwbw() -> None:
        out = fwd()
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.backward(grad_out)

    return fwbw


def _backend_kw(env: Env) -> dict:
    return {} if env.backend is None else {"backend": env.backend}


# ============================================================================================ mLSTM
def mlstm_inputs(shape: Shape, env: Env, layout: str = "BTHD"):
    """q, k, v, i, f (forget gates mostly open, f̃ ~ N(3, 1), as in trained models) and an
    upstream gradient for h, in our layout [B, T, H, D] or the peers' [B, H, T, D]."""
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    torch.manual_seed(0)
    seq = (lambda d: (B, T, H, d)) if layout == "BTHD" else (lambda d: (B, H, T, d))
    gate = (B, T, H) if layout == "BTHD" else (B, H, T)
    q, k, v = _randn(*seq(K), env=env), _randn(*seq(K), env=env), _randn(*seq(V), env=env)
    i, f = _randn(*gate, env=env), _randn(*gate, env=env, shift=3.0)
    dh = torch.randn(*seq(V), device=env.device).to(env.dtype)
    return (q, k, v, i, f), dh


def _mlstm_chunkwise_work(shape: Shape, env: Env, L: int = 64) -> Work:
    # matmul work of the chunkwise algorithm at chunk L (the causal half of each L x L block,
    # the inter-chunk read and update of the K x V state), backward as derived for the kernels
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    tok = B * T * H
    fwd_mac = tok * (L / 2 * (K + V) + 2 * K * V)
    bwd_mac = tok * (L / 2 * (3 * K + 2 * V) + 5 * K * V)
    # API traffic: read q, k, v, write h; backward reads q, k, v, h, δh, writes δq, δk, δv
    nbytes = tok * _size(env.dtype) * ((2 * K + 2 * V) + (2 * K + 3 * V) + (2 * K + V))
    return Work(flop=2 * (fwd_mac + bwd_mac), bytes=nbytes)


def _mlstm_parallel_work(shape: Shape, env: Env) -> Work:
    # causal T x T scores and their product with V per head; backward twice the forward
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    fwd = 2 * B * H * (T * T / 2) * (K + V)
    nbytes = B * T * H * _size(env.dtype) * ((2 * K + 2 * V) + (2 * K + 3 * V) + (2 * K + V))
    return Work(flop=3 * fwd, bytes=nbytes)


def _mlstm_recurrent_work(shape: Shape, env: Env) -> Work:
    # per step and head: the state update k vᵀ and the read Cᵀq (2·K·V FLOPs each)
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    fwd = B * T * H * 4 * K * V
    nbytes = B * T * H * _size(env.dtype) * ((2 * K + 2 * V) + (2 * K + 3 * V) + (2 * K + V))
    return Work(flop=3 * fwd, bytes=nbytes)


def _build_mlstm_seq(op_name: str, **op_kw):
    def build(shape: Shape, env: Env) -> Timed:
        op = getattr(ops, op_name)
        xs, dh = mlstm_inputs(shape, env)
        kw = dict(op_kw, **(_backend_kw(env) if op_name != "mlstm_parallel" else {}))
        fwd = lambda: op(*xs, **kw)  # noqa: E731
        return Timed(fwd, _backward_of(fwd, dh))

    return build


def _build_mlstm_step(shape: Shape, env: Env) -> Timed:
    B, H, K, V = (shape[x] for x in "BHKV")
    torch.manual_seed(0)
    q, k = _randn(B, H, K, env=env, grad=False), _randn(B, H, K, env=env, grad=False)
    v = _randn(B, H, V, env=env, grad=False)
    f32 = dict(env=env, grad=False, dtype=torch.float32)
    i, f = _randn(B, H, **f32), _randn(B, H, shift=3.0, **f32)
    state = (_randn(B, H, K, V, **f32), _randn(B, H, K, **f32), _randn(B, H, **f32))

    def fwd():
        with torch.no_grad():
            return mlstm_step(q, k, v, i, f, state)

    return Timed(fwd)


def _step_state_work(shape: Shape, env: Env) -> Work:
    # a decode step is bound by reading and writing the float32 K x V state of every head
    B, H, K, V = (shape[x] for x in "BHKV")
    return Work(flop=B * H * 4 * K * V, bytes=2 * B * H * K * V * 4)


# ============================================================================================ sLSTM
def slstm_inputs(shape: Shape, env: Env):
    """x_gates [B, T, 4, H, D], r [4, H, D, D] (scaled 1/√D), b [4, H, D], upstream gradient."""
    B, T, H, D = (shape[x] for x in "BTHD")
    torch.manual_seed(0)
    x = _randn(B, T, 4, H, D, env=env)
    r = _randn(4, H, D, D, env=env, scale=1 / math.sqrt(D))
    b = _randn(4, H, D, env=env, scale=0.1)
    dh = torch.randn(B, T, H, D, device=env.device).to(env.dtype)
    return (x, r, b), dh


def _build_slstm(shape: Shape, env: Env) -> Timed:
    xs, dh = slstm_inputs(shape, env)
    kw = _backend_kw(env)
    fwd = lambda: slstm_recurrent(*xs, **kw)  # noqa: E731
    return Timed(fwd, _backward_of(fwd, dh))


def _slstm_work(shape: Shape, env: Env) -> Work:
    # per step and head: h R_g for the four gates (4 · 2·D² FLOPs); backward twice the forward.
    # Bytes: x_gates, h in the forward; x_gates, h, δh in, δx_gates out in the backward
    B, T, H, D = (shape[x] for x in "BTHD")
    tok = B * T * H
    return Work(flop=3 * tok * 8 * D * D, bytes=tok * _size(env.dtype) * (5 * D + 10 * D))


# ============================================================================================ DPLR
# the "_f32gates" cases: the run's dtype for the activations, float32 gates (as models compute
# them; such mixed inputs used to fall back to the kernels' slow precision path)
F32_GATES = "_f32gates"


def _gate(x: torch.Tensor, env: Env, f32: bool) -> torch.Tensor:
    return x.detach().clone().requires_grad_() if f32 else _leaf(x, env)


def dplr_inputs(shape: Shape, env: Env, f32_gates: bool = False):
    """q, k (scaled 1/√K), v, a (unit rows), b = β a with β ∈ (0, 1) (so I − b aᵀ contracts),
    gk ∈ (−0.1, 0] (slow decay: long memory, the hard case for the state path); gk float32 with
    f32_gates."""
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    torch.manual_seed(0)
    dev = env.device
    q = _randn(B, T, H, K, env=env)
    k = _randn(B, T, H, K, env=env, scale=K ** -0.5)
    v = _randn(B, T, H, V, env=env)
    a_ = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1)
    b = _leaf(a_ * torch.rand(B, T, H, 1, device=dev), env)
    a = _leaf(a_, env)
    gk = _gate(torch.rand(B, T, H, K, device=dev) * -0.1, env, f32_gates)
    do = torch.randn(B, T, H, V, device=dev).to(env.dtype)
    return (q, k, v, a, b, gk), do


def kda_inputs(shape: Shape, env: Env, f32_gates: bool = False):
    """q, k (unit rows), v, g ∈ (−0.1, 0] per channel, beta ∈ (0, 1), upstream gradient; g and
    beta float32 with f32_gates."""
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    torch.manual_seed(0)
    dev = env.device
    q = _randn(B, T, H, K, env=env)
    k = _leaf(F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1), env)
    v = _randn(B, T, H, V, env=env)
    g = _gate(torch.rand(B, T, H, K, device=dev) * -0.1, env, f32_gates)
    beta = _gate(torch.rand(B, T, H, device=dev), env, f32_gates)
    do = torch.randn(B, T, H, V, device=dev).to(env.dtype)
    return (q, k, v, g, beta), do


def _build_delta(op: str, f32_gates: bool = False):
    def build(shape: Shape, env: Env) -> Timed:
        xs, do = (dplr_inputs if op == "dplr_chunkwise" else kda_inputs)(shape, env, f32_gates)
        kw = _backend_kw(env)
        fwd = lambda: getattr(ops, op)(*xs, **kw)  # noqa: E731
        return Timed(fwd, _backward_of(fwd, do))

    return build


def _dplr_work(n_k_inputs: int):
    def work(shape: Shape, env: Env) -> Work:
        # API bytes only: the FLOPs depend on the WY algorithm's choices (no single count).
        # Forward reads the K-wide inputs and v, writes o; backward reads them, o's gradient,
        # and writes every input's gradient
        B, T, H, K, V = (shape[x] for x in "BTHKV")
        per_tok = n_k_inputs * K + V
        return Work(bytes=B * T * H * _size(env.dtype) * ((per_tok + V) + (per_tok + V) + per_tok))

    return work


def _build_dplr_step(shape: Shape, env: Env) -> Timed:
    B, H, K, V = (shape[x] for x in "BHKV")
    torch.manual_seed(0)
    f32 = dict(env=env, grad=False, dtype=torch.float32)
    q, k, v = _randn(B, H, K, **f32), _randn(B, H, K, **f32), _randn(B, H, V, **f32)
    a = F.normalize(_randn(B, H, K, **f32), dim=-1)
    b = a * torch.rand(B, H, 1, device=env.device)
    gk = -torch.rand(B, H, K, device=env.device)
    state = _randn(B, H, K, V, **f32)

    def fwd():
        with torch.no_grad():
            return dplr_step(q, k, v, a, b, gk, state)

    return Timed(fwd)


# ============================================================================================ model
def model_config(shape: Shape):
    """The model of a model/generate shape: a preset by name (`preset`) with overrides, or an
    explicit small configuration (d_model, n_blocks, n_heads, slstm_at, vocab)."""
    if "preset" in shape:
        over = {"vocab_size": shape["vocab"]} if "vocab" in shape else {}
        return XLSTMConfig.from_name(shape["preset"], **over)
    return XLSTMConfig(vocab_size=shape["vocab"], d_model=shape["d_model"], n_blocks=shape["n_blocks"],
                       n_heads=shape["n_heads"], slstm_at=list(shape.get("slstm_at", [])),
                       context_length=max(256, shape.get("seq", 0), shape.get("prompt", 0) + shape.get("new", 0)))


def train_step_fn(model: torch.nn.Module, shape: Shape, env: Env) -> Callable[[], torch.Tensor]:
    """One training step of `model` (any module mapping ids [B, T] to logits [B, T, vocab])
    through the library's own `train_step`: forward under bf16 autocast on CUDA, float32
    cross-entropy, backward, clipping to norm 1, AdamW (fused on CUDA). Random token ids:
    throughput does not depend on the text."""
    B, T = shape["batch"], shape["seq"]
    vocab = model_config(shape).vocab_size
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (B, T + 1), generator=g).to(env.device)
    x, y = batch[:, :-1], batch[:, 1:]
    cuda = env.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    precision = "bf16" if cuda and env.dtype == torch.bfloat16 else "fp32"
    model.train()

    def step() -> torch.Tensor:
        return train_step(model, opt, [(x, y)], lm_loss, lr=1e-4, precision=precision, grad_clip=1.0).loss

    return step


def _build_train_step(shape: Shape, env: Env) -> Timed:
    torch.manual_seed(0)
    cfg = model_config(shape)
    if env.backend is not None:
        cfg = dataclasses.replace(cfg, backend=env.backend)
    model = XLSTMLanguageModel(cfg).to(env.device)
    return Timed(train_step_fn(model, shape, env))


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 per weight used in a multiply-add once per token (every
    parameter of 2+ dimensions but the embedding lookup; the head counts even when tied) plus
    the mLSTM mixing of the chunkwise form (full L x L score blocks, the state read and update),
    backward twice the forward."""
    with shapes_only():
        model = XLSTMLanguageModel(cfg)
    n_mm = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("embedding."))
    if cfg.tie_embeddings:
        n_mm += model.embedding.weight.numel()
    n_mlstm = cfg.block_types.count("m")
    if cfg.family == "large":
        k, v = cfg.qk_dim // cfg.n_heads, cfg.v_dim // cfg.n_heads
    else:
        k = v = cfg.mlstm_inner_dim // cfg.n_heads
    mixing = 3.0 * n_mlstm * cfg.n_heads * (2 * cfg.chunk_size * (k + v) + 4 * k * v)
    return 6.0 * n_mm + mixing


def _train_work(shape: Shape, env: Env) -> Work:
    tokens = shape["batch"] * shape["seq"]
    return Work(flop=tokens * flops_per_token(model_config(shape)), tokens=tokens)


def _build_generate(shape: Shape, env: Env) -> Timed:
    torch.manual_seed(0)
    cfg = model_config(shape)
    if env.backend is not None:
        cfg = dataclasses.replace(cfg, backend=env.backend)
    # the weights in the run's dtype (bf16 on the GPU): generation is memory-bound on them
    model = XLSTMLanguageModel(cfg).to(env.device, env.dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (shape["batch"], shape["prompt"]), generator=g).to(env.device)
    return Timed(lambda: generate(model, prompt, shape["new"], temperature=0))


def _generate_work(shape: Shape, env: Env) -> Work:
    return Work(tokens=shape["batch"] * shape["new"])


# ============================================================================================ cases
# Shapes of the committed tables (benchmarks/results/2026-11-30-*.md)
_MLSTM_GPU = tuple(dict(B=B, T=T, H=H, K=K, V=V) for B, T, H, K, V in
                   [(8, 2048, 16, 128, 128), (2, 8192, 16, 128, 128), (1, 32768, 8, 128, 128), (8, 2048, 8, 256, 512)])
_MLSTM_CPU = (dict(B=4, T=1024, H=4, K=64, V=64),)
# T a multiple of 64 (mlstm_kernels' native chunkwise needs it), K = V (SDPA needs it)
_TINY_SEQ = dict(B=1, T=64, H=2, K=16, V=16)
_DPLR_GPU = (dict(B=8, T=2048, H=16, K=128, V=128), dict(B=2, T=8192, H=16, K=128, V=128))
_DPLR_CPU = (dict(B=2, T=512, H=4, K=64, V=64),)
_TINY_MODEL = dict(vocab=64, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1])

CASES: tuple[Case, ...] = (
    Case("mlstm_chunkwise", "ops", "mLSTM chunkwise (chunk 64), the training path",
         _build_mlstm_seq("mlstm_chunkwise"), _mlstm_chunkwise_work, _MLSTM_GPU, _MLSTM_CPU, _TINY_SEQ,
         takes_backend=True,
         peers=("mlstm_kernels_limit_chunk", "mlstm_kernels_xl_chunk", "mlstm_kernels_native", "sdpa")),
    Case("mlstm_parallel", "ops", "mLSTM parallel (quadratic) form, PyTorch with hand-written backward",
         _build_mlstm_seq("mlstm_parallel"), _mlstm_parallel_work,
         (dict(B=8, T=2048, H=16, K=128, V=128),), (dict(B=4, T=256, H=4, K=64, V=64),), _TINY_SEQ,
         peers=("sdpa",)),
    Case("mlstm_recurrent", "ops", "mLSTM step-by-step loop (the reference; slow by design)",
         _build_mlstm_seq("mlstm_recurrent"), _mlstm_recurrent_work,
         (dict(B=8, T=256, H=4, K=128, V=128),), (dict(B=2, T=128, H=4, K=64, V=64),), _TINY_SEQ),
    Case("mlstm_step", "ops", "mLSTM decode step (bf16 q, k, v; float32 state), forward only",
         _build_mlstm_step, _step_state_work,
         (dict(B=1, H=4, K=384, V=384), dict(B=32, H=4, K=384, V=384)), (dict(B=1, H=4, K=64, V=64),),
         dict(B=2, H=2, K=8, V=16), peers=("mlstm_kernels_step",)),
    Case("slstm_recurrent", "ops", "sLSTM (fused recurrent kernel on the GPU)",
         _build_slstm, _slstm_work,
         (dict(B=16, T=1024, H=4, D=128), dict(B=16, T=1024, H=12, D=64)), (dict(B=8, T=256, H=4, D=32),),
         dict(B=2, T=12, H=2, D=8), takes_backend=True,
         peers=("flashrnn_triton_fused", "flashrnn_vanilla")),
    Case("dplr_chunkwise", "ops", "DPLR chunkwise (WY representation, chunk 64)",
         _build_delta("dplr_chunkwise"), _dplr_work(5), _DPLR_GPU, _DPLR_CPU, _TINY_SEQ, takes_backend=True,
         peers=("fla_dplr",)),
    Case("dplr_chunkwise" + F32_GATES, "ops", "DPLR chunkwise, float32 gk (q, k, v, a, b in the run's dtype)",
         _build_delta("dplr_chunkwise", True), _dplr_work(5), _DPLR_GPU, _DPLR_CPU, _TINY_SEQ,
         takes_backend=True, peers=("fla_dplr",)),
    Case("kda_chunkwise", "ops", "KDA chunkwise (DPLR with a = k, b = β k)",
         _build_delta("kda_chunkwise"), _dplr_work(3), _DPLR_GPU, _DPLR_CPU, _TINY_SEQ, takes_backend=True,
         peers=("fla_kda",)),
    Case("kda_chunkwise" + F32_GATES, "ops", "KDA chunkwise, float32 g and beta (q, k, v in the run's dtype)",
         _build_delta("kda_chunkwise", True), _dplr_work(3), _DPLR_GPU, _DPLR_CPU, _TINY_SEQ,
         takes_backend=True, peers=("fla_kda",)),
    Case("dplr_step", "ops", "DPLR decode step (float32), forward only",
         _build_dplr_step, _step_state_work,
         (dict(B=1, H=16, K=128, V=128), dict(B=64, H=16, K=128, V=128)), (dict(B=1, H=4, K=64, V=64),),
         dict(B=2, H=2, K=8, V=16)),
    Case("train_step", "model", "language-model training step: forward, loss, backward, clip, AdamW",
         _build_train_step, _train_work,
         (dict(preset="125m", vocab=50304, batch=16, seq=2048),),
         (dict(preset="tiny", batch=16, seq=128),
          dict(vocab=256, d_model=256, n_blocks=4, n_heads=4, slstm_at=[], batch=16, seq=256),
          dict(vocab=256, d_model=256, n_blocks=4, n_heads=4, slstm_at=[1], batch=16, seq=256)),
         dict(_TINY_MODEL, batch=2, seq=16), takes_backend=True, peers=("official_xlstm",)),
    Case("generate", "generate", "greedy generation: prompt read chunkwise, then one step per token",
         _build_generate, _generate_work,
         (dict(preset="125m", batch=1, prompt=16, new=256), dict(preset="125m", batch=32, prompt=16, new=256)),
         (dict(preset="tiny", batch=1, prompt=16, new=64), dict(preset="tiny", batch=8, prompt=16, new=64)),
         dict(_TINY_MODEL, batch=2, prompt=4, new=4), takes_backend=True, peers=("official_xlstm_large",)),
)


def cases(suite: str | None = None) -> list[Case]:
    """The registered cases of `suite` (None: all), in registry order."""
    if suite is not None and suite not in SUITES:
        raise XLSTMKitError(f"unknown benchmark suite {suite!r}; choose one of {', '.join(SUITES)}")
    return [c for c in CASES if suite is None or c.suite == suite]


def get(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise XLSTMKitError(f"unknown benchmark case {name!r}; choose one of {', '.join(c.name for c in CASES)}")
