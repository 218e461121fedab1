"""The ``builtin`` tokenizer: deterministic, dependency-free, shared by replica and router.

The router must tokenize exactly as the replica does (spec §1.6: identical token ids are the
precondition of identical block hashes), so the simulated replica (``gpu_emitter.server``) and
the router's ``builtin`` tokenizer strategy call these very functions.

Vocabulary (2048 ids), chosen to equal the tokenizer of the tiny real-vLLM test model
(``/work/shared/fixtures/vllm-0.32-hybrid-swa64/model``, a WordLevel tokenizer): text made of
``wN`` words tokenizes to the same ids on a real vLLM replica of that model and here.

* ids 0..6 are the special tokens ``<pad> <eos> <bos> <unk> <system> <user> <assistant>``;
* the word ``wN`` (``0 <= N < 2041``, decimal without leading zeros) is id ``N + 7``;
* text is split on whitespace (``str.split()``); a special token's text is its id;
* **any other word** is hashed (BLAKE2b, 8 bytes, big-endian, modulo 2041) onto the ``wN``
  range. The real tokenizer maps it to ``<unk>`` instead; hashing keeps distinct texts
  distinct, which a cache simulation needs. Consequently ``decode(encode(text))`` returns
  ``wN`` words for such text, while ``encode(decode(ids)) == ids`` holds for every id list
  without special tokens (generated text round-trips: multi-turn prompts that repeat earlier
  completions get the same ids).

Decoding joins the tokens' texts with single spaces and skips special tokens by default, like
vLLM's ``skip_special_tokens=True``.

Chat template (the test model's): for each message ``"<{role}> {content} "``, then
``"<assistant>"`` when ``add_generation_prompt``. Like vLLM's chat endpoints and ``/tokenize``
with ``messages``, the templated text is encoded **without** a BOS (``add_special_tokens``
defaults to false there; the template is expected to carry special tokens itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "NUM_WORDS",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "VOCAB_SIZE",
    "WORD_OFFSET",
    "TokenizerInputError",
    "apply_chat_template",
    "decode",
    "encode",
    "encode_chat",
    "token_text",
    "word_id",
]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<system>",
    "<user>",
    "<assistant>",
)
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
VOCAB_SIZE = 2048
WORD_OFFSET = len(SPECIAL_TOKENS)
"""Id of ``w0``."""
NUM_WORDS = VOCAB_SIZE - WORD_OFFSET
"""Number of ``wN`` words (2041)."""

_TEXTS: tuple[str, ...] = SPECIAL_TOKENS + tuple(f"w{n}" for n in range(NUM_WORDS))
_IDS: dict[str, int] = {t: i for i, t in enumerate(_TEXTS)}
_HASHED: dict[str, int] = {}
_HASHED_MAX = 1 << 16  # memo bound for hashed (out-of-vocabulary) words


class TokenizerInputError(ValueError):
    """Input the tokenizer cannot take (bad message shape, out-of-range id); the message says
    what is expected."""


def word_id(word: str) -> int:
    """The id of one whitespace-free word (see the module docstring for the rule)."""
    tid = _IDS.get(word)
    if tid is not None:
        return tid
    tid = _HASHED.get(word)
    if tid is None:
        digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        tid = WORD_OFFSET + int.from_bytes(digest, "big") % NUM_WORDS
        if len(_HASHED) < _HASHED_MAX:
            _HASHED[word] = tid
    return tid


def encode(text: str, add_bos: bool = True) -> list[int]:
    """Token ids of ``text``; a leading BOS when ``add_bos`` (vLLM's ``add_special_tokens``)."""
    if not isinstance(text, str):
        raise TokenizerInputError(f"text must be a string, got {type(text).__name__}")
    words = text.split()
    ids = [BOS_ID] if add_bos else []
    try:
        # One C-level pass when every word is in the vocabulary (the common case: about 3x
        # faster than a Python loop on a 2,000-word prompt); any other word raises KeyError
        # and the text takes the per-word path, so the ids are the same either way.
        ids += map(_IDS.__getitem__, words)
    except KeyError:
        del ids[1 if add_bos else 0 :]
        ids += map(word_id, words)
    return ids


def token_text(token_id: int) -> str:
    """The text of one id (special tokens included)."""
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        raise TokenizerInputError(f"token ids must be integers, got {token_id!r}")
    if not 0 <= token_id < VOCAB_SIZE:
        raise TokenizerInputError(
            f"token id {token_id} is outside the vocabulary 0..{VOCAB_SIZE - 1}"
        )
    return _TEXTS[token_id]


def decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """The text of ``ids``: token texts joined by single spaces."""
    parts = []
    for tid in ids:
        text = token_text(tid)
        if skip_special_tokens and tid < WORD_OFFSET:
            continue
        parts.append(text)
    return " ".join(parts)


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise TokenizerInputError(
                    f"messages[{index}].content: only text parts are supported, "
                    f'e.g. {{"type": "text", "text": "..."}}'
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise TokenizerInputError(f"messages[{index}].content text part needs a string")
            texts.append(text)
        return " ".join(texts)
    raise TokenizerInputError(f"messages[{index}].content must be a string or a list of text parts")


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> str:
    """The prompt text of a chat (the test model's template, see the module docstring)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise TokenizerInputError(
            'messages must be a non-empty list of {"role": ..., "content": ...} objects'
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerInputError(f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role or any(c.isspace() for c in role):
            raise TokenizerInputError(
                f"messages[{i}].role must be a non-empty string without spaces "
                "(system, user, assistant, ...)"
            )
        out.append(f"<{role}> {_content_text(m.get('content'), i)} ")
    if add_generation_prompt:
        out.append("<assistant>")
    return "".join(out)


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a chat as vLLM's chat endpoints compute them: template, then encode
    (no BOS unless ``add_special_tokens``)."""
    return encode(apply_chat_template(messages, add_generation_prompt), add_special_tokens)
