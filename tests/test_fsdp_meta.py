"""FSDP set-up where only rank 0 holds the whole model: the other ranks build it on the meta
device and allocate only their shards, whose values come from rank 0. Two processes over gloo,
through the command line's `train` (a fresh preset, --init-from a saved model and a HuggingFace
folder, --resume of a sharded run) and through the library's `train`."""
import os
from datetime import timedelta

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.loading import load_model
from xlstm_kit.training.data import load_data
from tests.helpers import destroy_together, spawn_ranks

TEXT = "the quick brown fox jumps over the lazy dog. " * 80
CLI_SMALL = ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--threads", "1"]


def _gathered(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def _setup_only(record):
    """Stands in for `train` in the command line: what the command line built, then the FSDP
    set-up of `train` (wrappers, shard_model), then the weights gathered back whole."""
    from xlstm_kit.training.compiling import prepare_model
    from xlstm_kit.training.distributed import on_meta, shard_model

    def setup(model, data, config, out, *, dist, **kwargs):
        device = torch.device("cpu")
        record["meta"] = on_meta(model)
        # no tensor with data on this rank before sharding: nothing of the whole model was allocated
        record["materialized"] = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
        full_sizes = {n: p.numel() for n, p in model.named_parameters()}
        prepare_model(model, config, device)
        shard_model(model, dist, device, config.precision)
        # each rank now holds only its shard of every parameter with more than one row
        record["local_vs_full"] = {n: (p.to_local().numel(), full_sizes[n]) for n, p in model.named_parameters()}
        record["weights"] = _gathered(model)
        record["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        return T.TrainResult(step=config.steps, interrupted=False)

    return setup


def _cli_worker(rank, world, port, job):
    from xlstm_kit.cli import app, train as cli_train

    os.environ.update(XLSTM_KIT_CACHE=job["cache"], WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    record = {}
    if job["setup_only"]:
        cli_train.train = _setup_only(record)
    else:
        real = cli_train.train

        def spy(model, *args, **kwargs):
            from xlstm_kit.training import loop
            from xlstm_kit.training.distributed import on_meta

            record["meta"] = on_meta(model)
            record["materialized"] = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
            load = loop.load_sharded_into

            def load_and_record(model, optimizer, checkpoint):
                load(model, optimizer, checkpoint)
                record["restored"] = _gathered(model)

            loop.load_sharded_into = load_and_record
            result = real(model, *args, **kwargs)
            record["weights"] = {k: v.clone() for k, v in _gathered(model).items()}
            record["losses"] = result.losses
            return result

        cli_train.train = spy
    data = [] if "--resume" in job["args"] else ["--parallel", "fsdp", "--data", job["corpus"]]
    assert app.main(["train", *data, "--out", job["out"], *job["args"], *CLI_SMALL]) == 0
    torch.save(record, f"{job['result']}.{rank}")


def _cli(tmp_path, tag, args, setup_only=True, world=2):
    job = dict(cache=str(tmp_path / "cache"), corpus=str(tmp_path / "c.txt"), out=str(tmp_path / tag),
               result=str(tmp_path / f"{tag}.pt"), args=args, setup_only=setup_only)
    spawn_ranks(_cli_worker, world, job)
    return [torch.load(f"{job['result']}.{r}", weights_only=False) for r in range(world)]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text(TEXT)
    load_data(str(tmp_path / "c.txt"), "byte")  # tokenized once: the workers only read the cache
    return tmp_path / "c.txt"


def _check_setup(ranks, expected):
    rank0, rank1 = ranks
    assert rank0["meta"] is False and rank0["materialized"] > 0
    assert rank1["meta"] is True and rank1["materialized"] == 0
    for name, (local, full) in rank1["local_vs_full"].items():
        assert local <= -(-full // 2), name  # a shard: at most half of the rows, rounded up
    assert sorted(rank0["weights"]) == sorted(expected)
    for r in ranks:
        assert r["buffers"].keys() == dict(XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=16, n_blocks=1,
                                                                          n_heads=1)).named_buffers()).keys()
        for k, v in expected.items():
            got = r["weights"][k]
            assert got.dtype == v.dtype == torch.float32 and torch.equal(got, v), k
    # rank 1's values are rank 0's, not leftovers of the allocation: the values differ from zero
    assert any(v.abs().sum() > 0 for v in rank1["weights"].values())


@pytest.mark.parametrize("extra", [[], ["--activation-checkpointing", "all"]])
def test_fresh_preset_sharded_from_rank0_equals_one_process(tmp_path, corpus, extra):
    ranks = _cli(tmp_path, "fresh", ["--preset", "tiny", "--steps", "1", "--seed", "7", *extra])
    torch.manual_seed(7)
    expected = XLSTMLanguageModel(XLSTMConfig.from_name("tiny", vocab_size=256)).state_dict()
    _check_setup(ranks, expected)


def test_init_from_a_saved_model_sharded_from_rank0(tmp_path, corpus):
    torch.manual_seed(3)
    saved = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1],
                                           tie_embeddings=True))
    saved.save(tmp_path / "saved", tokenizer="byte")
    ranks = _cli(tmp_path, "ft", ["--init-from", str(tmp_path / "saved"), "--steps", "1", "--seed", "9"])
    _check_setup(ranks, XLSTMLanguageModel.from_pretrained(tmp_path / "saved", dtype=torch.float32).state_dict())
    # the tie survives the meta build, to_empty and sharding on rank 1
    assert torch.equal(ranks[1]["weights"]["lm_head.weight"], ranks[1]["weights"]["embedding.weight"])


def test_init_from_a_huggingface_folder_sharded_from_rank0(tmp_path, corpus):
    from xlstm_kit.io.hf import save_pretrained

    torch.manual_seed(5)
    src = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=256, d_model=32, n_blocks=2, n_heads=2))
    save_pretrained(src, tmp_path / "hf")
    ranks = _cli(tmp_path, "hf-ft", ["--init-from", str(tmp_path / "hf"), "--tokenizer", "byte", "--steps", "1"])
    _check_setup(ranks, XLSTMLanguageModel.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict())


def test_fsdp_training_and_resume_through_the_command_line_with_meta_ranks(tmp_path, corpus):
    """Rank 1 built on meta trains to one process's losses; a resume, where every rank (0
    included) builds on meta and reads its shards from the sharded checkpoint, continues them
    and starts from exactly the weights saved. Only a sharded checkpoint puts rank 0 on meta: a
    resume from one with model.safetensors (the one-process run's here, as a DDP run's) keeps
    rank 0 building the whole model."""
    from xlstm_kit.cli import app
    from xlstm_kit.io.sharded import resumes_from_shards
    from xlstm_kit.training.distributed import builds_on_meta
    from xlstm_kit.training.plots import read_metrics

    common = ["--preset", "tiny", "--seed", "4", "--lr", "3e-3", "--checkpoint-interval", "2", "--eval-interval", "0"]
    # one process, the same two sessions (the resume stretches the 2-step schedule to 4 steps)
    assert app.main(["train", "--data", str(corpus), "--out", str(tmp_path / "one"), "--device", "cpu",
                     "--steps", "2", *common, *CLI_SMALL]) == 0
    assert app.main(["train", "--out", str(tmp_path / "one"), "--resume", "--steps", "4", *CLI_SMALL]) == 0
    ref = {row["step"]: row["loss"] for row in read_metrics(tmp_path / "one" / "metrics.jsonl", 4) if "loss" in row}
    first = _cli(tmp_path, "two", ["--steps", "2", *common], setup_only=False)
    assert first[1]["meta"] is True and first[0]["meta"] is False
    assert resumes_from_shards(tmp_path / "two") is True
    assert resumes_from_shards(tmp_path / "one") is False and resumes_from_shards(tmp_path / "nothing") is False
    rank0, rank1 = T.DistInfo(rank=0, world_size=2), T.DistInfo(rank=1, world_size=2)
    assert builds_on_meta(rank0, "fsdp", sharded_resume=True) and builds_on_meta(rank1, "fsdp", sharded_resume=True)
    assert not builds_on_meta(rank0, "fsdp", sharded_resume=False) and builds_on_meta(rank1, "fsdp")
    assert not builds_on_meta(rank0, "ddp", sharded_resume=True)
    assert not builds_on_meta(T.DistInfo(), "fsdp", sharded_resume=True)  # one process: nothing to shard over
    resumed = _cli(tmp_path, "two", ["--resume", "--steps", "4"], setup_only=False)
    for r in resumed:  # no rank read or built the whole model
        assert r["meta"] is True and r["materialized"] == 0
    # first[0]["weights"]: gathered after the first session, whose last step (2) it saved
    saved = load_model(tmp_path / "two" / "checkpoints" / "step-00000002")
    assert sorted(saved.state_dict()) == sorted(first[0]["weights"])
    for r in resumed:
        assert sorted(r["restored"]) == sorted(first[0]["weights"])
        for k, v in first[0]["weights"].items():
            got = r["restored"][k]
            assert got.dtype == v.dtype == torch.float32 and torch.equal(got, v), k
            assert torch.equal(saved.state_dict()[k], v), k
    losses = dict(first[0]["losses"] + resumed[0]["losses"])
    assert 4 in losses and set(losses) <= set(ref)
    for step, value in losses.items():
        assert value == pytest.approx(ref[step], rel=1e-5), step
    # (the weights are compared in the library test below: the command line has no --eps, and at
    # AdamW's default the sLSTM input-gate bias's zero gradient turns rounding noise into updates)


def _lib_worker(rank, world, port, job):
    import torch.distributed as dist

    os.environ["XLSTM_KIT_CACHE"] = job["cache"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        with torch.device("meta") if rank == job["meta_rank"] else torch.device("cpu"):
            model = XLSTMLanguageModel(XLSTMConfig(**job["model"]))
        try:
            res = T.train(model, load_data(job["corpus"], "byte"), T.TrainConfig(**job["config"]), None,
                          device="cpu", dist=T.DistInfo(rank=rank, world_size=world), handle_signals=False)
        except XLSTMKitError as e:
            torch.save({"error": str(e)}, f"{job['result']}.{rank}")
            return
        torch.save({"losses": res.losses, "weights": _gathered(model)}, f"{job['result']}.{rank}")
    finally:
        destroy_together()


def _lib(tmp_path, tag, meta_rank, model, config):
    job = dict(cache=str(tmp_path / "cache"), corpus=str(tmp_path / "c.txt"), result=str(tmp_path / f"{tag}.pt"),
               meta_rank=meta_rank, model=model, config=config)
    spawn_ranks(_lib_worker, 2, job)
    return [torch.load(f"{job['result']}.{r}", weights_only=False) for r in range(2)]


MODEL = dict(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1], context_length=16, chunk_size=8)
CONFIG = dict(steps=5, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=1, eps=1e-6, grad_clip=0.5,
              eval_interval=0, eval_batches=1, eval_at_start=False, checkpoint_interval=0, seed=2)


def test_library_train_with_a_meta_rank_equals_one_process(tmp_path, corpus):
    torch.manual_seed(0)
    single = XLSTMLanguageModel(XLSTMConfig(**MODEL))
    ref = T.train(single, load_data(str(corpus), "byte"), T.TrainConfig(**CONFIG), None, device="cpu",
                  handle_signals=False)
    ranks = _lib(tmp_path, "lib", 1, MODEL, dict(CONFIG, parallel="fsdp"))
    for r in ranks:
        assert [v for _, v in r["losses"]] == pytest.approx([v for _, v in ref.losses], rel=1e-5)
        for k, v in single.state_dict().items():
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_meta_model_where_it_cannot_be_filled_is_one_line(tmp_path, corpus):
    # rank 0 on meta: nobody holds the weights; every rank refuses, none waits for the others
    ranks = _lib(tmp_path, "meta0", 0, MODEL, dict(CONFIG, parallel="fsdp"))
    for r in ranks:
        assert "rank 0's is on the meta device" in r["error"] and "\n" not in r["error"]
    # without FSDP a meta model is refused before any collective
    with torch.device("meta"):
        model = XLSTMLanguageModel(XLSTMConfig(**MODEL))
    with pytest.raises(XLSTMKitError, match="on the meta device") as e:
        T.train(model, load_data(str(corpus), "byte"), T.TrainConfig(**CONFIG), None, device="cpu",
                handle_signals=False)
    assert "\n" not in str(e.value)


class _WithBuffers(torch.nn.Module):
    """The xlstm_kit models have no buffers (named_buffers is empty): this stands for a model that
    has both kinds, e.g. a rotary table (non-persistent) and running statistics (persistent)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.blocks[0].register_buffer("table", torch.randn(5, 3), persistent=False)
        self.register_buffer("stats", torch.randn(4))


def test_buffers_of_both_kinds_come_from_rank0(sharded):
    torch.manual_seed(11)
    ref = _WithBuffers()
    for r, got in enumerate(sharded["rank0"]):
        assert sorted(got["buffers"]) == ["blocks.0.table", "stats"]
        for n, b in ref.named_buffers():
            assert torch.equal(got["buffers"][n], b), (r, n)
        for k, v in ref.state_dict().items():
            assert torch.equal(got["weights"][k], v), (r, k)


def test_lora_fine_tuning_with_a_meta_rank_equals_one_process(tmp_path, corpus):
    """--init-from with --lora: rank 1 puts its adapters on the meta model; the adapters' initial
    values (from the seed) and the frozen base come from rank 0."""
    from xlstm_kit.cli import app
    from xlstm_kit.training.plots import read_metrics

    torch.manual_seed(3)
    XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1])).save(
        tmp_path / "saved", tokenizer="byte")
    tune = ["--init-from", str(tmp_path / "saved"), "--steps", "3", "--lora", "4", "--seed", "9", "--lr", "1e-2"]
    assert app.main(["train", "--data", str(corpus), "--out", str(tmp_path / "one"), "--device", "cpu", *tune,
                     *CLI_SMALL]) == 0
    ref = {row["step"]: row["loss"] for row in read_metrics(tmp_path / "one" / "metrics.jsonl", 3) if "loss" in row}
    ranks = _cli(tmp_path, "lora", tune, setup_only=False)
    assert ranks[1]["meta"] is True and any("lora" in k for k in ranks[0]["weights"])
    assert sorted(dict(ranks[0]["losses"])) == sorted(ref) == [1, 2, 3]
    for step, value in ranks[0]["losses"]:
        assert value == pytest.approx(ref[step], rel=1e-5), step
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][k], v), k


SHARD_CASES = {  # name: (ranks that build on meta, each rank's weights_from)
    "rank0": ({1}, ["rank0", "rank0"]),
    "allmeta": ({0, 1}, ["checkpoint", "checkpoint"]),
    "rank0full": ({1}, ["checkpoint", "checkpoint"]),
    "disagree": ({1}, ["rank0", "checkpoint"]),
}


def _shard_worker(rank, world, port, job):
    import torch.distributed as dist

    from xlstm_kit.training.distributed import shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {}
        for name, (meta_ranks, weights_from) in SHARD_CASES.items():  # a fresh model each, one process group
            torch.manual_seed(11)
            with torch.device("meta") if rank in meta_ranks else torch.device("cpu"):
                model = _WithBuffers()
            try:
                shard_model(model, T.DistInfo(rank=rank, world_size=world), torch.device("cpu"), "fp32",
                            weights_from=weights_from[rank])
            except XLSTMKitError as e:
                results[name] = {"error": str(e)}
                continue
            results[name] = {"buffers": {n: b.clone() for n, b in model.named_buffers()}}
            if set(weights_from) == {"rank0"}:
                results[name]["weights"] = _gathered(model)
        torch.save(results, f"{job['result']}.{rank}")
    finally:
        destroy_together()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Each rank's result of every case of SHARD_CASES, all from one 2-process run (starting
    the processes costs more than the cases)."""
    job = dict(result=str(tmp_path_factory.mktemp("shard") / "shard.pt"))
    spawn_ranks(_shard_worker, 2, job)
    ranks = [torch.load(f"{job['result']}.{r}", weights_only=False) for r in range(2)]
    return {name: [r[name] for r in ranks] for name in SHARD_CASES}


def test_weights_from_checkpoint_and_non_persistent_buffers(sharded):
    # every rank on meta: nobody holds the buffers a checkpoint lacks; both refuse in one line
    for r in sharded["allmeta"]:
        assert "non-persistent buffers" in r["error"] and "\n" not in r["error"]
    # rank 0 built with them: rank 1's non-persistent buffer is rank 0's, not to_empty's garbage
    torch.manual_seed(11)
    table = _WithBuffers().blocks[0].table
    for r in sharded["rank0full"]:
        assert torch.equal(r["buffers"]["blocks.0.table"], table)
    # ranks that disagree would hang in a broadcast only some join: refused on both
    for r in sharded["disagree"]:
        assert "disagree on where the weights come from" in r["error"] and "\n" not in r["error"]
