"""FSDP2 training on the CPU (gloo): the same losses and weights as one process with the same
global batch (float32, packed documents, gradient accumulation, clipping; DDP is held to the same
process in tests/test_ddp.py, with accumulation and clipping too); sharded
checkpoints that survive a rank killed mid-save, resume at 2 processes bit for bit, resume at 1
and 4 processes and load whole in a single process; FSDP with compiled, recomputed blocks; a
HuggingFace export of a sharded checkpoint."""
import json
import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.cli import app
from xlstm_kit.io.checkpoint import CHECKPOINTS_DIR, is_sharded
from xlstm_kit.training.data import load_data
from tests.helpers import destroy_together, spawn_ranks

TEXT = (
    "KING:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n\n"
    "QUEEN:\nAnd all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n\n"
) * 30
STEPS = 12


def _model(kind: str = "paper"):
    torch.manual_seed(0)
    if kind == "large":  # the xLSTM-7B blocks: the family a HuggingFace folder holds
        return XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=256, d_model=32, n_blocks=2, n_heads=2,
                                              context_length=16, chunk_size=8))
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                          context_length=16, chunk_size=8))


def _config(**kw):
    # eps=1e-6: see tests/test_ddp.py (the sLSTM input-gate bias's zero gradient). grad_clip 0.5
    # clips most steps, so the sharded total norm is exercised.
    # batch 8: a batch of 8 sequences divides into 4 processes x 2 micro-steps
    base = dict(steps=STEPS, batch_size=8, seq_len=16, lr=3e-3, min_lr=3e-4, warmup_steps=2, eps=1e-6,
                grad_clip=0.5, eval_interval=0, eval_batches=1, eval_at_start=False, checkpoint_interval=0, seed=2)
    return T.TrainConfig(**{**base, **kw})


def _full(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _die_in_save(n: int) -> None:
    """SIGKILL this process in its n-th sharded save, after every rank wrote its shards and before
    the index is written: a kill -9 mid-save."""
    from torch.distributed.checkpoint import FileSystemWriter

    finish, calls = FileSystemWriter.finish, [0]

    def dying(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return finish(self, *args, **kwargs)

    FileSystemWriter.finish = dying


def _worker(rank, world, port, job):
    import torch.distributed as dist

    os.environ["XLSTM_KIT_CACHE"] = job["cache"]
    torch.set_num_threads(1)
    if job.get("compiled"):  # Inductor's C++ builds take minutes on a small CPU; aot_eager traces the same graphs
        original = XLSTMLanguageModel.compile_blocks
        XLSTMLanguageModel.compile_blocks = lambda self: original(self, backend="aot_eager")
    if job.get("die_in_save") and rank == 0:
        _die_in_save(job["die_in_save"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model = _model(job.get("model", "paper"))
        if rank == 1:  # sharding must start every rank from rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        res = T.train(model, load_data(job["corpus"], "byte", documents=True), _config(**job["opts"]), job["out"],
                      device="cpu", resume=job.get("resume", False), dist=T.DistInfo(rank=rank, world_size=world),
                      handle_signals=False)
        full = _full(model)
        if rank == 0:
            torch.save({"params": full, "losses": res.losses, "val": [m.loss for _, m in res.evals],
                        "graphs": counters["stats"]["unique_graphs"]}, job["result"])
    finally:
        destroy_together()


def _spawn(tmp_path, out, opts, world=2, tag="r", **job):
    result = tmp_path / f"{tag}.pt"
    job = dict(corpus=str(tmp_path / "corpus"), cache=str(tmp_path / "cache"), out=str(out), result=str(result),
               opts=opts, **job)
    spawn_ranks(_worker, world, job)
    return torch.load(result, weights_only=True)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A folder of documents: packed where asked (pack=True), one stream otherwise."""
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, part in enumerate(TEXT.split("\n\n")[:40]):
        (folder / f"doc{i:02d}.txt").write_text((part + "\n") * (1 + i % 3))
    load_data(str(folder), "byte", documents=True)  # tokenized once: the workers only read the cache
    return folder


def test_fsdp_equals_one_process_and_its_checkpoints_survive_a_kill_resume_and_reshard(tmp_path, corpus):
    data = load_data(str(corpus), "byte", documents=True)
    single = _model()
    ref = T.train(single, data, _config(grad_accum=2, pack=False), tmp_path / "single", device="cpu",
                  handle_signals=False)
    start = _model().state_dict()
    after12 = {k: v.clone() for k, v in single.state_dict().items()}
    every4 = dict(grad_accum=2, pack=False, parallel="fsdp", checkpoint_interval=4)
    fsdp = _spawn(tmp_path, tmp_path / "fsdp", every4, tag="fsdp")
    assert [s for s, _ in fsdp["losses"]] == list(range(1, STEPS + 1))
    for (_, a), (_, b) in zip(fsdp["losses"], ref.losses):
        assert a == pytest.approx(b, rel=1e-5)
    for k, v in after12.items():
        torch.testing.assert_close(fsdp["params"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    assert max((v - start[k]).abs().max().item() for k, v in after12.items()) > 1e-2
    assert fsdp["val"] == pytest.approx([m.loss for _, m in ref.evals], rel=1e-5)

    # The FSDP run's checkpoint is sharded (one shard file per rank) and loads whole in one process.
    ckpt = T.resolve_checkpoint(tmp_path / "fsdp")
    assert is_sharded(ckpt) and sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    loaded = XLSTMLanguageModel.load(tmp_path / "fsdp")
    for k, v in fsdp["params"].items():
        assert torch.equal(loaded.state_dict()[k], v), k

    # kill -9 of rank 0 in the save of step 8: the run ends, `latest` stays on step 4 and the
    # staging folder of step 8 is left with the shards written so far.
    out = tmp_path / "killed"
    with pytest.raises(mp.ProcessExitedException):
        _spawn(tmp_path, out, every4, tag="killed", die_in_save=2)
    root = out / CHECKPOINTS_DIR
    assert (out / "latest").read_text().strip() == f"{CHECKPOINTS_DIR}/step-00000004"
    staging = [p for p in root.iterdir() if p.name.startswith(".tmp-step-00000008")]
    assert len(staging) == 1 and list(staging[0].glob("*.distcp"))
    mine = root / "notes.txt"  # a file of the user's: the clean-up leaves it
    mine.write_text("mine")

    # Resumed at 2 processes it removes the staging folder and continues bit for bit.
    resumed = _spawn(tmp_path, out, every4, tag="resumed", resume=True)
    assert not any(p.name.startswith(".tmp") for p in root.iterdir()) and mine.read_text() == "mine"
    assert resumed["losses"] == [(s, v) for s, v in fsdp["losses"] if s > 4]
    for k, v in fsdp["params"].items():
        assert torch.equal(resumed["params"][k], v), k

    # The 2-process checkpoint resumes at 1 and at 4 processes (weights and AdamW state
    # resharded): two more steps give what one process gives from its own step-12 checkpoint.
    cont = T.train(single, data, _config(grad_accum=2, pack=False, steps=STEPS + 2), tmp_path / "single",
                   device="cpu", resume=True, handle_signals=False)
    more = dict(every4, steps=STEPS + 2)
    one = _spawn(tmp_path, _copy_run(out, tmp_path / "at1"), more, world=1, tag="at1", resume=True)
    four = _spawn(tmp_path, _copy_run(out, tmp_path / "at4"), more, world=4, tag="at4", resume=True)
    for got in (one, four):
        assert [s for s, _ in got["losses"]] == [13, 14]
        for (_, a), (_, b) in zip(got["losses"], cont.losses):
            assert a == pytest.approx(b, rel=1e-5)
        for k, v in single.state_dict().items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-5, msg=k)


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".xlstm-kit.lock"))
    return dst


def test_fsdp_with_compiled_recomputed_blocks_exports_to_huggingface(tmp_path, corpus, monkeypatch):
    """compile_blocks (aot_eager; packed batches run the blocks uncompiled, so this run reads
    plain windows), activation checkpointing and accumulation under FSDP: one process's losses
    and weights; `xlstm-kit export` writes the sharded checkpoint as a HuggingFace folder holding
    the trained weights."""
    opts = dict(steps=4, grad_accum=2, pack=False, compile=True, activation_checkpointing="all")
    original = XLSTMLanguageModel.compile_blocks
    monkeypatch.setattr(XLSTMLanguageModel, "compile_blocks", lambda self: original(self, backend="aot_eager"))
    single = _model("large")
    ref = T.train(single, load_data(str(corpus), "byte", documents=True), _config(**opts), None, device="cpu",
                  handle_signals=False)
    start = _model("large").state_dict()
    got = _spawn(tmp_path, tmp_path / "run", dict(opts, parallel="fsdp"), tag="c", model="large", compiled=True)
    assert got["graphs"] > 0  # the workers ran compiled blocks
    for (_, a), (_, b) in zip(got["losses"], ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-5)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(got["params"][k], v, rtol=2e-5, atol=2e-5, msg=k)
    assert max((v - start[k]).abs().max().item() for k, v in single.state_dict().items()) > 1e-3
    assert got["val"] == pytest.approx([m.loss for _, m in ref.evals], rel=2e-5)

    assert app.main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "xlstm"
    exported = XLSTMLanguageModel.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for k, v in got["params"].items():
        assert torch.equal(exported.state_dict()[k], v), k


def test_fsdp_on_packed_documents_equals_one_process(tmp_path, corpus):
    """Packed windows (state reset at each document) under FSDP: one process's losses and weights
    (one process with 4 micro-steps reads the same micro-batches as 2 processes with 2 each), and
    packed validation, whose ranks read their windows in unequal numbers of forwards."""
    from xlstm_kit.training.packing import evaluate_packed, val_windows

    data = load_data(str(corpus), "byte", documents=True)
    single = _model()
    ref = T.train(single, data, _config(steps=6, grad_accum=4, pack=True), None, device="cpu", handle_signals=False)
    got = _spawn(tmp_path, tmp_path / "packed", dict(steps=6, grad_accum=2, pack=True, parallel="fsdp"), tag="p")
    for (_, a), (_, b) in zip(got["losses"], ref.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    # What 2 ranks compute: each its run of 4 windows, a document continued across the runs'
    # boundary read from zeros. A continued window whose document ends inside it is read in two
    # forwards, and the ranks have different numbers of those.
    val, docs = data.val, data.val_docs
    forwards = [sum(2 if cont and int(x.cu_seqlens[1]) < x.tokens.shape[1] else 1
                    for x, _, cont in val_windows(val, docs, 16, 8, r, 2)) for r in range(2)]
    assert forwards[0] != forwards[1], forwards
    single.eval()
    parts = [(float(loss), int((y != -100).sum())) for r in range(2)
             for loss, y in evaluate_packed(single, val, docs, seq_len=16, max_windows=8, rank=r, world_size=2)]
    assert got["val"] == pytest.approx([sum(p[0] for p in parts) / sum(p[1] for p in parts)], rel=1e-5)
