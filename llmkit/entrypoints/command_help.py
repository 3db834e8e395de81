"""``llmkit <command> --help``: what one command reads from the config and two ways to run it.

The groups come from ``conf/`` (the engine's) and ``conf/tools/`` (the tools') and the keys from
the pydantic config classes, so the help follows the config as it changes: nothing here lists a
key by hand. A command that builds an engine reads every engine group; its own sections
(``server.*`` for serve, ``bench.*`` for bench, ...) are listed key by key with their defaults.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

__all__ = ["COMMAND_HELP", "CommandHelp", "command_help", "section_keys"]

WIDTH = 96
# groups of the tools' root (conf/tools/) that are no part of an engine: `llmkit sim`'s
# modelled accelerator
TOOL_GROUPS = ("hardware",)


@dataclass(frozen=True, slots=True)
class CommandHelp:
    """One command's help. ``engine``: it builds (or composes) an engine, so the engine's
    groups apply; ``sections``: the config sections it reads beyond the components' (the
    engine's ``sampling``/``chat``/``server``, or its tool config's); ``tool``: its
    ``ToolConfig`` class name in ``llmkit.tools.schema`` (whose sections are added);
    ``extra_groups``: groups of the tools' root it reads."""

    usage: str
    about: str
    examples: tuple[str, str]
    engine: bool = True
    sections: tuple[str, ...] = ()
    tool: str | None = None
    extra_groups: tuple[str, ...] = ()
    notes: str = ""


COMMAND_HELP: dict[str, CommandHelp] = {
    "generate": CommandHelp(
        "llmkit generate [MODEL] --prompt TEXT [--image PATH] [key=value ...]",
        "Generate one completion for --prompt TEXT (stdout); speed and, with speculative "
        "decoding, its acceptance on stderr.",
        ('llmkit generate --prompt "Hello, world" sampling.max_tokens=32',
         'llmkit generate --prompt "def fib(n):" recipe=cpu-ngram sampling.max_tokens=64'),
        sections=("sampling",)),
    "chat": CommandHelp(
        "llmkit chat [MODEL] [key=value ...]",
        "Chat in the terminal. In the chat: /help, /stats (speed, tokens, speculation), "
        "/reset, /quit or /exit (or Ctrl-D); Ctrl-C stops a reply.",
        ("llmkit chat recipe=cpu-chat",
         "llmkit chat /path/to/model.gguf chat.max_tokens=256 sampling.temperature=0.7"),
        sections=("chat", "sampling")),
    "serve": CommandHelp(
        "llmkit serve [MODEL] [key=value ...]",
        "OpenAI-compatible HTTP server, with a chat page at / and a live engine view at "
        "/engine.",
        ("llmkit serve recipe=cpu-chat server.port=8000",
         "llmkit serve ./my-model server.host=0.0.0.0 server.api_key=secret "
         "scheduler.max_num_seqs=64"),
        sections=("server",)),
    "config": CommandHelp(
        "llmkit config [MODEL] [key=value ...] [-m]",
        "Print the composed, validated config (a tool's section only when the command line "
        "sets one of its keys); -m prints one per combination of a sweep.",
        ("llmkit config recipe=cpu-default scheduler.max_num_seqs=32",
         "llmkit config hardware=h100-sxm bench.rate=8"),
        extra_groups=TOOL_GROUPS,
        notes="Tool sections it shows when set: bench, hardware, sim, plan, eval, proxy "
              "(`llmkit bench --help` etc. list their keys)."),
    "bench": CommandHelp(
        "llmkit bench serve|throughput|latency|plot [MODEL] [key=value ...] [-m]",
        "Benchmarks: serve (load against a running server), throughput and latency (offline "
        "engine), plot (charts of a -m sweep's results).",
        ("llmkit bench serve ./my-model bench.rate=4 bench.num_requests=200 slo.ttft_ms=500",
         "llmkit bench latency recipe=cpu-ngram bench.batch_size=1"),
        tool="BenchToolConfig"),
    "sim": CommandHelp(
        "llmkit sim [calibrate] [MODEL] [hardware=NAME] [key=value ...] [-m]",
        "Simulate bench serve on modelled hardware (the engine's scheduler and KV cache, step "
        "times from a cost model); sim calibrate measures this CPU (hardware=cpu-local).",
        ("llmkit sim llama-2-7b hardware=h100-sxm bench.rate=8 bench.num_requests=2000 "
         "slo.ttft_ms=500",
         "llmkit sim calibrate"),
        tool="SimToolConfig", extra_groups=TOOL_GROUPS),
    "plan": CommandHelp(
        "llmkit plan [MODEL] [hardware=NAME] [key=value ...]",
        "Search engine configs (plan.* lists) in the simulator for a workload (bench.*, or "
        "plan.trace=RESULT.json; or plan.rate, plan.num_requests, plan.input_len, plan.output_len) and an SLO (slo.*), rank by goodput then tokens per "
        "core-second, verify the best plan.verify_top with bench serve on a real server (the "
        "best measured wins), and "
        "write plan.output (default plan.output_dir/recipe.yaml) (recipe=PATH loads it), a table and a plot. Default "
        "hardware: cpu-local (calibrated first when it is not; a cached profile is checked "
        "against a few timed engine steps and recalibrated when stale: plan.max_profile_error, "
        "plan.stale_profile).",
        ("llmkit plan bench.rate=1 bench.num_requests=48 bench.input_len=256 "
         "bench.output_len=128 slo.ttft_ms=1500 slo.tpot_ms=80",
         "llmkit plan llama-3-8b hardware=h100-sxm plan.verify_top=0 "
         "plan.max_num_seqs=[64,128,256] bench.rate=8"),
        tool="PlanToolConfig", extra_groups=TOOL_GROUPS),
    "eval": CommandHelp(
        "llmkit eval ppl [MODEL] [key=value ...]",
        "Perplexity of the model over a text file (JSON on stdout).",
        ("llmkit eval ppl eval.text_file=book.txt eval.window=512",
         "llmkit eval ppl /path/to/model.gguf eval.mode=llamacpp"),
        tool="EvalToolConfig"),
    "proxy": CommandHelp(
        "llmkit proxy [key=value ...]",
        "Disaggregated serving's front: each request prefills on one of proxy.prefill_urls, "
        "then decodes on one of proxy.decode_urls.",
        ("llmkit proxy proxy.prefill_urls=[http://127.0.0.1:8001] "
         "proxy.decode_urls=[http://127.0.0.1:8002]",
         "llmkit proxy proxy.port=9000 proxy.prefill_urls=[http://10.0.0.1:8000] "
         "proxy.decode_urls=[http://10.0.0.2:8000,http://10.0.0.3:8000]"),
        engine=False, tool="ProxyToolConfig"),
}


def _show(value: Any) -> str:
    """A default as it is typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def section_keys(section: str, model: type[BaseModel]) -> list[str]:
    """``section.key=default`` for each field of ``model`` (a nested model: ``section.key.*``)."""
    keys = []
    for name, info in model.model_fields.items():
        key = f"{section}.{info.alias or name}"
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            keys.append(f"{key}.*")
        else:
            keys.append(f"{key}={_show(default)}")
    return keys


def _sections(spec: CommandHelp) -> list[tuple[str, type[BaseModel]]]:
    from llmkit.config.schema import EngineConfig
    from llmkit.tools import schema as tool_schema

    out = [(name, EngineConfig.model_fields[name].annotation) for name in spec.sections]
    if spec.tool is not None:
        tool = getattr(tool_schema, spec.tool)
        groups = set(spec.extra_groups)
        out += [(name, info.annotation) for name, info in tool.model_fields.items()
                if name != "engine" and name not in groups]
    return out


def _groups(spec: CommandHelp) -> list[str]:
    from llmkit.config.compose import config_groups
    from llmkit.tools.compose import TOOLS_ROOT

    return [g for g in config_groups(TOOLS_ROOT)
            if (spec.engine and g not in TOOL_GROUPS) or g in spec.extra_groups]


def _wrap(text: str, indent: str = "  ") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def command_help(command: str) -> str:
    """The text of ``llmkit <command> --help``."""
    from llmkit.config.compose import group_options
    from llmkit.tools.compose import TOOLS_ROOT

    spec = COMMAND_HELP[command]
    parts = [f"usage: {spec.usage}", "", textwrap.fill(spec.about, WIDTH), ""]
    groups = _groups(spec)
    if groups:
        parts.append("config groups (GROUP=OPTION picks one; `llmkit config` shows the "
                     "result):")
        parts += [_wrap(f"{g}: {', '.join(group_options(g, TOOLS_ROOT)) or '(none)'}")
                  for g in groups]
        parts.append("  and each component's own keys, e.g. scheduler.max_num_seqs=64 "
                     "(`llmkit config` lists them)")
    else:
        parts.append("config groups: none (no engine runs here)")
    for name, model in _sections(spec):
        parts += ["", f"{name}.* keys (defaults shown):"]
        parts += [_wrap(" ".join(section_keys(name, model)))]
    if spec.notes:
        parts += ["", textwrap.fill(spec.notes, WIDTH)]
    parts += ["", "examples:"] + [f"  {e}" for e in spec.examples] + [""]
    return "\n".join(parts)
