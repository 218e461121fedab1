"""ZeroMQ endpoint addresses as both ends of a KV-event stream use them (spec §3).

The publisher (:mod:`events.publisher`) and the subscriber (:mod:`events.subscriber`) need
the same three things from an address: to check it before ZeroMQ sees it, to offset it for a
data-parallel rank the way vLLM does, and to bind or connect a socket to it with an error
that says what went wrong. They live here, in a module of their own, so that neither side
reaches into the other's internals for them.
"""

from __future__ import annotations

import re

import zmq

__all__ = ["EndpointError", "bind_or_connect", "offset_endpoint_port", "validate_endpoint"]

_TCP = re.compile(r"^tcp://(?P<host>.+):(?P<port>[^:\]]+)$")


class EndpointError(ValueError):
    """An endpoint string ZeroMQ cannot use; the message says what a valid one looks like."""


def validate_endpoint(endpoint: str, *, what: str = "endpoint") -> str:
    """Return ``endpoint`` if it is a ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``
    address, else raise :class:`EndpointError` naming the expected form.

    Checked up front because ZeroMQ reports a bad address only as ``Invalid argument``, and
    a connect to a well-formed but wrong address never fails at all.
    """
    hint = (
        f"{what} {endpoint!r} is not a ZeroMQ address; use tcp://HOST:PORT "
        "(e.g. tcp://127.0.0.1:5557, tcp://*:5557 to bind), ipc:///path or inproc://name"
    )
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise EndpointError(hint)
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise EndpointError(hint)
        return endpoint
    if scheme != "tcp":
        raise EndpointError(hint)
    m = _TCP.match(endpoint)
    if m is None:
        raise EndpointError(hint)
    port = m["port"]
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise EndpointError(
            f"{what} {endpoint!r} has port {port!r}; the port must be a number "
            "from 0 to 65535 (or * to bind an ephemeral port), e.g. tcp://127.0.0.1:5557"
        )
    return endpoint


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of DP rank ``data_parallel_rank`` for a configured ``endpoint``
    (spec §3, "Per DP rank"): TCP ports grow by the rank (port 0 and ``*`` are kept, so each
    rank still gets an ephemeral port), ``inproc://`` names get the suffix ``_dp<rank>``
    (for every rank, rank 0 included) and ``ipc://`` paths cannot be offset, so they are
    refused for ranks above 0.
    """
    if data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    validate_endpoint(endpoint)
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("ipc://"):
        if data_parallel_rank > 0:
            raise EndpointError(
                f"ipc endpoint {endpoint!r} cannot be offset for data-parallel rank "
                f"{data_parallel_rank}; use a tcp:// endpoint (its port grows by the rank)"
            )
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not (port.isascii() and port.isdigit()) or int(port) == 0 or data_parallel_rank == 0:
        return endpoint
    return f"{base}:{int(port) + data_parallel_rank}"


def bind_or_connect(sock: zmq.Socket, endpoint: str, *, bind: bool) -> str:
    """Bind ``sock`` to ``endpoint`` or connect it there, and return the address in use.

    When binding, that is the resolved address (an ephemeral ``*`` or ``0`` port filled in,
    e.g. ``tcp://0.0.0.0:41234``), which is what the other end must be told. IPv6 is switched
    on for bracketed or ``::`` addresses, which ZeroMQ refuses otherwise. A failure raises
    :class:`EndpointError` naming the action and address, instead of ZeroMQ's bare errno.
    """
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if bind:
            sock.bind(endpoint)
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            return last.decode() if isinstance(last, bytes) else str(last)
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        action = "bind" if bind else "connect"
        raise EndpointError(f"cannot {action} {endpoint!r}: {exc}") from None
    return endpoint
