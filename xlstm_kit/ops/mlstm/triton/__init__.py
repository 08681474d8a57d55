"""Chunkwise mLSTM in Triton: forward and hand-written backward kernels, and the decode step.

Maths: docs/design.md, "mLSTM" and "Stabilisation". Per head, the sequence is cut into NC
chunks of L steps (the last chunk is
padded with steps that leave the state alone: log f = 0, ĩ = NEG, q = k = v = 0). With β the
in-chunk cumulative log forget gate and (C_c, n_c, m_c) the state entering chunk c, row t of
the chunk has the recurrent stabilizer exactly

    m_t = max(β_t + m_c, u_t),     u_t = β_t + max_{s≤t}(ĩ_s − β_s),

so h_t = (e^{a_t} C_cᵀq̂_t + Σ_{s≤t} P_ts v_s) / (max(|n̄_t|, e^{−m_t}) + eps) with
a_t = β_t + m_c − m_t, P_ts = (q̂_t·k_s) e^{D_ts}, D_ts = β_t − β_s + ĩ_s − m_t and
n̄_t = e^{a_t} n_cᵀq̂_t + Σ_s P_ts.  The chunk's end state is
C_{c+1} = e^{b_c} C_c + Σ_s e^{w_s} k_s v_sᵀ with w_s = β_L − β_s + ĩ_s − m_{c+1},
b_c = β_L + m_c − m_{c+1}, m_{c+1} = max(β_L + m_c, u_L). Every exponent is ≤ 0.

Phases and their modules (all accumulation and states in float32 unless said otherwise):
  gates.py     prologue _gate_prep, parallel over (chunk, b·h): β (float64 cumsum of log σ(f),
               kept as hi + lo float32), ĩ, u and the max-chain flags, from i, f [B,T,H]
  states.py    _fwd_states: chunk-start states, sequential over chunks per (b·h, K-tile, V-tile)
  scan.py      or, where that is latency-bound (config seq_scan, see scan.use_scan): _m_chain
               (the stabilizers m_c, one max-plus scan per b·h), _fwd_local (each chunk's own
               state term, all chunks in parallel) and _state_scan (chains them)
  output.py    _fwd_out, parallel over (chunk, V-tile, b·h): h (and, for 16-bit inputs, its
               rounding residual), and per-row n̄ and m for the backward
  backward.py  _bwd_rows: the per-row factors of δh (δh·h/d, 1/d, δn̄)
  states.py    _bwd_dstates: reverse-sequential δC, δn at every chunk end (or _bwd_local +
  scan.py      _state_scan in reverse, as in the forward)
  backward.py  _bwd_fused, one program per (chunk, b·h) holding all of K (pow2(K) ≤
               config fused_max_k): δq, δk, δv and the chunk's log-gate gradients, every
               product formed once (the last chunk in a launch of its own when δC_T must stay
               float32, see backward.last_chunk_apart); for larger K, _bwd_dqk (chunk, K-tile,
               b·h: δq, δk, log-gate shares) and _bwd_dv (chunk, V-tile, b·h: δv)
  gates.py     epilogue _gate_tail, one program per b·h, backwards over blocks of steps: the
               stabilizers' own influence, δi and δf [B,T,H] in the input dtypes
  op.py        launch order, the torch.library custom ops xlstm_kit::mlstm_chunkwise_fwd / _bwd
               and their autograd formula, `mlstm_chunkwise_triton`
  config.py    MLSTMKernelConfig (tiles, warps, stages; `tuned(K, V, dtype, chunk)`) and the
               product numerics per dtype
  step.py      one recurrent step (decode), the custom op xlstm_kit::mlstm_step
  varlen.py    packed sequences (cu_seqlens, batch 1): the chunk table, one launch per call;
               every chunk lies inside one sequence, the per-chunk kernels take their rows
               from it (VARLEN), the state passing and the gate epilogue run one program per
               sequence and head (the sequential kernels: no scan for packed sequences)
The forward saves its chunk states and gate tensors for the backward; with config
recompute_states it keeps no chunk states [B,H,NC,K,V] and the backward runs the forward state
passing again (one more states launch, same values).

The backward holds every stabilizer fixed (the inputs then enter only through q̂ e^{β},
k e^{ĩ−β}, so the gate gradients are row and column sums of dP ⊙ P plus chunk terms) and
adds the stabilizers' own influence in the epilogue: h_t depends on m_t through eps only
(∂h_t/∂m_t = −eps h_t / d_t), the final state through C_T = e^{−m_T} C*_T, and each δm is
routed along the max chain to the ĩ_s or log f_t that realises it (float64). Apart from
allocations and a few [B,H]-sized terms of δm, a forward+backward is these kernel launches
only, because at the benchmark sizes the host's launch time is the bottleneck.

Dtypes: q, k, v in float16, bfloat16 or float32; h and the gradients are returned in that
dtype. Matrix products take 16-bit operands with float32 accumulation (float32 inputs use
3-pass TF32, close to full float32). The chunk states travel between kernels in bfloat16 for
bfloat16 inputs (they are bfloat16 operands of the products anyway) and in float32 otherwise;
the returned final state and the gradient of the initial state are always float32.
"""
from .config import MLSTMKernelConfig
from .op import mlstm_chunkwise_triton, supports
from .step import mlstm_step_triton

__all__ = ["MLSTMKernelConfig", "mlstm_chunkwise_triton", "mlstm_step_triton", "supports"]
