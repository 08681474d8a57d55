"""Memory-lean fused pieces of the mLSTM and sLSTM layers, with hand-written backward passes.

Why: autograd of the plain formulas saves every intermediate, and under bf16 autocast with
float32 parameters several of them are float32 (the skip product, the head-wise norm). Each
piece here saves only its inputs (which other ops save anyway) and per-row statistics, and
recomputes the cheap elementwise intermediates in the backward. Activations stay in the
layer's activation dtype (the autocast dtype, else the input's); statistics and the arithmetic
inside run in float32 (float64 for float64 inputs). conv_silu, head_norm, gated_head_norm and
mlstm_output run Triton kernels (xlstm_kit/ops/blocks/triton.py), swiglu those of
ops/blocks/swiglu.py, where ops.backend chooses "triton".

- `norm_up(x, ln_w, eps, w, b)`: a block's LayerNorm and up-projection (mLSTM block, sLSTM
  feed-forward), saves x.
- `gelu_mul_linear(g, u, w, b)`: the gated feed-forward's GELU gate and down-projection, saves g, u.
- `swiglu(gu)`: the large block's SiLU(g) * u from gu = [g, u] (one GEMM's output), saves gu.
- `conv_silu(x, state, w, b, act)`: depthwise causal conv (+ SiLU), saves x (and the state).
- `head_norm(x, w, eps)`: head-wise LayerNorm times a per-channel scale, saves x and mean/rstd.
- `gated_head_norm(x, o, w, eps)`: the large block's sigmoid(o) · head_norm(x, w, eps), saves x,
  o (a view of a GEMM output kept anyway) and mean/rstd.
- `mlstm_output(h, x_conv, z, norm_w, skip, down_w, down_b, eps)`: the mLSTM layer's tail
  down((MultiHeadNorm(h) + skip * x_conv) * SiLU(z)), saves h, x_conv (or, given its
  `conv_inputs`, recomputes it), z and mean/rstd.
- `slstm_gates` (in fused_slstm.py): the sLSTM layer's head-wise gate maps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import XLSTMKitError
from ..ops._checks import compute_dtype
from ..ops.backend import choose_backend, kernel_module, on_device

# the kernel modules are imported with the layers: torch.compile traces a lookup in sys.modules
# but not importlib, so an import on the first call inside a trace is a graph break per block
for _op in ("swiglu", "conv_silu", "head_norm", "gated_head_norm", "mlstm_output"):
    kernel_module(_op)


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer's activations take: the autocast dtype where autocast is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b (batched) for a strided `out` view: eager BLAS writes the view directly, while
    torch.compile cannot trace a non-contiguous out= (there a copy, which Inductor fuses)."""
    if torch.compiler.is_compiling():
        out.copy_(torch.bmm(a, b))
    else:
        torch.bmm(a, b, out=out)


# ----------------------------------------------------------------------------- norm + up-projection
class _NormUpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, w, b, eps: float, dt):
        cd = compute_dtype(x, ln_w)
        d = x.shape[-1]
        xf = x.reshape(-1, d).to(cd)
        xn, mean, rstd = torch.native_layer_norm(xf, (d,), ln_w.to(cd), None, eps)
        xn = xn.to(dt)
        wd = w.to(dt)
        w1, w2 = wd.chunk(2, dim=0)
        b1, b2 = (None, None) if b is None else b.to(dt).chunk(2)
        ctx.save_for_backward(x, ln_w, wd, mean, rstd)
        ctx.eps, ctx.has_bias = eps, b is not None
        lead = x.shape[:-1]
        # two matmuls on the weight's halves give contiguous outputs
        return F.linear(xn, w1, b1).view(*lead, -1), F.linear(xn, w2, b2).view(*lead, -1)

    @staticmethod
    def backward(ctx, d1, d2):
        x, ln_w, wd, mean, rstd = ctx.saved_tensors
        cd = compute_dtype(x, ln_w)
        d = x.shape[-1]
        xf = x.reshape(-1, d).to(cd)
        lw = ln_w.to(cd)
        xn = torch.native_layer_norm(xf, (d,), lw, None, ctx.eps)[0].to(wd.dtype)
        w1, w2 = wd.chunk(2, dim=0)
        d1 = d1.reshape(xn.shape[0], -1).to(wd.dtype)
        d2 = d2.reshape(xn.shape[0], -1).to(wd.dtype)
        dxn = torch.addmm(d1 @ w1, d2, w2)
        dw = torch.cat([d1.t() @ xn, d2.t() @ xn]).to(ln_w.dtype)
        db = torch.cat([d1.sum(0), d2.sum(0)]).to(ln_w.dtype) if ctx.has_bias else None
        dx, dlw, _ = torch.ops.aten.native_layer_norm_backward(dxn.to(cd), xf, (d,), mean, rstd, lw, None,
                                                               [True, True, False])
        return dx.to(x.dtype).view(x.shape), dlw.to(ln_w.dtype), dw, db, None, None


def norm_up(x: torch.Tensor, ln_w: torch.Tensor, eps: float, w: torch.Tensor, b: torch.Tensor | None):
    """LayerNorm (weight ln_w [d], no bias) of x [..., d], then the two halves of the linear map
    w [2 n, d], b [2 n] | None -> two [..., n] in the activation dtype. Saves x (the block's
    input, saved anyway) and mean/rstd: the normalised input is recomputed in the backward for the
    weight gradient instead of being kept in bf16."""
    return _NormUpFn.apply(x, ln_w, w, b, eps, activation_dtype(x))


# ----------------------------------------------------------------------------- gated feed-forward
class _GeluMulLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, w, b):
        wd = w.to(g.dtype)
        ctx.save_for_backward(g, u, wd)
        ctx.grad_dtype, ctx.bias_dtype = w.dtype, None if b is None else b.dtype
        return F.linear(F.gelu(g) * u, wd, None if b is None else b.to(g.dtype))

    @staticmethod
    def backward(ctx, dy):
        g, u, wd = ctx.saved_tensors
        n = g.numel() // g.shape[-1]
        dy = dy.reshape(n, -1).to(wd.dtype)
        a = F.gelu(g)
        dp = (dy @ wd).view(g.shape)
        dw = (dy.t() @ (a * u).view(n, -1)).to(ctx.grad_dtype)
        db = None if ctx.bias_dtype is None else dy.sum(0).to(ctx.bias_dtype)
        return torch.ops.aten.gelu_backward(dp * u, g), dp * a, dw, db


def gelu_mul_linear(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(GELU(g) * u) @ wᵀ + b for g, u [..., F] (one dtype, the activation dtype), w [d, F],
    b [d] | None -> [..., d]. Saves g and u; GELU(g) * u is recomputed in the backward."""
    return _GeluMulLinearFn.apply(g, u, w, b)


# ----------------------------------------------------------------------------- SwiGLU activation
def _swiglu_fwd_torch(gu: torch.Tensor) -> torch.Tensor:
    """gu [N, 2F] -> SiLU(g) u [N, F] in gu's dtype: the twin of xlstm_kit::swiglu_fwd."""
    cd = compute_dtype(gu)
    g, u = gu.to(cd).chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)


def _swiglu_bwd_torch(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dgu [N, 2F] = [dy u SiLU'(g), dy SiLU(g)] in gu's dtype: the twin of xlstm_kit::swiglu_bwd
    (aten's silu_backward: in float32 and float64 the bits of autograd through F.silu(g) * u)."""
    cd = compute_dtype(gu)
    g, u = gu.to(cd).chunk(2, dim=-1)
    dy = dy.to(cd)
    return torch.cat([torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)], dim=-1).to(gu.dtype)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, kernels):
        ctx.save_for_backward(gu)
        ctx.kernels = kernels
        if kernels is None:
            return _swiglu_fwd_torch(gu)
        with on_device(gu):
            return kernels.swiglu_fwd(gu, kernels.config_key())

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        dy = dy.to(gu.dtype)
        if ctx.kernels is None:
            return _swiglu_bwd_torch(gu, dy), None
        return ctx.kernels.swiglu_bwd(gu, dy, ctx.kernels.config_key()), None


def swiglu(gu: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """SiLU(g) * u for gu = [g, u] [..., 2F] (g its first F columns, u its last F; rows of any
    stride, e.g. a column slice of a GEMM's output) -> [..., F] in gu's dtype, computed in float32
    (float64 for float64). Saves gu only (which the up-projection's output is anyway, where the
    plain formula also kept SiLU(g)); the backward recomputes SiLU(g) and returns a contiguous
    [..., 2F] gradient. One Triton kernel each way where ops.backend chooses "triton" (`backend` as
    for the sequence ops), instead of two elementwise kernels on strided halves."""
    two_f = gu.shape[-1]
    if two_f % 2:
        raise XLSTMKitError(f"swiglu takes gu [..., 2F] (g and u side by side), got last dim {two_f}")
    use = choose_backend("swiglu", backend, gu.device, inputs=(gu,), dtype=gu.dtype)
    kernels = kernel_module("swiglu") if use == "triton" else None
    # rows stay a view where the leading dims flatten without a copy (a GEMM's output does)
    y = _SwiGLUFn.apply(gu.reshape(-1, two_f), kernels)
    return y.view(*gu.shape[:-1], two_f // 2)


# ----------------------------------------------------------------------------- conv + SiLU
def _tap_mask(pos: torch.Tensor | None, s: int, dtype: torch.dtype) -> torch.Tensor | None:
    """[1, T-s, 1]: 1 where step t (t >= s) may read x[t - s], i.e. pos[t] >= s (same document)."""
    return None if pos is None else (pos[s:] >= s).to(dtype)[None, :, None]


def _conv(x: torch.Tensor, state: torch.Tensor | None, taps: torch.Tensor, b: torch.Tensor,
          pos: torch.Tensor | None = None) -> torch.Tensor:
    """y[:, t] = b + sum_j taps[j] * xp[:, t + j], xp = cat(state, x) [B, T+K-1, C] (state None:
    zeros), in taps' dtype. Shifted multiply-adds on x itself: no padded copy of the input.
    pos [T] (packed documents; state None): step t reads x[t - s] only where pos[t] >= s."""
    K = taps.shape[0]
    T = x.shape[1]
    y = torch.addcmul(b, x, taps[K - 1])
    for j in range(K - 1):
        s = K - 1 - j  # x[t - s] feeds y[t]
        if s < T:
            src = x[:, : T - s] if pos is None else x[:, : T - s] * _tap_mask(pos, s, taps.dtype)
            y[:, s:].addcmul_(src, taps[j])
        if state is not None:
            n = min(s, T)
            y[:, :n].addcmul_(state[:, K - 1 - s : K - 1 - s + n], taps[j])
    return y


def _conv_backward(dy: torch.Tensor, x: torch.Tensor, state: torch.Tensor | None, taps: torch.Tensor,
                   pos: torch.Tensor | None = None):
    """Gradients (dx, dstate | None, dtaps [K, C], db) of `_conv` for dy in taps' dtype (x and
    state may be narrower: the products promote, no converted copies)."""
    K = taps.shape[0]
    T = x.shape[1]
    dx = torch.mul(dy, taps[K - 1])
    rows = [(dy * x).sum(dim=(0, 1))]  # dtaps[K-1], then K-2 down to 0
    dstate = None if state is None else torch.zeros_like(state, dtype=dy.dtype)
    for j in range(K - 2, -1, -1):
        s = K - 1 - j
        row = None
        if s < T:
            d = dy[:, s:] if pos is None else dy[:, s:] * _tap_mask(pos, s, dy.dtype)
            dx[:, : T - s].addcmul_(d, taps[j])
            row = (d * x[:, : T - s]).sum(dim=(0, 1))
        if state is not None:
            n = min(s, T)
            prev = state[:, K - 1 - s : K - 1 - s + n]
            dstate[:, K - 1 - s : K - 1 - s + n].addcmul_(dy[:, :n], taps[j])
            part = (dy[:, :n] * prev).sum(dim=(0, 1))
            row = part if row is None else row + part
        rows.append(torch.zeros_like(taps[j]) if row is None else row)
    return dx, dstate, torch.stack(rows[::-1]), dy.sum(dim=(0, 1))


def _silu_grad(y: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(y)
    return s * (1 + y * (1 - s))


def _conv_act(x, state, w, b, act: bool, cd, pos=None):
    """(conv output in cd, pre-activation or None) from the layer's saved inputs."""
    y = _conv(x, state, w.t().to(cd), b.to(cd), pos)
    return (F.silu(y), y) if act else (y, None)


def _conv_act_backward(dout, x, state, w, b, y_pre, act: bool, cd, pos=None):
    """Gradients of _conv_act: (dx, dstate, dw [C, K], db) in cd."""
    dy = dout.to(cd) * _silu_grad(y_pre) if act else dout.to(cd)
    dx, dstate, dtaps, db = _conv_backward(dy, x, state, w.t().to(cd), pos)
    return dx, dstate, dtaps.t(), db


def _conv_fwd(kernels, x, state, w, b, act: bool, pos=None) -> torch.Tensor:
    """Conv (+ SiLU) output in x's dtype: the Triton op (kernels = ops.blocks.triton) or torch."""
    if kernels is not None:
        with on_device(x):
            return kernels.conv_fwd(x, state, w, b, act, kernels.conv_config_key(), pos)
    y, _ = _conv_act(x, state, w, b, act, compute_dtype(x, w), pos)
    return y.to(x.dtype)


def _conv_bwd(kernels, dout, x, state, w, b, act: bool, pos=None):
    """(dx, dstate | None, dw, db) in the dtypes of x, state, w, b."""
    if kernels is not None:
        dx, dstate, dw, db = kernels.conv_bwd(dout.contiguous(), x, state, w, b, act, kernels.conv_config_key(), pos)
        return dx, (None if state is None else dstate), dw, db
    cd = compute_dtype(x, w)
    y_pre = _conv(x, state, w.t().to(cd), b.to(cd), pos) if act else None
    dx, dstate, dw, db = _conv_act_backward(dout, x, state, w, b, y_pre, act, cd, pos)
    return dx.to(x.dtype), None if state is None else dstate.to(state.dtype), dw.to(w.dtype), db.to(b.dtype)


def _conv_kernels(x: torch.Tensor, backend: str | None):
    """The Triton kernel module where ops.backend chooses it for the convolution, else None."""
    use = choose_backend("conv_silu", backend, x.device, inputs=(x,), dtype=x.dtype)
    return kernel_module("conv_silu") if use == "triton" else None


class _ConvSiLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state, w, b, act: bool, kernels, pos):
        ctx.save_for_backward(x, state, w, b, pos)
        ctx.act, ctx.kernels = act, kernels
        return _conv_fwd(kernels, x, state, w, b, act, pos)

    @staticmethod
    def backward(ctx, dout):
        x, state, w, b, pos = ctx.saved_tensors
        return (*_conv_bwd(ctx.kernels, dout, x, state, w, b, ctx.act, pos), None, None, None)


def doc_positions(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Each step's position in its document, int32 [T], from cu_seqlens [N+1] (on its device,
    no host sync): what the convolutions mask their taps with."""
    t = torch.arange(T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seg = torch.searchsorted(cu_seqlens[1:], t, right=True)
    return (t - cu_seqlens[seg]).to(torch.int32)


def conv_inputs(x: torch.Tensor, state: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor,
                backend: str | None = None, pos: torch.Tensor | None = None):
    """(x, state, w, b, kernels, pos) as `conv_silu` takes them: what a reader of SiLU(conv(x))
    keeps to recompute it in its backward (`conv_recompute`) instead of saving it."""
    x = x.contiguous()
    if state is not None:
        if pos is not None:
            raise XLSTMKitError("the convolution over packed documents (pos) starts every document from zeros: "
                                "pass state=None")
        state = state.to(x.dtype).contiguous()
    return x, state, w.contiguous(), b, _conv_kernels(x, backend), pos


def conv_recompute(inputs) -> torch.Tensor:
    """SiLU(conv(x)) [B, T, C] from `conv_inputs` (no autograd graph)."""
    x, state, w, b, kernels, pos = inputs
    return _conv_fwd(kernels, x, state, w, b, True, pos)


def conv_silu(x: torch.Tensor, state: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor, act: bool = True,
              backend: str | None = None, pos: torch.Tensor | None = None):
    """SiLU (act=True) of the depthwise causal convolution of x [B, T, C] with w [C, K], b [C]
    and the K-1 inputs before x in `state` [B, K-1, C] (None: zeros) -> [B, T, C] in x's dtype.
    Saves x and the state; the backward recomputes the convolution. One Triton kernel each way
    where ops.backend chooses "triton" (`backend` as for the sequence ops). `pos` (int32 [T],
    `doc_positions`; state None): packed documents, no step reads an earlier document."""
    x, state, w, b, kernels, pos = conv_inputs(x, state, w, b, backend, pos)
    return _ConvSiLUFn.apply(x, state, w, b, act, kernels, pos)


def conv_state_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The last K-1 inputs of each packed document of x [1, T, C] (zeros before its start)
    [N, K-1, C]: the convolution's state after each document."""
    K1 = kernel_size - 1
    ends = cu_seqlens[1:, None]                                  # [N, 1]
    idx = ends - K1 + torch.arange(K1, device=x.device, dtype=ends.dtype)
    ok = idx >= cu_seqlens[:-1, None]
    rows = x[0, idx.clamp_min(0).flatten()].view(idx.shape[0], K1, x.shape[2])
    return rows * ok[..., None].to(x.dtype)


def conv_state(x: torch.Tensor, state: torch.Tensor | None, kernel_size: int) -> torch.Tensor:
    """The last K-1 inputs of cat(state, x) [B, K-1, C] (the convolution's state after x), in a
    tensor of its own: a view would keep all of x alive with the state (a whole prompt's
    activations) and give the state other strides than a step's (a recompilation of a
    compiled step)."""
    K1, T = kernel_size - 1, x.shape[1]
    if T >= K1:
        return x[:, T - K1 :].contiguous()
    if state is None:
        state = x.new_zeros(x.shape[0], K1, x.shape[2])
    return torch.cat([state.to(x.dtype), x], dim=1)[:, T:].contiguous()


# ----------------------------------------------------------------------------- head-wise norm
def _head_stats(x: torch.Tensor, D: int, eps: float, cd):
    """x [..., C] -> (x̂ [N, H, D] in cd, mean, rstd [N, H, 1])."""
    xf = x.reshape(-1, x.shape[-1] // D, D).to(cd)
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
    rstd = torch.rsqrt(var + eps)
    return (xf - mean) * rstd, mean, rstd


def _normed(x, mean, rstd, D: int, cd):
    return (x.reshape(-1, x.shape[-1] // D, D).to(cd) - mean) * rstd


def _head_norm_backward(dxhat: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Input gradient of x̂ = (x - mean) rstd per row from dx̂ (all [N, H, D])."""
    return rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))


def _head_norm_fwd_torch(x, w, eps: float):
    """x [N, H, D] -> (x̂ w in x's dtype, mean, rstd [N, H]): the twin of xlstm_kit::head_norm_fwd."""
    cd = compute_dtype(x, w)
    N, H, D = x.shape
    xhat, mean, rstd = _head_stats(x.view(N, -1), D, eps, cd)
    return (xhat * w.view(H, D).to(cd)).to(x.dtype), mean.view(N, H), rstd.view(N, H)


def _head_norm_bwd_torch(x, w, mean, rstd, dy):
    """(dx, dw): the twin of xlstm_kit::head_norm_bwd."""
    cd = compute_dtype(x, w)
    N, H, D = x.shape
    rstd = rstd.view(N, H, 1)
    xhat = _normed(x.view(N, -1), mean.view(N, H, 1), rstd, D, cd)
    dyf = dy.to(cd)
    dx = _head_norm_backward(dyf * w.view(H, D).to(cd), xhat, rstd)
    return dx.to(x.dtype), (dyf * xhat).sum(0).reshape(-1).to(w.dtype)


class _HeadNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps: float, kernels):
        if kernels is None:
            y, mean, rstd = _head_norm_fwd_torch(x, w, eps)
        else:
            with on_device(x):
                y, mean, rstd = kernels.head_norm_fwd(x, w, eps, kernels.config_key())
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.kernels is None:
            dx, dw = _head_norm_bwd_torch(x, w, mean, rstd, dy)
        else:
            dx, dw = ctx.kernels.head_norm_bwd(x, w, mean, rstd, dy, ctx.kernels.config_key())
        return dx, dw, None, None


def head_norm(x: torch.Tensor, w: torch.Tensor, eps: float, backend: str | None = None) -> torch.Tensor:
    """Each head's features of x [..., H, D] normalised on their own (LayerNorm without bias),
    times w [H * D] -> [..., H, D] in x's dtype; float32 statistics, saves x and mean/rstd. One
    Triton kernel each way where ops.backend chooses "triton" (`backend` as for the sequence ops)."""
    H, D = x.shape[-2:]
    x3 = x.reshape(-1, H, D).contiguous()
    use = choose_backend("head_norm", backend, x.device, inputs=(x,), dtype=x.dtype, head_dim=D)
    kernels = kernel_module("head_norm") if use == "triton" else None
    return _HeadNormFn.apply(x3, w, eps, kernels).view(x.shape)


# ----------------------------------------------------------------------------- gated head-wise norm
def _gated_norm_fwd_torch(x, o, w, eps: float):
    """x [N, H, D], o [N, H*D] -> (sigmoid(o) x̂ w [N, H*D] in o's dtype, mean, rstd [N, H]): the
    twin of xlstm_kit::gated_head_norm_fwd."""
    cd = compute_dtype(x, o, w)
    N, H, D = x.shape
    xhat, mean, rstd = _head_stats(x.view(N, -1), D, eps, cd)
    y = (xhat * w.view(H, D).to(cd)).view(N, -1) * torch.sigmoid(o.to(cd))
    return y.to(o.dtype), mean.view(N, H), rstd.view(N, H)


def _gated_norm_bwd_torch(x, o, w, mean, rstd, dy):
    """(dx, do, dw) from dy = ∂L/∂y [N, H*D]: the twin of xlstm_kit::gated_head_norm_bwd."""
    cd = compute_dtype(x, o, w)
    N, H, D = x.shape
    rstd = rstd.view(N, H, 1)
    xhat = _normed(x.view(N, -1), mean.view(N, H, 1), rstd, D, cd).view(N, -1)
    a = xhat * w.to(cd)
    so = torch.sigmoid(o.to(cd))
    dyf = dy.to(cd)
    da = dyf * so
    dx = _head_norm_backward((da * w.to(cd)).view(N, H, D), xhat.view(N, H, D), rstd)
    do = dyf * a * so * (1 - so)
    return dx.to(x.dtype), do.to(o.dtype), (da * xhat).sum(0).to(w.dtype)


class _GatedHeadNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, o, w, eps: float, kernels):
        if kernels is None:
            y, mean, rstd = _gated_norm_fwd_torch(x, o, w, eps)
        else:
            with on_device(x):
                y, mean, rstd = kernels.gated_head_norm_fwd(x, o, w, eps, kernels.config_key())
        # o is a view of the input GEMM's output, whose storage the mLSTM op keeps for q, k, v:
        # saving it costs no memory (sigmoid(o) and the norm's output, which autograd of the
        # plain formula kept, would)
        ctx.save_for_backward(x, o, w, mean, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x, o, w, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.kernels is None:
            dx, do, dw = _gated_norm_bwd_torch(x, o, w, mean, rstd, dy)
        else:
            dx, do, dw = ctx.kernels.gated_head_norm_bwd(x, o, w, mean, rstd, dy, ctx.kernels.config_key())
        return dx, do, dw, None, None


def gated_head_norm(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float,
                    backend: str | None = None) -> torch.Tensor:
    """sigmoid(o) · head_norm(x, w, eps) for x [..., H, D], o [..., H * D] (rows of any stride,
    e.g. a column slice of a GEMM's output), w [H * D] -> [..., H * D] in o's dtype, computed in
    float32 (float64 for float64) and rounded once. Saves x, o and mean/rstd [N, H]; the gradient
    of o comes back contiguous. One Triton kernel each way where ops.backend chooses "triton"
    (`backend` as for the sequence ops), instead of the norm's kernel plus a strided sigmoid and
    a multiply."""
    H, D = x.shape[-2:]
    if o.shape[-1] != H * D or o.shape[:-1] != x.shape[:-2]:
        raise XLSTMKitError(f"gated_head_norm takes o [..., H*D] beside x [..., H, D], got {tuple(o.shape)} "
                            f"and {tuple(x.shape)}")
    x3 = x.reshape(-1, H, D).contiguous()
    o2 = o.reshape(-1, H * D)  # a view for a GEMM's column slice: its leading dims merge
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    use = choose_backend("gated_head_norm", backend, x.device, inputs=(x, o), dtype=x.dtype, head_dim=D,
                         gate_dtype=o.dtype)
    kernels = kernel_module("gated_head_norm") if use == "triton" else None
    return _GatedHeadNormFn.apply(x3, o2, w, eps, kernels).view(o.shape)


# ----------------------------------------------------------------------------- mLSTM tail
def _tail_fwd_torch(h, x_conv, z, w, skip, eps: float):
    """u = (norm(h) w + skip x_conv) SiLU(z) [N, C] in x_conv's dtype, mean, rstd [N, H]: the
    PyTorch twin of xlstm_kit::mlstm_tail_fwd (ops/blocks/triton.py)."""
    cd = compute_dtype(h, w)
    N, H, D = h.shape
    hhat, mean, rstd = _head_stats(h.view(N, -1), D, eps, cd)
    a = torch.addcmul(hhat.view(N, -1) * w.to(cd), x_conv, skip.to(cd))
    u = (a * F.silu(z.to(cd))).to(x_conv.dtype)
    return u, mean.view(N, H), rstd.view(N, H)


def _tail_bwd_torch(h, x_conv, z, w, skip, mean, rstd, du):
    """(u, dh, dx_conv, dz, dw, dskip) from du = ∂L/∂u: the twin of xlstm_kit::mlstm_tail_bwd."""
    cd = compute_dtype(h, w)
    N, H, D = h.shape
    mean, rstd = mean.view(N, H, 1), rstd.view(N, H, 1)
    hhat = _normed(h.view(N, -1), mean, rstd, D, cd).view(N, -1)
    a = torch.addcmul(hhat * w.to(cd), x_conv, skip.to(cd))
    zf = z.to(cd)
    sz = torch.sigmoid(zf)
    silz = zf * sz
    du = du.to(cd)
    da = du * silz
    dz = du * a * sz * (1 + zf * (1 - sz))
    dh = _head_norm_backward((da * w.to(cd)).view(N, H, D), hhat.view(N, H, D), rstd)
    return ((a * silz).to(x_conv.dtype), dh.to(h.dtype), (da * skip.to(cd)).to(x_conv.dtype), dz.to(z.dtype),
            (da * hhat).sum(0).to(w.dtype), (da * x_conv).sum(0).to(skip.dtype))


class _MLSTMOutputFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, x_conv, z, norm_w, skip, down_w, down_b, eps: float, kernels, cx, cstate, cw, cb, ckern, cpos):
        if kernels is None:
            u, mean, rstd = _tail_fwd_torch(h, x_conv, z, norm_w, skip, eps)
        else:
            with on_device(h):
                u, mean, rstd = kernels.mlstm_tail_fwd(h, x_conv, z, norm_w, skip, eps, kernels.config_key())
        wd = down_w.to(x_conv.dtype)
        # with the conv's inputs (cx, ...) given, x_conv is recomputed in the backward, not kept
        keep = None if cx is not None else x_conv
        ctx.save_for_backward(h, keep, z, norm_w, skip, wd, mean, rstd, cx, cstate, cw, cb, cpos)
        ctx.kernels, ctx.ckern, ctx.bias_dtype = kernels, ckern, None if down_b is None else down_b.dtype
        return F.linear(u, wd, None if down_b is None else down_b.to(u.dtype))

    @staticmethod
    def backward(ctx, dy):
        h, x_conv, z, norm_w, skip, wd, mean, rstd, cx, cstate, cw, cb, cpos = ctx.saved_tensors
        if x_conv is None:
            x_conv = conv_recompute((cx, cstate, cw, cb, ctx.ckern, cpos)).view(z.shape)
        kernels = ctx.kernels
        dy = dy.reshape(h.shape[0], -1).to(wd.dtype)
        du = dy @ wd
        if kernels is None:
            u, dh, dx_conv, dz, d_norm_w, d_skip = _tail_bwd_torch(h, x_conv, z, norm_w, skip, mean, rstd, du)
        else:
            u, dh, dx_conv, dz, d_norm_w, d_skip = kernels.mlstm_tail_bwd(
                h, x_conv, z, norm_w, skip, mean, rstd, du, kernels.config_key())
        d_down_w = (dy.t() @ u).to(norm_w.dtype)
        d_down_b = None if ctx.bias_dtype is None else dy.sum(0).to(ctx.bias_dtype)
        return dh, dx_conv, dz, d_norm_w, d_skip, d_down_w, d_down_b, None, None, None, None, None, None, None, None


def mlstm_output(h: torch.Tensor, x_conv: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor,
                 skip: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor | None, eps: float,
                 backend: str | None = None, conv=None) -> torch.Tensor:
    """down((MultiHeadNorm(h) + skip * x_conv) * SiLU(z)) for h [N, H, D], x_conv and z [N, H*D]
    (one dtype, the activation dtype), norm_w and skip [H*D], down_w [d, H*D], down_b [d] | None
    -> [N, d] in x_conv's dtype. Saves h, x_conv, z, mean/rstd [N, H] and the cast down_w; the
    backward recomputes the rest. `conv`: x_conv's `conv_inputs`, to recompute x_conv in the
    backward instead of saving it. The elementwise part runs as one Triton kernel each way where
    ops.backend chooses "triton" (CUDA; `backend` as for the sequence ops)."""
    h, x_conv, z = h.contiguous(), x_conv.contiguous(), z.contiguous()
    use = choose_backend("mlstm_output", backend, h.device, inputs=(h, x_conv, z),
                         dtype=h.dtype, head_dim=h.shape[-1])
    kernels = kernel_module("mlstm_output") if use == "triton" else None
    return _MLSTMOutputFn.apply(h, x_conv, z, norm_w, skip, down_w, down_b, eps, kernels,
                                *(conv if conv is not None else (None,) * 6))
