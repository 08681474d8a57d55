"""Models and settings shared by the lm-eval tests: a tiny HuggingFace-format xLSTM-7B-family
model with a BPE tokenizer that has a BOS token, and a training run folder of the paper's blocks
(mLSTM and sLSTM) with the byte tokenizer. The tasks are the YAML files of tasks/, over JSONL
files there; lm-eval loads them through HF datasets, kept offline here."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# lm-eval reads task data through HF datasets, which would otherwise ask the hub about "json";
# set before datasets is imported (it reads them once), and patched again below in case it was.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = Path(__file__).resolve().parent / "tasks"
VOCAB = 320
LARGE = dict(family="large", vocab_size=VOCAB, d_model=64, n_blocks=2, n_heads=2, qk_dim_factor=1.0,
             v_dim_factor=1.0, ffn_proj_factor=1.5, round_proj_to=16)


def task_texts() -> list[str]:
    """Every string of the tasks' JSONL files (the tokenizer learns its merges from them)."""
    out = []
    for f in sorted(TASKS.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            for v in json.loads(line).values():
                out += v if isinstance(v, list) else [v] if isinstance(v, str) else []
    return out


def make_bpe(path: Path):
    """A byte-level BPE tokenizer.json: every byte is a token (any text encodes), <|endoftext|> = 0
    (BOS and EOS, as in NX-AI/xLSTM-7b), <|pad|> = 1, merges learned from the task texts."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|pad|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(task_texts() * 5, trainer)
    tok.save(str(path))


def noisy(model, scale=0.1):
    """Weights moved off their initial values, so that the logits differ clearly between tokens."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    """A large-family model saved in HuggingFace format (transformers' xLSTMForCausalLM loads it),
    with its tokenizer.json and BOS = EOS = 0 in config.json."""
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.io.tokenizers import HFTokenizer

    base = tmp_path_factory.mktemp("lm_eval_hf")
    make_bpe(base / "tokenizer.json")
    torch.manual_seed(0)
    model = noisy(XLSTMLanguageModel(XLSTMConfig(**LARGE))).eval()
    model.hf_tokenizer = HFTokenizer(base / "tokenizer.json", bos_token_id=0, eos_token_id=0)
    model.save_pretrained(base / "hf")
    return base / "hf"


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory) -> Path:
    """A `xlstm-kit train --out` folder: the tiny preset (mLSTM and sLSTM blocks, byte tokenizer)
    after 2 steps on the task texts."""
    from xlstm_kit.cli import app as cli

    base = tmp_path_factory.mktemp("lm_eval_run")
    corpus = base / "corpus.txt"
    corpus.write_text("\n".join(task_texts() * 4), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLSTM_KIT_CACHE", str(base / "cache"))
        assert cli.main(["train", "--steps", "2", "--data", str(corpus), "--out", str(base / "run"),
                         "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
                         "--device", "cpu", "--threads", "1"]) == 0
    return base / "run"


@pytest.fixture
def in_tasks(monkeypatch, tmp_path):
    """Run from tasks/ (its YAML files name their JSONL files relative to the working directory),
    with HF datasets offline and caching into the test's own folder."""
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.chdir(TASKS)
    return TASKS
