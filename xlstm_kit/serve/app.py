"""The HTTP side: a Starlette app speaking the OpenAI API over an `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions (with a chat template), GET /v1/models,
GET /health, GET /metrics (Prometheus text format). Errors are OpenAI error objects
({"error": {"message", "type", "param", "code"}}) with their status: 400 for a body that is not
JSON or a field of the wrong type or range (or a prompt over the limit), 401 without the API
key, 404 for another model name, 429 with Retry-After when the queue is full, 503 while
shutting down, 500 when generation fails.

The engine runs in its own thread and hands each pass's updates to the event loop in one
call; each HTTP request reads its own queue. A client that goes away (mid-stream or while
waiting for a plain response) cancels its requests, which frees their slots at the next token.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import traceback
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .engine import Engine, EngineBusy, EngineClosed
from .request import CANCELLED, ERROR, FINISH_REASONS, SHUTDOWN, Request, Update
from .protocol import APIError, Limits, Parsed, bad, error_body, new_id, now, parse_chat, parse_completion

MAX_BODY_BYTES = 32 << 20
RETRY_AFTER_S = 1


class _ClientGone(Exception):
    pass


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class EventStream(Response):
    """A server-sent-events response that notices a client going away even while nothing is
    sent (a request waiting for a slot or reading its prompt) and then calls on_close."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events, self.on_close = events, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.raw_headers.append((b"content-type", b"text/event-stream; charset=utf-8"))

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client is gone
                pass

        writer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            for result in await asyncio.gather(writer, watcher, return_exceptions=True):
                if isinstance(result, Exception):  # a bug of ours: keep its traceback in the log
                    traceback.print_exception(result, file=sys.stderr)
            self.on_close()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


class App:
    """The routes over one engine. `served_name`: the model id of /v1/models (requests naming
    another model get 404); `api_key`: required as 'Authorization: Bearer KEY' on /v1/*."""

    def __init__(self, engine: Engine, tokenizer, served_name: str, *, max_prompt_tokens: int, max_tokens: int,
                 api_key: str | None = None, chat_template=None):
        self.engine, self.tokenizer, self.name = engine, tokenizer, served_name
        self.limits = Limits(engine.vocab, max_prompt_tokens, max_tokens)
        self.api_key = api_key
        self.chat_template = chat_template
        self.created = now()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_start: Callable[[], None] | None = None  # called once the app runs (the runner's)
        self.rejected = {"invalid": 0, "unauthorized": 0, "queue_full": 0, "shutting_down": 0}
        self.app = Starlette(
            routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"]),
                    Route("/metrics", self.metrics, methods=["GET"])],
            exception_handlers={APIError: self._api_error, HTTPException: self._http_error, Exception: self._crash},
            lifespan=self._lifespan)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    # ------------------------------------------------------------------ plumbing
    def _lifespan(self, app):
        outer = self

        class _Span:
            async def __aenter__(self):
                outer.loop = asyncio.get_running_loop()
                outer.engine.deliver = outer._deliver
                if outer.on_start is not None:
                    outer.on_start()

            async def __aexit__(self, *exc):
                outer.engine.close(0)

        return _Span()

    def _deliver(self, updates: list[Update]) -> None:  # the engine's thread
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._dispatch, updates)

    @staticmethod
    def _dispatch(updates: list[Update]) -> None:
        for u in updates:
            if u.request.sink is not None:
                u.request.sink.put_nowait(u)

    async def _api_error(self, request, e: APIError):
        if e.status == 400:
            self.rejected["invalid"] += 1
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def _http_error(self, request, e: HTTPException):
        kind = "not_found" if e.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", kind), status_code=e.status_code)

    async def _crash(self, request, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    def _auth(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            self.rejected["unauthorized"] += 1
            raise APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _body(self, request: HTTPRequest):
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.name}'",
                           code="model_not_found", param="model")

    def _encode(self, prompt) -> list[int]:
        if not isinstance(prompt, str):
            ids = prompt
        else:
            ids = self.tokenizer.encode(prompt)
            if not ids:  # an empty text starts from the end token (or a newline), as complete_texts does
                eos = getattr(self.tokenizer, "eos_token_id", None)
                ids = [eos] if eos is not None else self.tokenizer.encode("\n")
        if len(ids) > self.limits.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than the {self.limits.max_prompt_tokens} "
                           f"this server accepts (--max-prompt-tokens)", code="context_length_exceeded",
                           param="prompt")
        if max(ids) >= self.limits.vocab_size:
            raise bad(f"the tokenizer gave id {max(ids)}, outside the model's vocabulary of {self.limits.vocab_size}",
                      "prompt")
        return ids

    def _submit(self, prompts: list[list[int]], parsed: Parsed) -> tuple[list[Request], asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        reqs = [Request(ids, parsed.params, stream=parsed.stream, sink=queue, tag=i) for i, ids in enumerate(prompts)]
        try:
            self.engine.submit(reqs)
        except EngineBusy as e:
            self.rejected["queue_full"] += 1
            raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosed:
            self.rejected["shutting_down"] += 1
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        return reqs, queue

    def _cancel(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.engine.cancel(r)

    async def _results(self, request: HTTPRequest, reqs: list[Request], queue: asyncio.Queue) -> list[Request]:
        """Wait for every request to end, or for the client to go away (then cancel them)."""

        async def collect():
            left = len(reqs)
            while left:
                left -= (await queue.get()).finish_reason is not None

        work = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                self._cancel(reqs)
        if work.cancelled() or not work.done():
            raise _ClientGone()
        for r in reqs:
            if r.finish_reason in (ERROR, SHUTDOWN):
                raise _failure(r)
        return reqs

    @staticmethod
    def _usage(reqs: list[Request]) -> dict:
        p, c = sum(len(r.prompt) for r in reqs), sum(len(r.output) for r in reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ------------------------------------------------------------------ routes
    async def completions(self, request: HTTPRequest):
        self._auth(request)
        parsed = parse_completion(await self._body(request), self.limits)
        self._check_model(parsed.model)
        reqs, queue = self._submit([self._encode(p) for p in parsed.prompts], parsed)
        cid, created = new_id("cmpl"), now()

        def chunk(choices, usage=None):
            out = {"id": cid, "object": "text_completion", "created": created, "model": self.name, "choices": choices}
            return {**out, "usage": usage} if usage is not None else out

        def choice(r: Request, text: str, finish, ids):
            c = {"index": r.tag, "text": text, "logprobs": None, "finish_reason": finish}
            return {**c, "token_ids": ids} if parsed.return_token_ids else c

        if not parsed.stream:
            try:
                await self._results(request, reqs, queue)
            except _ClientGone:
                return Response(status_code=499)
            return JSONResponse(chunk([choice(r, r.text, r.finish_reason, r.output) for r in reqs], self._usage(reqs)))

        async def events():
            async for u in self._updates(reqs, queue):
                if isinstance(u, APIError):
                    yield _sse(u.body())
                    return
                if u.text or u.finish_reason or (parsed.return_token_ids and u.token_ids):
                    yield _sse(chunk([choice(u.request, u.text, u.finish_reason, u.token_ids)]))
            if parsed.include_usage:
                yield _sse(chunk([], self._usage(reqs)))
            yield b"data: [DONE]\n\n"

        return EventStream(events(), lambda: self._cancel(reqs))

    async def _updates(self, reqs: list[Request], queue: asyncio.Queue):
        """Each request's updates until all ended (those waiting together merged); an APIError
        (then stop) when one failed."""
        left = len(reqs)
        while left:
            pending = [await queue.get()]
            while not queue.empty():
                pending.append(queue.get_nowait())
            for u in _merged(pending):
                if u.finish_reason in (ERROR, SHUTDOWN, CANCELLED):
                    self._cancel(reqs)
                    yield _failure(u.request)
                    return
                left -= u.finish_reason is not None
                yield u

    async def chat(self, request: HTTPRequest):
        self._auth(request)
        parsed = parse_chat(await self._body(request), self.limits)
        self._check_model(parsed.model)
        if self.chat_template is None:
            raise bad(f"the model '{self.name}' has no chat template (chat_template.jinja or chat_template in "
                      f"tokenizer_config.json); use /v1/completions", "messages")
        try:
            text = self.chat_template.render(parsed.messages)
        except ValueError as e:
            raise bad(str(e), "messages") from None
        bos = self.chat_template.bos_token
        if bos and text.startswith(bos) and getattr(self.tokenizer, "bos_token_id", None) is not None:
            text = text[len(bos):]  # the tokenizer puts its BOS in front itself
        reqs, queue = self._submit([self._encode(text)], parsed)
        cid, created = new_id("chatcmpl"), now()

        def chunk(choices, usage=None, object="chat.completion.chunk"):
            out = {"id": cid, "object": object, "created": created, "model": self.name, "choices": choices}
            return {**out, "usage": usage} if usage is not None else out

        if not parsed.stream:
            try:
                await self._results(request, reqs, queue)
            except _ClientGone:
                return Response(status_code=499)
            r = reqs[0]
            c = {"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                 "finish_reason": r.finish_reason}
            if parsed.return_token_ids:
                c["token_ids"] = r.output
            return JSONResponse(chunk([c], self._usage(reqs), object="chat.completion"))

        def delta(d, finish=None, ids=None):
            c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            return {**c, "token_ids": ids} if parsed.return_token_ids and ids is not None else c

        async def events():
            yield _sse(chunk([delta({"role": "assistant", "content": ""})]))
            async for u in self._updates(reqs, queue):
                if isinstance(u, APIError):
                    yield _sse(u.body())
                    return
                if u.text or (parsed.return_token_ids and u.token_ids):
                    yield _sse(chunk([delta({"content": u.text}, ids=u.token_ids)]))
                if u.finish_reason:
                    yield _sse(chunk([delta({}, u.finish_reason)]))
            if parsed.include_usage:
                yield _sse(chunk([], self._usage(reqs)))
            yield b"data: [DONE]\n\n"

        return EventStream(events(), lambda: self._cancel(reqs))

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "xlstm-kit"}

    async def models(self, request: HTTPRequest):
        self._auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest):
        self._auth(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: HTTPRequest):
        if self.engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HTTPRequest):
        return PlainTextResponse(self.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def prometheus(self) -> str:
        e, s = self.engine, self.engine.stats
        lines: list[str] = []

        def metric(name, kind, help, values):
            lines.append(f"# HELP xlstm_kit_{name} {help}")
            lines.append(f"# TYPE xlstm_kit_{name} {kind}")
            for labels, v in values:
                lines.append(f"xlstm_kit_{name}{labels} {v}")

        metric("requests_total", "counter", "Requests ended, by finish reason.",
               [(f'{{finish_reason="{k}"}}', s.finished[k]) for k in FINISH_REASONS])
        metric("rejected_requests_total", "counter", "HTTP requests refused before generation, by reason.",
               [(f'{{reason="{k}"}}', v) for k, v in self.rejected.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.", [("", s.prompt_tokens)])
        metric("prefill_tokens_total", "counter", "Prompt tokens run through the model (the rest came from the "
               "prefix cache).", [("", s.prefill_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", s.generated_tokens)])
        metric("decode_steps_total", "counter", "Batched decode steps.", [("", s.decode_steps)])
        reader = e.reader
        metric("prompt_reads_total", "counter", "Prompt-read passes of the model (pieces or packed calls).",
               [("", reader.replays if reader is not None else 0)])
        metric("prompt_read_graphs", "gauge", "Prompt reads recorded as CUDA graphs (0: read eagerly).",
               [("", len(reader.graphs) if reader is not None else 0)])
        metric("prefix_cache_hits_total", "counter", "Requests that started from a cached prefix state.",
               [("", s.cache_hits)])
        metric("prefix_cache_misses_total", "counter", "Requests that found no cached prefix state.",
               [("", s.cache_misses)])
        metric("prefix_cache_tokens_total", "counter", "Prompt tokens whose state came from the cache.",
               [("", s.cache_tokens)])
        metric("prefix_cache_bytes", "gauge", "Bytes of cached states.", [("", e.cache.bytes)])
        metric("prefix_cache_entries", "gauge", "Cached prefix states.", [("", len(e.cache.entries))])
        for name, help, total in (
                ("request_queue_seconds", "Time from submission to a state slot.", s.queue_seconds),
                ("request_prefill_seconds", "Time from a state slot to the first token sampled (the prompt "
                 "read).", s.prefill_seconds),
                ("time_to_first_token_seconds", "Time from submission to the first token sampled, inside the "
                 "engine (the client's adds the HTTP side).", s.first_token_seconds)):
            lines.append(f"# HELP xlstm_kit_{name} {help}")
            lines.append(f"# TYPE xlstm_kit_{name} summary")
            lines.append(f"xlstm_kit_{name}_sum {total!r}")  # all digits: readers subtract two scrapes
            lines.append(f"xlstm_kit_{name}_count {s.first_tokens}")
        metric("queue_length", "gauge", "Requests waiting for a slot.", [("", e.queued)])
        metric("running_requests", "gauge", "Requests in a slot (reading their prompt or decoding).",
               [("", e.running)])
        metric("slots", "gauge", "State slots (--max-batch).", [("", e.max_batch)])
        metric("batch_occupancy", "gauge", "Share of the slots in use.", [("", round(e.running / e.max_batch, 6))])
        return "\n".join(lines) + "\n"


def _merged(updates: list[Update]) -> list[Update]:
    """Updates of one request that queued up (the client reads slower than the model writes) as
    one: one event for several tokens costs the event loop a fraction of one per token."""
    out: list[Update] = []
    for u in updates:
        last = out[-1] if out else None
        if last is not None and last.request is u.request and last.finish_reason is None:
            out[-1] = Update(u.request, last.token_ids + u.token_ids, last.text + u.text, u.finish_reason, u.error)
        else:
            out.append(u)
    return out


def _failure(r: Request) -> APIError:
    if r.finish_reason == SHUTDOWN:
        return APIError(503, "the server shut down before the request ended", type="server_error",
                        code="shutting_down")
    if r.finish_reason == CANCELLED:
        return APIError(499, "the request was cancelled", type="server_error", code="cancelled")
    return APIError(500, f"generation failed: {r.error}", type="server_error", code="generation_failed")
