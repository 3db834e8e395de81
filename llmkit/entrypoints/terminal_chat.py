"""``llmkit chat``'s loop: read a line, run a command or stream the model's reply.

Replies go to ``out`` (stdout), everything llmkit says about them to ``err`` (stderr) in
brackets, so that a piped stdout holds the conversation's replies only. The streams and the
line reader are parameters: tests drive the loop with scripted input.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from llmkit.entrypoints.chat_commands import HELP_TEXT, ChatCommand, parse_command
from llmkit.entrypoints.chat_history import ChatHistory
from llmkit.entrypoints.reply_stats import (ReplyMeter, spec_decode_line,
                                            spec_decode_reading)
from llmkit.sampling.params import SamplingParams

__all__ = ["ChatIO", "ChatSession", "run_chat_loop"]

PROMPT = ">>> "


@dataclass
class ChatIO:
    """Where the chat reads and writes (the terminal unless a test says otherwise). The
    defaults are looked up when the session starts, so a replaced ``sys.stdout`` is used."""

    read_line: Callable[[str], str] = input
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)


class ChatSession:
    """One conversation with ``llm`` (an ``LLM``) under ``config``'s chat settings."""

    def __init__(self, llm: Any, config: Any, params: SamplingParams, *,
                 lora: Any = None, io: ChatIO | None = None) -> None:
        self.llm, self.config, self.params, self.lora = llm, config, params, lora
        self.io = io or ChatIO()
        self.limit, self.max_reply = llm.max_model_len, config.chat.max_tokens
        # A reply always has room for min(chat.max_tokens, half the context).
        self.history = ChatHistory(llm.apply_chat_template,
                                   self.limit - min(self.max_reply, self.limit // 2))
        self.meter = ReplyMeter()
        self._spec_start = spec_decode_reading(llm)

    def say(self, text: str) -> None:
        print(text, file=self.io.err)

    def run(self) -> int:
        """Chat until /quit, /exit, Ctrl-D or Ctrl-C at the prompt; returns the exit code."""
        self.say(self._banner())
        while True:
            try:
                line = self.io.read_line(PROMPT)
            except (EOFError, KeyboardInterrupt):
                self.say("")  # end the prompt's line
                return 0
            if not line.strip():
                continue  # an empty Enter must not end the conversation
            command = parse_command(line)
            if command is None:
                self._reply(line)
            elif not self._run_command(command):
                return 0

    def _banner(self) -> str:
        c = self.config
        name = c.model.served_name or c.model.name or "model"
        if self.lora is not None:
            name = f"{name} + LoRA adapter {self.lora.lora_name}"
        return (f"llmkit chat with {name} — /help for commands, /quit or Ctrl-D to quit "
                f"(replies up to chat.max_tokens={self.max_reply} tokens).")

    def _run_command(self, command: ChatCommand) -> bool:
        """Run ``command``; False means: end the chat."""
        if not command.known:
            self.say(f"[unknown command {command.name}; /help lists the commands]")
        elif command.name == "/quit":
            return False
        elif command.name == "/help":
            self.say(HELP_TEXT)
        elif command.name == "/reset":
            self.history.clear()
            self.say("[conversation forgotten: the next message starts a new one]")
        elif command.name == "/stats":
            for line in self.stats_lines():
                self.say(f"[{line}]")
        return True

    def stats_lines(self) -> list[str]:
        lines = self.meter.lines()
        now = spec_decode_reading(self.llm)
        if now is not None and self._spec_start is not None:
            lines.append(spec_decode_line(now.since(self._spec_start),
                                          self.config.speculative))
        else:
            lines.append("speculative decoding: off (recipe=cpu-ngram turns on n-gram drafts)")
        return lines

    def _reply(self, user: str) -> None:
        limit, max_reply = self.limit, self.max_reply
        self.history.add("user", user)
        prompt = self.history.fit()
        if prompt.dropped_turns:
            self.say(f"[the conversation outgrew model.max_model_len={limit}: dropped the "
                     f"oldest {prompt.dropped_turns} turn(s)]")
        if prompt.token_ids is None:
            self.history.pop()
            self.say(f"[this message alone is too long for model.max_model_len={limit}; "
                     "shorten it]")
            return
        max_tokens = min(max_reply, limit - len(prompt.token_ids))
        reply, finish, n_out = [], None, 0
        out = self.io.out
        start = time.perf_counter()
        try:
            for step in self.llm.stream(prompt.token_ids,
                                        dataclasses.replace(self.params, max_tokens=max_tokens),
                                        lora_request=self.lora):
                piece = step.outputs[0].text
                reply.append(piece)
                n_out += len(step.outputs[0].token_ids)
                finish = step.outputs[0].finish_reason or finish
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            finish = "interrupted"  # stop this answer, keep the conversation
        self.meter.record(len(prompt.token_ids), n_out, time.perf_counter() - start)
        out.write("\n")
        if finish == "length":
            if max_tokens < max_reply:
                self.say(f"[reply cut: the context is full (model.max_model_len={limit}); the "
                         "oldest turns go next]")
            else:
                self.say(f"[reply cut at chat.max_tokens={max_reply} tokens; raise "
                         "chat.max_tokens for longer replies]")
        self.history.add("assistant", "".join(reply))


def run_chat_loop(llm: Any, config: Any, params: SamplingParams, *, lora: Any = None,
                  io: ChatIO | None = None) -> int:
    return ChatSession(llm, config, params, lora=lora, io=io).run()
