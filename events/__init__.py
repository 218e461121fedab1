"""vLLM KV-cache event SDK: the wire schema, a vLLM-compatible publisher and subscribers.

Usable on its own, without the router: ``from events import decode_batch, Subscriber``.
See :mod:`events.subscriber` for a minimal example.
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
