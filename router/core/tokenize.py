"""Token ids of an OpenAI request, computed exactly as the replica will (spec §1.6).

A prediction is only as good as its token ids: one differing id changes every block hash
after it. Three strategies per pool:

* ``builtin``: the simulated replica's word vocabulary (:class:`BuiltinTokenizer`).
* ``local``: the replica's own Hugging Face tokenizer directory (``tokenizer.json`` through the
  ``tokenizers`` library; the chat template of ``tokenizer_config.json`` rendered with jinja2
  the way ``transformers``' ``apply_chat_template`` does). Completions encode with special
  tokens (the post-processor adds BOS, like HF and vLLM's default ``add_special_tokens=True``);
  chats render the template with ``add_generation_prompt`` (default true) and encode without
  special tokens, as vLLM's chat endpoints and ``/tokenize`` with ``messages`` do.
* ``remote``: ask a replica's ``/tokenize`` (exact by construction; one extra round trip).

What cannot be tokenized here (several prompts in one request, images or audio) gives
``Tokenized(None, reason)``: the proxy routes it by load and counts the reason; it is never
rejected for it.

**Chat-template arguments.** A chat's ``tools``, ``chat_template_kwargs``, request-level
``chat_template``, ``continue_final_message`` and messages with ``tool_calls`` change what
vLLM renders. ``local`` cannot reproduce them exactly (vLLM hands the template its own
pydantic dump of each tool, with defaults and serializers of its own), so such a chat goes to
a replica's ``/tokenize``, which takes every one of them and renders with vLLM's renderer
(``template_args = "remote"``, the default; one extra round trip for those requests only), or
is routed by load under the reason ``chat_template_args`` (``"load_only"``). ``remote`` sends
them along. ``builtin`` (the simulated replica's fixed template, which uses none of them)
ignores ``tools`` and ``chat_template_kwargs`` as that template does, and routes the others by
load. The local renderer has Hugging Face's template globals and filters (``raise_exception``,
``strftime_now``, its ``tojson``), so templates that date their system prompt or print JSON
render as ``apply_chat_template`` renders them.

**Large prompts leave the event loop.** Every request shares the router's one event loop, and
tokenizing is CPU work: an 8 MB prompt took the builtin tokenizer 0.8 s, during which nothing
else was served (bench/loop_stall_bench.py). ``builtin`` and ``local`` tokenize a prompt of
more than :data:`OFF_LOOP_CHARS` characters on a worker thread of their own (one per
tokenizer, so huge prompts queue behind each other instead of crowding the loop off the
GIL). The builtin tokenizer splits such a text in slices of :data:`SPLIT_CHARS` characters cut
at whitespace, so no single C call holds the GIL for long; the ``tokenizers`` library releases
it while it encodes. ``remote`` stays on the loop (its work is I/O) but encodes the request
and decodes the answer with msgspec, 2-4x faster than ``json``: for an 8 MB prompt ~5 ms and
~25 ms (727k token ids).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from router.config import TokenizerConfig

__all__ = [
    "OFF_LOOP_CHARS",
    "SPLIT_CHARS",
    "TEMPLATE_ARGS",
    "BuiltinTokenizer",
    "LocalTokenizer",
    "RemoteTokenizer",
    "RequestTokenizer",
    "Tokenized",
    "TokenizerSetupError",
    "make_tokenizer",
    "prompt_input",
]

Kind = Literal["completion", "chat"]

OFF_LOOP_CHARS = 1 << 16
"""Prompts longer than this (characters of text, summed over a chat's messages) are
tokenized on a worker thread. Below it, tokenizing inline costs at most a few milliseconds
(the builtin tokenizer: ~6 ms for 64 Ki characters), less than the hand-over would."""
SPLIT_CHARS = 1 << 16
"""The builtin tokenizer splits longer texts in slices of about this many characters."""
_SPACE = re.compile(r"\s")
"""What ``str.split()`` splits on (both use the Unicode whitespace property)."""


class TokenizerSetupError(ValueError):
    """The tokenizer a pool's config names cannot be loaded; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    token_ids: list[int] | None
    reason: str | None = None
    """Why ``token_ids`` is None (a short label used as a metric label too)."""


@dataclass(frozen=True, slots=True)
class _Text:
    text: str
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class _Ids:
    ids: list[int]


@dataclass(frozen=True, slots=True)
class _Chat:
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    add_special_tokens: bool
    template_args: dict[str, Any]
    """The body's chat-template arguments (:data:`TEMPLATE_ARGS`) that are set."""
    tool_calls: bool = False
    """A message carries ``tool_calls``: rendered by the template from structured data."""


TEMPLATE_ARGS = ("tools", "chat_template_kwargs", "chat_template", "continue_final_message")
"""Request fields that change a chat's rendering, all accepted by vLLM's ``/tokenize``."""


def _text_only(messages: Any) -> str | None:
    """None if every message is plain text, else the reason it is not."""
    if not isinstance(messages, list) or not messages:
        return "bad_messages"
    for m in messages:
        if not isinstance(m, dict):
            return "bad_messages"
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return "non_text_content"
        elif content is not None and not isinstance(content, str):
            return "bad_messages"
    return None


def prompt_input(kind: Kind, body: dict[str, Any]) -> _Text | _Ids | _Chat | Tokenized:
    """What to tokenize in a request body, or an untokenizable ``Tokenized``."""
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return _Text(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return _Ids(prompt)
        if isinstance(prompt, list):
            return Tokenized(None, "batched_prompts")
        if body.get("prompt_embeds") is not None:
            return Tokenized(None, "prompt_embeds")
        return Tokenized(None, "no_prompt")
    messages = body.get("messages")
    reason = _text_only(messages)
    if reason is not None:
        return Tokenized(None, reason)
    return _Chat(
        messages,
        bool(body.get("add_generation_prompt", True)),
        bool(body.get("add_special_tokens", False)),
        {
            k: v
            for k in TEMPLATE_ARGS
            if (v := body.get(k)) is not None and v not in (False, {}, [])
        },
        any(m.get("tool_calls") for m in messages),
    )


def prompt_chars(what: _Text | _Ids | _Chat | Tokenized) -> int:
    """Characters of text to tokenize in ``what`` (0 for token ids: nothing to do)."""
    if isinstance(what, _Text):
        return len(what.text)
    if not isinstance(what, _Chat):
        return 0
    n = 0
    for m in what.messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(t) for p in content if isinstance(t := p.get("text"), str))
    return n


class _OffLoop:
    """A tokenizer's worker thread, started on first use (most prompts never need it)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[[Any], Tokenized], what: Any) -> Tokenized:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvrouter-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, what)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class RequestTokenizer(Protocol):
    strategy: str

    async def tokenize(self, kind: Kind, body: dict[str, Any]) -> Tokenized: ...

    async def aclose(self) -> None: ...


class BuiltinTokenizer:
    """The simulated replica's word vocabulary, implemented here on its own.

    The rule (also the tiny real-vLLM test model's WordLevel vocabulary for ``wN`` text): ids
    0..6 are ``<pad> <eos> <bos> <unk> <system> <user> <assistant>``; the word ``wN``
    (``N < 2041``, no leading zeros) is ``N + 7``; any other word is BLAKE2b-8 of its UTF-8
    bytes, big-endian, modulo 2041, plus 7; text splits on whitespace; a completion gets a
    leading BOS (2) unless ``add_special_tokens`` is false. A chat renders
    ``"<{role}> {content} "`` per message and ``"<assistant>"`` for the generation prompt.

    ``gpu_emitter.tokenizer`` is the replica's implementation of the same rule. The two are
    written apart on purpose: tests compare this one with the replica's ``/tokenize`` and with
    the test model's ``tokenizer.json``, so agreement is evidence, not an identity.
    """

    strategy = "builtin"

    _SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<system>", "<user>", "<assistant>")
    _BOS = 2
    _WORDS = 2041
    _WORD = re.compile(r"w(0|[1-9][0-9]{0,3})")

    def __init__(self) -> None:
        self._memo: dict[str, int] = {t: i for i, t in enumerate(self._SPECIALS)}
        # every wN word up front: a prompt of vocabulary words then takes the one C-level
        # pass of _words (about 3x faster than a call per word on 2,000 words)
        self._memo.update((f"w{n}", len(self._SPECIALS) + n) for n in range(self._WORDS))
        self._off_loop = _OffLoop()

    def _id(self, word: str) -> int:
        tid = self._memo.get(word)
        if tid is None:
            m = self._WORD.fullmatch(word)
            if m is not None and int(m.group(1)) < self._WORDS:
                tid = len(self._SPECIALS) + int(m.group(1))
            else:
                raw = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8)
                tid = len(self._SPECIALS) + int.from_bytes(raw.digest(), "big") % self._WORDS
            if len(self._memo) < 1 << 17:  # bounded: hostile prompts bring endless words
                self._memo[word] = tid
        return tid

    def _encode(self, text: str, bos: bool, chunk: int = SPLIT_CHARS) -> list[int]:
        ids = [self._BOS] if bos else []
        n = len(text)
        if n <= chunk:
            self._words(ids, text.split())
            return ids
        start = 0
        while start < n:
            # a slice of about `chunk` characters, cut before a whitespace character (no word
            # spans the cut, so the slices' words are the text's words); the search goes on
            # window by window, so a long run without whitespace is no single long call
            end = start + chunk
            while end < n:
                m = _SPACE.search(text, end, end + chunk)
                if m is not None:
                    end = m.start()
                    break
                end += chunk
            self._words(ids, text[start:end].split())
            start = end
        return ids

    def _words(self, ids: list[int], words: list[str]) -> None:
        """Append the ids of ``words``: one pass through the memo, or, at the first word it
        lacks, a call per word from there (the ids are the same either way)."""
        n = len(ids)
        try:
            ids += map(self._memo.__getitem__, words)
        except KeyError:
            done = len(ids) - n
            ids += map(self._id, words[done:])

    @staticmethod
    def _render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
        parts = []
        for m in messages:
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role or role.split() != [role]:
                return None
            if isinstance(content, list):
                texts = [p.get("text") for p in content]
                if not all(isinstance(t, str) for t in texts):
                    return None
                content = " ".join(texts)
            elif content is None:
                content = ""
            parts.append(f"<{role}> {content} ")
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")

    def tokenize_sync(self, kind: Kind, body: dict[str, Any]) -> Tokenized:
        return self._tokenize(prompt_input(kind, body))

    def _tokenize(self, what: _Text | _Ids | _Chat | Tokenized) -> Tokenized:
        if isinstance(what, _Text):
            return Tokenized(self._encode(what.text, what.add_special_tokens))
        if isinstance(what, _Ids):
            return Tokenized(what.ids)
        if isinstance(what, _Chat):
            if what.tool_calls:
                return Tokenized(None, "tool_calls")
            if "chat_template" in what.template_args or what.template_args.get(
                "continue_final_message"
            ):
                return Tokenized(None, "custom_chat_template")
            text = self._render(what.messages, what.add_generation_prompt)
            if text is None:
                return Tokenized(None, "tokenizer_rejected")
            return Tokenized(self._encode(text, what.add_special_tokens))
        return what

    async def tokenize(self, kind: Kind, body: dict[str, Any]) -> Tokenized:
        what = prompt_input(kind, body)
        if prompt_chars(what) > OFF_LOOP_CHARS:
            return await self._off_loop.run(self._tokenize, what)
        return self._tokenize(what)

    async def aclose(self) -> None:
        self._off_loop.close()


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizer:
    """A Hugging Face tokenizer directory, as vLLM loads it (module docstring)."""

    strategy = "local"

    def __init__(self, path: str | Path, remote: RemoteTokenizer | None = None) -> None:
        """``remote``: where chats with template arguments are tokenized (module docstring);
        None routes them by load."""
        from tokenizers import Tokenizer

        self._remote = remote
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerSetupError(
                f"{tj} not found: `local` needs the replica's tokenizer directory with a "
                f"tokenizer.json (a fast tokenizer; save one with transformers if needed)"
            )
        self.tokenizer = Tokenizer.from_file(str(tj))
        cfg: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            cfg = json.loads(tc.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: HF uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jt = d / "chat_template.jinja"
        if template is None and jt.is_file():
            template = jt.read_text()
        self.special = {
            k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self._template = None
        if isinstance(template, str):
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            # transformers' template environment (its _compile_jinja_template)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _hf_tojson
            self._template = env.from_string(template)
        self._off_loop = _OffLoop()

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise TokenizerSetupError("the tokenizer directory has no chat template")
        norm = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # vLLM's "string" content format joins text parts
                m = {**m, "content": "\n".join(p["text"] for p in content)}
            norm.append(m)
        return self._template.render(
            messages=norm, add_generation_prompt=add_generation_prompt, **self.special
        )

    def tokenize_sync(self, kind: Kind, body: dict[str, Any]) -> Tokenized:
        return self._tokenize(prompt_input(kind, body))

    def _tokenize(self, what: _Text | _Ids | _Chat | Tokenized) -> Tokenized:
        if isinstance(what, _Text):
            enc = self.tokenizer.encode(what.text, add_special_tokens=what.add_special_tokens)
            return Tokenized(enc.ids)
        if isinstance(what, _Ids):
            return Tokenized(what.ids)
        if isinstance(what, _Chat):
            if what.template_args or what.tool_calls:
                return Tokenized(None, "chat_template_args")  # the async path may ask a replica
            if self._template is None:
                return Tokenized(None, "no_chat_template")
            try:
                text = self.render_chat(what.messages, what.add_generation_prompt)
            except Exception:  # a template error is the request's problem, not ours
                return Tokenized(None, "chat_template_error")
            enc = self.tokenizer.encode(text, add_special_tokens=what.add_special_tokens)
            return Tokenized(enc.ids)
        return what

    async def tokenize(self, kind: Kind, body: dict[str, Any]) -> Tokenized:
        what = prompt_input(kind, body)
        if (
            self._remote is not None
            and isinstance(what, _Chat)
            and (what.template_args or what.tool_calls)
        ):
            return await self._remote.tokenize_input(what)
        if prompt_chars(what) > OFF_LOOP_CHARS:
            return await self._off_loop.run(self._tokenize, what)
        return self._tokenize(what)

    async def aclose(self) -> None:
        self._off_loop.close()
        if self._remote is not None:
            await self._remote.aclose()


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _hf_tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter: plain json.dumps (jinja's own escapes HTML)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class RemoteTokenizer:
    """A replica's ``/tokenize`` (vLLM's, or the simulated replica's)."""

    strategy = "remote"

    def __init__(
        self, model: str, urls: Callable[[], Sequence[str]], timeout_s: float = 2.0
    ) -> None:
        import httpx

        self.model = model
        self._urls = urls
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._next = 0

    async def tokenize(self, kind: Kind, body: dict[str, Any]) -> Tokenized:
        return await self.tokenize_input(prompt_input(kind, body))

    async def tokenize_input(self, what: _Text | _Ids | _Chat | Tokenized) -> Tokenized:
        """Ask a replica (round robin over the pool's, the next on a failure)."""
        import httpx

        if isinstance(what, Tokenized):
            return what
        if isinstance(what, _Ids):
            return Tokenized(what.ids)
        req: dict[str, Any] = {"model": self.model}
        if isinstance(what, _Text):
            req.update(prompt=what.text, add_special_tokens=what.add_special_tokens)
        else:
            req.update(
                messages=what.messages,
                add_generation_prompt=what.add_generation_prompt,
                add_special_tokens=what.add_special_tokens,
                **what.template_args,
            )
        urls = list(self._urls())
        for i in range(len(urls)):
            url = urls[(self._next + i) % len(urls)]
            try:
                r = await self._client.post(
                    url.rstrip("/") + "/tokenize",
                    content=msgspec.json.encode(req),  # on the loop: msgspec, not json (docstring)
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                self._next += 1
                try:
                    answer = msgspec.json.decode(r.content)
                except (msgspec.DecodeError, RecursionError):
                    return Tokenized(None, "remote_bad_answer")
                tokens = answer.get("tokens") if isinstance(answer, dict) else None
                if isinstance(tokens, list) and all(
                    type(t) is int and 0 <= t < _MAX_TOKEN_ID for t in tokens
                ):
                    return Tokenized(tokens)
                return Tokenized(None, "remote_bad_answer")  # routed by load, not on a guess
            if r.status_code < 500:
                return Tokenized(None, "remote_rejected")
        return Tokenized(None, "remote_unavailable")

    async def aclose(self) -> None:
        await self._client.aclose()


_MAX_TOKEN_ID = 1 << 31
"""A token id a replica may return (vLLM's are vocabulary indices): anything else in a
``/tokenize`` answer makes it a bad answer, not a prompt to hash."""


def make_tokenizer(
    cfg: TokenizerConfig, *, model: str, urls: Callable[[], Sequence[str]]
) -> RequestTokenizer:
    """The pool's tokenizer; raises :class:`TokenizerSetupError` at start when unusable."""
    if cfg.strategy == "builtin":
        return BuiltinTokenizer()
    if cfg.strategy == "local":
        remote = (
            RemoteTokenizer(model, urls, cfg.timeout_s) if cfg.template_args == "remote" else None
        )
        return LocalTokenizer(cfg.path or "", remote)
    return RemoteTokenizer(model, urls, cfg.timeout_s)
