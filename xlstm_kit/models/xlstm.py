"""The xLSTM language model, top to bottom.

    tokens [B, T] -> embedding -> n_blocks residual blocks (mLSTM or sLSTM, as `slstm_at` says)
                  -> LayerNorm -> LM head -> logits [B, T, vocab_size]

Family "large" (the xLSTM-7B architecture, xlstm_kit.layers.large): large blocks (RMSNorm -> mLSTM
layer -> residual, RMSNorm -> SwiGLU -> residual) -> RMSNorm -> LM head -> soft-capped logits.

Training runs every block in parallel over time (chunkwise mLSTM, sLSTM time loop); generation
runs the same weights one token at a time on a state whose size does not grow with the text.
The architecture and initialisation are those of the official `xlstm` package (2.0.6);
`xlstm_kit.io.compat` converts models both ways. A plain nn.Module: checkpoints and HuggingFace
folders are `xlstm_kit.io`'s, decoding is `xlstm_kit.generation`'s.
"""
from __future__ import annotations

import contextlib
from typing import Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _recompute

from ..errors import XLSTMKitError
from ..layers.common import small_init_
from ..layers.dplr import DPLRBlock, DPLRState
from ..layers.fused import activation_dtype
from ..layers.large import LargeBlock, RMSNorm, at_least_float32, soft_cap
from ..layers.mlstm import MLSTMBlock, MLSTMState
from ..layers.slstm import SLSTMBlock, SLSTMState
from ..layers.varlen import block_varlen
from ..ops._checks import check_cu_seqlens, cu_seqlens_read_once
from .config import _BLOCK_KIND, CheckpointBlocks, XLSTMConfig, _check_positive_int, checkpoint_blocks
from .meta import check_fits, shapes_only
from .tokens import check_token_ids

BlockState = Union[MLSTMState, SLSTMState, DPLRState]
ModelState = list  # one BlockState per block, in block order


# =============================================================================================
# Model
# =============================================================================================
def keep_positions(x: torch.Tensor, logits_to_keep: "int | torch.Tensor") -> torch.Tensor:
    """The hidden states [B, T, d] at the positions `logits_to_keep` names (see
    XLSTMLanguageModel.forward), so that the head runs there only: 0 keeps all, an int n the
    last n, a 1-D tensor those positions of every row, a 2-D [B, n] tensor n positions per row."""
    if isinstance(logits_to_keep, torch.Tensor):
        idx = logits_to_keep.to(x.device)
        if idx.dim() == 2:
            return x.gather(1, idx.long()[..., None].expand(-1, -1, x.shape[-1]))
        return x.index_select(1, idx)
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise XLSTMKitError(f"logits_to_keep must be an int >= 0 (0 keeps every position) or a tensor of "
                            f"positions, got {logits_to_keep!r}")
    return x[:, -logits_to_keep:] if logits_to_keep else x


class XLSTMLanguageModel(nn.Module):
    """xLSTM language model.

    model(tokens [B, T]) -> logits [B, T, vocab_size]
    model(tokens, state=s, return_state=True) -> (logits, state): feed a long text in pieces
    model.step(token [B], state) -> (logits [B, vocab_size], state): one token
    model.generate(prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id): prompt [T], [B, T],
        a list of 1-D prompts of any lengths, a str or a list of str
    The state is a list with one MLSTMState / SLSTMState / DPLRState per block (`init_state(batch)`;
    large-family blocks use MLSTMState with an empty conv field).
    """

    # From the folder a model was loaded from (xlstm_kit.io.hf): a tokenizers-format tokenizer.json
    # (BOS prepended) and the token ids a HuggingFace config.json records.
    hf_tokenizer = None
    hf_special_tokens = None
    # The end tokens generation stops at when not told otherwise: a HuggingFace folder's
    # (generation_config.json, else config.json), as transformers' generate does.
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, config: XLSTMConfig):
        super().__init__()
        if not isinstance(config, XLSTMConfig):
            raise XLSTMKitError(f"config must be an XLSTMConfig, got {type(config).__name__}")
        self.config = cfg = config
        if cfg.family == "large" and cfg.dropout > 0:
            raise XLSTMKitError("large-family models have no dropout (as the official xLSTM-7B); set dropout=0")
        device = torch.empty(()).device  # the default device, or that of a `with torch.device(...)`
        if device.type != "meta":
            # each field of a config has its bounds, but together they can still ask for more
            # memory than there is: refused here, before anything is allocated
            with shapes_only():
                # this class, not type(self): a subclass may take other arguments
                n_params = sum(p.numel() for p in XLSTMLanguageModel(cfg).parameters())
            check_fits(n_params, torch.get_default_dtype(), device, "the model")
        self.tokenizer_name: str | None = None  # set by load() from the checkpoint
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self._make_block(t, kind) for t, kind in enumerate(cfg.block_types))
        if cfg.family == "large":
            self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        else:
            self.norm = nn.LayerNorm(cfg.d_model, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        self.reset_parameters()
        self._recomputed: frozenset[int] = frozenset()  # blocks under activation checkpointing
        self._compiled: tuple | None = None  # (compiled blocks, compiled head) from compile_blocks
        self._compiled_step: tuple | None = None  # (compiled block steps, compiled head) from compile_step
        self._compiled_prefill: tuple | None = None  # (compiled blocks, compiled head) from compile_prefill

    def _make_block(self, index: int, kind: str) -> nn.Module:
        cfg = self.config
        if cfg.family == "large":
            return LargeBlock(
                cfg.d_model, cfg.n_heads, cfg.qk_dim, cfg.v_dim, cfg.ffn_dim, n_blocks=cfg.n_blocks,
                bias=cfg.bias, norm_eps=cfg.norm_eps, gate_soft_cap=cfg.gate_soft_cap, chunk_size=cfg.chunk_size, backend=cfg.backend,
                recompute_states=cfg.recompute_mlstm_states,
            )
        if kind == "d":
            return DPLRBlock(
                cfg.d_model, cfg.n_heads, conv_kernel_size=cfg.conv_kernel_size, n_blocks=cfg.n_blocks,
                bias=cfg.bias, dropout=cfg.dropout, chunk_size=cfg.chunk_size, backend=cfg.backend,
            )
        if kind == "m":
            return MLSTMBlock(
                cfg.d_model, cfg.mlstm_inner_dim, cfg.n_heads,
                conv_kernel_size=cfg.conv_kernel_size, qkv_block_size=cfg.qkv_block_size,
                n_blocks=cfg.n_blocks, bias=cfg.bias, dropout=cfg.dropout,
                chunk_size=cfg.chunk_size, backend=cfg.backend,
                recompute_states=cfg.recompute_mlstm_states,
            )
        return SLSTMBlock(
            cfg.d_model, cfg.slstm_num_heads, cfg.ffn_dim,
            conv_kernel_size=cfg.conv_kernel_size, block_index=index, n_blocks=cfg.n_blocks,
            bias=cfg.bias, dropout=cfg.dropout, backend=cfg.backend,
        )

    def reset_parameters(self) -> None:
        """The official initialisation (blocks re-initialise themselves; see layers/)."""
        for block in self.blocks:
            block.reset_parameters()
        self.norm.reset_parameters()
        small_init_(self.embedding.weight, self.config.d_model)
        if not self.config.tie_embeddings:
            small_init_(self.lm_head.weight, self.config.d_model)

    # ------------------------------------------------------------------ training speed and memory
    def set_activation_checkpointing(self, blocks: "CheckpointBlocks | bool" = "all") -> None:
        """Recompute the forward of the chosen blocks during the backward instead of keeping
        their activations: "all", "mlstm", "slstm", "dplr" (blocks of that type), "none" (or
        True / False). Each chosen block then keeps only its input [B, T, d_model] for the
        backward, at the cost of one more forward of it. Gradients are unchanged (dropout masks
        are replayed: torch's RNG state is restored for the recomputation). Applies only where
        gradients are recorded; works with autocast and with :meth:`compile_blocks`.
        """
        kind = checkpoint_blocks(blocks)
        self._recomputed = frozenset(
            t for t, k in enumerate(self.config.block_types) if kind == "all" or _BLOCK_KIND.get(kind) == k)

    @property
    def activation_checkpointing(self) -> tuple[int, ...]:
        """Indices of the blocks whose forward is recomputed in the backward."""
        return tuple(sorted(self._recomputed))

    def compile_blocks(self, **options) -> None:
        """torch.compile the model for training, one region per block plus one for the head.

        Regional rather than whole-model compilation: blocks of one type are the same code with
        other parameters, so Dynamo traces and Inductor compiles each block type once and every
        further block reuses that graph (compile time does not grow with depth, also once the
        blocks trace without graph breaks, where a whole-model graph would unroll every block),
        the parameters and state_dict keys stay those of the plain model (checkpoints load into
        uncompiled models), and activation checkpointing wraps whole compiled blocks. On CPU
        (aot_eager, a d_model 32 model, 1 and 4 mLSTM blocks) whole-model torch.compile(model) was
        no better: both reuse their graphs across blocks today (the graph breaks in the blocks'
        hand-written backwards split the graph per block), with compile times within the noise
        of a shared 2-core machine (20-35 s). `options` go to torch.compile (e.g.
        backend="aot_eager", fullgraph=True, mode="max-autotune").

        The compiled blocks are kept beside the plain ones (not `block.compile()` in place) and
        run where gradients are recorded (training). Under torch.no_grad — validation,
        `generate`, `step` — the model runs eagerly: other batch shapes, prompt lengths and the
        recurrent step then cost no recompilation, and compile time goes to the training step
        only. Compilation itself happens lazily at the first training forward.
        """
        blocks = tuple(torch.compile(block, **options) for block in self.blocks)
        self._compiled = (blocks, torch.compile(self._head, **options))

    def compile_step(self, **options) -> None:
        """torch.compile the one-token step (`step`, and so the decode of `generate`), one region
        per block plus the head, each traced whole: a block's projections, gates, state update and
        norms become a few fused kernels instead of dozens of small ones, and on CUDA `generate`
        records those in its CUDA graph. Blocks of one type share one compiled graph (their
        parameters are its inputs). A new batch size compiles again, once. `options` go to
        torch.compile over the defaults fullgraph=True, dynamic=False (e.g. backend="aot_eager")
        and, for the default backend without a `mode`, Inductor's coordinate-descent tuning: it
        turns a one-token matrix product into a reduction fused with its neighbours and tunes
        it to the memory bandwidth (on an H200: up to 3.6 TB/s, where cuBLAS's one-row kernels
        reached 1-2.6; benchmarks/results/2026-12-02-h200-generate.md)."""
        opts = {"fullgraph": True, "dynamic": False, **options}
        if opts.get("backend", "inductor") == "inductor" and "mode" not in opts:
            opts["options"] = {"coordinate_descent_tuning": True, **opts.get("options", {})}
        self._compiled_step = (tuple(torch.compile(block.step, **opts) for block in self.blocks),
                               torch.compile(self._head, **opts))

    def compile_prefill(self, **options) -> None:
        """torch.compile the forward where no gradients are recorded (prompt reads: the prefill of
        `generate` and of `xlstm-kit serve`), one region per block plus the head, with dynamic
        shapes: prompts of other lengths and batch sizes reuse the graphs instead of compiling
        again. Eager, a prompt read is bound by the host (the 125M model: about 900 launches through
        Python, ~40 ms on an H100 whatever the prompt's length, for ~5 ms of GPU work). Packed
        documents (`cu_seqlens`) stay eager, their boundaries being Python values the graphs would
        specialise on: prompts of different lengths read together stay one packed eager call.
        `options` go to torch.compile over the default dynamic=True (e.g. backend="aot_eager")."""
        opts = {"dynamic": True, **options}
        self._compiled_prefill = (tuple(torch.compile(block, **opts) for block in self.blocks),
                                  torch.compile(self._head, **opts))

    @property
    def prefill_compiled(self) -> bool:
        """Whether `compile_prefill` was called."""
        return self._compiled_prefill is not None

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        if self.config.family != "large":
            return logits
        return soft_cap(at_least_float32(logits), self.config.logit_soft_cap).to(logits.dtype)

    # ------------------------------------------------------------------ state
    def init_state(self, batch: int, device=None) -> ModelState:
        """The zero state for `batch` sequences: one state per block, float32 (float64 models: float64)."""
        _check_positive_int("batch", batch)
        return [block.init_state(batch, device=device) for block in self.blocks]

    @property
    def supports_lengths(self) -> bool:
        """Whether every block reads padded rows (`forward(..., lengths=)`); DPLR blocks do not."""
        return all(getattr(b, "supports_lengths", False) for b in self.blocks)

    def _check_lengths(self, lengths, batch: int, T: int, bounds) -> None:
        if bounds is not None:
            raise XLSTMKitError("lengths and cu_seqlens cannot be combined")
        if not self.supports_lengths:
            kinds = sorted({type(b).__name__ for b in self.blocks if not getattr(b, "supports_lengths", False)})
            raise XLSTMKitError(f"lengths (padded rows) are not supported by {', '.join(kinds)}")
        if (not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,) or lengths.dtype.is_floating_point
                or lengths.dtype == torch.bool or lengths.is_complex()):
            got = f"{lengths.dtype} {list(lengths.shape)}" if isinstance(lengths, torch.Tensor) else type(lengths).__name__
            raise XLSTMKitError(f"lengths must be an integer tensor of shape [{batch}], got {got}")
        if lengths.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a graph being recorded cannot read values; the reader checks them on the host
        lo, hi = torch.stack(torch.aminmax(lengths)).tolist()  # one host sync
        if lo < 1 or hi > T:
            raise XLSTMKitError(f"lengths must lie in [1, {T}] (the tokens' length), got values in [{lo}, {hi}]")

    def _check_state(self, state, batch: int, packed: bool = False) -> None:
        if not isinstance(state, (list, tuple)) or len(state) != len(self.blocks):
            raise XLSTMKitError(
                f"state must be a list of {len(self.blocks)} block states from this model's "
                f"init_state() or forward(..., return_state=True), got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, (list, tuple)) else "")
            )
        for t, (block, s) in enumerate(zip(self.blocks, state)):
            ref = block.init_state(1, device="meta")
            if type(s) is not type(ref):
                raise XLSTMKitError(
                    f"state[{t}] is a {type(s).__name__} but block {t} takes a {type(ref).__name__}; "
                    f"the state comes from a model with another config"
                )
            for name, x, r in zip(ref._fields, s, ref):
                if not isinstance(x, torch.Tensor) or x.shape[1:] != r.shape[1:]:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise XLSTMKitError(
                        f"state[{t}].{name} has shape {got}, expected [{batch}, "
                        f"{', '.join(map(str, r.shape[1:]))}]; the state comes from a model with another config"
                    )
                if x.shape[0] != batch:
                    raise XLSTMKitError(
                        f"state[{t}].{name} is for batch size {x.shape[0]} but the tokens have "
                        + (f"{batch} documents (cu_seqlens)" if packed else f"batch size {batch}")
                        + f"; use model.init_state({batch}) or the state of a {batch}-sequence call"
                    )

    def _check_tokens(self, tokens, dims: int, what: str) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise XLSTMKitError(f"{what} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.dim() != dims:
            want = "[B, T]" if dims == 2 else "[B]"
            raise XLSTMKitError(f"{what} must have shape {want}, got {list(tokens.shape)}")
        check_token_ids(tokens, self.config.vocab_size, what)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, state: ModelState | None = None, return_state: bool = False,
                *, cu_seqlens: torch.Tensor | None = None, logits_to_keep: "int | torch.Tensor" = 0,
                lengths: torch.Tensor | None = None):
        """tokens [B, T] (T >= 1) -> logits [B, T, vocab] (float in the parameters' dtype),
        or (logits, state) with return_state=True. `state` continues from an earlier call.

        logits_to_keep (as in transformers): 0 = every position; an int n > 0 = the last n
        positions (logits [B, n, vocab]); a 1-D tensor of positions = those (logits
        [B, len, vocab]); a 2-D [B, n] tensor = n positions per row (logits [B, n, vocab]). A prefill needs one position per prompt, and the head's output over
        a long prompt would be the largest tensor of the call (T x vocab).

        cu_seqlens: None, or int32/int64 [N+1] (0 = cu[0] < ... < cu[N] = T) with tokens [1, T]:
        N documents packed in one row, each read as if alone (every block's state, the causal
        convolutions' included, resets at each boundary). `state` then has N rows (one per
        document; None: zeros) and so has the returned state.

        lengths: None, or an integer tensor [B] with 1 <= lengths[b] <= T: row b is its first
        lengths[b] tokens, the rest padding that leaves every block's state as it was (rows of
        different lengths in one batch of fixed shape: a server's prompt reads). The returned
        state is the state after lengths[b] tokens; logits past them mean nothing (keep
        `lengths - 1` with a [B, 1] logits_to_keep). No host sync when CUDA graphs record the call."""
        self._check_tokens(tokens, 2, "tokens")
        B, T = tokens.shape
        if T < 1 or B < 1:
            raise XLSTMKitError(f"tokens must have shape [B, T] with B, T >= 1, got {list(tokens.shape)}")
        bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, tokens.device)
        if lengths is not None:
            self._check_lengths(lengths, B, T, bounds)
        if state is not None:
            self._check_state(state, B if bounds is None else len(bounds) - 1, packed=bounds is not None)
        x = self.embedding(tokens if tokens.dtype in (torch.int32, torch.int64) else tokens.long())
        training = torch.is_grad_enabled()
        # packed documents take the eager blocks: their per-document shapes would recompile
        if training and self._compiled is not None and bounds is None:
            blocks, head = self._compiled
        elif not training and self._compiled_prefill is not None and bounds is None:
            blocks, head = self._compiled_prefill
        else:
            blocks, head = self.blocks, self._head
        # the mLSTM blocks' derived weights, kept between reads, go into compiled prefill blocks
        # as inputs (a compiled region cannot tell whether kept ones are still current)
        pass_maps = (self._compiled_prefill is not None and blocks is self._compiled_prefill[0]
                     and not torch.compiler.is_compiling())
        new_state = []
        # the layers' ops take the boundaries read above (one host sync per call, not per layer)
        with contextlib.nullcontext() if bounds is None else cu_seqlens_read_once(cu_seqlens, bounds):
            for t, block in enumerate(blocks):
                s = None if state is None else state[t]
                recompute = training and t in self._recomputed

                def call(blk, x_, s_, rs, **kw):
                    if recompute:
                        return _recompute(blk, x_, s_, return_state=rs, use_reentrant=False, **kw)
                    return blk(x_, s_, return_state=rs, **kw)

                kw = {}
                if pass_maps and isinstance(self.blocks[t], MLSTMBlock):
                    kw["maps"] = self.blocks[t].layer.read_maps(activation_dtype(x))
                if lengths is not None:
                    out = call(block, x, s, return_state, lengths=lengths, **kw)
                elif bounds is None:
                    out = call(block, x, s, return_state, **kw)
                else:
                    out = block_varlen(block, x, s, return_state, bounds, cu_seqlens, call)
                if return_state:
                    x, s = out
                    new_state.append(s)
                else:
                    x = out
        logits = head(keep_positions(x, logits_to_keep))
        return (logits, new_state) if return_state else logits

    def step(self, tokens: torch.Tensor, state: ModelState | None = None, *, inplace: bool = False,
             check: bool = True):
        """One token per sequence: tokens [B] -> (logits [B, vocab], new state).

        check=False skips the input checks: no host-device sync, so a CUDA graph can capture the
        step (the decode loop of xlstm_kit.generation does). inplace: the caller gives `state` up;
        the blocks may update its large tensors in place."""
        if check:
            self._check_tokens(tokens, 1, "tokens")
            B = tokens.shape[0]
            state = self.init_state(B) if state is None else state
            self._check_state(state, B)
        x = self.embedding(tokens if tokens.dtype in (torch.int32, torch.int64) else tokens.long())
        steps, head = self._compiled_step or ([b.step for b in self.blocks], self._head)
        new_state = []
        for block_step, s in zip(steps, state):
            x, s = block_step(x, s, inplace=inplace)
            new_state.append(s)
        return head(x), new_state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
