"""Shared pieces of the server tests: a tiny byte-level model saved to a folder, and a server
process on a free port (`xlstm-kit serve ... --port 0`, the port read from the line it prints
once it serves)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180  # a loaded 2-core machine takes long to import torch

# A chat template in the ChatML style (a tokenizer_config.json entry, as HuggingFace folders ship it)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_model(seed: int = 0):
    """float32, byte vocabulary, an mLSTM and an sLSTM block, weights moved off their init so
    that the logits are far from ties (greedy tokens then do not hang on rounding)."""
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

    torch.manual_seed(seed)
    cfg = XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1], chunk_size=8)
    model = XLSTMLanguageModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    tiny_model().save(folder, tokenizer="byte")
    (folder / "tokenizer_config.json").write_text('{"chat_template": %s}' % __import__("json").dumps(CHAT_TEMPLATE))
    return folder


@pytest.fixture(scope="session")
def reference(model_dir):
    """The saved model, loaded in this process: what `model.generate` gives is the reference."""
    from xlstm_kit import XLSTMLanguageModel

    return XLSTMLanguageModel.load(model_dir)


class Server:
    """`xlstm-kit serve MODEL_DIR --port 0 ARGS` in a child process."""

    def __init__(self, folder: Path, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "xlstm_kit", "serve", str(folder), "--port", "0",
                                      "--threads", "1", *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.first_line = self._read_start()
        port = re.search(r"http://127\.0\.0\.1:(\d+)", self.first_line)
        assert port, self.first_line
        self.url = f"http://127.0.0.1:{port[1]}"

    def _read_start(self) -> str:
        import threading

        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stderr.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not box or not box[0]:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {self.proc.stderr.read()[-3000:]}")
        return box[0]

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM, then (exit status, the rest of stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"the server did not stop within {timeout} s after SIGTERM:\n{err[-3000:]}")
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def server(model_dir):
    """One server for the module: an API key, 8 slots, prompts of at most 400 tokens read 48 at a
    time, at most 100,000 new tokens (a request that outlasts a test's steps)."""
    s = Server(model_dir, "--api-key", "sesame", "--max-batch", "8", "--max-queue", "64",
               "--max-prompt-tokens", "400", "--max-tokens", "100000", "--prefill-chunk", "48")
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
