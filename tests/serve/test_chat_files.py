"""The chat template's files in a model folder (tokenizer_config.json, chat_template.jinja): read
with a bound; a hostile one is a one-line XLSTMKitError at once, not a hang, a traceback or a
server without the template the folder means to have."""
import pytest

from tests.helpers import HOSTILE_FILES, HOSTILE_MESSAGES, make_hostile
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.serve.chat import (CONFIG_FILE, MAX_TEMPLATE_BYTES, MAX_TOKENIZER_CONFIG_BYTES, TEMPLATE_FILE,
                                  find_chat_template)

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def refused(folder, needle):
    with pytest.raises(XLSTMKitError) as e:
        find_chat_template(folder)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_templates_from_either_file(tmp_path):
    pytest.importorskip("jinja2")
    (tmp_path / CONFIG_FILE).write_text('{"chat_template": "%s", "bos_token": "<s>"}' % TEMPLATE.replace('"', '\\"'))
    msgs = [{"role": "user", "content": "hi"}]
    assert find_chat_template(tmp_path).render(msgs) == "<user>hi"
    (tmp_path / TEMPLATE_FILE).write_text("[{{ messages[0]['content'] }}]")
    assert find_chat_template(tmp_path).render(msgs) == "[hi]"
    assert find_chat_template(tmp_path / "nothing-here") is None


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_hostile_tokenizer_config_is_one_line(tmp_path, kind):
    make_hostile(tmp_path / CONFIG_FILE, kind, MAX_TOKENIZER_CONFIG_BYTES)
    refused(tmp_path, HOSTILE_MESSAGES[kind])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "oversized", "not UTF-8"])
def test_a_hostile_template_file_is_one_line(tmp_path, kind):
    if kind == "not UTF-8":
        (tmp_path / TEMPLATE_FILE).write_bytes(b"{{ messages }}\xff")
        refused(tmp_path, "not UTF-8")
    else:
        make_hostile(tmp_path / TEMPLATE_FILE, kind, MAX_TEMPLATE_BYTES)
        refused(tmp_path, HOSTILE_MESSAGES[kind])


def test_loading_and_serving_read_tokenizer_config_with_one_bound(tmp_path):
    """tokenizer_config.json is read by loading (the BOS/EOS of a folder's tokenizer.json) and by
    serving (the chat template): with one bound, so that a folder that serves also loads and
    vice versa. One of more than 1 MiB (a large added-tokens table beside the template) loaded
    only for serving; one over the bound is refused by both, in one line."""
    pytest.importorskip("jinja2")
    import json

    from xlstm_kit.io.tokenizers import find_tokenizer

    vocab = {"<s>": 0, "</s>": 1, "a": 2}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}}))
    added = {str(i): {"content": f"<|reserved_special_token_{i}|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i in range(3, 10_003)}
    text = json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
                       "added_tokens_decoder": added}, indent=2)
    assert 1 << 20 < len(text) < MAX_TOKENIZER_CONFIG_BYTES
    (tmp_path / CONFIG_FILE).write_text(text)
    tok = find_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert find_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "<user>hi"

    make_hostile(tmp_path / CONFIG_FILE, "oversized", MAX_TOKENIZER_CONFIG_BYTES)
    for read in (find_tokenizer, find_chat_template):
        with pytest.raises(XLSTMKitError) as e:
            read(tmp_path)
        assert HOSTILE_MESSAGES["oversized"] in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(60)  # a FIFO read by name would hang
@pytest.mark.parametrize("kind", ["fifo", "folder", "a list", "a string"])
def test_loading_and_serving_refuse_the_same_tokenizer_configs(tmp_path, kind):
    """Loading passed over a tokenizer_config.json that was a FIFO or a folder (is_file) while
    serving refused it, and only loading refused JSON other than an object (serving took it for
    no template). Both now read it with one reader: refused by both, in the same one line. Loading
    reads it even where config.json names BOS and EOS, so that a folder that loads also serves."""
    import json
    import os

    from xlstm_kit.io.tokenizers import HFSpecialTokens, find_tokenizer

    vocab = {"<s>": 0, "</s>": 1, "a": 2}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"}}))
    config, needle = tmp_path / CONFIG_FILE, "not a regular file"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "folder":
        config.mkdir()
    else:
        config.write_text(json.dumps([TEMPLATE] if kind == "a list" else TEMPLATE))
        needle = f"must hold a JSON object, not {kind}"
    messages = []
    for read in (find_tokenizer, lambda f: find_tokenizer(f, HFSpecialTokens(0, 1)), find_chat_template):
        with pytest.raises(XLSTMKitError) as e:
            read(tmp_path)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        messages.append(str(e.value))
    assert len(set(messages)) == 1, messages
