"""Saved-activation bytes of a forward pass, counted exactly on any device.

    from xlstm_kit.bench.memory import saved_bytes_per_token
    per_token, fixed = saved_bytes_per_token(block, d_model=768, tokens=(64, 128), dtype=torch.bfloat16)

Every tensor that autograd saves for the backward passes through a `saved_tensors_hooks` pack
hook; the hook records its storage once (views and repeated saves of one tensor cost nothing
extra), so the sum is what the graph keeps alive, apart from parameters (alive anyway) and
the block's output. (The block's input counts where it is saved: in a stack of blocks it is the
previous block's output, kept alive only by that.) Sequence ops can be set apart (`exclude`): what is saved while
one runs, and its inputs and outputs, is counted under "op" — the Triton sequence kernels save
their inputs and outputs, so everything else ("rest") is what the surrounding layer adds.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@contextlib.contextmanager
def _wrapped(targets, inside: list, op_keys: set, keep: list):
    """Patch each (namespace, name) in `targets` with a wrapper that marks its call as "inside"
    and records the storages of its tensor inputs and outputs."""
    originals = []

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                yield from tensors(o)

    for ns, name in targets:
        fn = getattr(ns, name)

        @functools.wraps(fn)
        def wrapper(*args, __fn=fn, **kwargs):
            inside.append(True)
            try:
                out = __fn(*args, **kwargs)
            finally:
                inside.pop()
            for t in tensors((args, tuple(kwargs.values()), out)):
                op_keys.add(_key(t))
                keep.append(t)  # alive until the count ends: a freed storage's address is reused
            return out

        originals.append((ns, name, fn))
        setattr(ns, name, wrapper)
    try:
        yield
    finally:
        for ns, name, fn in originals:
            setattr(ns, name, fn)


def saved_bytes(module: torch.nn.Module, x: torch.Tensor, *, autocast: torch.dtype | None = None,
                exclude=()) -> dict[str, int]:
    """Bytes saved for backward by `module(x)` (x [B, T, d] or any input), deduplicated by storage:
    {"op": bytes saved inside or passed in/out of the `exclude` targets ((namespace, attr) pairs
    patched for the call), "rest": everything else, "total": both}. Parameters and the output are
    not counted. `autocast`: run under torch.autocast(x.device.type, autocast)."""
    params = {_key(p) for p in module.parameters()}
    inside: list = []
    op_keys: set = set()
    saved: dict = {}

    def pack(t):
        k = _key(t)
        if k not in saved:
            saved[k] = bool(inside)
        elif inside:
            saved[k] = True
        return t

    ctx = torch.autocast(x.device.type, autocast) if autocast is not None else contextlib.nullcontext()
    keep: list = []
    with _wrapped(exclude, inside, op_keys, keep), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        y = module(x)
    skip = params | {_key(y)}
    op = rest = 0
    for k, in_op in saved.items():
        if k in skip:
            continue
        if in_op or k in op_keys:
            op += k[1]
        else:
            rest += k[1]
    del y, keep
    return {"op": op, "rest": rest, "total": op + rest}


def saved_bytes_per_token(make_input, module: torch.nn.Module, tokens=(2 * 64, 4 * 64), **kwargs) -> dict[str, tuple[float, float]]:
    """Per-token and fixed saved bytes: `saved_bytes` at two token counts (make_input(n) gives
    an input of n tokens), fitted exactly as fixed + per_token * n (every saved activation is
    linear in the token count; the fixed part is weight copies). {part: (per_token, fixed)}."""
    n1, n2 = tokens
    a = saved_bytes(module, make_input(n1), **kwargs)
    b = saved_bytes(module, make_input(n2), **kwargs)
    out = {}
    for part in a:
        slope = (b[part] - a[part]) / (n2 - n1)
        out[part] = (slope, a[part] - slope * n1)
    return out


def op_counts(module: torch.nn.Module, x: torch.Tensor, *, autocast: torch.dtype | None = None,
              exclude=()) -> dict[str, int]:
    """{"nodes": autograd nodes of module(x)'s graph, "fwd_ops", "bwd_ops": aten ops dispatched in
    the forward and in the backward of sum(y) — on a GPU each is about one kernel launch (views
    and metadata ops excluded)}. Ops inside the `exclude` targets (see `saved_bytes`) are not
    counted in the forward; the backward count includes the sequence op's backward."""
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not _is_view_like(func) and not inside:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    ctx = torch.autocast(x.device.type, autocast) if autocast is not None else contextlib.nullcontext()
    inside: list = []
    with _wrapped(exclude, inside, set(), []), ctx, Count():
        y = module(x)
    fwd = Count.n
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    nodes = sum(1 for n in seen if type(n).__name__ != "AccumulateGrad")
    g = torch.randn_like(y)
    for p in module.parameters():
        p.grad = None  # accumulating into existing gradients would count extra adds
    Count.n = 0
    with Count():
        y.backward(g)
    return {"nodes": nodes, "fwd_ops": fwd, "bwd_ops": Count.n}


def _is_view_like(func) -> bool:
    name = func.__name__.split(".")[0]
    return name in _METADATA_OPS or torch.Tag.view_copy in func.tags or func.is_view


_METADATA_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
                 "unsqueeze", "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes",
                 "chunk", "unbind", "diagonal", "narrow", "empty", "empty_like", "empty_strided",
                 "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias", "unflatten",
                 "is_same_size", "_to_copy_meta"}
