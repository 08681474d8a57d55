"""Generation: batches of prompts of different lengths (equal to one-by-one, both block families),
end tokens per row, stop strings, seeded sampling, the repetition penalty, argument errors, the
whole-character text streamer, and `xlstm-kit generate` (--prompts to JSON lines, --stream)."""
import io
import json
import sys

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.cli import app as cli
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.generation.generate import complete_texts, generate_text
from xlstm_kit.generation.sampling import apply_repetition_penalty
from xlstm_kit.generation.textstream import IncrementalDecoder, TextRow

VOCAB = 64
LENGTHS = (17, 1, 40, 5, 17)  # unsorted, one length twice: the per-length prefill puts rows back in order


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def tiny_model(family="neurips", chunk_size=8, vocab=VOCAB, seed=0, scale=0.3):
    """float32, 2 blocks (NeurIPS: an mLSTM and an sLSTM block), every weight moved off its init."""
    torch.manual_seed(seed)
    if family == "neurips":
        cfg = XLSTMConfig(vocab_size=vocab, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1], chunk_size=chunk_size)
    else:
        cfg = XLSTMConfig(family="large", vocab_size=vocab, d_model=32, n_blocks=2, n_heads=2, chunk_size=chunk_size)
    model = XLSTMLanguageModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


class CharTokenizer:
    """64 ids: a-z, A-Z, ten two-character tokens "0." .. "9.", space, and an end token (63)."""

    name = "chars"
    vocab_size = VOCAB
    eos_token_id = 63
    pieces = [chr(97 + i) for i in range(26)] + [chr(65 + i) for i in range(26)] + [f"{i}." for i in range(10)] + [" "]

    def encode(self, text):
        return [self.pieces.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.pieces[i] if i < 63 else "" for i in ids)


def prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# ---------------------------------------------------------------------------- batching
@pytest.mark.parametrize("family, chunk_size", [("neurips", 5), ("large", 8)])
def test_batched_mixed_lengths_equal_one_by_one(family, chunk_size):
    # chunk 5: lengths 5 and 40 are chunk multiples, 1 and 17 are not; chunk 8: only 40 is
    model = tiny_model(family, chunk_size)
    rows = prompts()
    batch = model.generate(rows, max_new_tokens=10, temperature=0)
    assert isinstance(batch, list) and len(batch) == len(rows)
    for p, out in zip(rows, batch):
        alone = model.generate(p, max_new_tokens=10, temperature=0)
        assert out.dim() == 1 and torch.equal(out, alone) and torch.equal(out[: p.numel()], p)
        # and greedy: every new token is the argmax of the teacher-forced logits
        logits = model(out[None])[0]
        assert torch.equal(logits[p.numel() - 1:-1].argmax(-1), out[p.numel():])


def test_mixed_lengths_are_read_in_one_packed_call(monkeypatch):
    """One forward over the prompts packed with cu_seqlens, keeping only each prompt's last
    logits; a model without packed input (plain forward/step) gets the same tokens per length."""
    import functools

    from xlstm_kit.generation.generate import generate

    model = tiny_model()
    rows = prompts()
    want = model.generate(rows, max_new_tokens=6, temperature=0)
    calls = []
    original = XLSTMLanguageModel.forward

    @functools.wraps(original)
    def spy(self, tokens, *args, **kwargs):
        out = original(self, tokens, *args, **kwargs)
        calls.append((list(tokens.shape), kwargs.get("cu_seqlens") is not None, list(out[0].shape)))
        return out

    monkeypatch.setattr(XLSTMLanguageModel, "forward", spy)
    got = model.generate(rows, max_new_tokens=6, temperature=0)
    assert calls == [([1, sum(LENGTHS)], True, [1, len(rows), VOCAB])]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(XLSTMLanguageModel, "forward", original)

    class Plain(torch.nn.Module):  # forward(tokens, state, return_state) only
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens, state=None, return_state=False):
            return self.inner(tokens, state, return_state)

        def step(self, tokens, state):
            return self.inner.step(tokens, state)

    plain = generate(Plain(model), rows, 6, temperature=0)
    assert all(torch.equal(a, b) for a, b in zip(plain, want))


def test_logits_to_keep_selects_positions():
    model = tiny_model("large")
    tokens = torch.randint(0, VOCAB, (2, 9))
    full = model(tokens)
    same = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731 - BLAS blocking
    assert same(model(tokens, logits_to_keep=1), full[:, -1:])
    assert same(model(tokens, logits_to_keep=3), full[:, -3:])
    at = torch.tensor([0, 4, 8])
    logits, state = model(tokens, return_state=True, logits_to_keep=at)
    assert same(logits, full[:, at]) and len(state) == len(model.blocks)
    # a negative count (which slicing would read as "all but the first") or a non-int is refused
    for bad in (-1, 1.5, True):
        with pytest.raises(XLSTMKitError, match="logits_to_keep"):
            model(tokens, logits_to_keep=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["neurips", "large"])
def test_batched_mixed_lengths_equal_one_by_one_on_cuda(family):
    """Triton prefill, CUDA-graph decode, the end-token check every few tokens on the device."""
    model = tiny_model(family, chunk_size=16).cuda()
    rows = [p.cuda() for p in prompts()]
    # cuda_graph=True: a step that fails to record raises instead of falling back in silence
    batch = model.generate(rows, max_new_tokens=20, temperature=0, cuda_graph=True)
    alone = [model.generate(p, max_new_tokens=20, temperature=0, cuda_graph=False) for p in rows]
    assert all(torch.equal(a, b) for a, b in zip(batch, alone))
    eos = int(alone[0][rows[0].numel() + 4])  # row 0 ends after 5 tokens
    ended = model.generate(rows, max_new_tokens=20, temperature=0, eos_token_id=eos, cuda_graph=True)
    for p, a, e in zip(rows, alone, ended):
        new = a[p.numel():].tolist()
        k = new.index(eos) + 1 if eos in new else len(new)
        assert torch.equal(e, a[: p.numel() + k])


def test_equal_lengths_in_a_list_match_the_tensor_form():
    model = tiny_model()
    rows = prompts((6, 6, 6))
    assert torch.equal(torch.stack(model.generate(rows, 5, temperature=0)),
                       model.generate(torch.stack(rows), 5, temperature=0))


def test_eos_ends_each_row_on_its_own():
    model = tiny_model()
    rows = prompts((5, 17, 1))
    greedy = [o[p.numel():].tolist() for p, o in zip(rows, model.generate(rows, 8, temperature=0))]
    eos = greedy[0][2]  # the 3rd token of row 0
    other = next((t for t in greedy[2] if t != eos), None)
    outs = model.generate(rows, 8, temperature=0, eos_token_id=[eos, other] if other is not None else eos)
    for p, g, out in zip(rows, greedy, outs):
        new = out[p.numel():].tolist()
        stop_ids = {eos, other}
        first = next((n for n, t in enumerate(g) if t in stop_ids), None)
        assert new == (g if first is None else g[: first + 1])  # through the end token, nothing after
    assert len(outs[0]) == 5 + 3
    # a [B, T] batch pads the rows that ended with the first end token id
    padded = model.generate(torch.stack([rows[0], rows[0]]), 8, temperature=0, eos_token_id=eos)
    assert padded.shape == (2, 8) and padded[0, 5:].tolist() == greedy[0][:3]


# ---------------------------------------------------------------------------- stop strings
def test_stop_strings_cut_text_and_end_token_rows():
    model = tiny_model(scale=0.6)
    tok = CharTokenizer()
    texts = ["ab", "hello world", "Q"]
    free = complete_texts(model, tok, texts, 24, temperature=0, eos_token_id=[])
    for n, c in enumerate(free):
        assert c.tokens == 24 and len(c.text) >= 20, "the test needs unstopped continuations"
    # a stop string from the middle of row 1's continuation, one that never occurs for row 2
    stop = free[1].text[6:8]
    never = "zzzzz"
    done = complete_texts(model, tok, texts, 24, temperature=0, eos_token_id=[], stop=[never, stop])
    for f, d in zip(free, done):
        cut = f.text.find(stop)
        assert d.text == (f.text if cut < 0 else f.text[:cut])
        assert stop not in d.text
    assert done[1].tokens < 24
    # the text API returns prompt + cut continuation; the token API ends rows with the token that
    # completed the stop string
    assert model.generate(texts, 24, temperature=0, stop=stop, tokenizer=tok)[1] == texts[1] + done[1].text
    ids = [torch.tensor(tok.encode(t)) for t in texts]
    full = model.generate(ids, 24, temperature=0)
    outs = model.generate(ids, 24, temperature=0, stop=stop, tokenizer=tok)
    for p, f, o in zip(ids, full, outs):
        new = f[p.numel():].tolist()
        k = next((k for k in range(1, len(new) + 1) if stop in tok.decode(new[:k])), len(new))
        assert o.tolist() == f[: p.numel() + k].tolist()


def test_streamed_text_adds_up_and_never_shows_a_stop_string():
    model = tiny_model(scale=0.6)
    tok = CharTokenizer()
    free = complete_texts(model, tok, ["hello world"], 24, temperature=0, eos_token_id=[])[0].text
    stop = free[10:13]
    pieces = []
    done = complete_texts(model, tok, ["ab", "hello world"], 24, temperature=0, eos_token_id=[], stop=stop,
                          streamer=lambda row, piece: pieces.append((row, piece)))
    for row in (0, 1):
        assert "".join(p for r, p in pieces if r == row) == done[row].text
    assert len([p for r, p in pieces if r == 1]) > 3  # it streamed, piece by piece
    assert done[1].text == free[: free.find(stop)]


def test_incremental_decoder_emits_whole_characters_only():
    from xlstm_kit.io.tokenizers import get_tokenizer

    byte = get_tokenizer("byte")
    text = "h€llo 🦜 ü"
    dec = IncrementalDecoder(byte)
    pieces = [dec.push(b) for b in text.encode("utf-8")]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces[1:4] == ["", "", "€"]  # three bytes, one character once the last arrives
    # a byte-level BPE splits the parrot over three tokens
    gpt2 = get_tokenizer("gpt2")
    ids = gpt2.encode("€🦜x")
    dec = IncrementalDecoder(gpt2)
    assert [dec.push(i) for i in ids] == ["€", "", "", "🦜", "x"]
    # a partial character at the very end comes out as U+FFFD, as a whole decode gives it
    row = TextRow(byte, emit=(out := []).append)
    for b in "aé".encode("utf-8")[:-1]:
        row.push(b)
    row.finish()
    assert "".join(out) == row.text == byte.decode("aé".encode("utf-8")[:-1])


def test_byte_ids_past_256_decode_to_the_replacement_character(tmp_path, capsys):
    """A byte-tokenizer model with a vocabulary larger than 256 (a padded one, or one trained
    from another model's): the ids past the bytes have no text and decode to U+FFFD, as an
    invalid byte does, in Python and on the command line (they raised ValueError)."""
    from xlstm_kit.io.tokenizers import get_tokenizer

    byte = get_tokenizer("byte")
    assert byte.decode([104, 300, 105]) == "h\ufffdi"
    assert byte.decode("é".encode("utf-8")[:1] + b"a") == "\ufffda"
    assert byte.decode(list("é".encode("utf-8")[:1]) + [256, 97]) == "\ufffd\ufffda"
    model = tiny_model(vocab=512, scale=0.5)
    new = model.generate(torch.tensor(list(b"ab")), 12, temperature=0)[2:].tolist()
    assert any(i >= 256 for i in new) and any(i < 256 for i in new)  # the case under test
    expected = "ab" + byte.decode(new)
    assert "\ufffd" in expected
    assert model.generate("ab", 12, temperature=0, tokenizer=byte) == expected
    folder = model.save(tmp_path / "m", tokenizer="byte")
    assert XLSTMLanguageModel.load(folder).generate("ab", 12, temperature=0) == expected
    assert cli.main(["generate", str(folder), "--prompt", "ab", "--max-new-tokens", "12", "--temperature", "0",
                     "--device", "cpu", "--threads", "1"]) == 0
    assert capsys.readouterr().out == expected + "\n"


# ---------------------------------------------------------------------------- sampling
def test_seed_reproduces_single_and_batched_sampling():
    model = tiny_model()
    rows = prompts((3, 9))
    kw = dict(temperature=1.0, top_k=40, top_p=0.95)
    a = model.generate(rows[0], 20, seed=7, **kw)
    assert torch.equal(a, model.generate(rows[0], 20, seed=7, **kw))
    assert not torch.equal(a, model.generate(rows[0], 20, seed=8, **kw))
    b = model.generate(rows, 20, seed=7, **kw)
    c = model.generate(rows, 20, seed=7, **kw)
    assert all(torch.equal(x, y) for x, y in zip(b, c))
    assert not all(torch.equal(x, y) for x, y in zip(b, model.generate(rows, 20, seed=8, **kw)))
    # the distribution is not degenerate: the samples are not the greedy tokens
    assert not torch.equal(a, model.generate(rows[0], 20, temperature=0))


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    present = torch.tensor([[True, True, False, True, False, True]])
    assert apply_repetition_penalty(logits, present, 2.0).tolist() == [[1.0, -2.0, 0.5, -6.0, 1.0, 0.0]]
    assert apply_repetition_penalty(logits, present, 0.5).tolist() == [[4.0, -0.5, 0.5, -1.5, 1.0, 0.0]]


def test_repetition_penalty_in_greedy_generation():
    model = tiny_model()
    for p in prompts((6, 2)):
        seq, penalty = p.tolist(), 1.7
        for _ in range(8):  # the reference: the whole sequence again for every token
            logits = model(torch.tensor([seq]))[0, -1].tolist()
            scored = [(x / penalty if x > 0 else x * penalty) if t in seq else x for t, x in enumerate(logits)]
            seq.append(max(range(VOCAB), key=scored.__getitem__))
        got = model.generate([p], 8, temperature=0, repetition_penalty=penalty)[0]
        assert got.tolist() == seq
    assert model.generate([p], 8, temperature=0, repetition_penalty=penalty)[0].tolist() != \
        model.generate([p], 8, temperature=0)[0].tolist()


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("prompt, kwargs, message", [
    ("ok", dict(temperature=-0.5), "temperature"),
    ("ok", dict(top_p=0.0), "top_p"),
    ("ok", dict(top_p=1.5), "top_p"),
    ("ok", dict(top_k=0), "top_k"),
    ("ok", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("ok", dict(repetition_penalty=-1.2), "repetition_penalty"),
    ("ok", dict(max_new_tokens=-1), "max_new_tokens"),
    ("ok", dict(seed=-3), "seed"),
    ("ok", dict(seed=1, generator=torch.Generator()), "not both"),
    ("ok", dict(stop=""), "stop"),
    ("ok", dict(eos_token_id=VOCAB), "eos_token_id"),
    ("ok", dict(streamer="print"), "streamer"),
    (torch.tensor([], dtype=torch.long), {}, "at least one token"),
    ([], {}, "empty"),
    ([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], {}, "prompt 1 of the list is empty"),
    ([torch.tensor([1, 2]), torch.tensor([[1, 2]])], {}, "1-D"),
    ([torch.tensor(3)], {}, "1-D"),
    ([torch.tensor([1, 2]), [1, 2]], {}, "1-D"),
    ([torch.tensor([1, VOCAB])], {}, "ids"),
    (torch.tensor([[1, -1]]), {}, "ids"),
    (torch.tensor([[1, 2]]), dict(stop="x", tokenizer=CharTokenizer()), "eos_token_id"),
])
def test_bad_arguments_raise_clear_errors(prompt, kwargs, message):
    model = tiny_model()
    prompt = [torch.tensor([1, 2, 3])] if isinstance(prompt, str) else prompt
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(XLSTMKitError, match=message):
        model.generate(prompt, **kwargs)


def test_text_lists_need_strings_only():
    model = tiny_model()
    with pytest.raises(XLSTMKitError, match="str"):
        generate_text(model, CharTokenizer(), ("ab", 3), 2)


# ---------------------------------------------------------------------------- command line
@pytest.fixture
def byte_model_dir(tmp_path):
    model = tiny_model(vocab=256, scale=0.5)
    return model, model.save(tmp_path / "m", tokenizer="byte")


class Terminal:
    """A stdout that says it is a terminal and keeps every write."""

    def __init__(self):
        self.writes = []
        self.encoding = "utf-8"

    def write(self, s):
        self.writes.append(s)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_cli_prompts_file_to_json_lines(byte_model_dir, tmp_path, monkeypatch, capsys):
    model, folder = byte_model_dir
    texts = ["ROMEO:", "a", "Zwölf Boxkämpfer jagen Viktor"]
    (tmp_path / "p.txt").write_text("\n".join(texts[:2]) + "\n\n" + texts[2] + "\n", encoding="utf-8")
    base = ["generate", str(folder), "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "12",
            "--temperature", "0", "--device", "cpu", "--threads", "1"]
    assert cli.main(base) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert "tokens/s" in captured.err and "tokens/s" not in captured.out
    assert [d["prompt"] for d in lines] == texts  # the empty line is skipped
    model.tokenizer_name = "byte"
    for d in lines:
        assert d["prompt"] + d["completion"] == model.generate(d["prompt"], 12, temperature=0)  # one by one
        assert d["tokens"] == 12
    assert cli.main(base + ["--output", str(tmp_path / "out.jsonl")]) == 0
    assert capsys.readouterr().out == ""
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()] == lines
    # "-": the prompts from stdin
    stdin = io.TextIOWrapper(io.BytesIO((tmp_path / "p.txt").read_bytes()), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main([x if x != str(tmp_path / "p.txt") else "-" for x in base]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines
    # --stop: each completion cut where its text appears
    stop = lines[2]["completion"][3:5]
    assert cli.main(base + ["--stop", stop, "--stop", "@@@"]) == 0
    cut = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for full, short in zip(lines, cut):
        i = full["completion"].find(stop)
        assert short["completion"] == (full["completion"] if i < 0 else full["completion"][:i])


def test_cli_refuses_hostile_prompts_files_in_one_line(byte_model_dir, tmp_path, monkeypatch, capsys):
    """--prompts /dev/zero read until memory ran out; a FIFO, a device, a folder or an oversized
    file (or standard input beyond the limit) is now refused in one line, exit 2."""
    import os

    from xlstm_kit.cli import generate as cli_generate

    _, folder = byte_model_dir
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(cli_generate, "MAX_PROMPTS_BYTES", 64)
    big = tmp_path / "big.txt"
    big.write_text("x" * 65)
    for path, needle in (("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
                         (str(tmp_path), "not a regular file"), (str(big), "more than the 64"),
                         (str(tmp_path / "missing.txt"), "does not exist")):
        argv = ["generate", str(folder), "--prompts", path, "--max-new-tokens", "2", "--device", "cpu"]
        assert cli.main(argv) == 2, path
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, (path, err)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"y" * 200), encoding="utf-8"))
    assert cli.main(["generate", str(folder), "--prompts", "-", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    assert "more than the 64" in capsys.readouterr().err


def test_prompts_file_swapped_for_a_fifo_after_the_check_is_refused(tmp_path, monkeypatch):
    """--prompts checked the name (stat) and then opened it: a FIFO put there in between blocked
    the open for ever. The file is now opened without blocking and its descriptor checked. The
    swap is simulated by a stat that still sees the regular file; the read runs in a thread, and
    a hang is ended by opening the FIFO for writing (the reader then sees end of file)."""
    import os
    import threading

    from xlstm_kit.cli import generate as cli_generate

    regular, fifo = tmp_path / "p.txt", tmp_path / "fifo"
    regular.write_text("a prompt\n")
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(regular if str(p) == str(fifo) else p, *a, **k))
    result = {}

    def read():
        try:
            result["value"] = cli_generate._read_prompts(str(fifo))
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(2)
    hung = thread.is_alive()
    if hung:  # a writer's open lets the blocked reader's open return; its close is end of file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
    assert not hung, "reading a FIFO swapped in after the check blocked"
    err = result.get("error")
    assert isinstance(err, XLSTMKitError) and "not a regular file" in str(err) and "\n" not in str(err), result


def test_cli_stream_prints_the_same_text_piece_by_piece(byte_model_dir, monkeypatch, capsys):
    _, folder = byte_model_dir
    base = ["generate", str(folder), "--prompt", "To be", "--max-new-tokens", "30", "--seed", "3",
            "--top-p", "0.9", "--repetition-penalty", "1.3", "--device", "cpu", "--threads", "1"]
    assert cli.main(base + ["--no-stream"]) == 0
    plain = capsys.readouterr().out
    for flags in (["--stream"], []):  # a terminal streams by default
        term = Terminal()
        monkeypatch.setattr(sys, "stdout", term)
        assert cli.main(base + flags) == 0
        monkeypatch.undo()
        assert "".join(term.writes) == plain
        assert len([w for w in term.writes if w]) > 3


def test_cli_generate_argument_errors(byte_model_dir, tmp_path, capsys):
    _, folder = byte_model_dir
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "p.txt").write_text("ab\n")
    for argv, message in [
        (["--prompts", str(tmp_path / "empty.txt")], "no prompt"),
        (["--prompts", str(tmp_path / "p.txt"), "--stream"], "--stream"),
        (["--prompt", "a", "--output", str(tmp_path / "o.jsonl")], "--output goes with --prompts"),
        (["--prompts", str(tmp_path / "p.txt"), "--output", str(tmp_path / "no" / "o.jsonl")], "does not exist"),
        (["--prompt", "a", "--top-p", "1.5"], "top-p"),
        (["--prompt", "a", "--stop", ""], "--stop"),
    ]:
        assert cli.main(["generate", str(folder), "--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--prompts FILE" in out and "--stream" in out and "JSON" in out


def test_cli_compile_decodes_the_same_text(byte_model_dir, monkeypatch, capsys):
    """--compile goes through model.compile_step (here with Dynamo's aot_eager backend: Inductor's
    C++ builds take minutes on a CPU) and prints what the eager decode prints."""
    from xlstm_kit.models import XLSTMLanguageModel  # the class the command line loads

    _, folder = byte_model_dir
    base = ["generate", str(folder), "--prompt", "To be", "--max-new-tokens", "12", "--temperature", "0",
            "--no-stream", "--device", "cpu", "--threads", "1"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    calls = []
    original = XLSTMLanguageModel.compile_step

    def compile_step(self, **options):
        calls.append(options)
        original(self, backend="aot_eager", **options)

    monkeypatch.setattr(XLSTMLanguageModel, "compile_step", compile_step)
    monkeypatch.setattr("xlstm_kit.cli.common.compile_unavailable", lambda device: None)
    assert cli.main(base + ["--compile"]) == 0
    assert calls == [{}] and capsys.readouterr().out == plain
