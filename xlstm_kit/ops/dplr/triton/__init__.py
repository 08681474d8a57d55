"""Chunkwise DPLR in Triton: the chunkwise WY algorithm (docs/design.md, "DPLR and KDA") and its
hand-written backward; the decode step (step.py).

Same maths and notation as ../chunkwise.py (the tested PyTorch version): per chunk of L steps, with
G the inclusive cumulative sum of gk over the chunk (log Γ) and the state stored
transposed (h = Sᵀ ∈ R^{K×V}),

    pair matrices   A_xy[r, i] = Σ_k x_r[k] y_i[k] e^{G_r[k] − G_i[k]},  i ≤ r (i < r for x = b)
    WY              F = I + A_ba,  E = F⁻¹,  W = E B←,  Cm = −E (A_bk V)
    state passing   V2 = Cm − W h,  h' = Diag(γ_L) h + (K ⊙ e^{G_L−G})ᵀ V + (A ⊙ e^{G_L−G})ᵀ V2
    output          O = (Q ⊙ e^G) h + A_qk V + A_qa V2

Modules, by phase (all accumulation, scratch and states in float32; every phase module also
holds the phase's PyTorch reference, `*_reference`, which its test compares the kernel against).
Every kernel reads q, k, v, a, b (and gk, β, δO) and writes o and every gradient in the caller's
contiguous [B, T, H, ·] layout and dtype (`_x_ld` / `_x_st`, common.py): no layout copies on
either path; only the scratch below is in the chunk layout [B·H, Tp, ·].
  forward
    pairs.py     _fwd_pairs   parallel over (chunk, column sub-chunk, b·h): the four pair
                              matrices, one [L, S] column block each, to scratch [BH, NC, L, L]
    wy.py        _fwd_wy      parallel over (chunk, b·h): E on chip (diagonal blocks by row-wise
                              forward substitution, then block forward substitution with
                              products), W = E B←, Cm = −E (A_bk V), and the decayed operands
                              Q ⊙ e^G, K ⊙ e^{G_L−G}, A ⊙ e^{G_L−G}, e^{G_L} of the state kernels
    state.py     _fwd_state   sequential over chunks, parallel over (V-tile, b·h): V2, the
                              output, the state
  backward (as in ../chunkwise.py; the forward's scratch is kept, not recomputed)
    state.py     _bwd_state   reverse-sequential over chunks per (V-tile, b·h): δ of each chunk's
                              end state, δV2
    backward.py  _bwd_dv      parallel over (chunk, b·h): δv, GC = Eᵀ δC and the pair-matrix
                              gradients
    dplr_dk.py   _bwd_dk_pairs, _bwd_dk_state   δq, δk, δa, δb and the gate gradient in two
                              kernels: the pair-matrix gradients on [16, 16] blocks per
                              (sub-chunk, K-tile, chunk, b·h), then the state side and the rest
                              per (chunk, b·h); kda_dk.py splits KDA's the same way
  common.py      _mm (the low-precision product), _offs / _row (the scratch's offset rule),
                 _x_ld / _x_st (the caller's layout), SUB, and the row masks of packed sequences
Packed sequences (cu_seqlens): every kernel above takes the device-side chunk table of the mLSTM
kernels (mlstm/triton/varlen.py) under VARLEN: chunks never cross a sequence boundary, the rows
past a sequence's end are masked (no padding in memory), the per-chunk kernels run over the chunks
of all sequences at once, and the two state kernels walk each sequence from its own initial state
to its own final state (op.py, common.py).
  config.py      DPLRKernelConfig (precision mode, tiles, warps) and its resolution per shape
  op.py          launchers, the custom ops xlstm_kit::dplr_chunkwise_fwd/_bwd with
                 their autograd, dplr_chunkwise_triton, supports
  kda.py         the KDA-specialised kernels (a = k, b = β k, v ← β v): k, v, β read as given,
                 each distinct pair product once (A_qa = A_qk, A_ba = A_bk), U = β v + V2, the β
                 gradient reduced in the kernels; `_fwd_wy` / `_fwd_state` take KDA as a flag
  kda_op.py      their launchers, the custom ops xlstm_kit::kda_chunkwise_fwd/_bwd,
                 kda_chunkwise_triton
  step.py        the decode step (xlstm_kit::dplr_step), a kernel of its own
Memory: the forward keeps (4 L + 6 K + V) float32 values per token and head (A_qk, A_qa, A_bk, E;
W, Q⊙e^G, K⊙e^{G_L−G}, A⊙e^{G_L−G}, G in float64; V2) plus one K×V state per chunk: about
1.5 GB at B=8, T=2048, H=16, K=V=128; q, k, v, a, b are kept as the caller's own tensors (no
copies).

Numerics (log-gates down to −5 per step). The plain factorisation Q← = Q⊙Γ, K→ = K⊘Γ would
need 1/Γ up to e^{320} in a chunk of 64 steps at gk = −5. The pair matrices are therefore built
per column sub-chunk J of S = 16 steps with a reference point inside the chunk:
  rows below J:  (X ⊙ e^{G_r − G_end(J)}) (Y_J ⊙ e^{G_end(J) − G_J})ᵀ   — both factors ≤ 1, any gk;
  rows inside J:  (X ⊙ e^{G_r − G_mid(J)}) (Y_J ⊙ e^{G_mid(J) − G_J})ᵀ, G_mid(J) at step 8 of the
                 16 — each factor lies in [e^{−40}, e^{40}] at gk ≥ −5 (the float32 limits are
                 e^{±88}; even the low parts of the 3-pass TF32 split stay normal numbers), and
                 the product is e^{G_r − G_i} ≤ 1 for every pair used. The entries above the
                 diagonal of the block (up to e^{80}·|xy|) are replaced by 0 with `where` and
                 never reach a later sum. (Tested at −5; the factors stay finite to about −10;
                 the public ops floor log-decays at −9, the package docstring says why.)
Precision modes. Products run as 3-pass TF32 (≈ float32) except those whose results reach only
bf16 outputs, in three groups decided by the dtypes of the outputs they reach (config.py,
`for_dtypes`; `DPLRKernelConfig.lowp` = "tf32", the default, single-pass TF32 for them):
"o" the three output products of _fwd_state (Q⊙e^G h, A_qk V, A_qa V2) when o (q's dtype) is
bf16; "dv" the δv products of _bwd_dv when δv is; "dk" the pair-matrix gradients of _bwd_dv and
all of the key gradient (δq, δk, δa, δb and δgk share every product there) when all of those are. A_qk
(o and δv) and GC = Eᵀ δV2 (δv and dk) are low when both their groups are. So bf16 activations
with a float32 gk (as models compute gates) keep the fast forward and δv while the float32 gate
gradient gets float32-accurate products: its PyTorch reference error is float32-sized, and the
2x rule leaves single-pass TF32 (2^-11 operand rounding) no room there. KDA: β joins δv and dk. Whatever the final state or δh0
depends on (A_ba, A_bk, A_qa, E, W, Cm, the state kernels) stays 3-pass: the PyTorch op returns
the float32 state with ~5e-8 error, and the 2x rule leaves no room there. Operands rounded to
bf16 ("bf16") are not the default: with operand rounding as coarse as the outputs' own, the gate
gradient (a cumulative sum of differences) gets 3.5x the PyTorch op's error (measured with the
float16 analogue in the interpreter); TF32's operand rounding (2^-11) is 8x below bf16's.
All other decays (e^{G_r}, e^{G_L − G_r}, e^{G_L}) are ≤ 1. G is cumulated in float64 (the
wrapper's cumsum) and only differences are cast to float32 before the exp: a float32 G reaches
−320 at gk = −5 and differences of such numbers would cost 2e-5 relative on every decay.
"""
