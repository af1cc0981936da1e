"""OpenAI-compatible DFlash server (FastAPI + uvicorn) with continuous batching.

One worker thread owns the engine and one `DecodeBatch`: between decoding steps it admits queued requests
(prefilled, then joined to the running batch) and drops finished or cancelled ones. HTTP handlers only
validate, enqueue and relay tokens. A client that disconnects cancels its sequence; a full queue answers
429; shutdown stops admitting and lets the running batch finish.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

(No `from __future__ import annotations` here: FastAPI must see the request models defined inside
`build_app` as real classes, or it takes them for query parameters.)
"""

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from .engine import DecodeBatch, DFlashEngine, cache_positions
from .errors import DFlashError
from .sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Job:
    seq: object  # engine._Seq
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # StepOutput items, then None
    cancelled: bool = False


@dataclass
class Metrics:
    requests: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    latency_buckets: tuple = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
    latency_counts: list[int] = field(default_factory=lambda: [0] * 9)  # one per bucket
    latency_sum: float = 0.0
    latency_n: int = 0

    def observe(self, stats, latency: float, block_size: int) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.generated_tokens += stats.new_tokens
        self.target_passes += stats.target_passes
        self.draft_tokens += stats.target_passes * (block_size - 1)
        self.accepted_tokens += sum(stats.accepted)
        if len(self.accepted_per_position) < block_size - 1:
            self.accepted_per_position += [0] * (block_size - 1 - len(self.accepted_per_position))
        for a in stats.accepted:
            for j in range(a):
                self.accepted_per_position[j] += 1
        for i, b in enumerate(self.latency_buckets):
            self.latency_counts[i] += latency <= b
        self.latency_sum += latency
        self.latency_n += 1

    def prometheus(self) -> str:
        tau = (self.target_passes + self.accepted_tokens) / self.target_passes if self.target_passes else 0.0
        lines = [
            "# TYPE dflashkit_requests_total counter", f"dflashkit_requests_total {self.requests}",
            "# TYPE dflashkit_requests_rejected_total counter", f"dflashkit_requests_rejected_total {self.requests_rejected}",
            "# TYPE dflashkit_prompt_tokens_total counter", f"dflashkit_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE dflashkit_generated_tokens_total counter", f"dflashkit_generated_tokens_total {self.generated_tokens}",
            "# TYPE dflashkit_target_passes_total counter", f"dflashkit_target_passes_total {self.target_passes}",
            "# TYPE dflashkit_draft_tokens_total counter", f"dflashkit_draft_tokens_total {self.draft_tokens}",
            "# TYPE dflashkit_accepted_tokens_total counter", f"dflashkit_accepted_tokens_total {self.accepted_tokens}",
            "# TYPE dflashkit_tau gauge", f"dflashkit_tau {tau:.4f}",
            "# TYPE dflashkit_accepted_per_position_total counter",
        ]
        lines += [f'dflashkit_accepted_per_position_total{{position="{j + 1}"}} {c}'
                  for j, c in enumerate(self.accepted_per_position)]
        lines.append("# TYPE dflashkit_request_latency_seconds histogram")
        for b, c in zip(self.latency_buckets, self.latency_counts):
            lines.append(f'dflashkit_request_latency_seconds_bucket{{le="{b}"}} {c}')
        lines += [f'dflashkit_request_latency_seconds_bucket{{le="+Inf"}} {self.latency_n}',
                  f"dflashkit_request_latency_seconds_sum {self.latency_sum:.6f}",
                  f"dflashkit_request_latency_seconds_count {self.latency_n}"]
        return "\n".join(lines) + "\n"


class Scheduler:
    """Owns the engine in one thread; requests join and leave the running batch between steps."""

    def __init__(self, engine: DFlashEngine, block_size: int, max_batch: int, max_queue: int, max_len: int):
        self.engine, self.block_size, self.max_batch, self.max_len = engine, block_size, max_batch, max_len
        self.pending: queue.Queue[_Job] = queue.Queue(maxsize=max_queue)
        self.jobs: dict[int, _Job] = {}
        self.metrics = Metrics()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._draining = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine loop in a new thread (tests, embedding). `dflashkit serve` calls `run()` on its main
        thread instead: see `run`."""
        self.thread = threading.Thread(target=self.run, name="dflashkit-engine", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """The engine loop, in the calling thread, until `shutdown`.

        Why the thread matters: torch's OpenMP runtime keeps one thread team per thread that ran a parallel op.
        Once two teams exist (the thread that loaded the model, and an engine thread) and their threads outnumber
        the cores, libgomp stops spinning between parallel regions and every op pays a wake-up: on 2 cores a
        one-token decode step got ~1.5x slower. Running the loop on the thread that loaded the model avoids that."""
        try:
            self._run()
        finally:
            self._done.set()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop admitting; in-flight requests finish (drain), then the engine loop returns."""
        self._draining = True
        self._stop.set()
        self._done.wait(timeout)

    def submit(self, prompt_ids, sampling: SamplingParams, max_new_tokens: int, stop) -> _Job:
        if self._draining:
            raise OverloadError("the server is shutting down")
        seq = self.engine.sequence(next(self._ids), prompt_ids, sampling, max_new_tokens, stop, self.block_size)
        width = self.engine.verify_width(self.block_size)
        if cache_positions(len(prompt_ids), max_new_tokens, width) > self.max_len:
            raise DFlashError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_new_tokens}) exceeds the "
                              f"server's context of {self.max_len - width - 1} tokens; shorten the prompt "
                              "or lower max_tokens.")
        loop = asyncio.get_running_loop()
        job = _Job(seq, loop, asyncio.Queue())
        try:
            self.pending.put_nowait(job)
        except queue.Full:
            self.metrics.requests_rejected += 1
            raise OverloadError("the request queue is full; retry later") from None
        self.metrics.requests += 1
        return job

    def cancel(self, job: _Job) -> None:
        job.cancelled = True  # the worker drops its row before the next step

    def _emit(self, job: _Job, item) -> None:
        job.loop.call_soon_threadsafe(job.out.put_nowait, item)

    def _run(self) -> None:
        batch = DecodeBatch(self.engine, self.block_size, self.max_len)
        while True:
            for j in self.jobs.values():
                if j.cancelled and not j.seq.finished:
                    batch.cancel(j.seq.index)
            # admit queued requests up to max_batch (wait briefly when idle, so the stop flag is still seen)
            new = []
            while len(self.jobs) + len(new) < self.max_batch:
                try:
                    idle = not self.jobs and not new
                    job = self.pending.get(timeout=0.05) if idle else self.pending.get_nowait()
                except queue.Empty:
                    break
                if not job.cancelled:
                    new.append(job)
            if self._stop.is_set() and not self.jobs and not new:
                return
            try:
                if new:
                    for j in new:
                        self.jobs[j.seq.index] = j
                    self._dispatch(batch.add([j.seq for j in new]))
                if batch.alive:
                    self._dispatch(batch.step())
                elif self.jobs:  # every job finished or was cancelled
                    self._dispatch([])
            except Exception as e:  # never let one bad step kill the server: fail the jobs in the batch
                log.exception("decoding step failed")
                for j in list(self.jobs.values()):
                    self._emit(j, e)
                self.jobs.clear()
                batch = DecodeBatch(self.engine, self.block_size, self.max_len)

    def _dispatch(self, outs) -> None:
        for o in outs:
            job = self.jobs.get(o.index)
            if job is not None and o.tokens:
                self._emit(job, o)
        for idx, job in list(self.jobs.items()):
            if job.seq.finished:
                self.metrics.observe(job.seq.stats, time.perf_counter() - job.seq.t_arrival, job.seq.stats.block_size)
                self._emit(job, None)
                del self.jobs[idx]


class OverloadError(Exception):
    pass


def build_app(engine: DFlashEngine, tokenizer, model_name: str, block_size: int, max_batch: int = 8,
              max_queue: int = 64, max_len: int = 2048, engine_thread: bool = True):
    """The FastAPI app. engine_thread=False: the caller runs `app.state.scheduler.run()` itself (on the thread
    that loaded the model, as `dflashkit serve` does); otherwise the app starts an engine thread at start-up."""
    from typing import Literal

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    from .loader import encode_chat

    sched = Scheduler(engine, block_size, max_batch, max_queue, max_len)

    class Message(BaseModel):
        role: Literal["system", "user", "assistant"]
        content: str

    class Common(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        max_tokens: int | None = Field(default=None, ge=1)
        max_completion_tokens: int | None = Field(default=None, ge=1)
        temperature: float = Field(default=1.0, ge=0, le=100)
        top_p: float = Field(default=1.0, gt=0, le=1)
        top_k: int = Field(default=0, ge=0)
        stop: str | list[str] | None = None
        seed: int | None = None
        stream: bool = False
        n: int = Field(default=1, ge=1, le=1)

    class ChatRequest(Common):
        messages: list[Message] = Field(min_length=1)

    class CompletionRequest(Common):
        prompt: str

    def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_,
                                                                   "param": param, "code": None}})

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            sched.start()
        yield
        # drain: stop admitting, let in-flight requests finish
        await asyncio.get_running_loop().run_in_executor(None, sched.shutdown)

    app = FastAPI(title="dflashkit", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
        return error(400, f"invalid request: {loc}: {first.get('msg', 'malformed body')}", param=loc or None)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(sched.jobs), "queued": sched.pending.qsize()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dflashkit"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(sched.metrics.prometheus())

    async def run(req: Common, prompt_ids: list[int], chat: bool, request: Request):
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        max_new = req.max_completion_tokens or req.max_tokens or 256
        try:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)
            job = sched.submit(prompt_ids, params, max_new, stop)
        except DFlashError as e:
            return error(400, str(e))
        except OverloadError as e:
            return error(429, str(e), type_="rate_limit_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage_and_stats():
            st = job.seq.stats
            return ({"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
                     "total_tokens": st.prompt_tokens + st.new_tokens}, st.to_dict())

        def finish_reason():
            r = job.seq.finish_reason
            return "length" if r == "length" else "stop"

        if req.stream:
            async def events():
                sent = ""
                try:
                    while True:
                        item = await job.out.get()
                        # uvicorn may swallow writes to a closed socket, so ask the connection directly.
                        if await request.is_disconnected():
                            return
                        if isinstance(item, Exception):
                            yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                            return
                        done = item is None
                        text = engine.decode(job.seq.generated, stop)
                        if not done and text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                            continue
                        delta, sent = text[len(sent):], text
                        if delta or done:
                            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                     "model": model_name}
                            fr = finish_reason() if done else None
                            if chat:
                                chunk["choices"] = [{"index": 0, "delta": {"content": delta} if delta else {},
                                                     "finish_reason": fr}]
                            else:
                                chunk["choices"] = [{"index": 0, "text": delta, "finish_reason": fr}]
                            if done:
                                chunk["usage"], chunk["dflash"] = usage_and_stats()
                            yield f"data: {json.dumps(chunk)}\n\n"
                        if done:
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not job.seq.finished:  # the client went away mid-stream
                        sched.cancel(job)

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            while True:
                item = await job.out.get()
                if isinstance(item, Exception):
                    return error(500, f"generation failed: {item}", type_="server_error")
                if item is None:
                    break
        except asyncio.CancelledError:
            sched.cancel(job)
            raise
        text = engine.decode(job.seq.generated, stop)
        usage, stats = usage_and_stats()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason()}
                  if chat else {"index": 0, "text": text, "finish_reason": finish_reason()})
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                "usage": usage, "dflash": stats}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        ids = encode_chat(tokenizer, [m.model_dump() for m in req.messages])
        return await run(req, ids, True, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ids = tokenizer(req.prompt)["input_ids"]
        if not ids:
            return error(400, "the prompt is empty", param="prompt")
        return await run(req, ids, False, request)

    app.state.scheduler = sched
    return app


def serve_in_thread(app, host: str = "127.0.0.1", timeout: float = 60.0, port: int | None = None):
    """Run `app` under uvicorn in a daemon thread (on a free port unless `port` is given).

    Returns (server, thread, base_url) once it accepts connections; stop it with `server.should_exit = True`
    and `thread.join()`."""
    import socket

    import uvicorn

    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + timeout
    while not srv.started:
        if time.time() > deadline or not th.is_alive():
            raise DFlashError(f"the server did not start on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.05)
    return srv, th, f"http://{host}:{port}"
