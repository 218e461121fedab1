"""vLLM KV-cache event SDK: the wire schema, a vLLM-compatible publisher and subscribers.

Usable on its own, without the router: ``from events import decode_batch, Subscriber``.
"""

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

__all__ = [
    "AllBlocksCleared",
    "BatchDecodeError",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "UnknownEvent",
    "decode_batch",
    "encode_batch",
]
