"""The HTTP face of the server: OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` (whole or streamed as
server-sent events), ``/v1/models`` and ``/health``, over an :class:`~specula.serve.engine.Engine`.

A body is checked by the rules of request files (:func:`specula.jobs.requests.parse_request`, as a Batch API line
of its endpoint), so every field, range and near miss is answered as there: HTTP 400 with OpenAI's error object,
``param`` naming the field. Answers are the bodies Batch API output lines carry (:mod:`specula.jobs.line_formats`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from ..core.logprobs import TokenLogprob
from ..decoding.budget import CacheBudget, OverBudget
from ..decoding.loop import Row
from ..hf.tools import sendable
from ..jobs.decode import (
    Settings,
    answer_of,
    answered_by,
    choice_of,
    choices,
    content_tokens,
    jobs_of,
    logprob_entries,
    names,
    stopped_text,
)
from ..jobs.line_formats import choice_logprobs
from ..jobs.requests import BadRequest, parse_request
from ..machine.memory import resident_bytes
from .engine import Engine

WAIT = 0.25  # seconds between checks that a waiting client is still there


class HTTPError(Exception):
    """An answer with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


def create_app(
    engine: Engine, model, tokenizer, settings: Settings, api_key: str | None = None, budget: CacheBudget | None = None
) -> FastAPI:
    """The server's app, answering with ``engine`` (closed when the app shuts down: what is in flight finishes); a
    request whose cache would not fit ``budget`` even alone is a 400."""
    numbers = itertools.count(1)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(engine.close)  # (uvicorn stopped accepting: what is in flight finishes)
        print(
            f"specula serve: stopped ({engine.answered} answered, {engine.cancelled} cancelled, {engine.failed} "
            "failed)",
            file=sys.stderr,
        )

    app = FastAPI(title="specula", lifespan=lifespan)

    @app.exception_handler(HTTPError)
    async def _error(request: Request, error: HTTPError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def _failure(request: Request, error: Exception) -> JSONResponse:
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        return HTTPError(500, f"specula failed on this request ({message})", kind="server_error").response()

    @app.middleware("http")
    async def _key(request: Request, call_next):
        if (
            api_key is not None
            and request.url.path.startswith("/v1/")
            and request.headers.get("authorization") != f"Bearer {api_key}"
        ):
            return HTTPError(
                401,
                "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
                kind="invalid_request_error",
                code="invalid_api_key",
            ).response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": settings.model_name,
            "in_flight": engine.in_flight,
            "answered": engine.answered,
            "cancelled": engine.cancelled,
            "failed": engine.failed,
            "tokens": engine.tokens,
            "memory": {**(budget.report() if budget is not None else {}), "resident_bytes": resident_bytes()},
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specula"} for name in names(settings)],
        }

    async def complete(request: Request, url: str):
        body = await _body(request)
        stream, include_usage = _stream_options(body)
        number = next(numbers)  # (a request without its own seed draws from --seed + number, as a file's line)
        parsed = parse_request(
            {"custom_id": f"request-{number}", "method": "POST", "url": url, "body": body}, number, names(settings)
        )
        if isinstance(parsed, BadRequest):
            raise HTTPError(400, str(parsed), _param(str(parsed)))
        try:
            jobs = await run_in_threadpool(jobs_of, model, tokenizer, parsed, settings, budget)
        except OverBudget as error:
            raise HTTPError(400, str(error), "max_tokens") from None
        except (ValueError, TemplateError) as error:  # (a prompt longer than the context, a template's refusal ...)
            field = _param(str(error)) or ("messages" if parsed.messages is not None else "prompt")
            raise HTTPError(400, str(error), field) from None
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        handles = [
            engine.submit(
                job,
                lambda kept, logprobs, index=index: loop.call_soon_threadsafe(
                    events.put_nowait, Kept(index, kept, logprobs)
                ),
                lambda row, error, index=index: loop.call_soon_threadsafe(events.put_nowait, Ended(index, row, error)),
            )
            for index, job in enumerate(jobs)
        ]
        if stream:
            chunks = _chunks(events, handles, parsed, tokenizer, settings, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        rows: list[Row | None] = [None] * len(handles)
        try:
            while None in rows:
                if isinstance(event := await _next(events, request, handles), Ended):  # (whole answers wait)
                    rows[event.job] = _ended(event)
        except asyncio.CancelledError:
            for handle in handles:
                handle.cancel()
            raise
        return answer_of(rows, parsed, tokenizer, settings)["response"]["body"]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "/v1/completions")

    return app


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as error:
        raise HTTPError(400, f"the body is not JSON ({error})") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object: the completion request")
    return body


def _stream_options(body: dict) -> tuple[bool, bool]:
    """Whether to stream the answer and end with a usage chunk (``stream``, ``stream_options.include_usage``), taken
    out of ``body``."""
    stream, options = body.pop("stream", None), body.pop("stream_options", None)
    if stream is not None and not isinstance(stream, bool):
        raise HTTPError(400, f'"stream" must be true or false, got {json.dumps(stream)}', "stream")
    if options is not None and not stream:
        raise HTTPError(400, '"stream_options" is only allowed with "stream": true', "stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise HTTPError(400, '"stream_options" must be {"include_usage": true or false}', "stream_options")
    return bool(stream), bool((options or {}).get("include_usage"))


def _param(message: str) -> str | None:
    """The field a request-file message names first.

    >>> _param('"max_tokens" must be a whole number >= 1, got 0'), _param('body: unknown field "max_token" for ...')
    ('max_tokens', 'max_token')
    """
    found = re.search(r'"([A-Za-z_]+)"', message)
    return found.group(1) if found else None


@dataclass(frozen=True)
class Kept:
    """An event of a request: the tokens a pass kept for its ``job``-th job, and their log probabilities where it
    asked."""

    job: int
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class Ended:
    """An event of a request: its ``job``-th job ended, in ``row``, or failed with ``error``."""

    job: int
    row: Row | None
    error: BaseException | None


async def _next(events: asyncio.Queue, request: Request, handles: list) -> Kept | Ended:
    """The next event of a request's jobs; a client that went away cancels them."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), WAIT)
        except TimeoutError:
            if await request.is_disconnected():
                for handle in handles:
                    handle.cancel()
                raise asyncio.CancelledError from None


def _ended(event: Ended) -> Row:
    """The row of a job that ended; a failure of the loop is a 500."""
    if event.error is not None:
        error = event.error
        raise HTTPError(
            500, f"decoding failed ({type(error).__name__}: {str(error).splitlines()[0]})", kind="server_error"
        )
    return event.row


@dataclass
class _Stream:
    """What a streamed job has sent so far: its tokens (and their log probabilities, where asked), the text sent of
    them, and how many tokens' log probabilities."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent: str = ""
    listed: int = 0


async def _chunks(
    events: asyncio.Queue, handles: list, parsed, tokenizer, settings: Settings, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shape, each choice's (``index``) as its job's passes accept tokens (text
    held back only while it may end in a broken character or the start of a stop string; with ``echo``, sent whole
    at its end), then its finish reason; usage if asked, ``[DONE]``. One job of a greedy request serves every
    choice it asks for (:func:`specula.jobs.decode.jobs_of`)."""
    chat = parsed.url == "/v1/chat/completions"
    name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    skip = parsed.options.get("skip_special_tokens", True)
    echo, tools = parsed.options.get("echo", False), "tools" in parsed.options
    indices = [range(choices(parsed))] if len(handles) == 1 else [[job] for job in range(len(handles))]

    def chunks(job: int, text: str | None, finish=None, logprobs=None, offset: int = 0, first=False, calls=()):
        """The chunk of each choice job ``job`` serves: ``text`` (and its tokens' ``logprobs``, from ``offset``), the
        tools it ``calls``."""
        listed = None if logprobs is None else choice_logprobs(parsed.url, logprob_entries(logprobs, tokenizer), offset)
        for index in indices[job]:
            delta = ({"role": "assistant"} if first else {}) | ({} if text is None else {"content": text})
            if calls:
                delta["tool_calls"] = [{"index": at} | call for at, call in enumerate(calls)]
            choice = (
                {"index": index, "delta": delta, "logprobs": listed, "finish_reason": finish}
                if chat
                else {"index": index, "text": text or "", "logprobs": listed, "finish_reason": finish}
            )
            yield event({"choices": [choice]})

    def event(data: dict) -> str:
        data = {
            "id": name,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": answered_by(parsed, settings),
        } | data
        return f"data: {json.dumps(data)}\n\n"

    streams = [_Stream() for _ in handles]
    rows: list[Row | None] = [None] * len(handles)
    try:
        for job in range(len(handles) if chat else 0):
            for line in chunks(job, "", first=True):
                yield line
        while None in rows:
            got = await events.get()
            stream = streams[got.job]
            if isinstance(got, Kept):
                stream.ids += got.tokens
                stream.logprobs += got.logprobs or []
                text = tokenizer.decode(stream.ids, skip_special_tokens=skip)
                ready = _ready(text, parsed.options)
                if tools:  # (not what may be a call)
                    ready = sendable(ready)
                if len(ready) > len(stream.sent) and not echo:
                    whole = (
                        stream.listed
                        if got.logprobs is None
                        else _whole_tokens(tokenizer, stream.ids, ready, text, skip)
                    )
                    listed = None if got.logprobs is None else stream.logprobs[stream.listed : whole]
                    for line in chunks(got.job, ready[len(stream.sent) :], None, listed, len(stream.sent)):
                        yield line
                    stream.sent, stream.listed = ready, whole
                continue
            row = rows[got.job] = _ended(got)
            made = choice_of(row, parsed, tokenizer)
            rest = None
            if row.job.logprobs is not None:
                answered = made["text"][len(parsed.prompt) :] if echo else made["text"]
                rest = row.logprobs[stream.listed : max(stream.listed, content_tokens(row, tokenizer, answered, skip))]
                rest = row.prompt_logprobs + rest if echo else rest
            final, sent = made["text"], stream.sent
            if final.startswith(sent) and (len(final) > len(sent) or rest):
                for line in chunks(got.job, final[len(sent) :], None, rest, len(sent)):
                    yield line
            if "tool_calls" in made:
                for line in chunks(got.job, None, calls=made["tool_calls"]):
                    yield line
            for line in chunks(got.job, None if chat else "", made["finish_reason"]):
                yield line
        if include_usage:
            yield event(
                {"choices": [], "usage": answer_of(rows, parsed, tokenizer, settings)["response"]["body"]["usage"]}
            )
        yield "data: [DONE]\n\n"
    except HTTPError as error:
        body = {"error": {"message": str(error), "type": error.kind, "param": None, "code": None}}
        yield f"data: {json.dumps(body)}\n\n"
    finally:
        for handle, row in zip(handles, rows):
            if row is None:  # (the client went away: its row ends after the pass under way)
                handle.cancel()


def _whole_tokens(tokenizer, ids: list[int], ready: str, text: str, skip: bool) -> int:
    """How many of ``ids`` (whose text is ``text``, special tokens skipped where ``skip``) have their text within
    ``ready``, a prefix of it."""
    count = len(ids)
    while count and len(ready) < len(text):
        text = tokenizer.decode(ids[: count - 1], skip_special_tokens=skip)
        count -= 1
    return count


def _ready(text: str, options: dict) -> str:
    """What of ``text`` can be sent now (``options``: its request's): up to a stop string it holds
    (:func:`stopped_text`), less what a later token may still change: a last broken character, a tail that may
    become a stop string, trailing spaces (a tokenizer's clean-up joins ``" ."`` into ``"."``).

    >>> _ready("ab\\ufffd", {}), _ready("hello wo", {"stop": ["world"]}), _ready("hello world!", {"stop": ["world"]})
    ('ab', 'hello', 'hello ')
    >>> _ready("a b ", {}), _ready("hello world!", {"stop": ["world"], "include_stop_str_in_output": True})
    ('a b', 'hello world')
    """
    content, stopped = stopped_text(text, options)
    if stopped:
        return content
    text = text.rstrip("\ufffd")
    held = max(
        (n for stop in options.get("stop", ()) for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )
    return text[: len(text) - held].rstrip(" ")
