"""Files of a model folder, a checkpoint or a run that may be missing (tokenizer.json,
generation_config.json, train_meta.json, checksums.json, a sharded checkpoint's index, ...) and
are planted as something other than a regular file: a FIFO, a device, a folder. Each one the
library reads is refused in one line naming it, at once: never passed over as if it were absent
(a model loaded without its tokenizer or end tokens, weights loaded unchecked), never a hang on
a FIFO without a writer. A file that is absent stays fine."""
import json
import os
import shutil

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import MissingFileError, XLSTMKitError

pytestmark = pytest.mark.usefixtures("single_thread")

SPECIAL = ("fifo", "device", "folder")
VOCAB = 64


def remove(path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def plant(path, kind):
    """Put a FIFO without a writer (a plain open blocks for ever), a link to a character device or
    a folder where the file ``path`` was."""
    remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to(os.devnull)
    elif kind == "folder":
        path.mkdir()
        (path / "inside").write_text("{}")
    else:
        raise ValueError(kind)


def refused(fn, name, needle="not a regular file"):
    with pytest.raises(XLSTMKitError) as e:
        fn()
    message = str(e.value)
    assert name in message and needle in message and "\n" not in message, message


def ours(folder, tokenizer=None):
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(vocab_size=VOCAB, d_model=16, n_blocks=2, n_heads=2, slstm_at=[1], chunk_size=8))
    m.save(folder, tokenizer=tokenizer)
    return folder


def hf(folder):
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=VOCAB, d_model=16, n_blocks=2, n_heads=2,
                                       ffn_proj_factor=1.5, round_proj_to=16))
    m.save_pretrained(folder)
    return folder


def tokenizer_json(path):
    vocab = {"<s>": 0, "</s>": 1, **{chr(97 + i): 2 + i for i in range(20)}}
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}}))


LOADS = {"load": XLSTMLanguageModel.load, "from_pretrained": XLSTMLanguageModel.from_pretrained}


@pytest.mark.timeout(60)  # the failure a FIFO read by name would cause is a hang
@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", ["tokenizer.json", "train_meta.json"])
def test_a_checkpoints_tokenizer_files_are_refused_not_passed_over(tmp_path, kind, name):
    """tokenizer.json (our tokenizer's name, or a tokenizers file) and train_meta.json (where
    checkpoints written before tokenizer.json recorded the tokenizer) were read only when a name
    check saw a regular file: a FIFO or a folder there loaded the model without its tokenizer."""
    from xlstm_kit.io.checkpoint import read_train_meta

    folder = ours(tmp_path / "m")
    for load in LOADS.values():  # absent: the model loads and knows no tokenizer
        m = load(folder)
        assert m.tokenizer_name is None and m.hf_tokenizer is None
    plant(folder / name, kind)
    for load in LOADS.values():
        refused(lambda: load(folder), name)
    if name == "train_meta.json":  # resume and the command line read it too
        refused(lambda: read_train_meta(folder), name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_find_tokenizer_refuses_a_tokenizer_json_that_is_not_a_file(tmp_path, kind):
    """Through find_tokenizer alone, which loading and serving share; absent: no tokenizer."""
    from xlstm_kit.io.tokenizers import find_tokenizer, is_hf_tokenizer_file

    folder = tmp_path / "f"
    folder.mkdir()
    tokenizer_json(folder / "tokenizer.json")
    assert is_hf_tokenizer_file(folder / "tokenizer.json") and find_tokenizer(folder) is not None
    plant(folder / "tokenizer.json", kind)
    refused(lambda: is_hf_tokenizer_file(folder / "tokenizer.json"), "tokenizer.json")
    refused(lambda: find_tokenizer(folder), "tokenizer.json")
    remove(folder / "tokenizer.json")
    assert not is_hf_tokenizer_file(folder / "tokenizer.json") and find_tokenizer(folder) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_a_huggingface_folders_tokenizer_and_end_tokens_are_refused_not_passed_over(tmp_path, kind, name):
    """generation_config.json sets the end tokens generation stops at: one that was a FIFO or a
    folder was passed over (is_file), and generation ran past the model's end tokens."""
    folder = hf(tmp_path / "hf")
    tokenizer_json(folder / "tokenizer.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    m = XLSTMLanguageModel.from_pretrained(folder)
    assert m.hf_tokenizer is not None and m.eos_token_ids == (1, 2)
    plant(folder / name, kind)
    refused(lambda: XLSTMLanguageModel.from_pretrained(folder), name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_checksums_file_that_is_not_a_file_is_refused_not_a_load_unchecked(tmp_path, kind):
    """checksums.json passed over when it was not a regular file: the weights loaded without the
    check of their digest."""
    from xlstm_kit.io.checkpoint import verify_checksum

    folder = ours(tmp_path / "m")
    plant(folder / "checksums.json", kind)
    refused(lambda: verify_checksum(folder, "model.safetensors"), "checksums.json")
    for load in LOADS.values():
        refused(lambda: load(folder), "checksums.json")
    remove(folder / "checksums.json")
    verify_checksum(folder, "model.safetensors")  # absent: checkpoints written before checksums load
    XLSTMLanguageModel.load(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_config_that_is_not_a_file_is_named_as_such(tmp_path, kind):
    """from_pretrained said the folder "has no config.json" when one was there as a FIFO."""
    folder = ours(tmp_path / "m")
    plant(folder / "config.json", kind)
    for load in LOADS.values():
        refused(lambda: load(folder), "config.json")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_huggingface_folders_weights_that_are_not_files_are_refused(tmp_path, kind, name):
    """A FIFO index beside model.safetensors was passed over (the weights it does not list were
    loaded); weights that were a FIFO were reported missing ("has neither ...")."""
    folder = hf(tmp_path / "hf")
    XLSTMLanguageModel.from_pretrained(folder)
    plant(folder / name, kind)
    refused(lambda: XLSTMLanguageModel.from_pretrained(folder), name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_huggingface_shard_that_is_not_a_file_is_refused(tmp_path, kind):
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=VOCAB, d_model=16, n_blocks=2, n_heads=2,
                                       ffn_proj_factor=1.5, round_proj_to=16))
    m.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
    shards = sorted(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(set(shards)) > 1
    plant(tmp_path / "hf" / shards[-1], kind)
    refused(lambda: XLSTMLanguageModel.from_pretrained(tmp_path / "hf"), shards[-1])


def _checkpoint(tmp_path):
    from xlstm_kit.io.checkpoint import save_checkpoint
    from xlstm_kit.training import TrainConfig, make_optimizer

    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(vocab_size=VOCAB, d_model=16, n_blocks=2, n_heads=2, slstm_at=[1], chunk_size=8))
    return save_checkpoint(tmp_path / "run", m, make_optimizer(m, TrainConfig()), 3, TrainConfig(),
                           meta={"tokenizer": "byte"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_training_state_that_is_not_a_file_is_refused_as_such(tmp_path, kind):
    """train_state.pt as a FIFO: "has no train_state.pt: it is a model checkpoint", and the
    check of the name was followed by an open by name."""
    from xlstm_kit.io.checkpoint import load_training_state

    final = _checkpoint(tmp_path)
    assert load_training_state(final)["step"] == 3
    plant(final / "train_state.pt", kind)
    refused(lambda: load_training_state(final), "train_state.pt")
    remove(final / "train_state.pt")
    refused(lambda: load_training_state(final), "train_state.pt", "it is a model checkpoint, not resumable")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_runs_latest_that_is_not_a_file_is_refused_as_such(tmp_path, kind):
    """`latest` as a FIFO made the run folder look like one that holds no checkpoint."""
    from xlstm_kit.io.checkpoint import resolve_checkpoint

    final = _checkpoint(tmp_path)
    assert resolve_checkpoint(tmp_path / "run") == final
    plant(tmp_path / "run" / "latest", kind)
    refused(lambda: resolve_checkpoint(tmp_path / "run"), "latest")
    for load in LOADS.values():
        refused(lambda: load(tmp_path / "run"), "latest")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_sharded_index_that_is_not_a_file_is_refused(tmp_path, kind):
    """A FIFO at a sharded checkpoint's index (.metadata), without model.safetensors, made the
    checkpoint look like one whose model.safetensors is missing."""
    from xlstm_kit.io.checkpoint import is_sharded

    folder = ours(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    assert not is_sharded(folder)
    plant(folder / ".metadata", kind)
    refused(lambda: is_sharded(folder), ".metadata")


def _stat_sees_a_regular_file(monkeypatch, fifo, stand_in):
    """A check by name that sees `stand_in` where `fifo` is: a FIFO put in place of a file between
    a check of its name and its opening."""
    real_stat, real_lstat = os.stat, os.lstat
    swap = lambda p: stand_in if os.fspath(p) == os.fspath(fifo) else p  # noqa: E731
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(swap(p), *a, **k))
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: real_lstat(swap(p), *a, **k))


@pytest.mark.timeout(60)
def test_a_file_swapped_for_a_fifo_after_its_check_is_refused_by_its_checksum(tmp_path, monkeypatch):
    """The checksum of a file was taken after a stat of its name: a FIFO put there in between
    blocked the open for ever."""
    from xlstm_kit.io.checkpoint import CheckpointError, verify_checksum

    folder = ours(tmp_path / "m")
    stand_in = tmp_path / "stand-in"
    shutil.copy(folder / "model.safetensors", stand_in)
    plant(folder / "model.safetensors", "fifo")
    _stat_sees_a_regular_file(monkeypatch, folder / "model.safetensors", stand_in)
    with pytest.raises(CheckpointError, match="model.safetensors is not a regular file"):
        verify_checksum(folder, "model.safetensors")


def test_our_config_without_weights_is_one_line_through_from_pretrained(tmp_path):
    """A bare FileNotFoundError (a traceback on the command line) before."""
    folder = ours(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "checksums.json").unlink()
    with pytest.raises(MissingFileError, match="has no model.safetensors"):
        XLSTMLanguageModel.from_pretrained(folder)


@pytest.mark.timeout(60)
def test_a_sharded_index_swapped_for_a_fifo_after_its_check_is_refused(tmp_path, monkeypatch):
    from xlstm_kit.io.checkpoint import CheckpointError
    from xlstm_kit.io.sharded import read_index

    stand_in = tmp_path / "stand-in"
    stand_in.write_bytes(b"not a pickle")
    plant(tmp_path / ".metadata", "fifo")
    _stat_sees_a_regular_file(monkeypatch, tmp_path / ".metadata", stand_in)
    with pytest.raises(CheckpointError, match=r"\.metadata .*not a regular file"):
        read_index(tmp_path)


@pytest.mark.timeout(60)
def test_earlier_weights_swapped_for_a_fifo_are_not_taken_for_ours(tmp_path, monkeypatch):
    """A save over a folder without a manifest opened its model.safetensors by name after a name
    check, to see whether an earlier version of xlstm_kit wrote it."""
    from xlstm_kit.io.files import MANIFEST_FILE, _earlier_model_files

    folder = ours(tmp_path / "m")
    (folder / MANIFEST_FILE).unlink()
    assert "model.safetensors" in _earlier_model_files(folder)
    stand_in = tmp_path / "stand-in"
    shutil.copy(folder / "model.safetensors", stand_in)
    plant(folder / "model.safetensors", "fifo")
    _stat_sees_a_regular_file(monkeypatch, folder / "model.safetensors", stand_in)
    assert _earlier_model_files(folder) == set()


@pytest.mark.parametrize("kind", SPECIAL)
def test_weights_of_a_model_without_config_that_are_not_a_file_are_refused(tmp_path, kind):
    """Resuming a model of another kind (no config) handed model.safetensors to safetensors by
    name, unchecked where checksums.json does not list it: a FIFO blocked the resume for ever,
    holding the GIL (hence the child process)."""
    from safetensors.torch import save_model

    from tests.helpers import in_child
    from xlstm_kit.io.checkpoint import load_weights_into

    folder = tmp_path / "c"
    folder.mkdir()
    save_model(torch.nn.Linear(3, 2), str(folder / "model.safetensors"))
    load_weights_into(torch.nn.Linear(3, 2), folder)
    plant(folder / "model.safetensors", kind)
    error = in_child(lambda: load_weights_into(torch.nn.Linear(3, 2), folder))
    assert error is not None and error[2] and "model.safetensors is not a regular file" in error[1], error


def test_weights_of_another_model_without_config_are_one_line(tmp_path):
    """A model of another kind (no config) resumed from weights of another shape or other names:
    torch's load raised its multi-line RuntimeError."""
    from safetensors.torch import save_model

    from xlstm_kit.io.checkpoint import CheckpointError, load_weights_into

    folder = tmp_path / "c"
    folder.mkdir()
    save_model(torch.nn.Linear(3, 2), str(folder / "model.safetensors"))
    for other in (torch.nn.Linear(4, 2), torch.nn.Sequential(torch.nn.Linear(3, 2))):
        with pytest.raises(CheckpointError, match="holds weights of another model") as e:
            load_weights_into(other, folder)
        assert "\n" not in str(e.value)


# Weights handed to safetensors. It opens the name it is given itself, in native code that holds
# the GIL: a FIFO at that name blocks the whole process for ever (hence the child process), and a
# check of the file before that open, by name or by a descriptor then closed, leaves the name
# free to be swapped in between. The library hands it the name of the descriptor it checked
# (/proc/self/fd/N) instead, which reopens the file checked, whatever is at its name by then.

needs_proc_fd = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                   reason="without /proc/self/fd safetensors is handed the name itself")


def _fifo_when_opened(monkeypatch, target, at=1):
    """safetensors' open, wrapped: at its ``at``-th open of the file ``target`` (told by its
    inode, whatever name it is handed) a FIFO is put at ``target``'s name first. The file was a
    regular one for every check before; it is a FIFO once safetensors opens."""
    import safetensors
    import safetensors.torch

    from xlstm_kit.io import hf as hf_module

    real, inode = safetensors.safe_open, (os.stat(target).st_dev, os.stat(target).st_ino)
    opens = []

    def opening(name, *args, **kwargs):
        st = os.stat(name)
        if (st.st_dev, st.st_ino) == inode:
            opens.append(name)
            if len(opens) == at:
                plant(target, "fifo")
        return real(name, *args, **kwargs)

    for module in (safetensors, safetensors.torch, hf_module):
        monkeypatch.setattr(module, "safe_open", opening)


def _same_state(expected):
    def check(model):
        state = model.state_dict()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
    return check


def _one_line_refusal(error, name):
    assert error is not None and error[2], error
    assert f"{name} is not a regular file" in error[1] and "\n" not in error[1], error


@needs_proc_fd
@pytest.mark.parametrize("how", ["load", "read_model_files", "load_weights_into"])
def test_our_weights_swapped_for_a_fifo_as_safetensors_opens_them_still_load(tmp_path, monkeypatch, how):
    """read_model_files (load, a resume of our model) checked model.safetensors, then handed
    safetensors its name: a FIFO put there in between blocked the process for ever."""
    from tests.helpers import in_child
    from xlstm_kit.io.checkpoint import load_weights_into, read_model_files

    folder = ours(tmp_path / "m")
    model = XLSTMLanguageModel.load(folder)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _fifo_when_opened(monkeypatch, folder / "model.safetensors")

    def call():
        if how == "load":
            _same_state(expected)(XLSTMLanguageModel.load(folder))
        elif how == "read_model_files":
            tensors = read_model_files(folder)[1]
            assert tensors and all(torch.equal(t, expected[k]) for k, t in tensors.items())
        else:
            fresh = XLSTMLanguageModel(model.config)
            load_weights_into(fresh, folder)
            _same_state(expected)(fresh)

    assert in_child(call, seconds=20) is None


@needs_proc_fd
def test_weights_of_a_model_without_config_swapped_for_a_fifo_as_safetensors_opens_them_still_load(tmp_path, monkeypatch):
    from safetensors.torch import save_model

    from tests.helpers import in_child
    from xlstm_kit.io.checkpoint import load_weights_into

    folder = tmp_path / "c"
    folder.mkdir()
    torch.manual_seed(1)
    saved = torch.nn.Linear(3, 2)
    save_model(saved, str(folder / "model.safetensors"))
    _fifo_when_opened(monkeypatch, folder / "model.safetensors")

    def call():
        model = torch.nn.Linear(3, 2)
        load_weights_into(model, folder)
        _same_state(saved.state_dict())(model)

    assert in_child(call, seconds=20) is None


@pytest.mark.timeout(60)
def test_our_weights_a_fifo_where_a_stat_of_their_name_sees_a_file_are_refused(tmp_path, monkeypatch):
    """read_model_files checked model.safetensors by its name (is_file), and without a
    checksums.json (checkpoints written before them) nothing opened it before safetensors did."""
    from tests.helpers import in_child
    from xlstm_kit.io.checkpoint import read_model_files

    folder = ours(tmp_path / "m")
    (folder / "checksums.json").unlink()
    stand_in = tmp_path / "stand-in"
    shutil.copy(folder / "model.safetensors", stand_in)
    plant(folder / "model.safetensors", "fifo")
    _stat_sees_a_regular_file(monkeypatch, folder / "model.safetensors", stand_in)
    _one_line_refusal(in_child(lambda: read_model_files(folder), seconds=20), "model.safetensors")


def _sharded_hf(folder):
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=VOCAB, d_model=16, n_blocks=2, n_heads=2,
                                       ffn_proj_factor=1.5, round_proj_to=16))
    m.save_pretrained(folder, max_shard_size="10KB")
    return folder


@needs_proc_fd
@pytest.mark.parametrize("opened", ["headers", "tensors"])
@pytest.mark.parametrize("kind", ["ours", "hf", "hf sharded"])
def test_weights_swapped_for_a_fifo_as_from_pretrained_opens_them_load_or_are_refused(tmp_path, monkeypatch, kind, opened):
    """from_pretrained opens each weights file twice, for its headers and for its tensors, each time
    by the name that weight_files had checked: a FIFO put there before either open blocked the
    process for ever. Put there as the headers are read, the file is refused at the second open;
    put there as the tensors are read, they are read from the file that was checked."""
    from tests.helpers import in_child

    folder = {"ours": ours, "hf": hf, "hf sharded": _sharded_hf}[kind](tmp_path / "m")
    expected = {k: v.clone() for k, v in XLSTMLanguageModel.from_pretrained(folder).state_dict().items()}
    if kind == "hf sharded":
        shards = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
        assert len(shards) > 1
        target = folder / shards[-1]
    else:
        target = folder / "model.safetensors"
    _fifo_when_opened(monkeypatch, target, at=1 if opened == "headers" else 2)
    error = in_child(lambda: _same_state(expected)(XLSTMLanguageModel.from_pretrained(folder)), seconds=20)
    if opened == "headers":
        _one_line_refusal(error, target.name)
    else:
        assert error is None


@pytest.mark.parametrize("replacement", ["other tensors", "other shapes", "other dtypes", "not safetensors"])
def test_weights_replaced_by_another_file_between_from_pretrained_reads_are_one_line(tmp_path, monkeypatch, replacement):
    """from_pretrained reads a file's headers, checks them against the config, then opens the file
    again for its tensors: a regular file put at its name in between that does not hold what the
    headers said was a SafetensorError traceback (a tensor it lacks) or torch's multi-line error
    (another shape)."""
    import safetensors.torch

    from xlstm_kit.io import loading

    folder = hf(tmp_path / "hf")
    weights = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    other = {"other tensors": {"other": torch.zeros(2)},
             "other shapes": {k: torch.zeros(*v.shape[:-1], v.shape[-1] + 1, dtype=v.dtype) for k, v in tensors.items()},
             "other dtypes": {k: v.to(torch.float16 if v.dtype != torch.float16 else torch.float32) for k, v in tensors.items()},
             "not safetensors": None}[replacement]
    real = loading.read_headers

    def then_replaced(*args, **kwargs):
        result = real(*args, **kwargs)
        weights.unlink()
        if other is None:
            weights.write_bytes(b"\x00" * 64)
        else:
            safetensors.torch.save_file(other, str(weights))
        return result

    monkeypatch.setattr(loading, "read_headers", then_replaced)
    refused(lambda: XLSTMLanguageModel.from_pretrained(folder), "model.safetensors", "was it replaced while loading?")
