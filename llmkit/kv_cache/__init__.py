"""Paged KV cache management with prefix caching (see ``base.KVCacheManagerBase``)."""
from llmkit.kv_cache.base import KVCacheIntegrityError, KVCacheManagerBase, PrefixCacheStats
from llmkit.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from llmkit.kv_cache.hashing import hash_block_tokens
from llmkit.kv_cache.manager import KVCacheManager
from llmkit.registry import Registry

KV_CACHE_MANAGERS: Registry[KVCacheManagerBase] = Registry("kv_cache")
KV_CACHE_MANAGERS.register("paged")(KVCacheManager)

__all__ = [
    "BlockPool", "FreeBlockQueue", "KVCacheBlock", "KVCacheIntegrityError", "KVCacheManager",
    "KVCacheManagerBase", "KV_CACHE_MANAGERS", "PrefixCacheStats", "hash_block_tokens",
]
