"""FSDP2 training on CPU (gloo, 2 processes): the same losses and weights as one process with the
same global batch (float32), sharded checkpoints written by every rank that resume bit-exactly
and load whole in a single process, and the one-line refusals."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.checkpoint import CheckpointError, is_sharded
from xlstm_kit.training.data import load_data

TEXT = (
    "KING:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n\n"
    "QUEEN:\nAnd all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n\n"
) * 30
STEPS = 12


def _model():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                          context_length=16, chunk_size=8))


def _config(**kw):
    # eps=1e-6: see tests/test_ddp.py (the sLSTM input-gate bias's zero gradient). grad_clip 0.5
    # clips most steps, so the sharded total norm is exercised.
    base = dict(steps=STEPS, batch_size=4, seq_len=16, lr=3e-3, min_lr=3e-4, warmup_steps=2, eps=1e-6,
                grad_clip=0.5, eval_interval=0, eval_batches=1, eval_at_start=False, checkpoint_interval=0, seed=2)
    return T.TrainConfig(**{**base, **kw})


def _worker(rank, world, port, corpus, cache, out, result, opts, resume=False):
    import torch.distributed as dist

    os.environ["XLSTM_KIT_CACHE"] = cache
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _model()
        if rank == 1:  # sharding must start every rank from rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        res = T.train(model, load_data(corpus, "byte"), _config(**opts), out, device="cpu", resume=resume,
                      dist=T.DistInfo(rank=rank, world_size=world), handle_signals=False)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"params": full, "losses": res.losses}, result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, out, opts, resume=False, tag="r"):
    result = tmp_path / f"{tag}.pt"
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path / "corpus.txt"), str(tmp_path / "cache"), str(out),
                            str(result), opts, resume), nprocs=2, join=True)
    return torch.load(result, weights_only=True)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    load_data(str(path), "byte")  # tokenized once: the workers only read the cache
    return path


def test_fsdp_and_ddp_match_one_process_and_sharded_checkpoints_resume_and_load(tmp_path, corpus):
    single = _model()
    ref = T.train(single, load_data(str(corpus), "byte"), _config(grad_accum=2), None, device="cpu",
                  handle_signals=False)
    start = _model().state_dict()
    ddp = _spawn(tmp_path, tmp_path / "ddp", dict(grad_accum=2), tag="ddp")
    fsdp = _spawn(tmp_path, tmp_path / "fsdp", dict(grad_accum=2, parallel="fsdp"), tag="fsdp")
    for got in (ddp, fsdp):
        assert [s for s, _ in got["losses"]] == list(range(1, STEPS + 1))
        for (_, a), (_, b) in zip(got["losses"], ref.losses):
            assert a == pytest.approx(b, rel=1e-5)
        for k, v in single.state_dict().items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert max((v - start[k]).abs().max().item() for k, v in single.state_dict().items()) > 1e-2

    # The FSDP run's checkpoint is sharded (one shard file per rank) and loads whole in one process.
    ckpt = T.resolve_checkpoint(tmp_path / "fsdp")
    assert is_sharded(ckpt) and len(list(ckpt.glob("*.distcp"))) == 2
    loaded = XLSTMLanguageModel.load(tmp_path / "fsdp")
    for k, v in fsdp["params"].items():
        assert torch.equal(loaded.state_dict()[k], v), k
