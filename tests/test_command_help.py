"""`llmkit <command> --help`: each command's own help names its config groups, every key of
its own sections (from the pydantic classes) and two examples; `llmkit --help` stays general."""
from __future__ import annotations

import re

import pytest

from llmkit.config.compose import config_groups, group_options
from llmkit.config.schema import EngineConfig
from llmkit.entrypoints import cli
from llmkit.tools import schema as tool_schema

ENGINE_GROUPS = ("scheduler", "kv_cache", "attention", "speculative", "model", "recipe")
# command -> the sections whose every key its help lists
SECTIONS = {
    "generate": {"sampling": EngineConfig.model_fields["sampling"].annotation},
    "chat": {"chat": EngineConfig.model_fields["chat"].annotation,
             "sampling": EngineConfig.model_fields["sampling"].annotation},
    "serve": {"server": EngineConfig.model_fields["server"].annotation},
    "config": {},
    "bench": {"bench": tool_schema.BenchConfig, "slo": tool_schema.SloConfig},
    "sim": {"bench": tool_schema.BenchConfig, "slo": tool_schema.SloConfig,
            "sim": tool_schema.SimConfig},
    "plan": {"bench": tool_schema.BenchConfig, "slo": tool_schema.SloConfig,
             "sim": tool_schema.SimConfig, "plan": tool_schema.PlanConfig},
    "eval": {"eval": tool_schema.EvalConfig},
    "proxy": {"proxy": tool_schema.ProxyConfig},
}


def help_of(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    out, err = capsys.readouterr()
    assert not err
    return out


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_each_command_has_its_own_help(command, capsys):
    text = help_of(capsys, command, "--help")
    assert text.startswith(f"usage: llmkit {command} ")
    assert "commands:" not in text  # not the general usage
    for section, model in SECTIONS[command].items():
        assert f"\n{section}.* keys" in text
        for name, info in model.model_fields.items():
            assert re.search(rf"(^|\s){re.escape(section)}\.{info.alias or name}[=.]", text,
                             re.M), f"{command}: {section}.{name}"
    if command == "proxy":
        assert "config groups: none" in text
    else:
        for group in ENGINE_GROUPS:
            line = f"  {group}: {', '.join(group_options(group))}"
            assert line in text, (command, group)
    has_hardware = "  hardware: " in text
    assert has_hardware == (command in ("sim", "plan", "config"))
    examples = text.split("\nexamples:\n", 1)[1].rstrip("\n").splitlines()
    assert len(examples) == 2 and all(e.startswith(f"  llmkit {command}") for e in examples)


def test_help_inside_sub_commands_and_the_general_usage(capsys):
    assert help_of(capsys, "bench", "serve", "--help") == help_of(capsys, "bench", "--help")
    assert help_of(capsys, "eval", "ppl", "-h") == help_of(capsys, "eval", "--help")
    assert help_of(capsys, "generate", "--prompt", "x", "--help").startswith(
        "usage: llmkit generate")
    general = help_of(capsys, "--help")
    assert general.startswith("usage: llmkit <command>") and "--help lists that command" in general
    assert set(ENGINE_GROUPS) <= set(config_groups())
