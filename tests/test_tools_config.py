"""The tools' config root (conf/tools/tools.yaml): it composes the engine's root and adds the
tools' sections and groups, which the engine's root names nowhere."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from llmkit.config import ConfigError, compose_config
from llmkit.config import compose as compose_mod
from llmkit.config.schema import EngineConfig
from llmkit.tools.compose import TOOLS_ROOT, compose_tool_config
from llmkit.tools.schema import TOOL_SECTIONS, AllToolsConfig, SimToolConfig

REPO = Path(__file__).resolve().parents[1]


def test_the_engines_root_names_no_tool():
    text = (REPO / "conf" / "config.yaml").read_text()
    doc = yaml.safe_load(text)
    assert not set(TOOL_SECTIONS) & set(doc)
    assert not any(isinstance(d, dict) and set(d) & set(TOOL_SECTIONS) for d in doc["defaults"])
    assert "hardware" not in compose_mod.config_groups()
    assert "tools" not in compose_mod.config_groups()
    assert "hardware" in compose_mod.config_groups(TOOLS_ROOT)
    assert "tools" not in compose_mod.config_groups(TOOLS_ROOT)  # a root, no group of either
    assert compose_mod.group_options("tools", TOOLS_ROOT) == []
    assert set(compose_mod.config_groups()) < set(compose_mod.config_groups(TOOLS_ROOT))
    with pytest.raises(ConfigError, match=r"^hardware"):
        compose_config(["hardware=h100-sxm"])


def test_the_tools_root_holds_the_engines_config_unchanged():
    overrides = ["scheduler.max_num_seqs=7", "recipe=cpu-chat", "seed=3"]
    cfg = compose_tool_config(AllToolsConfig, overrides + ["hardware=l4", "bench.rate=2"])
    assert cfg.engine == compose_config(overrides)
    assert (cfg.hardware.name, cfg.bench.rate) == ("l4", 2.0)
    assert type(cfg.engine) is EngineConfig


def test_a_recipe_applied_last_sets_a_tools_key(tmp_path, monkeypatch):
    (tmp_path / "slo-tight.yaml").write_text("slo:\n  ttft_ms: 250\nseed: 5\n")
    monkeypatch.setattr(compose_mod, "recipes_dir", lambda: tmp_path)
    cfg = compose_tool_config(SimToolConfig, ["recipe=slo-tight"])
    assert cfg.slo.ttft_ms == 250 and cfg.engine.seed == 5
    cfg = compose_tool_config(SimToolConfig, ["recipe=slo-tight", "slo.ttft_ms=9"])
    assert cfg.slo.ttft_ms == 9  # the command line still wins


def test_the_tools_root_composes_from_an_odd_install_path(tmp_path, monkeypatch):
    """The engine's root is found on Hydra's search path, given as an override: a folder name
    with '=', ',', a space or a quote (pip's cache has such names) must not break it."""
    conf = tmp_path / "pkg==1.0, it's" / "conf"
    shutil.copytree(REPO / "conf", conf)
    monkeypatch.setattr(compose_mod, "conf_dir", lambda: conf)
    cfg = compose_tool_config(SimToolConfig, ["hardware=h200", "scheduler.max_num_seqs=5"])
    assert cfg.hardware.name == "h200" and cfg.engine.scheduler.max_num_seqs == 5
