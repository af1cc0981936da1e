"""The OpenAI-compatible server, driven by the real `openai` client over loopback (real SmolLM2, float32)."""

import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.real

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
           "What is 2 + 2?", "Say hello in Spanish.", "List two fruits.", "What is Python?", "Define gravity briefly."]


def alone(server, prompt, n):
    from dflashkit.loader import encode_chat
    eng, tok = server["engine"], server["tok"]
    return eng.generate([encode_chat(tok, prompt)], max_new_tokens=n)[0].text


def test_chat_non_streaming_and_streaming(server, client):
    r = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.usage.completion_tokens <= 24 and r.choices[0].finish_reason in ("stop", "length")
    assert r.model_extra["dflash"]["tau"] >= 1.0 and len(r.model_extra["dflash"]["acceptance"]) == 7
    chunks = list(client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                 max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_completions_models_health_metrics(server, client):
    r = client.completions.create(model="smollm2-test", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 6
    assert [m.id for m in client.models.list().data] == ["smollm2-test"]
    health = json.loads(urllib.request.urlopen(server["url"] + "/health").read())
    assert health["status"] == "ok" and health["greedy_exactness"] in {"bitwise", "near-tie rule", "not measured"}
    metrics = urllib.request.urlopen(server["url"] + "/metrics").read().decode()
    for name in ("dflashkit_requests_total", "dflashkit_generated_tokens_total", "dflashkit_tau",
                 "dflashkit_accepted_per_position_total", "dflashkit_request_latency_seconds_bucket",
                 'dflashkit_policy_steps_total{setting="b8-tree0-lookup0"}', "dflashkit_policy_drafter_steps_total",
                 "dflashkit_policy_plain_steps_total"):
        assert name in metrics


def test_eight_concurrent_clients_get_what_they_get_alone(server, client):
    """Lossless under batching: at T=0 each of 8 concurrent requests receives exactly its single-request text."""
    def ask(p):
        return client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": p}],
                                              max_tokens=32, temperature=0).choices[0].message.content
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(ask, PROMPTS))
    for p, g in zip(PROMPTS, got):
        assert g == alone(server, p, 32), p


def test_requests_without_speculation_run_beside_speculating_ones(server, client):
    """`speculate: false` decodes a request autoregressively in the scheduler's second batch, concurrently with
    speculating requests: the same greedy text as alone, no drafts verified, and the speculating rows unharmed."""
    def ask(i_p):
        i, p = i_p
        r = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": p}],
                                           max_tokens=24, temperature=0, extra_body={"speculate": i % 2 == 0})
        return r.choices[0].message.content, r.model_extra["dflash"]
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(ask, enumerate(PROMPTS[:6])))
    for i, (p, (text, stats)) in enumerate(zip(PROMPTS, got)):
        assert text == alone(server, p, 24), p
        if i % 2:  # autoregressive: one token per target pass, nothing drafted
            assert stats["tau"] == 1.0 and stats["acceptance"] == [] and stats["max_tokens_per_pass"] == 1
        else:  # the speculating batch (whether a step drafts is the adaptive policy's choice under this load)
            assert len(stats["acceptance"]) == 7 and stats["max_tokens_per_pass"] == 8


def post(server, body: bytes | str, path="/v1/chat/completions"):
    """(status, the JSON body; for a streamed answer the list of its events' JSON)."""
    req = urllib.request.Request(server["url"] + path, data=body if isinstance(body, bytes) else body.encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, _decoded(r)
    except urllib.error.HTTPError as e:
        return e.code, _decoded(e)


def _decoded(r):
    raw = r.read()
    if r.headers.get("content-type", "").startswith("text/event-stream"):  # a valid body may ask to stream
        lines = raw.decode().splitlines()
        return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
    return json.loads(raw or b"{}")


@pytest.mark.parametrize("body", [
    "{not json",
    '{"messages": []}',
    '{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
    '{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
    '{"messages": [{"role": "robot", "content": "hi"}]}',
    '{"messages": "hi"}',
    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}',
    '{"messages": [{"role": "user", "content": "hi"}], "speculate": "maybe"}',
])
def test_bad_requests_get_openai_style_4xx(server, body):
    status, payload = post(server, body)
    assert 400 <= status < 500 and payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]


def test_disconnecting_client_frees_its_slot(server):
    import http.client
    host, port = server["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 900, "temperature": 0, "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.read(64)  # the stream started
    sched = server["app"].state.scheduler
    assert len(sched.jobs) == 1
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    resp.close()
    conn.close()
    deadline = time.time() + 30
    while sched.jobs and time.time() < deadline:
        time.sleep(0.1)
    assert not sched.jobs, "the cancelled request still holds its slot"
    assert json.loads(urllib.request.urlopen(server["url"] + "/health").read())["running"] == 0


def test_fuzzed_request_bodies_never_yield_5xx(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=8))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                     "content": st.one_of(st.text(max_size=20), scalar)})
    body = st.fixed_dictionaries({}, optional={
        "messages": st.one_of(st.lists(message, max_size=3), scalar),
        "max_tokens": st.one_of(st.integers(-3, 4), scalar),
        "temperature": st.one_of(st.floats(-2, 3, allow_nan=False), scalar),
        "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), scalar),
        "top_k": scalar, "stop": st.one_of(scalar, st.lists(st.text(max_size=3), max_size=2)),
        "seed": scalar, "stream": st.booleans(), "n": st.integers(0, 3), "model": scalar,
        "unknown_field": scalar})

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body)
    def check(b):
        status, _ = post(server, json.dumps(b).encode())
        assert status < 500, b

    check()


def test_full_queue_gets_429_and_shutdown_drains_in_flight_requests():
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.loader import load_default_drafter, load_target
    from dflashkit.server import build_app, serve_in_thread

    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    app = build_app(DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(block_size=4)), tok, "t",
                    max_batch=1, max_queue=1, max_len=512)
    srv, th, url = serve_in_thread(app)
    server = {"url": url}
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 120,
                       "temperature": 0})
    def status_and_retry(_):
        req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers.get("Retry-After")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Retry-After")
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(status_and_retry, range(6)))
    statuses = [s for s, _ in got]
    assert statuses.count(200) >= 1 and 429 in statuses and set(statuses) <= {200, 429}
    assert all(retry == "1" for s, retry in got if s == 429)  # the 429 says when to come back
    # shutdown while a request is running: it still completes (drain)
    sched = app.state.scheduler
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, server, body)
        while not sched.jobs:
            time.sleep(0.02)
        srv.should_exit = True
        status, payload = fut.result(timeout=120)
    th.join(60)
    assert status == 200 and payload["choices"][0]["message"]["content"]
    assert not th.is_alive()


def test_cli_serve_runs_the_engine_on_its_main_thread_and_drains_on_sigterm(tmp_path):
    """`dflashkit serve` as users start it: HTTP in a thread, the engine loop on the main thread (one OpenMP
    team, see Scheduler.run); SIGTERM while a request runs still answers it, then the process exits 0."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "dflashkit"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--dtype", "float32", "--block-size", "4",
                             "--max-len", "512"], stdout=log, stderr=subprocess.STDOUT)
    server = {"url": f"http://127.0.0.1:{port}"}
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if urllib.request.urlopen(server["url"] + "/health", timeout=2).status == 200:
                    break
            except OSError:
                assert time.time() < deadline, "the server did not start"
                time.sleep(0.5)
        body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 60,
                           "temperature": 0})
        status, payload = post(server, body)
        assert status == 200 and payload["usage"]["completion_tokens"] > 0
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(post, server, body)
            while json.loads(urllib.request.urlopen(server["url"] + "/health").read())["running"] == 0:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            status2, payload2 = fut.result(timeout=120)
        assert status2 == 200 and payload2["choices"][0]["message"]["content"] == payload["choices"][0]["message"]["content"]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_lookup_branch_under_continuous_batching():
    """A server whose engine verifies draft trees (a pruned drafter tree of up to 6 nodes over the drafter's 16K most
    frequent ids, block 4, + a 6-token lookup branch): clients that arrive while others are mid-generation (rows join
    and leave the running batch) still get exactly their text alone."""
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.loader import encode_chat, load_default_drafter, load_target
    from dflashkit.lookup import LookupParams
    from dflashkit.server import build_app, serve_in_thread

    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(
        block_size=4, tree=6, tree_min_prob=0.03, draft_vocab=16384,
        lookup=LookupParams(max_tokens=6, skip_drafter_n=2, tokens_per_n=3)))
    app = build_app(engine, tok, "t", max_batch=4, max_queue=16, max_len=1024)
    srv, th, url = serve_in_thread(app)
    try:
        def ask(i):
            time.sleep(0.3 * i)  # staggered: later requests join a batch that is already decoding
            status, body = post({"url": url}, json.dumps({"messages": [{"role": "user", "content": PROMPTS[i]}],
                                                          "max_tokens": 40, "temperature": 0}))
            assert status == 200, body
            return body
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(ask, range(6)))
        metrics = scrape(url)
    finally:
        srv.should_exit = True
        th.join(30)
    for i, body in enumerate(got):
        alone_text = engine.generate([encode_chat(tok, PROMPTS[i])], max_new_tokens=40)[0].text
        assert body["choices"][0]["message"]["content"] == alone_text, PROMPTS[i]
        assert len(body["dflash"]["acceptance"]) == 6  # draft positions reach the lookup branch's depth
    # /metrics after this known workload (a fresh server, 6 requests) is the sum of what the engine reported
    stats = [b["dflash"] for b in got]
    passes = sum(st["target_passes"] for st in stats)
    for src in ("drafter", "lookup"):
        verified = sum(st["draft_nodes"][src]["verified"] for st in stats)
        accepted = sum(st["draft_nodes"][src]["accepted"] for st in stats)
        assert verified > accepted > 0, src  # both sources drafted, some of it right, some wrong
        assert metrics[f'dflashkit_draft_tokens_total{{source="{src}"}}'] == verified
        assert metrics[f'dflashkit_accepted_tokens_total{{source="{src}"}}'] == accepted
    assert metrics["dflashkit_target_passes_total"] == passes
    assert metrics["dflashkit_requests_total"] == metrics["dflashkit_sequences_total"] == 6
    engine_tau = sum(st["tau"] * st["target_passes"] for st in stats) / passes
    assert metrics["dflashkit_tau"] == pytest.approx(engine_tau, abs=1e-4)
    drafted = metrics['dflashkit_draft_tokens_total{source="drafter"}'] + \
        metrics['dflashkit_draft_tokens_total{source="lookup"}']
    assert drafted <= passes * (6 + 6)  # at most the tree's nodes per pass, not passes x (span - 1) made up


def scrape(url: str) -> dict:
    """/metrics as {series: value}."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def test_requests_and_sequences_are_counted_apart(server, client):
    """One request with n = 3 is one request and three sequences on /metrics."""
    before = scrape(server["url"])
    r = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=8, temperature=0.9, seed=3, n=3)
    after = scrape(server["url"])
    assert len(r.choices) == 3
    assert after["dflashkit_requests_total"] - before["dflashkit_requests_total"] == 1
    assert after["dflashkit_sequences_total"] - before["dflashkit_sequences_total"] == 3


def test_seeded_sampling_reproduces_speculating_or_not_alone_or_under_load(server, client):
    """temperature 0.7 with a seed: the same text on every run, speculating or not (`speculate: false` decodes
    plainly), alone or while seven other requests (unseeded, some plain) share the batches."""
    def ask(p, seed=1234, speculate=True, temperature=0.7):
        r = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": p}],
                                           max_tokens=40, temperature=temperature, seed=seed,
                                           extra_body={"speculate": speculate})
        return r.choices[0].message.content
    p = PROMPTS[2]
    first = ask(p)
    assert ask(p) == first and ask(p, speculate=False) == first
    with ThreadPoolExecutor(8) as ex:
        mine = ex.submit(ask, p)
        load = [ex.submit(ask, q, None, i % 2 == 0, 1.0) for i, q in enumerate(PROMPTS[:6])]
        plain = ex.submit(ask, p, speculate=False)
        others = [f.result() for f in load]
        assert mine.result() == first and plain.result() == first
    assert len(set(others)) > 1
    assert ask(p, seed=4321) != first  # the seed decides


def test_a_client_that_leaves_a_json_request_is_logged_once_without_a_traceback(server):
    """A non-streaming request whose client disconnects: its row is freed, one INFO line, no ASGI traceback."""
    import http.client
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    handler = Keep(logging.INFO)
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "dflashkit.openai_api")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        host, port = server["url"].removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 900, "temperature": 0}), {"content-type": "application/json"})
        sched = server["app"].state.scheduler
        deadline = time.time() + 30
        while not sched.jobs and time.time() < deadline:
            time.sleep(0.02)
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away before its answer
        conn.close()
        while (sched.jobs or not records) and time.time() < deadline + 30:
            time.sleep(0.1)
    finally:
        for lg, lv in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(lv)
    assert not sched.jobs
    assert [r.levelno for r in records] == [logging.INFO], [r.getMessage() for r in records]
    assert "disconnected" in records[0].getMessage() and records[0].exc_info is None
