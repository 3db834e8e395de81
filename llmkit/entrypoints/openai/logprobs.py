"""A choice's logprobs in OpenAI's two shapes: ``/v1/completions``' (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and ``/v1/chat/completions``'
(``content``: one entry per token, with its bytes and top alternatives)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.entrypoints.openai.protocol import (ChatLogprobs, ChatLogprobToken, ChatLogprobTop,
                                                CompletionLogprobs)
from llmkit.outputs import CompletionOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["chat_logprobs", "completion_logprobs", "logprob_rows", "token_text"]


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int, decoded: str | None) -> str:
    if decoded is not None:
        return decoded
    return tokenizer.decode([token_id])


def logprob_rows(tokenizer: PreTrainedTokenizerBase, c: CompletionOutput, k: int | None,
                 ) -> list[tuple[int, float, str, list[tuple[int, float, str]]]] | None:
    """``(token_id, logprob, text, [(top_id, top_logprob, top_text)...])`` for the new tokens
    of ``c``; None when no logprobs were asked for."""
    if k is None or c.logprobs is None:
        return None
    ids = list(c.token_ids)
    lps = list(c.logprobs)
    if len(lps) > len(ids):
        lps = lps[len(lps) - len(ids):]
    rows = []
    for tok, entry in zip(ids[len(ids) - len(lps):], lps):
        chosen = entry.get(tok)
        # The entry holds the top k (ranks 1..k) and the chosen token (any rank): the k
        # best by rank are OpenAI's top_logprobs, with the chosen one only if among them.
        tops = sorted(entry.items(), key=lambda x: (
            x[1].rank if x[1].rank is not None else 1 << 30, -x[1].logprob))[:k]
        top = [(t, lp.logprob, token_text(tokenizer, t, lp.decoded_token)) for t, lp in tops]
        rows.append((tok, chosen.logprob if chosen else float("nan"),
                     token_text(tokenizer, tok, chosen.decoded_token if chosen else None), top))
    return rows


def completion_logprobs(tokenizer: PreTrainedTokenizerBase, c: CompletionOutput, k: int | None,
                        offset: int = 0) -> CompletionLogprobs | None:
    rows = logprob_rows(tokenizer, c, k)
    if rows is None:
        return None
    out = CompletionLogprobs()
    for _tok, lp, text, top in rows:
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({t: v for _, v, t in top} if k else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, c: CompletionOutput,
                  k: int | None) -> ChatLogprobs | None:
    rows = logprob_rows(tokenizer, c, k)
    if rows is None:
        return None
    return ChatLogprobs(content=[
        ChatLogprobToken(token=text, logprob=lp, bytes=list(text.encode()),
                         top_logprobs=[ChatLogprobTop(token=t, logprob=v,
                                                      bytes=list(t.encode()))
                                       for _, v, t in top])
        for _tok, lp, text, top in rows])
