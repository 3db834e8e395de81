"""The terminal chat's slash commands: which lines are commands, and what /help says.

A line is a command when its first word is ``/`` followed by letters (``/help``, ``/quit``):
a command is never sent to the model, and an unknown one gets a one-line answer instead of a
1,000-token reply. Any other line, ``/usr/bin``-like paths included, is a message.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["COMMANDS", "ChatCommand", "HELP_TEXT", "parse_command"]

# name -> what it does; aliases map to the same action in ``ALIASES``
COMMANDS: dict[str, str] = {
    "/help": "list these commands",
    "/stats": "speed (tok/s), tokens in/out, speculative decoding's acceptance",
    "/reset": "forget the conversation and start a new one",
    "/quit": "end the chat (also /exit, Ctrl-D)",
}
ALIASES: dict[str, str] = {"/exit": "/quit", "/?": "/help"}

HELP_TEXT = "\n".join(
    [f"  {name:<8} {what}" for name, what in COMMANDS.items()]
    + ["  Ctrl-C stops a reply (the conversation stays); an empty line does nothing."])

_COMMAND_WORD = re.compile(r"^(/[A-Za-z]+|/\?)(?:\s|$)")


@dataclass(frozen=True, slots=True)
class ChatCommand:
    """A command line: ``name`` is the canonical command (``/exit`` -> ``/quit``) or, for an
    unknown command, the word as typed (``known`` false)."""

    name: str
    known: bool


def parse_command(line: str) -> ChatCommand | None:
    """The command on ``line``, or None when the line is a message for the model."""
    m = _COMMAND_WORD.match(line.strip())
    if m is None:
        return None
    word = m.group(1).lower()
    name = ALIASES.get(word, word)
    return ChatCommand(name, name in COMMANDS)
