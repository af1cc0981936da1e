"""The OpenAI-compatible request bodies, their limits, and the responses (JSON or server-sent events).

Every field is bounded: numbers by the request models and `SamplingParams`, sizes (messages, stop strings, n,
top_logprobs) by `Limits` (server flags). Fields dflashkit does not implement are rejected with a 400 that names
them, never silently ignored; unknown extra fields (e.g. `user`, `metadata`) are ignored as OpenAI does.

(No `from __future__ import annotations` here: FastAPI must see the request models' annotations as real
classes, or it takes them for query parameters.)
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import DFlashError
from .sampling import MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams
from .scheduler import OverloadError, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (server flags)."""

    max_body_bytes: int = 1 << 20  # larger bodies get a 413 before they are read
    max_messages: int = 256
    max_stop: int = 4  # OpenAI's own limit
    max_stop_chars: int = 256
    max_n: int = 8
    max_top_logprobs: int = 20  # OpenAI's own limit


def _valid_text(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains a lone UTF-16 surrogate (e.g. \\ud800); send valid Unicode") from None
    return v


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str

    _text = field_validator("text")(_valid_text)


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        return _valid_text(v) if isinstance(v, str) else v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "parallel_tool_calls", "suffix", "echo", "best_of", "presence_penalty", "frequency_penalty")


HARMLESS = (0, [], {}, "none", "auto", {"type": "text"})  # values of UNSUPPORTED fields that ask for nothing


class Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    # 1.0 is the OpenAI API's default; `dflashkit generate` defaults to greedy (decode_config.py says why)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    # dflashkit's own field: false decodes this request autoregressively (same weights, same output when greedy),
    # e.g. as the baseline of an A/B comparison inside one server process
    speculate: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        for x in [v] if isinstance(v, str) else v or []:
            _valid_text(x)
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> str | None:
        """The first field that asks for something dflashkit does not do (a zero penalty, no tools, plain-text
        response format: fine)."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            v = extra.get(name)
            if v is not None and v not in HARMLESS:
                return name
        return None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Common):
    prompt: str
    logprobs: int | None = Field(default=None, ge=0, le=5)

    _prompt = field_validator("prompt")(_valid_text)

    def logprobs_k(self) -> int | None:
        return self.logprobs


def check_limits(req: Common, limits: Limits) -> str | None:
    """The reason a well-formed request is still refused (sizes and unsupported features), or None."""
    name = req.unsupported()
    if name:
        return f"`{name}` is not supported by dflashkit; remove it from the request"
    if isinstance(req, ChatRequest) and len(req.messages) > limits.max_messages:
        return f"{len(req.messages)} messages exceed the server's limit of {limits.max_messages}"
    stops = req.stops()
    if len(stops) > limits.max_stop or any(len(x) > limits.max_stop_chars for x in stops):
        return f"at most {limits.max_stop} stop strings of at most {limits.max_stop_chars} characters each"
    if req.n > limits.max_n:
        return f"n = {req.n} exceeds the server's limit of {limits.max_n}"
    k = req.logprobs_k()
    if k is not None and k > limits.max_top_logprobs:
        return f"top_logprobs = {k} exceeds {limits.max_top_logprobs}"
    return None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Seconds a 429 asks the client to wait (`Retry-After`): about what a queued request of a busy server waits.
RETRY_AFTER_S = 1


def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content=error_body(message, type_, param, code), headers=headers)


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


def gone(rid: str):
    """The answer to a client that left: its rows are cancelled; one INFO line, no traceback; nobody reads the 499
    (nginx's "client closed request")."""
    from fastapi.responses import Response

    log.info("request %s: the client disconnected; its sequences are cancelled", rid)
    return Response(status_code=499)


class Responder:
    """Turns one validated request into an OpenAI response: a JSON body, or server-sent events. `n` > 1 submits n
    sequences (seeded requests get seeds seed, seed+1, ...)."""

    def __init__(self, sched: Scheduler, model_name: str, limits: Limits):
        self.sched, self.engine, self.model_name, self.limits = sched, sched.engine, model_name, limits

    async def __call__(self, req: Common, prompt_ids: list[int], chat: bool, request, rid: str):
        if req.model is not None and req.model != self.model_name:
            return error(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}` "
                              "(GET /v1/models)", type_="NotFoundError", param="model", code="model_not_found")
        max_new = req.max_completion_tokens or req.max_tokens or 256
        jobs = []
        try:
            for i in range(req.n):
                seed = req.seed if req.seed is None or i == 0 else (req.seed + i if req.seed + i <= SEED_MAX
                                                                    else req.seed - i)
                params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=seed)
                jobs.append(self.sched.submit(prompt_ids, params, max_new, req.stops(), req.logprobs_k(),
                                              speculate=req.speculate, stream=bool(req.stream)))
        except (DFlashError, OverloadError) as e:
            for j in jobs:
                self.sched.cancel(j)
            if isinstance(e, OverloadError):
                return error(429, str(e), type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            return error(400, str(e))
        self.sched.metrics.requests += 1
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": "chat.completion" if chat else
                "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            from fastapi.responses import StreamingResponse

            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.events(jobs, req.stops(), chat, head, request, usage),
                                     media_type="text/event-stream")
        try:
            return await self.complete(jobs, req.stops(), chat, head, request)
        except (ClientGone, asyncio.CancelledError) as e:
            for j in jobs:
                self.sched.cancel(j)
            if isinstance(e, ClientGone):
                return gone(rid)
            raise

    # ---- pieces of a response --------------------------------------------------------------------------------
    @staticmethod
    def usage(jobs) -> dict:
        p = jobs[0].seq.stats.prompt_tokens
        c = sum(j.seq.stats.new_tokens for j in jobs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def finish_reason(job) -> str:
        return "length" if job.seq.finish_reason == "length" else "stop"

    def logprobs(self, entries: list, tokens: list[int], chat: bool) -> dict:
        dec = self.engine.tokenizer.decode

        def tok(i):
            t = dec([i])
            return t, list(t.encode("utf-8"))
        if chat:
            content = []
            for t, (lp, top) in zip(tokens, entries):
                s, b = tok(t)
                content.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": [
                    {"token": tok(i)[0], "logprob": v, "bytes": tok(i)[1]} for i, v in top]})
            return {"content": content}
        strs = [tok(t)[0] for t in tokens]
        offsets = [sum(len(x) for x in strs[:k]) for k in range(len(strs))]
        return {"tokens": strs, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [{tok(i)[0]: v for i, v in top} for _, top in entries], "text_offset": offsets}

    def choice(self, i: int, job, text: str, chat: bool, lps: list | None, toks: list[int], done: bool,
               stream: bool) -> dict:
        fr = self.finish_reason(job) if done else None
        c: dict[str, Any] = {"index": i}
        if chat and stream:
            c["delta"] = {"content": text} if text else {}
        elif chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self.logprobs(lps, toks, chat) if lps is not None else None
        c["finish_reason"] = fr
        return c

    # ---- a JSON body ------------------------------------------------------------------------------------------
    async def wait(self, job, request):
        """The job's end (None) or its error, checking twice a second that the client is still there (steps keep
        arriving while it decodes, so the check runs on a clock, not only when the queue is quiet)."""
        checked = time.monotonic()
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), 0.5)
            except asyncio.TimeoutError:
                item = ...
            if item is None or isinstance(item, Exception):
                return item
            if time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone

    async def complete(self, jobs, stops, chat: bool, head: dict, request):
        choices = []
        for i, job in enumerate(jobs):
            item = await self.wait(job, request)
            if isinstance(item, Exception):
                for j in jobs:
                    self.sched.cancel(j)
                return error(500, f"generation failed: {item}", type_="server_error")
            s = job.seq
            lps = s.logprobs if s.logprobs_k is not None else None
            choices.append(self.choice(i, job, self.engine.decode(s.generated, stops), chat, lps, s.generated,
                                       True, False))
        return {**head, "choices": choices, "usage": self.usage(jobs), "dflash": jobs[0].seq.stats.to_dict()}

    # ---- server-sent events ------------------------------------------------------------------------------------
    def sse(self, head: dict, chat: bool, choices: list, **extra) -> str:
        c = {**head, "object": head["object"] + ".chunk" if chat else head["object"], "choices": choices, **extra}
        return f"data: {json.dumps(c)}\n\n"

    async def events(self, jobs, stops, chat: bool, head: dict, request, include_usage: bool):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, job):
            while True:
                item = await job.out.get()
                await merged.put((i, item))
                if item is None or isinstance(item, Exception):
                    return
        tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
        sent, ntok, done = [""] * len(jobs), [0] * len(jobs), 0
        try:
            first = True
            while done < len(jobs):
                i, item = await merged.get()
                if first and chat:  # the first delta carries the role, as OpenAI's does (sent once decoding runs)
                    yield self.sse(head, chat, [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None} for k in range(len(jobs))])
                first = False
                # uvicorn may swallow writes to a closed socket, so ask the connection directly.
                if await request.is_disconnected():
                    return
                if isinstance(item, Exception):
                    yield f"data: {json.dumps(error_body(str(item), 'server_error'))}\n\n"
                    return
                fin, s = item is None, jobs[i].seq
                text = self.engine.decode(s.generated, stops)
                if not fin and text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                    continue
                delta, sent[i] = text[len(sent[i]):], text
                n = len(s.generated)
                lps = s.logprobs[ntok[i]:n] if s.logprobs_k is not None else None
                toks, ntok[i] = s.generated[ntok[i]:n], n
                if delta or fin or lps:
                    extra = {"dflash": s.stats.to_dict()} if fin else {}
                    yield self.sse(head, chat, [self.choice(i, jobs[i], delta, chat, lps, toks, fin, True)], **extra)
                done += fin
            if include_usage:
                yield self.sse(head, chat, [], usage=self.usage(jobs))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for j in jobs:
                if not j.seq.finished:  # the client went away mid-stream
                    self.sched.cancel(j)
