"""Where ``KVCacheBlock`` and ``FreeBlockQueue`` used to live: they are the pool's
(``block_pool.py``). Kept for the imports that still name this module (``scheduler/``, under
``TYPE_CHECKING``); runs on no request's path."""
from llmkit.kv_cache.block_pool import FreeBlockQueue, KVCacheBlock

__all__ = ["FreeBlockQueue", "KVCacheBlock"]
