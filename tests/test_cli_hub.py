"""The command line on HuggingFace xLSTM folders (config.json + safetensors + a tokenizers-format
tokenizer.json) and on our checkpoints: generate, eval, and train --init-from (fine-tuning)."""
import json

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.cli import app as cli
from xlstm_kit.training import TRAIN_META_FILE, resolve_checkpoint

from .test_cli_inputs import corpus  # noqa: F401  (a small text file)
from .test_hub import VOCAB, large_model, make_tokenizer_json

SMALL = ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--device", "cpu",
         "--threads", "1"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def hf_folder(tmp_path):
    """A tiny large-family model in HuggingFace format with its tokenizer.json (BOS id 0)."""
    folder = tmp_path / "hf"
    large_model(vocab_size=VOCAB).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 0, "eos_token_id": 1}))
    make_tokenizer_json(folder / "tokenizer.json")
    return folder


def test_help_mentions_huggingface_folders_and_init_from(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--init-from DIR" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "HuggingFace xLSTM folder" in capsys.readouterr().out


def test_generate_on_a_huggingface_folder_prepends_bos(hf_folder, capsys):
    assert cli.main(["generate", str(hf_folder), "--prompt", "to be", "--max-new-tokens", "6",
                     "--temperature", "0", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    model = XLSTMLanguageModel.from_pretrained(hf_folder)
    tok = model.tokenizer
    ids = tok.encode("to be")
    assert ids[0] == 0  # BOS first
    out = model.generate(torch.tensor(ids), max_new_tokens=6, temperature=0)[len(ids):].tolist()
    new = out[:out.index(1)] if 1 in out else out  # generation ends at EOS
    assert text.rstrip("\n") == "to be" + tok.decode(new)


def test_eval_on_a_huggingface_folder(hf_folder, corpus, capsys):
    losses = []
    for dtype in ("fp32", "bf16"):
        assert cli.main(["eval", str(hf_folder), "--data", str(corpus), "--seq-len", "16", "--batch-size", "2",
                         "--device", "cpu", "--threads", "1", "--dtype", dtype]) == 0
        line = capsys.readouterr().out
        assert "val loss" in line and "bits/byte" in line and "tokenizer hf-" in line
        losses.append(float(line.split("val loss ")[1].split()[0]))
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.05 * losses[0]  # bf16 weights: close, not equal


def test_train_init_from_a_huggingface_folder_then_resume_and_generate(hf_folder, corpus, tmp_path, capsys):
    out = tmp_path / "ft"
    start = XLSTMLanguageModel.from_pretrained(hf_folder)
    assert cli.main(["train", "--init-from", str(hf_folder), "--data", str(corpus), "--out", str(out),
                     "--steps", "2", "--lr", "1e-2", *SMALL]) == 0
    err = capsys.readouterr().err
    assert f"training the model of {hf_folder}" in err and "done: step 2" in err
    ckpt = resolve_checkpoint(out)
    meta = json.loads((ckpt / TRAIN_META_FILE).read_text())
    assert meta["init_from"] == str(hf_folder.resolve()) and meta["tokenizer"].startswith("hf-")
    assert (ckpt / "tokenizer.json").read_bytes() == (hf_folder / "tokenizer.json").read_bytes()
    tuned = XLSTMLanguageModel.load(ckpt)
    assert tuned.config == start.config and tuned.tokenizer.bos_token_id == 0
    moved = [k for k, v in tuned.state_dict().items() if not torch.equal(v, start.state_dict()[k])]
    assert len(moved) == len(start.state_dict())  # every weight trained from the loaded values
    assert all(torch.allclose(v, start.state_dict()[k], atol=0.2) for k, v in tuned.state_dict().items())
    # the run resumes with the folder's tokenizer, and the result generates and exports
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress", "--device", "cpu",
                     "--threads", "1"]) == 0
    assert "done: step 3" in capsys.readouterr().err
    assert cli.main(["generate", str(out), "--prompt", "to", "--max-new-tokens", "3", "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith("to")
    XLSTMLanguageModel.from_pretrained(out).save_pretrained(tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").is_file()


def test_init_from_a_larger_vocabulary_with_byte_tokens_then_generate(tmp_path, corpus, capsys):
    """An HF folder of 512 tokens and no tokenizer, fine-tuned on bytes: the ids past 255 the
    model still produces come out as U+FFFD (generate raised ValueError on them)."""
    folder = tmp_path / "hf512"
    model = large_model(vocab_size=512)
    with torch.no_grad():
        model.lm_head.weight[:256] = 0  # every byte's logit 0: the largest logit is a non-byte id
    model.save_pretrained(folder)
    out = tmp_path / "ft"
    assert cli.main(["train", "--init-from", str(folder), "--tokenizer", "byte", "--data", str(corpus),
                     "--out", str(out), "--steps", "1", "--lr", "1e-5", *SMALL]) == 0
    capsys.readouterr()
    tuned = XLSTMLanguageModel.load(out)
    new = tuned.generate(torch.tensor(list(b"to")), 4, temperature=0)[2:].tolist()
    assert any(i >= 256 for i in new)
    assert cli.main(["generate", str(out), "--prompt", "to", "--max-new-tokens", "4", "--temperature", "0",
                     "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert text == "to" + tuned.tokenizer.decode(new) + "\n" and "\ufffd" in text
    assert tuned.generate("to", 4, temperature=0) == text[:-1]


def test_train_init_from_our_checkpoint(tmp_path, corpus, capsys):
    m = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1]))
    m.save(tmp_path / "ours", tokenizer="byte")
    assert cli.main(["train", "--init-from", str(tmp_path / "ours"), "--data", str(corpus),
                     "--out", str(tmp_path / "ft"), "--steps", "1", *SMALL]) == 0
    assert "tokenizer byte" in capsys.readouterr().err
    assert XLSTMLanguageModel.load(tmp_path / "ft").config == m.config


@pytest.mark.parametrize("extra, words", [
    (["--preset", "tiny"], "leave out --preset"),
    (["--resume"], "leave out --resume"),
    (["--tokenizer", "gpt2"], "comes with its own tokenizer"),
])
def test_init_from_refuses_contradictions(hf_folder, corpus, tmp_path, capsys, extra, words):
    assert cli.main(["train", "--init-from", str(hf_folder), "--data", str(corpus), "--out", str(tmp_path / "o"),
                     *extra, *SMALL]) == 2
    assert words in capsys.readouterr().err


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["generate", str(tmp_path / "empty")]) == 2
    assert cli.main(["train", "--init-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "Traceback" not in err
