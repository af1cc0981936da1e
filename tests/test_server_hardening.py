"""Server hardening: one bad request never hurts another, bounded inputs, and the OpenAI surface (real SmolLM2).

Shares the session-scoped server of conftest.py (one model load); a second app on the same engine runs only while
the first is idle (the engine is used by one thread at a time).
"""

import http.client
import json
import re
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_server import PROMPTS, alone, post

pytestmark = pytest.mark.real


def chat(content="What is 2 + 2?", **kw):
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, **kw})


def raw(server, body: bytes, headers: dict, path="/v1/chat/completions", method="POST"):
    host, port = server["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body, headers)
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


# ---- one request never hurts another -------------------------------------------------------------------------
POISON = [{"seed": 2 ** 64}, {"top_k": 2 ** 63}, {"seed": -(2 ** 63) - 1}]
_alone: dict = {}


def alone_text(server, p, n):
    """A request's text decoded alone (cached: several tests compare with it)."""
    if (p, n) not in _alone:
        _alone[p, n] = alone(server, p, n)
    return _alone[p, n]


def test_poison_requests_get_400_while_victims_get_their_answers(server):
    with ThreadPoolExecutor(6) as ex:
        victims = [ex.submit(post, server, chat(p, max_tokens=16)) for p in PROMPTS[:3]]
        time.sleep(0.2)  # the victims are decoding when the poison arrives
        bad = [ex.submit(post, server, chat(temperature=1.0, **kw)) for kw in POISON]
        got = [f.result() for f in victims]
        poisoned = [f.result() for f in bad]
    for status, payload in poisoned:
        assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    for p, (s, body) in zip(PROMPTS[:3], got):
        assert s == 200 and body["choices"][0]["message"]["content"] == alone_text(server, p, 16)


def test_a_request_whose_admission_fails_fails_alone(server):
    """Past validation (a SamplingParams forced to an unrepresentable seed): only that request fails; the rows
    admitted with it and the running ones finish normally."""
    import asyncio

    from dflashkit.loader import encode_chat
    from dflashkit.sampling import SamplingParams

    sched, tok = server["app"].state.scheduler, server["tok"]
    bad = SamplingParams(temperature=1.0)
    object.__setattr__(bad, "seed", 2 ** 64)  # bypasses validation on purpose

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [sched.submit(encode_chat(tok, p), SamplingParams(), 16, [], loop=loop) for p in PROMPTS[:2]]
        jobs.insert(1, sched.submit(encode_chat(tok, PROMPTS[2]), bad, 16, [], loop=loop))
        ends = []
        for j in jobs:
            while True:
                item = await j.out.get()
                if item is None or isinstance(item, Exception):
                    ends.append(item)
                    break
        return jobs, ends

    jobs, ends = asyncio.run(run())
    assert isinstance(ends[1], Exception) and ends[0] is None and ends[2] is None
    for j, p in ((jobs[0], PROMPTS[0]), (jobs[2], PROMPTS[1])):
        assert server["engine"].decode(j.seq.generated) == alone_text(server, p, 16)


def test_a_row_that_fails_inside_a_step_fails_alone(server):
    """A failure inside a decoding step (here: the step's proposal raises whenever one marked request is in the
    batch) finishes that request with an error; the requests decoding beside it get their normal answers, in its
    batch and in the autoregressive batch (`speculate: false`) stepped in turn with it."""
    from dflashkit.proposers import LookupProposer

    eng = server["engine"]

    class Failing(LookupProposer):  # asked every step that looks (below: all of them), drafter or not
        def propose(self, seqs):
            if any(s.max_new_tokens == 77 for s in seqs):
                raise RuntimeError("injected failure")
            return super().propose(seqs)

    from dflashkit.server import build_app, serve_in_thread

    # Why: a plain step between looks (`probes.Looks`) does not ask the lookup, and the server's recovery re-runs
    # the rows; the injected failure must fire on every step for the test to say which row it hits: a clock that
    # stands still makes every look free (with fresh look records), so every step looks.
    from dflashkit.policy.probes import Looks

    pol = eng.policy(eng.config)
    saved = pol.clock, pol.looks
    pol.clock, pol.looks = (lambda: 0.0), Looks()
    eng.set_proposers(lookup=Failing)  # a second app on the same engine: its batch is built with the failing one
    srv, th, url = serve_in_thread(build_app(eng, server["tok"], "smollm2-test", max_len=1024))
    try:
        with ThreadPoolExecutor(4) as ex:
            victims = [ex.submit(post, {"url": url}, chat(p, max_tokens=16, speculate=i != 1))
                       for i, p in enumerate(PROMPTS[:3])]
            time.sleep(0.2)
            bad = ex.submit(post, {"url": url}, chat(max_tokens=77))
            got = [f.result() for f in victims]
            status, payload = bad.result()
    finally:
        srv.should_exit = True
        th.join(30)
        eng.set_proposers(lookup=LookupProposer)
        pol.clock, pol.looks = saved
    assert status == 500 and "injected failure" in payload["error"]["message"]
    for p, (s, body) in zip(PROMPTS[:3], got):
        assert s == 200 and body["choices"][0]["message"]["content"] == alone_text(server, p, 16)
    assert got[1][1]["dflash"]["max_tokens_per_pass"] == 1  # the AR victim ran in the AR batch


# ---- bounded inputs --------------------------------------------------------------------------------------------
def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2 ** 20


def send_then_read(server, head: bytes, body_parts) -> tuple[int, dict]:
    """Raw HTTP: send the head and as much of the body as the server takes, then read its answer."""
    host, port = server["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed without reading the rest: that is the point
            pass
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head_s, sep, rest = data.partition(b"\r\n\r\n")
            m = re.search(rb"content-length: (\d+)", head_s, re.I)
            if sep and m and len(rest) >= int(m.group(1)):
                break
    head_s, _, payload = data.partition(b"\r\n\r\n")
    return int(head_s.split()[1]), json.loads(payload)


def test_a_10mb_body_gets_413_at_once_and_health_keeps_answering(server):
    rss = rss_mb()
    size = 10 << 20
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(size).encode() + b"\r\n\r\n")
    with ThreadPoolExecutor(2) as ex:
        t0 = time.time()
        big = ex.submit(send_then_read, server, head, (b"x" * (1 << 20) for _ in range(10)))
        t1 = time.time()
        health = urllib.request.urlopen(server["url"] + "/health", timeout=5)
        health_s = time.time() - t1
        status, payload = big.result()
        big_s = time.time() - t0
    assert status == 413 and "limit" in payload["error"]["message"] and big_s < 1.0
    assert health.status == 200 and health_s < 0.2
    assert rss_mb() - rss < 50  # the body was never read into memory


def test_a_chunked_body_over_the_limit_gets_413(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    part = b"x" * 65536
    chunks = [b"%x\r\n" % len(part) + part + b"\r\n" for _ in range(17)] + [b"0\r\n\r\n"]  # 1.06 MiB > 1 MiB
    status, payload = send_then_read(server, head, chunks)
    assert status == 413 and "limit" in payload["error"]["message"]


@pytest.mark.parametrize("body, message", [
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=["x" * 300]), "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}] * 300}), "messages"),
    (chat(n=9), "n = 9"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "`tools`"),
    (chat(response_format={"type": "json_object"}), "`response_format`"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(max_tokens=5000), "--max-len"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', ""),
])
def test_limits_and_odd_input_get_openai_style_400(server, body, message):
    status, payload = post(server, body)
    assert status == 400 and payload["error"]["type"] == "invalid_request_error" and message in payload["error"]["message"]
    assert set(payload) == {"error"}  # OpenAI's shape, never FastAPI's {"detail": ...}


def test_a_prompt_longer_than_the_context_in_characters_is_refused_before_tokenising(server):
    """200,000 characters cannot be 1,024 tokens (no token of this tokenizer spans 200 characters): a 400 naming
    --max-len, without tokenising it (a 100k-token prompt was tokenised in full first: seconds and a GB)."""
    status, payload = post(server, chat("lorem ipsum " * 17000))
    err = payload["error"]
    assert status == 400 and "characters" in err["message"] and "--max-len 1024" in err["message"]
    assert err["param"] == "messages"
    status, payload = post(server, json.dumps({"prompt": "x" * 200_000, "max_tokens": 4}), "/v1/completions")
    assert status == 400 and payload["error"]["param"] == "prompt"


@pytest.mark.parametrize("body", ['{"messages": [{"role": "user", "content": "hi"}]', "{not json", "[1, 2"])
def test_invalid_json_names_where_it_breaks_without_a_param(server, body):
    status, payload = post(server, body)
    assert status == 400 and "not valid JSON" in payload["error"]["message"] and payload["error"]["param"] is None


@pytest.mark.parametrize("extra", [{"temperature": 1e-45}, {"temperature": 1e-300}, {"top_p": 1e-300},
                                   {"temperature": 2.0, "top_p": 1e-300, "seed": 3}])
def test_extreme_sampling_values_give_text_not_nan(server, extra):
    status, payload = post(server, chat(**extra))
    assert status == 200 and payload["choices"][0]["message"]["content"].strip()
    if extra.get("temperature", 1) < 1e-30 or extra.get("top_p", 1) < 1e-30:  # the greedy limit
        assert payload["choices"][0]["message"]["content"] == alone_text(server, "What is 2 + 2?", 12)


def test_a_dropped_non_streaming_request_is_cancelled(server):
    sched = server["app"].state.scheduler
    host, port = server["url"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    body = chat("Write a very long story about a dragon.", max_tokens=900).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 30
    while not sched.jobs and time.time() < deadline:
        time.sleep(0.05)
    assert sched.jobs
    sock.close()  # the client goes away before the answer
    deadline = time.time() + 10
    while sched.jobs and time.time() < deadline:
        time.sleep(0.1)
    assert not sched.jobs, "the abandoned request is still generating"


# ---- the OpenAI surface ------------------------------------------------------------------------------------------
def test_unknown_model_is_404_and_models_lists_created_and_max_len(server, client):
    status, payload = post(server, chat(model="../../etc/passwd"))
    assert status == 404 and "does not exist" in payload["error"]["message"]
    m = json.loads(urllib.request.urlopen(server["url"] + "/v1/models").read())["data"][0]
    assert m["id"] == "smollm2-test" and m["created"] > 0 and 0 < m["max_model_len"] < 1024


def test_request_id_header_is_echoed_or_made(server):
    status, headers, _ = raw(server, chat().encode(), {"content-type": "application/json", "X-Request-Id": "abc-1"})
    assert status == 200 and headers["x-request-id"] == "abc-1"
    status, headers, _ = raw(server, b"", {}, path="/health", method="GET")
    assert len(headers["x-request-id"]) >= 16


def test_stream_has_role_first_and_usage_only_when_asked(server, client):
    msgs = [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of "}, {"type": "text",
                                                                                                  "text": "France?"}]}]
    chunks = list(client.chat.completions.create(model="smollm2-test", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="smollm2-test", messages=msgs, max_tokens=16, temperature=0,
                                                stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in plain)
    assert text and text == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_n_choices_and_logprobs(server, client):
    r = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=10, temperature=0.8, seed=5, n=3, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        for t in c.logprobs.content:
            tops = [x.logprob for x in t.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6 <= 1e-6
    g = client.chat.completions.create(model="smollm2-test", messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    greedy = g.choices[0].logprobs.content
    assert "".join(t.token for t in greedy).startswith(g.choices[0].message.content)  # the tokens spell the text
    assert all(t.top_logprobs[0].token == t.token for t in greedy)  # greedy picks the most likely token
    c = client.completions.create(model="smollm2-test", prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=2, n=2)
    assert len(c.choices) == 2 and c.choices[0].text == c.choices[1].text
    assert 0 < len(c.choices[0].logprobs.tokens) == len(c.choices[0].logprobs.token_logprobs) <= 5


def test_api_key_and_startup_errors(server):
    from dflashkit import DFlashError
    from dflashkit.server import build_app, check_port, serve_in_thread

    eng, tok = server["engine"], server["tok"]
    for bad in ({"max_batch": 0}, {"max_queue": 0}):
        with pytest.raises(DFlashError, match="must be >= 1"):
            build_app(eng, tok, "k", **bad)
    host, port = server["url"].removeprefix("http://").split(":")
    t0 = time.time()
    with pytest.raises(DFlashError, match="another --port"):
        check_port(host, int(port))  # the fixture's server holds it
    assert time.time() - t0 < 1
    app = build_app(eng, tok, "k", api_key="secret", max_len=512)
    srv, th, url = serve_in_thread(app)
    try:
        status, payload = post({"url": url}, chat())
        assert status == 401 and payload["error"]["type"] == "authentication_error"
        req = urllib.request.Request(url + "/v1/chat/completions", data=chat().encode(),
                                     headers={"content-type": "application/json", "authorization": "Bearer secret"})
        assert urllib.request.urlopen(req, timeout=60).status == 200
        assert urllib.request.urlopen(url + "/health").status == 200  # only /v1/* needs the key
    finally:
        srv.should_exit = True
        th.join(30)


def test_fuzzed_full_range_bodies_never_yield_5xx(server):
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    huge = st.one_of(st.integers(), st.integers(-(2 ** 80), 2 ** 80), st.sampled_from([2 ** 63, 2 ** 64, -(2 ** 63) - 1]))
    edge = st.one_of(st.floats(), st.sampled_from([1e-45, 5e-324, 1e308, -0.0, 2.0, 2.0000001]))
    text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
    scalar = st.one_of(st.none(), st.booleans(), huge, edge, text)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                                     "content": st.one_of(text, scalar, st.lists(st.fixed_dictionaries(
                                         {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2))})
    body = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional={
        "max_tokens": st.one_of(st.integers(-3, 4), huge, scalar), "temperature": scalar, "top_p": scalar,
        "top_k": st.one_of(huge, scalar), "seed": st.one_of(huge, scalar), "n": st.one_of(st.integers(-1, 3), huge),
        "stop": st.one_of(scalar, st.lists(text, max_size=6)), "logprobs": scalar, "top_logprobs": huge,
        "stream": st.booleans(), "model": st.one_of(st.none(), st.just("smollm2-test"), text),
        "stream_options": st.one_of(scalar, st.fixed_dictionaries({"include_usage": st.booleans()}))})

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body)
    @example({"messages": [{"role": "user", "content": ""}], "stream": True})  # valid and streamed: found by the fuzzer
    def check(b):
        b.setdefault("max_tokens", 3)  # keep the valid ones short
        status, _ = post(server, json.dumps(b).encode())
        assert status < 500, b

    check()
