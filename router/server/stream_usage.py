"""Ask a streaming request for vLLM's usage chunk, and hide it from a client that did not ask.

The router learns from every answer's ``usage.prompt_tokens_details.cached_tokens`` (the
prediction error loop, and learning the blocks a partial replica held before the router
attached). A streamed answer carries usage only when the request sets
``stream_options.include_usage`` (vLLM 0.32 ``should_include_usage``): then, after the last
content chunk, vLLM sends one more event whose ``choices`` is empty and whose ``usage`` holds
the totals. So the router sets the option on streaming requests that lack it and removes that
event (and any ``"usage": null`` other servers put in each chunk) from what the client reads,
which then sees the stream it asked for.

Pure byte handling, no I/O: :class:`UsageStripper` is fed the upstream's chunks as they come
(an SSE event may be split over chunks, or several may share one) and returns what to forward
at once; only the incomplete last event is held back.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["UsageStripper", "reported_cached_tokens", "request_usage"]

_decode = msgspec.json.Decoder()
_encode = msgspec.json.encode
_USAGE = b'"usage"'
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,15})(?![\d.eE])')
"""At most 15 digits (no prompt is near a quadrillion tokens): a longer number is a broken or
hostile answer, and a thousands-digit one would make ``int`` refuse it. A fraction or an
exponent is not a token count either."""
_MAX_HELD = 1 << 20
"""An event this large without its terminating blank line is forwarded as it is rather
than held (a broken upstream must not make the router buffer without bound)."""


def request_usage(body: dict[str, Any]) -> bool:
    """Turn on ``stream_options.include_usage`` in a streaming request body; True when the
    router did so (the client did not ask, so the usage event must be stripped)."""
    if not body.get("stream"):
        return False
    options = body.get("stream_options")
    if options is None:
        body["stream_options"] = {"include_usage": True}
        return True
    if not isinstance(options, dict) or options.get("include_usage"):
        # the client asked for usage, or sent something vLLM will refuse on its own terms
        return False
    body["stream_options"] = {**options, "include_usage": True}
    return True


class UsageStripper:
    """Removes the usage-only event from an SSE stream, keeping it for the router.

    ``usage`` holds the last removed event's JSON (bytes), for the prediction check. Events
    end with a blank line (``\\n\\n`` or ``\\r\\n\\r\\n``); each is forwarded
    byte for byte unless it is the usage event or carries ``"usage": null``.
    """

    __slots__ = ("_held", "usage")

    def __init__(self) -> None:
        self._held = b""
        self.usage: bytes | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` to forward now (complete events, minus the usage event)."""
        data = self._held + chunk if self._held else chunk
        end = _last_event_end(data)
        if end < 0:
            if len(data) > _MAX_HELD:
                self._held = b""
                return data
            self._held = data
            return b""
        self._held = data[end:]
        complete = data[:end]
        if _USAGE not in complete:
            return complete
        parts = _EVENT_END.split(complete)  # [event, separator, event, separator, ..., b""]
        return b"".join(self._filter(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2))

    def flush(self) -> bytes:
        """What is still held at the end of the stream (an unterminated last event)."""
        held, self._held = self._held, b""
        return self._filter(held, b"") if _USAGE in held else held

    def _filter(self, event: bytes, end: bytes) -> bytes:
        if _USAGE not in event:
            return event + end
        kept = []
        changed = False
        for line in event.splitlines(keepends=True):
            if line.startswith(b"data:") and _USAGE in line:
                payload = line[5:].strip()
                try:
                    obj = _decode.decode(payload)
                except (msgspec.DecodeError, RecursionError):  # forwarded as it came
                    obj = None
                if isinstance(obj, dict) and "usage" in obj:
                    if obj.get("choices") == [] and obj["usage"] is not None:
                        self.usage = payload
                        changed = True
                        continue
                    if obj["usage"] is None:
                        del obj["usage"]
                        eol = line[len(line.rstrip(b"\r\n")) :]
                        line = b"data: " + _encode(obj) + eol
                        changed = True
            kept.append(line)
        if not changed:
            return event + end
        if not any(line.startswith(b"data:") for line in kept):
            return b""  # the whole event was the usage event
        return b"".join(kept) + end


_EVENT_END = re.compile(rb"(\r\n\r\n|\n\n)")


def _last_event_end(data: bytes) -> int:
    """Index just past the last blank line in ``data``, or -1."""
    a = data.rfind(b"\n\n")
    b = data.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else -1, b + 4 if b >= 0 else -1)


def reported_cached_tokens(data: bytes) -> int | None:
    """The last ``cached_tokens`` in an answer's body (or its streamed tail), None if it has
    none that is a token count: vLLM reports it once, in ``usage.prompt_tokens_details``; the
    last one is that of the final usage event when a stream's tail holds several."""
    found = _CACHED.findall(data)
    return int(found[-1]) if found else None
