"""Pinned prefixes (``kv_cache.pinned_prefixes``): token-id prefixes (or text, tokenized as
prompts are) whose full blocks the prefix cache never evicts once computed. They are hashed as a request's blocks are, with no
extra keys (no LoRA, images or salt), and must fit in half of the pool.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

from llmkit.kv_cache.hashing import hash_block_tokens_encoded

logger = logging.getLogger(__name__)


def pinned_prefix_ids(prefixes: Sequence[str | Sequence[int]], enable_prefix_caching: bool,
                      load_tokenizer: Callable[[], Any]) -> list[list[int]]:
    """``kv_cache.pinned_prefixes`` as token ids: text is tokenized as prompts are (the
    tokenizer loads only if some prefix is text); none when prefix caching is off."""
    if not prefixes:
        return []
    if not enable_prefix_caching:
        logger.warning("kv_cache.pinned_prefixes is set but kv_cache.enable_prefix_caching is "
                       "false: nothing is cached, so nothing can be pinned")
        return []
    tokenizer = None
    ids = []
    for p in prefixes:
        if isinstance(p, str):
            if tokenizer is None:
                tokenizer = load_tokenizer()
            ids.append(tokenizer.encode(p))
        else:
            ids.append(list(p))
    return ids


def pinned_prefix_hashes(prefixes: Sequence[Sequence[int]], num_blocks: int, block_size: int,
                         enable_prefix_caching: bool) -> frozenset[bytes]:
    """The hashes of the pinned prefixes' full blocks; ValueError naming the setting."""
    if isinstance(prefixes, (str, bytes)):
        raise ValueError("kv_cache.pinned_prefixes: expected a list of token-id lists, "
                         f"got {type(prefixes).__name__}")
    prefixes = list(prefixes)
    if not prefixes:
        return frozenset()
    if not enable_prefix_caching:
        raise ValueError(f"kv_cache.pinned_prefixes ({len(prefixes)} given) needs "
                         "kv_cache.enable_prefix_caching=true; it is false")
    hashes: set[bytes] = set()
    for i, prefix in enumerate(prefixes):
        try:
            if isinstance(prefix, (str, bytes)) or any(isinstance(t, bool) for t in prefix):
                raise TypeError
            prefix = [operator.index(t) for t in prefix]
        except TypeError:
            raise ValueError(f"kv_cache.pinned_prefixes[{i}]: expected a list of token ids "
                             "(tokenize text prefixes before building the manager), got "
                             f"{prefix!r:.60}") from None
        n_full = len(prefix) // block_size
        if n_full == 0:
            raise ValueError(f"kv_cache.pinned_prefixes[{i}]: {len(prefix)} tokens, shorter "
                             f"than one block (kv_cache.block_size={block_size}); only full "
                             "blocks are cached, so nothing would be pinned")
        parent = None
        for j in range(n_full):
            parent = hash_block_tokens_encoded(
                parent, prefix[j * block_size:(j + 1) * block_size], b"")
            hashes.add(parent)
    limit = num_blocks // 2
    if len(hashes) > limit:
        raise ValueError(f"kv_cache.pinned_prefixes: {len(hashes)} blocks of {block_size} "
                         f"tokens to pin; at most half of the pool ({limit} of {num_blocks} "
                         "blocks) may be pinned")
    return frozenset(hashes)
