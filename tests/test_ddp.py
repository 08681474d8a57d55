"""DistributedDataParallel training on CPU (gloo, 2 processes) equals one process with the same
global batch: the same parameters after a few AdamW steps (float32, tolerance 1e-5; gradient
accumulation and clipping on), and only rank 0 writes files."""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from xlstm_kit import training as T
from xlstm_kit.io.checkpoint import MANIFEST_FILE, RUN_LOCK_FILE
from xlstm_kit.training.data import load_data
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from tests.helpers import destroy_together, spawn_ranks

TEXT = (
    "KING:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n\n"
    "QUEEN:\nAnd all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n\n"
) * 30


def _model(compiled: bool = False):
    torch.manual_seed(0)
    # The compiled variant: one mLSTM block (an sLSTM block's unrolled time loop makes Dynamo's
    # tracing the longest part of the test).
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=1 if compiled else 2, n_heads=2,
                                          slstm_at=[] if compiled else [1], context_length=16, chunk_size=8))


def _config(**kw):
    # eps=1e-6 keeps Adam from amplifying the rounding noise of the sLSTM input-gate bias, whose
    # gradient is mathematically zero (see TrainConfig.eps); every other parameter is a real test.
    # Two micro-steps (DDP syncs the last one only) and a clip of 0.5 (every step is clipped, at
    # gradient norms near 3: the total norm of the synced gradients).
    return T.TrainConfig(steps=3, batch_size=4, seq_len=16, lr=3e-3, min_lr=3e-4, warmup_steps=1, eps=1e-6,
                         grad_accum=2, grad_clip=0.5, eval_interval=3, eval_batches=2, checkpoint_interval=0,
                         seed=2, **kw)


def _aot_eager_compile():
    # Inductor's C++ builds take minutes on a small CPU; aot_eager traces the same graphs.
    original = XLSTMLanguageModel.compile_blocks
    XLSTMLanguageModel.compile_blocks = lambda self: original(self, backend="aot_eager")


def _worker(rank: int, world: int, port: int, corpus: str, cache: str, out: str, result: str,
            compiled: bool = False) -> None:
    import torch.distributed as dist

    os.environ["XLSTM_KIT_CACHE"] = cache
    torch.set_num_threads(1)
    if compiled:
        _aot_eager_compile()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        data = load_data(corpus, "byte")
        model = _model(compiled)
        if rank == 1:  # DDP must broadcast rank 0's initial weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        events = []
        opts = dict(compile=True, activation_checkpointing="all") if compiled else {}
        res = T.train(model, data, _config(**opts), out, device="cpu", callback=events.append,
                      dist=T.DistInfo(rank=rank, world_size=world), handle_signals=False)
        if rank == 0:
            torch.save({"params": model.state_dict(), "losses": res.losses,
                        "val": [m.loss for _, m in res.evals], "events": len(events),
                        "graphs": counters["stats"]["unique_graphs"]}, result)
        else:
            assert not events, "only rank 0 may report progress"
    finally:
        destroy_together()


def test_ddp_two_cpu_processes_match_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out, result = tmp_path / "ddp", tmp_path / "ddp_result.pt"
    load_data(str(corpus), "byte")  # tokenize once, so the workers only read the cache
    spawn_ranks(_worker, 2, str(corpus), str(tmp_path / "cache"), str(out), str(result))
    ddp = torch.load(result, weights_only=True)

    single = _model()
    ref = T.train(single, load_data(str(corpus), "byte"), _config(), tmp_path / "single", device="cpu",
                  handle_signals=False)
    start = _model().state_dict()
    moved = 0.0
    for k, v in single.state_dict().items():
        torch.testing.assert_close(ddp["params"][k], v, rtol=0, atol=1e-5, msg=k)
        moved = max(moved, (v - start[k]).abs().max().item())
    assert moved > 1e-3  # the comparison is between trained weights, not initial ones
    assert [s for s, _ in ddp["losses"]] == [1, 2, 3]
    for (_, a), (_, b) in zip(ddp["losses"], ref.losses):
        assert a == pytest.approx(b, abs=1e-5)
    assert ddp["val"] == pytest.approx([m.loss for _, m in ref.evals], abs=1e-5)
    assert ddp["events"] > 0
    # Rank 0 wrote one checkpoint that loads as a model; nobody else wrote anything.
    loaded = XLSTMLanguageModel.load(T.resolve_checkpoint(out))
    for k, v in ddp["params"].items():
        assert torch.equal(loaded.state_dict()[k], v)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, RUN_LOCK_FILE, "checkpoints", "latest",
                                                     "loss.png", "metrics.jsonl"]  # the lock: rank 0's, while it wrote


def test_ddp_with_compile_and_activation_checkpointing(tmp_path, monkeypatch):
    """Compiled blocks (recomputed in the backward) inside DistributedDataParallel: the same
    weights as one eager process, up to the rounding differences of the compiled graphs."""
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out, result = tmp_path / "ddp", tmp_path / "ddp_result.pt"
    load_data(str(corpus), "byte")
    spawn_ranks(_worker, 2, str(corpus), str(tmp_path / "cache"), str(out), str(result), True)
    ddp = torch.load(result, weights_only=True)
    assert ddp["graphs"] > 0  # the workers did run compiled blocks
    single = _model(compiled=True)
    ref = T.train(single, load_data(str(corpus), "byte"), _config(), None, device="cpu", handle_signals=False)
    start = _model(compiled=True).state_dict()
    moved = 0.0
    for k, v in single.state_dict().items():
        torch.testing.assert_close(ddp["params"][k], v, rtol=0, atol=2e-5, msg=k)
        moved = max(moved, (v - start[k]).abs().max().item())
    assert moved > 1e-3
    for (_, a), (_, b) in zip(ddp["losses"], ref.losses):
        assert a == pytest.approx(b, abs=2e-5)
    loaded = XLSTMLanguageModel.load(T.resolve_checkpoint(out))
    for k, v in ddp["params"].items():
        assert torch.equal(loaded.state_dict()[k], v)
