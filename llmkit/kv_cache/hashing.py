"""Prefix caching's keys and counters: the block hashes a lookup matches on, and the counters of
:class:`~llmkit.kv_cache.base.PrefixCacheStats` every manager keeps over them.

A block's hash covers its parent's hash, its token ids and the request's extra keys (LoRA id,
multimodal hashes, cache salt), so two blocks share a hash only when the *whole* prefix up to
and including them matches under the same adapter/salt. The hash must be identical in every
process (API servers, engine core, workers, a restarted engine), so it is sha256 over a
deterministic byte encoding, never Python's seeded ``hash()``.

Byte layout hashed (unambiguous, so distinct inputs cannot alias):
``parent (16 bytes) | number of tokens (4 bytes, little endian) | token ids (int64 each) |
msgpack(extra_keys) or nothing``.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING, Any, Sequence

import msgspec

from llmkit.kv_cache.base import PrefixCacheStats

if TYPE_CHECKING:
    from llmkit.request import Request

#: Length of a block hash in bytes (sha256 truncated to 128 bits).
BLOCK_HASH_BYTES = 16

#: Stands in for the parent of a request's first block.
ROOT_PARENT_HASH: bytes = hashlib.sha256(b"llmkit.kv_cache.root").digest()[:BLOCK_HASH_BYTES]

_sha256 = hashlib.sha256
_msgpack_encode = msgspec.msgpack.Encoder().encode


def encode_extra_keys(extra_keys: tuple[Any, ...] | None) -> bytes:
    """Deterministic bytes for a request's extra keys; ``b""`` when there are none.

    Encode once per request and pass the result to :func:`hash_block_tokens_encoded` to keep
    msgpack off the per-block path.
    """
    if extra_keys is None:
        return b""
    return _msgpack_encode(extra_keys)


def hash_block_tokens_encoded(parent_hash: bytes | None, token_ids: Sequence[int],
                              extra: bytes) -> bytes:
    """:func:`hash_block_tokens` with the extra keys already encoded by :func:`encode_extra_keys`."""
    h = _sha256(ROOT_PARENT_HASH if parent_hash is None else parent_hash)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids))
    if extra:
        h.update(extra)
    return h.digest()[:BLOCK_HASH_BYTES]


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """The 16-byte hash of one block: H(parent hash, token ids, extra keys).

    ``parent_hash`` is ``None`` for a request's first block. ``extra_keys`` must be built of
    msgpack-encodable values (ints, strings, None, tuples of those).
    """
    return hash_block_tokens_encoded(parent_hash, token_ids, encode_extra_keys(extra_keys))


def extend_block_hashes(request: Request, n: int, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to at least ``n`` entries (those blocks must be full)
    and return it. Append-only and incremental: each block is hashed once in the request's
    lifetime, preemptions included. A request with images keys each block by the images it
    holds; others key every block by the request's extra keys (LoRA, salt). Every manager
    hashes through this: one group's blocks or several groups' (each adds its tag)."""
    hashes = request.block_hashes
    i = len(hashes)
    if i >= n:
        return hashes
    bs = block_size
    ids = request.all_token_ids
    per_block = bool(request.mm_features)
    extra = b"" if per_block else encode_extra_keys(request.block_hash_extra_keys)
    parent = hashes[-1] if i else None
    append = hashes.append
    start = i * bs
    for _ in range(n - i):
        if per_block:
            extra = encode_extra_keys(request.block_extra_keys(start, start + bs))
        parent = hash_block_tokens_encoded(parent, ids[start:start + bs], extra)
        append(parent)
        start += bs
    return hashes


# -- counters ------------------------------------------------------------------------------
# Kept the same way by every manager over a ``BlockPool`` (one KV-cache group or several): a
# lookup counts once the request it was for is admitted, not when it is made.
class PrefixCacheCounters:
    """Admissions, tokens looked up and tokens hit, with the share of re-admissions after
    preemption.

    The manager's protocol: ``get_computed_blocks`` sets ``pending`` to the request it looked
    up; ``allocate_slots`` calls :meth:`admitted` when it succeeds for that request (testing
    ``pending is request`` itself: it runs for every request every step, so no call there
    when nothing is pending); ``free`` calls :meth:`forget`.
    """

    __slots__ = ("pending", "requests", "queries", "hits", "preempted_requests",
                 "preempted_queries", "preempted_hits")

    def __init__(self) -> None:
        #: The request whose lookup is not counted yet (looked up, not yet admitted).
        self.pending: Request | None = None
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def admitted(self, request: Request, num_hit: int) -> None:
        """Count the pending lookup: ``request`` was admitted with ``num_hit`` cached tokens."""
        self.pending = None
        n = request.num_tokens
        self.requests += 1
        self.queries += n
        self.hits += num_hit
        if request.num_preemptions:
            self.preempted_requests += 1
            self.preempted_queries += n
            self.preempted_hits += num_hit

    def forget(self, request: Request) -> None:
        """Drop ``request``'s pending lookup (it leaves without being admitted)."""
        if self.pending is request:
            self.pending = None

    def snapshot(self, evictions: int) -> PrefixCacheStats:
        """The counters so far, with the pool's ``evictions``."""
        return PrefixCacheStats(requests=self.requests, queries=self.queries, hits=self.hits,
                                evictions=evictions,
                                preempted_requests=self.preempted_requests,
                                preempted_queries=self.preempted_queries,
                                preempted_hits=self.preempted_hits)
