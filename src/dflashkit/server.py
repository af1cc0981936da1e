"""OpenAI-compatible DFlash server (FastAPI + uvicorn) with continuous batching.

The engine loop (`scheduler.py`) owns the engine and one `DecodeBatch` (the engine's `DecodeConfig`): between
decoding steps it admits queued requests (prefilled, then joined to the running batch) and drops finished or
cancelled ones. HTTP handlers only validate (`openai_api.py`), tokenise off the event loop, enqueue and relay
tokens. A client that disconnects cancels its sequences (streaming or not); a full queue answers 429; a body over
the size limit 413 before it is read; shutdown stops admitting and lets the running batch finish.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text). With an API key, /v1/* needs
`Authorization: Bearer KEY`. Every response carries an `X-Request-Id` (the client's, or a new one).
"""

import asyncio
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager

from .engine import DFlashEngine
from .invariance import mode as exactness_mode
from .loader import encode_chat
from .errors import DFlashError
from .openai_api import ChatRequest, CompletionRequest, Limits, Responder, check_limits, error, error_body
from .scheduler import DEFAULT_PREFILL_CHUNK, Job, Metrics, OverloadError, Scheduler

log = logging.getLogger(__name__)

__all__ = ["Job", "Limits", "Metrics", "OverloadError", "Scheduler", "build_app", "serve_in_thread"]


class _TooLarge(Exception):
    pass


class Gate:
    """ASGI middleware in front of every route: the body-size limit (413, from Content-Length before the body is
    read, or while a chunked body streams in), the API key (401) and the X-Request-Id header."""

    def __init__(self, app, limit: int, api_key: str | None = None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                msg = {**msg, "headers": list(msg.get("headers", [])) + [(b"x-request-id", rid.encode("latin-1"))]}
            await send(msg)

        if self.api_key and scope["path"].startswith("/v1/") and \
                headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
            return await self._reject(send_with_id, 401, "missing or wrong API key: send `Authorization: Bearer "
                                      "KEY` (the key given to `dflashkit serve --api-key`)", "authentication_error")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.limit:
            return await self._reject(send_with_id, 413, self._too_large(declared))
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg
        try:
            await self.app(scope, limited, send_with_id)
        except _TooLarge:
            if not started:
                await self._reject(send_with_id, 413, self._too_large(seen))

    def _too_large(self, n: int) -> str:
        return f"the request body ({n} bytes or more) exceeds the server's limit of {self.limit} bytes " \
               "(`dflashkit serve --max-body-bytes`)"

    @staticmethod
    async def _reject(send, status: int, message: str, type_: str = "invalid_request_error"):
        import json

        body = json.dumps(error_body(message, type_)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def build_app(engine: DFlashEngine, tokenizer, model_name: str, max_batch: int = 8, max_queue: int = 64,
              max_len: int = 2048, engine_thread: bool = True, limits: Limits = Limits(), api_key: str | None = None,
              prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
    """The FastAPI app. engine_thread=False: the caller runs `app.state.scheduler.run()` itself (on the thread
    that loaded the model, as `dflashkit serve` does); otherwise the app starts an engine thread at start-up."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse
    from starlette.exceptions import HTTPException

    sched = Scheduler(engine, max_batch, max_queue, max_len, prefill_chunk)
    respond = Responder(sched, model_name, limits)
    max_token_chars = max_chars_per_token(tokenizer)  # `too_long` refuses prompts of more characters x context

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
        return invalid_request(exc.errors()[0] if exc.errors() else {})

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):  # e.g. a body that is not UTF-8 JSON: OpenAI's shape, not FastAPI's
        if isinstance(exc.__cause__, _TooLarge):  # a chunked body that outgrew the limit while FastAPI read it
            return error(413, f"the request body exceeds the server's limit of {limits.max_body_bytes} bytes "
                              "(`dflashkit serve --max-body-bytes`)")
        return error(exc.status_code, str(exc.detail), type_="invalid_request_error" if exc.status_code < 500
                     else "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(sched.jobs), "prefilling": len(sched.prefilling),
                "queued": sched.pending.qsize(),
                "greedy_exactness": exactness_mode(engine.target)}  # measured at start-up (invariance.py)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dflashkit", "max_model_len": sched.context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(sched.metrics.prometheus(sched.engine.policy_stats()))

    async def handle(req, request: Request, chat: bool):
        why = check_limits(req, limits)
        if why:
            return error(400, why)
        if why := too_long(req, chat, sched, max_token_chars):
            return error(400, why, param="messages" if chat else "prompt")
        if chat:  # tokenise and template off the event loop: /health and other requests keep answering
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            ids = await asyncio.to_thread(encode_chat, tokenizer, msgs)
        else:
            ids = (await asyncio.to_thread(tokenizer, req.prompt))["input_ids"]
            if not ids:
                return error(400, "the prompt is empty", param="prompt")
        return await respond(req, ids, chat, request, request.scope["state"]["request_id"])

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await handle(req, request, True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await handle(req, request, False)

    created = int(time.time())
    app.add_middleware(Gate, limit=limits.max_body_bytes, api_key=api_key)
    app.state.scheduler = sched
    return app


def invalid_request(first: dict):
    """The 400 for a body FastAPI could not read into a request (`first`: its first error)."""
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field: no `param`
        where, why = first.get("loc", ("body", "?"))[-1], first.get("ctx", {}).get("error", "malformed")
        return error(400, f"the body is not valid JSON ({why} at character {where}); send one JSON object")
    loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
    return error(400, f"invalid request: {loc}: {first.get('msg', 'malformed body')}", param=loc or None)


def too_long(req, chat: bool, sched: Scheduler, max_token_chars: int) -> str | None:
    """Why a prompt is refused before it is tokenised: more characters than the context's tokens can spell, however
    long each token is (`max_chars_per_token`). A 100k-token prompt would otherwise be tokenised in full, seconds and
    a GB, only to be refused."""
    chars = sum(len(m.text()) for m in req.messages) if chat else len(req.prompt)
    if chars <= sched.context * max_token_chars:
        return None
    return (f"the prompt ({chars} characters) cannot fit the server's context of {sched.context} tokens (--max-len "
            f"{sched.max_len}; a token here spans at most {max_token_chars} characters); shorten the prompt.")


def max_chars_per_token(tokenizer) -> int:
    """The most characters any token of `tokenizer` decodes to (at least 1; 64 where the vocabulary is unknown)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max(len(tokenizer.convert_tokens_to_string([t])) for t in vocab))
    except Exception:  # noqa: BLE001 - a tokenizer without these methods: a generous bound
        return 64


def check_port(host: str, port: int) -> None:
    """Raise DFlashError at once, naming the remedy, if nothing can listen on host:port (uvicorn would retry)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror}); is another server running? "
                              "Pick another --port.") from None


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
    else:
        check_port(host, port)
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + timeout
    while not srv.started:
        if time.time() > deadline or not th.is_alive():
            raise DFlashError(f"the server did not start on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.05)
    return srv, th, f"http://{host}:{port}"
