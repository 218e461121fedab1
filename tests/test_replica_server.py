"""The simulated replica over real HTTP (uvicorn on 127.0.0.1, httpx) and real ZeroMQ.

Covers the OpenAI API (JSON and SSE), cached_tokens, /tokenize, /metrics, reset, errors, the
KV events as a real Subscriber sees them, and ``kvrouter replica`` as a subprocess.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st

from events.publisher import EventPublisher
from events.schema import AllBlocksCleared, BlockStored
from events.stream import StreamSpec
from events.subscriber import Subscriber
from gpu_emitter import tokenizer as tok
from gpu_emitter.cost_model import CostModel
from gpu_emitter.engine import Engine
from gpu_emitter.server import ReplicaInfo, create_app
from tests.shared_paths import GOLDEN, require
from tests.test_engine import make_pool
from tests.zmq_helpers import LOOPBACK, wait_for

MODEL = "sim-test"
MAX_LEN = 1024


class Replica:
    """A replica served by uvicorn on a thread (its own event loop), on an ephemeral port."""

    def __init__(
        self, num_blocks: int = 512, max_model_len: int = MAX_LEN, pool: Any = None
    ) -> None:
        self.publisher = EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        self.pool = make_pool(num_blocks) if pool is None else pool
        self.engine = Engine(self.pool, self.publisher, cost=CostModel(time_scale=0.01))
        info = ReplicaInfo(
            model_name=MODEL,
            max_model_len=max_model_len,
            event_sources=[
                {
                    "data_parallel_rank": 0,
                    "endpoint": self.publisher.endpoint,
                    "replay_endpoint": self.publisher.replay_endpoint,
                }
            ],
            lora_modules={"sql": "/adapters/sql-v1"},
        )
        app = create_app(self.engine, info, on_shutdown=self.publisher.close)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        wait_for(lambda: self.server.started, 10, "uvicorn start")
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.client.post(path, json=body)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()
        if self._thread.is_alive():
            raise AssertionError("replica server did not stop")


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    r = Replica()
    yield r
    r.close()


def ids(n: int, salt: int) -> list[int]:
    """A prompt of ``n`` token ids unique to ``salt``."""
    return [tok.BOS_ID] + [
        tok.WORD_OFFSET + (salt * 131 + i * 17) % tok.NUM_WORDS for i in range(n - 1)
    ]


def sse(resp: httpx.Response) -> list[Any]:
    """Parse an SSE body strictly: every event is one ``data:`` line and a blank line."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    out: list[Any] = []
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, ev
        payload = ev[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out.count("[DONE]") == 1
    return out[:-1]


# -- completions and chat -----------------------------------------------------------------


def test_completion_json(replica: Replica) -> None:
    text = "w1 w2 hello world w3"
    r = replica.post(
        "/v1/completions",
        {"model": MODEL, "prompt": text, "max_tokens": 5, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == tok.encode(text)
    assert len(choice["token_ids"]) == 5
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert body["usage"]["prompt_tokens"] == len(tok.encode(text))
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == len(tok.encode(text)) + 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_accepts_token_ids_and_one_element_lists(replica: Replica) -> None:
    p = ids(30, salt=1)
    texts = set()
    for prompt in (p, [p], tok.decode(p[1:]), [tok.decode(p[1:])]):
        r = replica.post("/v1/completions", {"prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 30
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1  # same ids, same deterministic output


def test_chat_json(replica: Replica) -> None:
    messages = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 hi"}]
    r = replica.post(
        "/v1/chat/completions",
        {"messages": messages, "max_completion_tokens": 4, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["prompt_token_ids"] == tok.encode_chat(messages)
    assert choice["message"]["content"] == tok.decode(choice["token_ids"])
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_text_equals_json_text(replica: Replica, chat: bool) -> None:
    if chat:
        path, req = "/v1/chat/completions", {"messages": [{"role": "user", "content": "w9 w8"}]}
    else:
        path, req = "/v1/completions", {"prompt": "w9 w8 w7"}
    req["max_tokens"] = 9
    plain = replica.post(path, req).json()
    stream = replica.post(path, {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.status_code == 200
    chunks = sse(stream)
    *text_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 9
    assert usage_chunk["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    ids_seen = {c["id"] for c in chunks}
    assert len(ids_seen) == 1
    reasons = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    if chat:
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert text_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in text_chunks)
        assert text == plain["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in text_chunks)
        assert text == plain["choices"][0]["text"]
    assert len(text.split()) == 9


def test_stream_without_usage_has_no_usage_chunk(replica: Replica) -> None:
    chunks = sse(replica.post("/v1/completions", {"prompt": "w1", "max_tokens": 2, "stream": True}))
    assert all(c["choices"] and "usage" not in c for c in chunks)


def test_cached_tokens_is_the_pools_hit(replica: Replica) -> None:
    p = ids(200, salt=2)
    first = replica.post("/v1/completions", {"prompt": p, "max_tokens": 2}).json()
    second = replica.post(
        "/v1/completions", {"prompt": p, "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}},
    )  # fmt: skip
    skipped = replica.post("/v1/completions", {"prompt": p, "max_tokens": 2, "prompt_logprobs": 1})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sse(second)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert skipped.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_skip_reading_follows_vllms_request_rules(replica: Replica) -> None:
    # vLLM 0.32 (tests/test_request_flags_vs_vllm.py reads its request classes): echo asks
    # for prompt logprobs (a completion's logprobs, a chat's top_logprobs, 0 by default);
    # skip_reading_prefix_cache is no field of its OpenAI requests
    p = ids(200, salt=4)
    replica.post("/v1/completions", {"prompt": p, "max_tokens": 2})

    def cached(path: str, **extra: object) -> int:
        body = {"max_tokens": 2, **extra}
        if path == "/v1/completions":
            body["prompt"] = p
        else:
            body["messages"] = [{"role": "user", "content": tok.decode(p)}]
        return replica.post(path, body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("/v1/completions", skip_reading_prefix_cache=True) == 192
    assert cached("/v1/completions", echo=True) == 192
    assert cached("/v1/completions", echo=True, logprobs=0) == 0
    chat = "/v1/chat/completions"
    cached(chat)  # caches the chat's prompt (templated, so not the completion's blocks)
    assert cached(chat) > 0
    assert cached(chat, echo=True) == 0
    assert cached(chat, echo=True, top_logprobs=None) == 0


def test_lora_and_cache_salt_enter_the_hashes_as_in_vllm(replica: Replica) -> None:
    p = ids(160, salt=9)

    def cached(**extra: object) -> int:
        r = replica.post("/v1/completions", {"prompt": p, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == 0
    assert cached() == 144  # the base model's blocks
    assert cached(model="sql") == 0  # ("lora", name, path) on every block: a disjoint chain
    assert cached(model="sql") == 144
    assert cached(cache_salt="tenant-a") == 0  # the salt on the first block: disjoint too
    assert cached(cache_salt="tenant-a") == 144
    assert cached(model="sql", cache_salt="tenant-a") == 0
    for bad in ("a/b", "x@y", "", "s" * 129, 7):
        r = replica.post("/v1/completions", {"prompt": p, "max_tokens": 2, "cache_salt": bad})
        assert r.status_code == 400, bad
    models = replica.client.get("/v1/models").json()["data"]
    adapter = next(m for m in models if m["id"] == "sql")
    assert adapter["root"] == "/adapters/sql-v1" and adapter["parent"] == MODEL
    assert replica.post("/v1/completions", {"prompt": p, "model": "nope"}).status_code == 404


# -- tokenize, models, health, metrics, sources -------------------------------------------


@given(st.lists(st.integers(tok.WORD_OFFSET, tok.VOCAB_SIZE - 1), max_size=50))
def test_builtin_tokenizer_round_trips_word_ids(word_ids: list[int]) -> None:
    text = tok.decode(word_ids)
    assert tok.encode(text, add_bos=False) == word_ids
    assert tok.encode(text) == [tok.BOS_ID, *word_ids]


@given(st.text(max_size=80))
def test_builtin_tokenizer_is_total_and_in_vocabulary(text: str) -> None:
    out = tok.encode(text)
    assert out[0] == tok.BOS_ID and len(out) == len(text.split()) + 1
    assert all(0 <= t < tok.VOCAB_SIZE for t in out) and out == tok.encode(text)


def test_builtin_tokenizer_equals_the_real_test_models_tokenizer() -> None:
    """Same ids as the tiny real-vLLM model's HF tokenizer and chat template for wN text."""
    tokenizers = pytest.importorskip("tokenizers")
    jinja2 = pytest.importorskip("jinja2")
    model = require(GOLDEN / "model")
    hf = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    for text in ["w1 w2 w2040 w0", " w5\n\tw6  ", "", "<user> w3 <assistant>"]:
        assert hf.encode(text).ids == tok.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text, add_bos=False)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]
    rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(messages)
    assert hf.encode(rendered, add_special_tokens=False).ids == tok.encode_chat(messages)
    assert hf.decode([2, 8, 9, 10]) == tok.decode([2, 8, 9, 10])


def test_tokenize_matches_builtin_tokenizer(replica: Replica) -> None:
    text = "w3 w4 some words w2040"
    r = replica.post("/tokenize", {"prompt": text}).json()
    assert r == {
        "count": 6,
        "max_model_len": MAX_LEN,
        "tokens": tok.encode(text),
        "token_strs": None,
    }
    r = replica.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text, add_bos=False)
    messages = [{"role": "user", "content": "w1 w2"}]
    r = replica.post("/tokenize", {"messages": messages}).json()
    assert r["tokens"] == tok.encode_chat(messages) == [5, 8, 9, 6]
    r = replica.post("/detokenize", {"tokens": [2, 8, 9]}).json()
    assert r == {"prompt": "w1 w2"}


def test_models_health_and_event_sources(replica: Replica) -> None:
    models = replica.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "sql"]  # the base model, then adapters
    assert models["data"][0]["max_model_len"] == MAX_LEN
    assert replica.client.get("/health").status_code == 200
    src = replica.client.get("/kv_event_sources").json()
    assert src["sources"][0]["endpoint"] == replica.publisher.endpoint
    assert src["sources"][0]["replay_endpoint"] == replica.publisher.replay_endpoint


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*model_name=\"{MODEL}\"[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_metrics_use_vllm_names_and_count(replica: Replica) -> None:
    before = replica.client.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        _metric(before.text, name)
        assert f"# TYPE {name} " in before.text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0"' in before.text
    p = ids(100, salt=3)
    cached = []
    for _ in range(2):
        r = replica.post("/v1/completions", {"prompt": p, "max_tokens": 3}).json()
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = replica.client.get("/metrics").text
    delta = {
        n: _metric(after, n) - _metric(before.text, n)
        for n in (
            "vllm:prompt_tokens_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:generation_tokens_total",
        )
    }
    assert delta == {
        "vllm:prompt_tokens_total": 200,
        "vllm:prefix_cache_queries_total": 200,
        "vllm:prefix_cache_hits_total": sum(cached),
        "vllm:generation_tokens_total": 6,
    }
    assert cached == [0, 96]
    assert _metric(after, "vllm:num_requests_running") == 0
    assert 0 <= _metric(after, "vllm:kv_cache_usage_perc") <= 1


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"max_tokens": 3}, 400, "'prompt' is required"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": "3"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": MAX_LEN}, 400, "too large"),
        ("/v1/completions", {"prompt": "w1", "model": "other"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "w1 " * MAX_LEN}, 400, "maximum context length"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "99999"),
        ("/v1/completions", {"prompt": ["w1", "w2"]}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": "w1", "n": 2}, 400, "'n'"),
        ("/v1/completions", {"prompt": "w1", "stream": "yes"}, 400, "'stream'"),
        ("/v1/completions", {"prompt": "w1", "stream_options": {}}, 400, "stream_options"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"prompt": "w1"}, 400, "'messages' is required"),
        ("/tokenize", {}, 400, "'prompt'"),
        ("/v1/nothing", {}, 404, "Not Found"),
    ],
)
def test_bad_requests_get_openai_style_errors(
    replica: Replica, path: str, body: Any, status: int, needle: str
) -> None:
    if isinstance(body, bytes):
        r = replica.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = replica.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["code"] == status and isinstance(err["type"], str)


def test_request_that_cannot_fit_gets_400_and_replica_goes_on() -> None:
    small = Replica(num_blocks=4)
    try:
        for stream in (False, True):
            r = small.post("/v1/completions", {"prompt": ids(200, 4), "stream": stream})
            assert r.status_code == 400 and "--num-blocks" in r.json()["error"]["message"]
        assert small.post("/v1/completions", {"prompt": "w1", "max_tokens": 2}).status_code == 200
    finally:
        small.close()


# -- events -------------------------------------------------------------------------------


def test_events_reach_a_real_subscriber_before_the_response_completes() -> None:
    rep = Replica()
    items: list[Any] = []
    spec = StreamSpec("sim", rep.publisher.endpoint, rep.publisher.replay_endpoint)
    sub = Subscriber([spec], on_item=items.append)
    try:
        # Past the ZeroMQ slow joiner: send requests until the subscriber sees a batch.
        salt = iter(range(1000, 2000))

        def primed() -> bool:
            body = {"prompt": ids(40, next(salt)), "max_tokens": 1}
            assert rep.post("/v1/completions", body).status_code == 200
            return bool(items)

        wait_for(primed, 10, "first batch")
        p = ids(100, salt=5)
        for stream in (False, True):
            before = rep.publisher.next_seq
            rep.post("/v1/completions", {"prompt": p, "max_tokens": 20, "stream": stream})
            # Every batch of this request was on the wire when the response ended.
            assert rep.publisher.flush(0)
            assert rep.publisher.next_seq > before
            wait_for(lambda: items[-1].seq == rep.publisher.next_seq - 1, 5, "batches")
        stored = [ev for it in items for ev in it.batch.events if isinstance(ev, BlockStored)]
        assert any(ev.token_ids[:96] == p[:96] for ev in stored)
        # Reset: AllBlocksCleared goes out with the next step's batch, then a cold request.
        assert rep.client.post("/reset_prefix_cache").status_code == 200
        r = rep.post("/v1/completions", {"prompt": p, "max_tokens": 1}).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for(lambda: items[-1].seq == rep.publisher.next_seq - 1, 5, "reset batch")
        last = items[-1].batch.events
        assert isinstance(last[0], AllBlocksCleared)
        assert all(it.batch.data_parallel_rank == 0 for it in items)
    finally:
        sub.close()
        rep.close()


# -- the CLI ------------------------------------------------------------------------------


def test_cli_serves_and_stops_on_sigint() -> None:
    pytest.importorskip("gpu_emitter.hybrid_pool")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "router.cli", "replica", "--port", "0", "--layout", "fa",
            "--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", "tcp://127.0.0.1:*",
            "--num-blocks", "256", "--time-scale", "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        assert lines[0].startswith("http http://127.0.0.1:"), (lines, proc.stderr.read())
        url = lines[0].split(" ", 1)[1]
        assert lines[1].startswith("events tcp://127.0.0.1:")
        with httpx.Client(base_url=url, timeout=5) as client:

            def healthy() -> bool:
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(healthy, 60, "replica /health")
            r = client.post("/v1/completions", json={"prompt": ids(40, 6), "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_http_socket_is_tcp_so_asyncio_sets_nodelay() -> None:
    """A listening socket made with proto 0 makes asyncio skip TCP_NODELAY on accepted
    connections, and every response with a body then stalls ~40 ms (Nagle + delayed ACK)."""
    from gpu_emitter.cli import bind_http

    sock = bind_http("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_cli_rejects_unknown_layout() -> None:
    pytest.importorskip("gpu_emitter.layouts")
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "replica", "--port", "0", "--layout", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "nope" in out.stderr and "fa_swa" in out.stderr
