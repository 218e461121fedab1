"""router.core.tokenize: local HF tokenizer parity with the real vLLM recording, builtin."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from fake_replica import ServerThread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_paths import GOLDEN, require

from gpu_emitter import tokenizer as bt
from router.config import TokenizerConfig
from router.core.tokenize import (
    OFF_LOOP_CHARS,
    BuiltinTokenizer,
    LocalTokenizer,
    RemoteTokenizer,
    Tokenized,
    TokenizerSetupError,
    make_tokenizer,
    prompt_input,
)


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer(require(GOLDEN / "model"))


def _golden_prompts(n: int = 40) -> list[list[int]]:
    lines = require(GOLDEN / "requests.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["prompt_token_ids"] for line in lines]


def _words(ids: list[int], local: LocalTokenizer) -> str:
    return " ".join(local.tokenizer.id_to_token(i) for i in ids)


def test_local_reproduces_vllm_prompt_token_ids(local: LocalTokenizer) -> None:
    for ids in _golden_prompts():
        assert ids[0] == 2  # vLLM added the BOS
        text = _words(ids[1:], local)
        got = local.tokenize_sync("completion", {"prompt": text})
        assert got.token_ids == ids
        no_bos = local.tokenize_sync("completion", {"prompt": text, "add_special_tokens": False})
        assert no_bos.token_ids == ids[1:]


def test_local_chat_template_matches_builtin_template(local: LocalTokenizer) -> None:
    messages = [
        {"role": "system", "content": "w1 w2 w3"},
        {"role": "user", "content": [{"type": "text", "text": "w10 w11"}]},
    ]
    got = local.tokenize_sync("chat", {"messages": messages})
    assert got.token_ids == bt.encode_chat(messages)
    assert got.token_ids[0] != bt.BOS_ID and got.token_ids[-1] == 6  # <assistant>, no BOS
    no_gen = local.tokenize_sync("chat", {"messages": messages, "add_generation_prompt": False})
    assert no_gen.token_ids == got.token_ids[:-1]


def test_builtin_equals_local_on_vocabulary_text(local: LocalTokenizer) -> None:
    b = BuiltinTokenizer()
    for ids in _golden_prompts(10):
        body = {"prompt": _words(ids[1:], local)}
        assert b.tokenize_sync("completion", body) == local.tokenize_sync("completion", body)


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        ("completion", {"prompt": ["a", "b"]}, "batched_prompts"),
        ("completion", {}, "no_prompt"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "non_text_content",
        ),
        ("chat", {"messages": "hi"}, "bad_messages"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
            "custom_chat_template",
        ),
    ],
)
def test_untokenizable_requests_say_why(kind, body, reason) -> None:
    assert BuiltinTokenizer().tokenize_sync(kind, body).reason == reason


def test_token_id_prompts_pass_through() -> None:
    tok = BuiltinTokenizer()
    assert tok.tokenize_sync("completion", {"prompt": [5, 6, 7]}).token_ids == [5, 6, 7]
    assert tok.tokenize_sync("completion", {"prompt": [[5, 6]]}).token_ids == [5, 6]
    assert prompt_input("completion", {"prompt": ["w1"]}).text == "w1"


def test_local_without_tokenizer_json_fails_at_start(tmp_path) -> None:
    with pytest.raises(TokenizerSetupError, match=r"tokenizer\.json"):
        make_tokenizer(TokenizerConfig(strategy="local", path=str(tmp_path)), model="m", urls=list)


def test_async_face() -> None:
    tok = make_tokenizer(TokenizerConfig(), model="m", urls=list)
    got = asyncio.run(tok.tokenize("completion", {"prompt": "w0 w1"}))
    assert got.token_ids == [2, 7, 8]


_word = st.one_of(
    st.integers(0, 2100).map(lambda n: f"w{n}"),  # in and past the vocabulary
    st.sampled_from(["<bos>", "<user>", "<tool>", "w007", "w-1", "W5", "ww1", "w1.5"]),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6),
)
_text = st.lists(_word, max_size=12).map(" ".join) | st.text(max_size=40)


@settings(max_examples=400, deadline=None)
@given(text=_text, bos=st.booleans())
def test_builtin_equals_the_replica_tokenizer_on_any_text(text: str, bos: bool) -> None:
    """Two implementations of one vocabulary rule (router's and the simulated replica's)."""
    body = {"prompt": text, "add_special_tokens": bos}
    assert BuiltinTokenizer().tokenize_sync("completion", body).token_ids == bt.encode(text, bos)


_content = _text | st.none() | st.lists(_text.map(lambda t: {"type": "text", "text": t}))
_role = st.sampled_from(["system", "user", "assistant", "tool", "", "two words", "x\ty"])


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(st.fixed_dictionaries({"role": _role, "content": _content}), min_size=1),
    gen=st.booleans(),
)
def test_builtin_chat_equals_the_replica_tokenizer(messages: list, gen: bool) -> None:
    got = BuiltinTokenizer().tokenize_sync(
        "chat", {"messages": messages, "add_generation_prompt": gen}
    )
    try:
        want = bt.encode_chat(messages, gen)
    except bt.TokenizerInputError:
        assert got.token_ids is None and got.reason == "tokenizer_rejected"
    else:
        assert got.token_ids == want


@settings(max_examples=300, deadline=None)
@given(
    text=_text | st.text(st.sampled_from("ab \t\n\x0b\x0c\r\x1c\x85\xa0\u2028\u3000")),
    k=st.integers(1, 6),
)
def test_builtin_slices_give_the_words_of_the_whole_text(text: str, k: int) -> None:
    """A long text is split in slices cut at whitespace; any slice size gives its words."""
    tok = BuiltinTokenizer()
    assert tok._encode(text, True, chunk=k) == [2, *map(tok._id, text.split())]


def test_a_word_longer_than_many_slices_stays_one_word() -> None:
    tok = BuiltinTokenizer()
    text = "w1 " + "x" * 50 + " w2\u3000" + "y" * 7
    assert tok._encode(text, False, chunk=4) == [*map(tok._id, text.split())]
    assert len(tok._encode(text, False, chunk=4)) == 4


def _big_words(n: int) -> str:
    """``n`` words, none memoised yet (each one is hashed: the tokenizer's slow path)."""
    return " ".join(f"x{i:09d}" for i in range(n))


def _loop_turns_during(tokenize: Callable[[], Awaitable[Tokenized]]) -> tuple[int, Tokenized]:
    """How often another task on the loop ran while ``tokenize()`` was awaited, and its
    result."""

    async def main() -> tuple[int, Tokenized]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker has started
        start = ticks
        got = await tokenize()
        during = ticks - start
        stop.set()
        await task
        return during, got

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_large_prompt_is_tokenized_while_the_event_loop_runs(kind: str) -> None:
    """Over OFF_LOOP_CHARS the builtin tokenizer works on its worker thread: a task on the
    same loop keeps running meanwhile (inline, it could not run until tokenizing ended), and
    the ids are those of tokenizing inline."""
    text = _big_words(200_000)  # 2 MB
    assert len(text) > OFF_LOOP_CHARS
    body = (
        {"prompt": text}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": text}]}
    )
    tok = BuiltinTokenizer()
    during, got = _loop_turns_during(lambda: tok.tokenize(kind, body))  # type: ignore[arg-type]
    assert during >= 3, f"the loop ran {during} times while 2 MB were tokenized"
    assert got.token_ids == BuiltinTokenizer().tokenize_sync(kind, body).token_ids  # type: ignore[arg-type]
    asyncio.run(tok.aclose())


def test_a_large_prompt_through_the_local_tokenizer_keeps_the_loop_running(
    local: LocalTokenizer,
) -> None:
    body = {"prompt": " ".join(f"w{i % 2000}" for i in range(200_000))}
    during, got = _loop_turns_during(lambda: local.tokenize("completion", body))
    assert during >= 3, f"the loop ran {during} times while 1.2 MB were tokenized"
    assert got.token_ids == local.tokenize_sync("completion", body).token_ids


# -- chat-template arguments ---------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "w_lookup", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "w1 w2"}]


def test_template_args_are_collected_only_when_set() -> None:
    what = prompt_input("chat", {"messages": CHAT, "tools": TOOLS, "chat_template_kwargs": {}})
    assert what.template_args == {"tools": TOOLS}
    plain = prompt_input(
        "chat",
        {"messages": CHAT, "tools": [], "continue_final_message": False, "chat_template": None},
    )
    assert plain.template_args == {} and not plain.tool_calls
    calls = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert prompt_input("chat", {"messages": calls}).tool_calls


def test_builtin_template_ignores_tools_and_kwargs_like_the_replica() -> None:
    tok = BuiltinTokenizer()
    plain = tok.tokenize_sync("chat", {"messages": CHAT}).token_ids
    args = {"messages": CHAT, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    assert tok.tokenize_sync("chat", args).token_ids == plain == bt.encode_chat(CHAT)
    custom = tok.tokenize_sync("chat", {"messages": CHAT, "chat_template": "{{ 1 }}"})
    assert custom == Tokenized(None, "custom_chat_template")
    calls = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert tok.tokenize_sync("chat", {"messages": calls}) == Tokenized(None, "tool_calls")


def test_local_sends_template_args_to_a_replica_or_routes_by_load() -> None:
    from fastapi.responses import JSONResponse

    seen: list[dict] = []
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        return JSONResponse({"tokens": [7, 8, 9], "count": 3, "max_model_len": 64})

    body = {
        "messages": CHAT,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    path = require(GOLDEN / "model")

    async def both(url: str) -> tuple[Tokenized, Tokenized]:
        local = LocalTokenizer(path, RemoteTokenizer("m", lambda: [url]))
        try:
            return await local.tokenize("chat", body), await local.tokenize("chat", plain_body)
        finally:
            await local.aclose()

    plain_body = {"messages": CHAT}
    with ServerThread(app) as server:
        got, plain = asyncio.run(both(server.url))
    assert got.token_ids == [7, 8, 9]
    assert len(seen) == 1  # the plain chat was rendered here
    assert plain.token_ids == bt.encode_chat(CHAT)
    sent = seen[0]
    assert sent["tools"] == TOOLS and sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["messages"] == CHAT and sent["model"] == "m"
    load_only = LocalTokenizer(path)
    assert asyncio.run(load_only.tokenize("chat", body)) == Tokenized(None, "chat_template_args")
    cfg = TokenizerConfig(strategy="local", path=str(path), template_args="load_only")
    made = make_tokenizer(cfg, model="m", urls=lambda: [])
    assert asyncio.run(made.tokenize("chat", body)).reason == "chat_template_args"


def test_local_template_has_transformers_globals_and_tojson(tmp_path) -> None:
    # transformers renders with strftime_now and a tojson that is plain json.dumps (jinja's own
    # HTML-escapes "<" and ">"): a template that dates its prompt or prints JSON must match
    import shutil
    from datetime import datetime

    src = require(GOLDEN / "model")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ messages | tojson(indent=1) }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "user", "content": "<w1> é"}]
    text = LocalTokenizer(tmp_path).render_chat(messages, add_generation_prompt=False)
    year = datetime.now().strftime("%Y")
    assert text == f"{year}|{json.dumps(messages, ensure_ascii=False)}|" + json.dumps(
        messages, ensure_ascii=False, indent=1
    )


@pytest.mark.parametrize(
    "answer",
    [
        b"[" * 100_000 + b"]" * 100_000,  # past the decoder's depth
        b'{"tokens": [1, "two", 3]}',
        b'{"tokens": [1, -2]}',
        b'{"tokens": [1, 3.0]}',
        b'{"tokens": [1, 99999999999999999999]}',
        b'{"tokens": {"0": 1}}',
        b"not json",
    ],
)
def test_a_bad_tokenize_answer_routes_by_load_instead_of_failing(answer: bytes) -> None:
    from fastapi.responses import Response

    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return Response(answer, media_type="application/json")

    async def ask(url: str) -> Tokenized:
        remote = RemoteTokenizer("m", lambda: [url])
        try:
            return await remote.tokenize("chat", {"messages": CHAT})
        finally:
            await remote.aclose()

    with ServerThread(app) as server:
        assert asyncio.run(ask(server.url)) == Tokenized(None, "remote_bad_answer")
