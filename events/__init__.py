"""vLLM KV-cache event SDK: the wire schema, a vLLM-compatible publisher and subscribers,
and the parts of vLLM's contract both sides of it need: the block hash chain
(:mod:`events.hashing`) and the model layout (:mod:`events.layout`).

Usable on its own, without the router or torch: ``from events import decode_batch, Subscriber``.
See :mod:`events.subscriber` for a minimal example. The router (``router/``) and the simulated
engine (``gpu_emitter/``) both build on this package and never on each other.
"""

from events.endpoints import EndpointError, offset_endpoint_port, validate_endpoint
from events.publisher import EventPublisher, PublisherClosedError, publisher_binds
from events.schema import (
    AllBlocksCleared,
    BatchDecodeError,
    BlockHash,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    KVCacheEvent,
    KVEventBatch,
    UnknownEvent,
    decode_batch,
    encode_batch,
)
from events.stream import (
    GapUnrecoverable,
    MalformedMessage,
    RankMismatch,
    StreamBatch,
    StreamItem,
    StreamProcessor,
    StreamReset,
    StreamSignal,
    StreamSpec,
    StreamStats,
)
from events.subscriber import AsyncSubscriber, Subscriber, SubscriberError, dp_stream_specs

__all__ = [
    "AllBlocksCleared",
    "AsyncSubscriber",
    "BatchDecodeError",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EndpointError",
    "EventPublisher",
    "GapUnrecoverable",
    "KVCacheEvent",
    "KVEventBatch",
    "MalformedMessage",
    "PublisherClosedError",
    "RankMismatch",
    "StreamBatch",
    "StreamItem",
    "StreamProcessor",
    "StreamReset",
    "StreamSignal",
    "StreamSpec",
    "StreamStats",
    "Subscriber",
    "SubscriberError",
    "UnknownEvent",
    "decode_batch",
    "dp_stream_specs",
    "encode_batch",
    "offset_endpoint_port",
    "publisher_binds",
    "validate_endpoint",
]
