"""MLSTMKernelConfig: typed, frozen, unknown or invalid fields are errors, travels as a key."""
import dataclasses

import pytest
import torch

from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig, mlstm_chunkwise_triton


def test_tuned_config_by_shape_and_dtype():
    bf = MLSTMKernelConfig.tuned(128, 128, torch.bfloat16)
    assert bf == MLSTMKernelConfig()  # the field defaults are this case
    f32 = MLSTMKernelConfig.tuned(128, 128, torch.float32)
    assert (f32.fused_bv, f32.fused_stages, f32.out_warps) == (32, 2, 8)  # float32 tiles fit shared memory
    big = MLSTMKernelConfig.tuned(256, 512, torch.bfloat16, 32)
    assert (big.chunk, big.fused_bv, big.out_bk) == (32, 16, 128)
    assert MLSTMKernelConfig.tuned(16, 24, torch.bfloat16).states_bv == 32  # tiles no wider than pow2(V)
    # bfloat16 heads above 128 (the 125M/350M models' 384, 512): wider state tiles, 128-deep
    # K-tiles in _fwd_out and _bwd_dqk; float32 keeps its shared-memory-bound tiles
    h384 = MLSTMKernelConfig.tuned(384, 384, torch.bfloat16)
    assert (h384.chunk, h384.states_bv, h384.dstates_bv, h384.out_bk, h384.dqk_bk, h384.dqk_warps,
            h384.dv_bv, h384.recompute_states) == (64, 128, 128, 128, 128, 8, 64, False)
    assert MLSTMKernelConfig.tuned(512, 512, torch.bfloat16).dv_bv == 128
    assert MLSTMKernelConfig.tuned(384, 384, torch.float32).out_bk == 64
    with pytest.raises(ValueError, match="recompute_states"):
        MLSTMKernelConfig().replace(recompute_states=1)


def test_unknown_and_invalid_fields_are_errors():
    cfg = MLSTMKernelConfig()
    with pytest.raises(ValueError, match="no field fb_BV"):
        cfg.replace(fb_BV=32)
    with pytest.raises(ValueError, match="chunk"):
        cfg.replace(chunk=48)
    with pytest.raises(ValueError, match="seq_scan"):
        cfg.replace(seq_scan="yes")
    with pytest.raises(ValueError, match="power of two"):
        cfg.replace(out_bv=48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk = 32


def test_key_round_trip():
    cfg = MLSTMKernelConfig.tuned(40, 24, torch.float16, 16).replace(seq_scan=True, tail_bt=16)
    assert MLSTMKernelConfig.from_key(cfg.key()) == cfg


def test_chunk_size_must_agree_with_config():
    x = torch.randn(1, 4, 1, 16)
    g = torch.randn(1, 4, 1)
    with pytest.raises(ValueError, match="disagrees"):
        mlstm_chunkwise_triton(x, x, x, g, g, chunk_size=32, config=MLSTMKernelConfig())
