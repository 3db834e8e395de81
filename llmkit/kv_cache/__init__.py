"""Paged KV cache management with prefix caching (see ``base.KVCacheManagerBase``)."""
from llmkit.kv_cache.base import KVCacheIntegrityError, KVCacheManagerBase, PrefixCacheStats
from llmkit.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from llmkit.kv_cache.eviction import (EVICTION_POLICIES, EvictionPolicy, LFUEvictionPolicy,
                                      LRUEvictionPolicy, make_eviction_policy)
from llmkit.kv_cache.hashing import hash_block_tokens
from llmkit.kv_cache.manager import KVCacheManager
from llmkit.registry import Registry

KV_CACHE_MANAGERS: Registry[KVCacheManagerBase] = Registry("kv_cache")
KV_CACHE_MANAGERS.register("paged")(KVCacheManager)

__all__ = [
    "BlockPool", "EVICTION_POLICIES", "EvictionPolicy", "FreeBlockQueue", "KVCacheBlock",
    "KVCacheIntegrityError", "KVCacheManager", "KVCacheManagerBase", "KV_CACHE_MANAGERS",
    "LFUEvictionPolicy", "LRUEvictionPolicy", "PrefixCacheStats", "hash_block_tokens",
    "make_eviction_policy",
]
