"""The usage event of a stream the router asked for: requested, kept, hidden (pure part).

The byte shapes are vLLM 0.32's (``serving.py``: content chunks dumped with
``exclude_unset=True``, then one event with ``"choices":[]`` and the usage, then
``data: [DONE]``), written out by hand here.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router.server.stream_usage import UsageStripper, reported_cached_tokens, request_usage

CONTENT = [
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" hi","logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"!","logprobs":null,"finish_reason":"length"}]}\n\n',
]
USAGE = (
    b'{"id":"c1","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":40,'
    b'"total_tokens":42,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}'
)
STREAM = b"".join(CONTENT) + b"data: " + USAGE + b"\n\n" + b"data: [DONE]\n\n"
EXPECTED = b"".join(CONTENT) + b"data: [DONE]\n\n"


def run(chunks: list[bytes]) -> tuple[bytes, UsageStripper]:
    s = UsageStripper()
    out = b"".join(s.feed(c) for c in chunks) + s.flush()
    return out, s


def cut(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in points})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_request_usage_sets_the_option_only_where_the_client_did_not() -> None:
    body: dict = {"stream": True}
    assert request_usage(body) and body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"continuous_usage_stats": False}}
    assert request_usage(body)
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert not request_usage(asked) and asked["stream_options"] == {"include_usage": True}
    assert not request_usage({"stream": False})
    assert not request_usage({"prompt": "x"})
    odd = {"stream": True, "stream_options": "yes"}  # vLLM refuses it; the router does not guess
    assert not request_usage(odd) and odd["stream_options"] == "yes"


def test_the_usage_event_is_removed_and_kept() -> None:
    out, s = run([STREAM])
    assert out == EXPECTED
    assert s.usage is not None
    assert json.loads(s.usage)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_a_stream_without_usage_passes_byte_for_byte() -> None:
    out, s = run([EXPECTED])
    assert out == EXPECTED and s.usage is None


def test_usage_null_in_content_chunks_is_dropped_and_nothing_else_changes() -> None:
    chunk = b'data: {"id":"c","choices":[{"index":0,"text":"a"}],"usage":null}\n\n'
    out, s = run([chunk, b"data: [DONE]\n\n"])
    assert json.loads(out.split(b"\n\n")[0][6:]) == {
        "id": "c",
        "choices": [{"index": 0, "text": "a"}],
    }
    assert out.endswith(b"\n\ndata: [DONE]\n\n") and s.usage is None


def test_crlf_events_are_split_too() -> None:
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    out, s = run(cut(crlf, [7, 100, 300, 301]))
    assert out == EXPECTED.replace(b"\n\n", b"\r\n\r\n") and s.usage is not None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_chunking_gives_the_same_stream(points: list[int]) -> None:
    out, s = run(cut(STREAM, points))
    assert out == EXPECTED
    assert s.usage == USAGE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_complete_events_are_never_held_back(points: list[int]) -> None:
    """Streaming must stay streaming: after each chunk, everything up to the last complete
    event has been forwarded (only an unfinished event waits)."""
    s = UsageStripper()
    fed = b""
    sent = b""
    for c in cut(EXPECTED, points):
        fed += c
        sent += s.feed(c)
        done = fed[: fed.rfind(b"\n\n") + 2] if b"\n\n" in fed else b""
        assert sent == done


def test_an_unterminated_giant_event_is_not_buffered_without_bound() -> None:
    s = UsageStripper()
    blob = b"data: " + b"x" * (2 << 20)
    assert s.feed(blob) == blob


def test_reported_cached_tokens_reads_vllms_usage_and_refuses_what_is_not_a_count() -> None:
    assert reported_cached_tokens(USAGE) == 32
    assert reported_cached_tokens(STREAM) == 32
    assert reported_cached_tokens(b"".join(CONTENT)) is None  # no usage: nothing to check
    # the last one counts (a tail holding two usage events)
    assert reported_cached_tokens(USAGE.replace(b"32", b"16") + b"\n\n" + USAGE) == 32
    assert reported_cached_tokens(b'{"cached_tokens": 7}') == 7
    # a broken or hostile replica: no number the router would act on
    assert reported_cached_tokens(b'{"cached_tokens":' + b"9" * 5000 + b"}") is None
    assert reported_cached_tokens(b'{"cached_tokens": 3.5}') is None
    assert reported_cached_tokens(b'{"cached_tokens": 2e9}') is None
    assert reported_cached_tokens(b'{"cached_tokens": -4}') is None
    assert reported_cached_tokens(b'{"cached_tokens": "12"}') is None
    assert reported_cached_tokens(b'{"cached_tokens": \xd9\xa3}') is None  # Arabic-Indic 3


digits = st.tuples(st.integers(1, 6000), st.sampled_from(b"0123456789")).map(
    lambda t: bytes([t[1]]) * t[0]
) | st.integers(0, 10**20).map(lambda n: str(n).encode())


@given(st.binary(max_size=64), digits, st.binary(max_size=8))
def test_reported_cached_tokens_never_raises(head: bytes, n: bytes, tail: bytes) -> None:
    got = reported_cached_tokens(head + b'"cached_tokens": ' + n + tail)
    assert got is None or 0 <= got < 10**15


def test_a_usage_event_nested_past_the_decoders_depth_is_forwarded_as_it_came() -> None:
    deep = b'data: {"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n"
    s = UsageStripper()
    assert s.feed(deep) + s.flush() == deep and s.usage is None
