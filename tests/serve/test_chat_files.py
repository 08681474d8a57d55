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
