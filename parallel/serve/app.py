"""The HTTP server: OpenAI's endpoints over a :class:`~reshard.parallel.serve.front.Front`
(FastAPI on uvicorn, as vLLM's and SGLang's servers), run by :class:`HttpServer` in a thread of
its own (its event loop) of the process that runs the job's router.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``: server-sent
events, one per step that gave a choice tokens), ``GET /v1/models``, vLLM's ``POST /tokenize`` and
``POST /detokenize``, ``GET /health`` (503 while draining) and ``GET /metrics`` (Prometheus' text
format).
"""

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from reshard.parallel.engine.request import Completion
from reshard.parallel.engine.sampling import SamplingParams
from reshard.parallel.serve.front import Front, Stream
from reshard.parallel.serve.protocol import BadRequest, Limits, Parsed, choice, envelope, logprobs_of, parse, usage
from reshard.parallel.serve.text import Text, TextCursor, decoder, final_text
from reshard.parallel.serve.tokenize import detokenize, tokenize
from reshard.parallel.vllm_api import output_text, stop_reason

POLL_S = 0.25  # a waiting handler looks whether its client is still there this often
LOG = logging.getLogger(__name__)


def build_app(front: Front, limits: Limits, text: Text, loads: Callable[[], Mapping]) -> Any:
    """The FastAPI application (``loads()``: each engine group's last :class:`Load`, for the metrics)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="reshard serve")

    @app.exception_handler(BadRequest)
    async def refused(request: Request, e: BadRequest) -> JSONResponse:
        front.metrics.reject(e.status)
        headers = {"Retry-After": str(front.limits.retry_after_s)} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "draining" if front.draining else "ok"}, 503 if front.draining else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": limits.model, "object": "model", "created": int(front.start), "owned_by": "reshard"}
        return {"object": "list", "data": [{**card, "max_model_len": limits.max_seq_len}]}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return tokenize(await _json(request), limits, text)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return detokenize(await _json(request), limits, text)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(front.metrics.render(loads()), media_type="text/plain; version=0.0.4")

    async def handle(kind: str, request: Request):
        parsed = parse(kind, await _json(request), limits, text.encode, text.chat)
        front.loop = asyncio.get_running_loop()
        streams = front.accept(parsed)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            events = _events(front, text, parsed, streams, rid, limits.model)
            return StreamingResponse(events, media_type="text/event-stream")
        if not await _finished(front, streams, request):
            return JSONResponse({}, status_code=499)  # (nobody reads it: the client closed the request)
        return JSONResponse(_whole(front, text, parsed, streams, rid, limits.model))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("chat", request)

    return app


async def _json(request) -> Any:
    """The request's body, decoded (a 400 where it is not JSON)."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None


async def _finished(front: Front, streams: list[Stream], request) -> bool:
    """Wait until every choice completed (True); a client that went away meanwhile cancels them
    (False; looked at every ``POLL_S``, whatever wakes the handler)."""
    wake, loop = streams[0].wake, asyncio.get_running_loop()
    look = loop.time() + POLL_S
    while any(s.completion is None for s in streams):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), max(0.0, look - loop.time()))
        wake.clear()
        if loop.time() >= look:
            look = loop.time() + POLL_S
            if await request.is_disconnected():
                front.cancel(streams)
                return False
    return True


def _whole(front: Front, text: Text, parsed: Parsed, streams: list[Stream], rid: str, model: str) -> dict:
    choices, timing = [], []
    for s in streams:
        c = s.completion
        out = final_text(text, c, parsed.sampling)
        lps = None if parsed.logprobs is None else logprobs_of(parsed.kind, c.output_ids, c.logprobs, text.piece)
        reason = _reason(text, c, parsed.sampling)
        choices.append(choice(parsed.kind, s.index, out, c.finish_reason, lps, delta=False, stop_reason=reason))
        timing.append(_timing(front, s))
    body = envelope(parsed.kind, rid, model, choices, chunk=False)
    body["usage"] = _usage(parsed, streams)
    body["reshard_timing"] = timing  # an extension: each choice's milestones, wall clock
    return body


def _usage(parsed: Parsed, streams: list[Stream]) -> dict:
    prompt = sum(map(len, parsed.prompts))
    return usage(prompt, sum(len(s.completion.output_ids) for s in streams))


def _timing(front: Front, s: Stream) -> dict:
    """Request ``s``'s arrival at the server, and (job clock + start) when the engine began it,
    sent its first token and finished it."""
    t = s.completion.timing
    marks = {} if t is None else {"started": t.started, "first_token": t.first_token, "finished": t.finished}
    return {"arrival": s.arrival, **{k: front.start + v for k, v in marks.items()}}


async def _events(
    front: Front, text: Text, parsed: Parsed, streams: list[Stream], rid: str, model: str
) -> AsyncIterator[str]:
    """Server-sent events: each choice's new text as its tokens land, its finish reason, then
    (``stream_options.include_usage``) the usage, then ``[DONE]``. A client that goes away
    cancels the choices still running."""
    cursors = {s.rid: TextCursor(text, parsed.sampling, parsed.prompts[s.index // parsed.n]) for s in streams}
    wake, open_ = streams[0].wake, list(streams)
    try:
        if parsed.kind == "chat":  # the assistant's turn opens each choice (as OpenAI's first chunk)
            first = [choice("chat", s.index, "", None, None, delta=True) for s in streams]
            yield _sse(envelope("chat", rid, model, first, chunk=True))
        while open_:
            wake.clear()
            for s in list(open_):
                completion = s.completion  # read once: the router's thread may set it any time
                event = _advance(parsed, text, s, cursors[s.rid], completion)
                if event is not None:
                    yield _sse(envelope(parsed.kind, rid, model, [event], chunk=True))
                if completion is not None:
                    open_.remove(s)
            if open_:
                await wake.wait()
        if parsed.include_usage:
            yield _sse({**envelope(parsed.kind, rid, model, [], chunk=True), "usage": _usage(parsed, streams)})
        yield "data: [DONE]\n\n"
    finally:
        front.cancel(open_)  # (none left on a stream that ran to its end)


def _advance(parsed: Parsed, text: Text, s: Stream, cursor: TextCursor, completion) -> dict | None:
    """Choice ``s``'s next event (None: nothing new to send), ``completion`` as last read."""
    finish, stopped_by = (None, None) if completion is None else (completion.finish_reason, completion.stopped_by)
    new, items = cursor.advance(s.ready(completion), finish, stopped_by)
    if not items and finish is None:  # (a step's token whose text is held back still has its event)
        return None
    lps = None
    if parsed.logprobs is not None and items:
        offset = len(cursor.sent) - len(new)  # where this event's text begins in the choice's
        lps = logprobs_of(parsed.kind, [t for t, _ in items], [lp for _, lp in items], text.piece, offset)
    reason = None if completion is None else _reason(text, completion, parsed.sampling)
    return choice(parsed.kind, s.index, new, finish, lps, delta=True, stop_reason=reason)


def _reason(text: Text, c: Completion, sampling: SamplingParams) -> int | str | None:
    """Completion ``c``'s ``stop_reason`` (vLLM's): its stop string or stop token (None: the
    tokenizer's EOS, or no stop). One rebuilt from a journal says nothing: found from its text."""
    string = c.stopped_by if isinstance(c.stopped_by, str) else None
    if c.stopped_by is None and c.finish_reason == "stop":
        string = output_text(decoder(text, sampling, c.prompt_ids), c.output_ids, "stop", sampling)[1]
    return stop_reason(string, c.output_ids, c.finish_reason, getattr(text.tokenizer, "eos_token_id", None))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` in a thread of its own, started by ``with`` (once
    it listens; ``ValueError`` naming the address when it cannot) and stopped, joined, on exit."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self.server, self.address = uvicorn.Server(config), f"{host}:{port}"
        self.thread = threading.Thread(target=self.server.run, name="reshard-http", daemon=True)

    def __enter__(self) -> "HttpServer":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise ValueError(f"serve.host:serve.port = {self.address}: cannot listen there (in use?)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS picked for port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
