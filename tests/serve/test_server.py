"""`xlstm-kit serve` end to end: a server process with a tiny model, driven by the official
`openai` client (plain and streaming, completions and chat) and by raw HTTP for the errors.
Greedy results are compared with `model.generate` on each prompt alone."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from .conftest import Server

openai = pytest.importorskip("openai")
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def alone(reference, prompt_ids: list[int], n: int) -> list[int]:
    """What model.generate gives this prompt alone, greedy."""
    out = reference.generate(torch.tensor(prompt_ids), max_new_tokens=n, temperature=0)
    return out[len(prompt_ids):].tolist()


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(xlstm_kit_\S+) (\S+)$", text, re.M)}


def post(server, path, body, headers=AUTH, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    kw.setdefault("timeout", 60)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **headers},
                      **kw)


def test_openai_client_plain_and_streaming(server, reference, single_thread):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    plain = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len(b"ROMEO:")
    expected = bytes(alone(reference, list(b"ROMEO:"), 12)).decode("utf-8", errors="replace")
    assert plain.choices[0].text == expected
    pieces, finish = [], None
    for chunk in c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == plain.choices[0].text and finish == "length" and len(pieces) > 1
    # a stop string ends the text before it, in both modes
    stop = plain.choices[0].text[4:6]
    cut = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == plain.choices[0].text[:4]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_openai_client_chat_with_the_folders_template(server, reference):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    prompt = "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>"  # conftest's template, rendered
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(prompt.encode())
    assert r.choices[0].message.content == bytes(alone(reference, list(prompt.encode()), 8)).decode(
        "utf-8", errors="replace")
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_32_concurrent_greedy_requests_equal_generate_alone(server, reference, single_thread):
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 100, (32,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    new = torch.randint(1, 30, (32,), generator=g).tolist()
    before = metrics(server)

    def ask(i):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompts[i], "max_tokens": new[i],
                                             "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, range(32)))
    for i in range(32):
        assert got[i] == alone(reference, prompts[i], new[i]), f"request {i} differs from generate alone"
    after = metrics(server)
    # they ran in batches (8 slots), and prompts over the 48-token chunk were read in pieces
    assert after["xlstm_kit_decode_steps_total"] - before["xlstm_kit_decode_steps_total"] < sum(new)
    assert after["xlstm_kit_generation_tokens_total"] - before["xlstm_kit_generation_tokens_total"] == sum(new)
    # a pass reads at most 48 tokens of each prompt, all of them in one eager call on the CPU
    # (no graphs): at least the longest prompt's chunks, at most every prompt's chunks read apart
    reads = after["xlstm_kit_prompt_reads_total"] - before["xlstm_kit_prompt_reads_total"]
    chunks = [-(-n // 48) for n in lengths]
    assert max(chunks) <= reads <= sum(chunks) and after["xlstm_kit_prompt_read_graphs"] == 0
    # each request's time to its first token is its wait for one of the 8 slots plus its read
    d = {k: after[f"xlstm_kit_{k}"] - before[f"xlstm_kit_{k}"] for k in (
        "time_to_first_token_seconds_count", "time_to_first_token_seconds_sum", "request_queue_seconds_sum",
        "request_prefill_seconds_sum")}
    assert d["time_to_first_token_seconds_count"] == 32
    assert d["time_to_first_token_seconds_sum"] == pytest.approx(
        d["request_queue_seconds_sum"] + d["request_prefill_seconds_sum"], rel=1e-3, abs=1e-5)
    assert d["request_queue_seconds_sum"] > 0 and d["request_prefill_seconds_sum"] > 0


def test_prefix_cache_gives_the_same_tokens(server, reference, single_thread):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (120,), generator=g).tolist()
    prompts = [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3, 14)]
    before = metrics(server)
    for p in prompts:  # one after the other: the second marks the shared prefix, the others start there
        r = post(server, "/v1/completions", {"prompt": p, "max_tokens": 10, "temperature": 0,
                                             "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == alone(reference, p, 10)
    after = metrics(server)
    assert after["xlstm_kit_prefix_cache_hits_total"] - before["xlstm_kit_prefix_cache_hits_total"] >= 2
    read = after["xlstm_kit_prefill_tokens_total"] - before["xlstm_kit_prefill_tokens_total"]
    assert read <= sum(map(len, prompts)) - 2 * len(system)


@pytest.mark.parametrize("body, field", [
    (b'{"prompt": "a", ', None),  # not JSON
    (b'[1, 2]', None),  # not an object
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 100001}, "max_tokens"),  # over --max-tokens
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": 1.5}, "top_k"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "seed": -3}, "seed"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "max_tokns": 5}, "max_tokns"),  # unknown field
    ({"prompt": [1, 256]}, "prompt"),  # outside the vocabulary
    ({"prompt": []}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a" * 401}, "prompt"),  # over --max-prompt-tokens
])
def test_bad_requests_get_400_in_the_openai_format(server, body, field):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field and err["message"]
    assert "\n" not in err["message"]
    if field == "prompt" and isinstance(body, dict) and body.get("prompt") == "a" * 401:
        assert err["code"] == "context_length_exceeded" and "401 tokens" in err["message"]


def test_chat_errors(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400


def test_api_key_model_name_and_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/completions", {"prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}  # open, for load balancers
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/v1/nothing", timeout=30).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_seeded_sampling_is_reproducible_and_matches_generate(server, reference, single_thread):
    body = {"prompt": "JULIET:", "max_tokens": 16, "temperature": 0.9, "top_k": 50, "seed": 11,
            "return_token_ids": True}
    first = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    assert post(server, "/v1/completions", body).json()["choices"][0]["token_ids"] == first
    out = reference.generate(torch.tensor(list(b"JULIET:")), max_new_tokens=16, temperature=0.9, top_k=50, seed=11)
    assert first == out[7:].tolist()
    other = post(server, "/v1/completions", {**body, "seed": 12}).json()["choices"][0]["token_ids"]
    assert other != first


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = metrics(server)
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "x", "max_tokens": 100000, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # the connection is closed here, long before 100,000 tokens
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"] > \
                before["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"]:
            break
        time.sleep(0.05)
    assert m["xlstm_kit_running_requests"] == 0
    assert m["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"] == \
        before["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"] + 1
    assert m["xlstm_kit_generation_tokens_total"] - before["xlstm_kit_generation_tokens_total"] < 100000
    # a plain (not streamed) request whose client gives up is cancelled as well
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 100000}, timeout=1)
    deadline = time.monotonic() + 30
    while metrics(server)["xlstm_kit_running_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = metrics(server)
    assert m["xlstm_kit_running_requests"] == 0
    assert m["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"] == \
        before["xlstm_kit_requests_total{finish_reason=\"cancelled\"}"] + 2


def test_full_queue_gets_429_and_sigterm_ends_streams_cleanly(model_dir):
    s = Server(model_dir, "--max-batch", "1", "--max-queue", "1", "--shutdown-grace", "1", "--max-tokens", "1000000")
    try:
        body = {"prompt": "x", "max_tokens": 1000000, "temperature": 0, "stream": True}
        events: list[str] = []
        opened = threading.Event()

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        opened.set()

        runner = threading.Thread(target=stream)
        runner.start()
        assert opened.wait(60)
        waiting: list[httpx.Response] = []
        queued = threading.Thread(target=lambda: waiting.append(httpx.post(
            s.url + "/v1/completions", json={**body, "stream": False}, timeout=60)))
        queued.start()
        deadline = time.monotonic() + 30
        while metrics(s)["xlstm_kit_queue_length"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        full = httpx.post(s.url + "/v1/completions", json={"prompt": "y"}, timeout=30)
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        code, err = s.stop()
        runner.join(30)
        queued.join(30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0 and "Traceback" not in err and "stopped after" in err, err
    # the stream ended with an error event after its tokens (no [DONE]: it did not complete)
    assert len(events) > 2 and json.loads(events[-1][len("data: "):])["error"]["code"] == "shutting_down"
    assert all("error" not in json.loads(e[len("data: "):]) for e in events[:-1])
    assert waiting and waiting[0].status_code == 503 and waiting[0].json()["error"]["code"] == "shutting_down"


def test_serve_needs_its_extra_and_a_model(tmp_path, monkeypatch, capsys):
    from xlstm_kit import _extras
    from xlstm_kit.cli import app as cli

    assert cli.main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "error:" in capsys.readouterr().err
    from xlstm_kit.cli import serve as cli_serve

    # starlette missing: the command says which extra brings it, before loading anything
    monkeypatch.setitem(_extras.EXTRA_OF, "xlstm_kit_absent_pkg", "serve")
    monkeypatch.setattr(cli_serve, "require", lambda m, f: _extras.require(
        "xlstm_kit_absent_pkg" if m == "starlette" else m, f))
    assert cli.main(["serve", str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("xlstm-kit serve: error: xlstm-kit serve needs the extra: "
                                               "pip install 'xlstm-kit[serve]'")


def test_connections_send_each_event_at_once():
    # Nagle's algorithm would hold a token's small write until the client acknowledged the one
    # before, which a client delays by 40 ms or more: the connections the server accepts (on
    # the socket it binds, through asyncio as uvicorn does) must have TCP_NODELAY
    import asyncio
    import socket

    from xlstm_kit.serve.server import _bind

    async def accepted_nodelay() -> int:
        sock = _bind("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 30)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
