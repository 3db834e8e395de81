"""The ``llmkit`` command line (the console script ``llmkit = llmkit.entrypoints.cli:main``).

    llmkit <command> [MODEL] [--prompt TEXT] [key=value ...] [-m]

argv is split by hand before Hydra sees it: the command word (and ``bench``'s sub-command), the
optional positional MODEL (a preset from ``conf/model/`` or a path), ``--prompt TEXT`` (taken
verbatim), ``-m``; every other word is a Hydra override. Configuration errors print one line
``llmkit: error: <key>: got <value>; allowed: <...>`` and exit with 2 (a traceback only with
``LLMKIT_DEBUG=1``).
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmkit.config.errors import ConfigError

COMMANDS = ("generate", "chat", "serve", "config", "bench", "sim", "plan", "eval",
            "proxy")
BENCH_SUBCOMMANDS = ("serve", "throughput", "latency", "plot")
SIM_SUBCOMMANDS = ("calibrate",)
EVAL_SUBCOMMANDS = ("ppl",)
EXIT_USAGE = 2
# The commands that compute in this process or in processes it spawns: their OpenMP wait
# policy is set before anything imports torch. config and proxy compute nothing.
COMPUTE_COMMANDS = ("generate", "chat", "serve", "bench", "sim", "plan", "eval")

USAGE = """\
usage: llmkit <command> [MODEL] [--prompt TEXT] [key=value ...] [-m]

commands:
  generate   generate a completion for --prompt TEXT
  chat       interactive chat in the terminal
  serve      OpenAI-compatible HTTP server
  config     print the composed, validated config
  bench      benchmarks: bench serve|throughput|latency|plot
  sim        simulate bench serve on modelled hardware: sim [MODEL] hardware=NAME;
             sim calibrate measures this CPU (hardware=cpu-local)
  plan       search configs in the simulator for a workload and SLO, verify the best with
             bench serve, write a recipe (recipe=PATH loads it)
  eval       eval ppl [MODEL] eval.text_file=PATH: perplexity over a text file (JSON)
  proxy      disaggregated serving's front: proxy proxy.prefill_urls=[..] proxy.decode_urls=[..]

MODEL        a preset from conf/model/ (default: smollm2-135m-instruct) or a path to an HF
             model folder or a .gguf file
--prompt T   the prompt for generate (taken verbatim: commas, quotes and '=' are fine)
--image P    an image file for generate, one per <image> in the prompt (repeatable)
key=value    Hydra overrides: scheduler.max_num_seqs=64 attention=triton recipe=cpu-chat
             +key=value adds a key, ~key deletes one
-m           multirun: sweep over comma-separated values (key=a,b)

llmkit <command> --help lists that command's config groups, its own keys and examples.

examples:
  llmkit config recipe=cpu-default scheduler.max_num_seqs=32
  llmkit generate --prompt "Hello, world" sampling.max_tokens=32
  llmkit chat /path/to/model.gguf recipe=cpu-chat
  llmkit serve ./my-model recipe=cpu-chat server.port=8000
  llmkit bench serve ./my-model bench.rate=4 bench.num_requests=200 slo.ttft_ms=500
  llmkit bench serve ./my-model -m bench.rate=1,2,4,8 bench.output_dir=sweep
  llmkit bench plot sweep
  llmkit bench throughput ./my-model baseline=hf
  llmkit sim llama-2-7b hardware=h100-sxm bench.rate=8 bench.num_requests=2000 slo.ttft_ms=500
  llmkit plan bench.rate=1 bench.input_len=256 bench.output_len=128 slo.ttft_ms=1500 slo.tpot_ms=80
  llmkit eval ppl eval.text_file=book.txt eval.window=512 eval.mode=llamacpp
  llmkit proxy proxy.prefill_urls=[http://127.0.0.1:8001] proxy.decode_urls=[http://127.0.0.1:8002]
"""


class UsageError(Exception):
    """A malformed command line (exit code 2)."""


@dataclass
class CliArgs:
    command: str
    subcommand: str | None = None
    model: str | None = None
    prompt: str | None = None
    # generate: image files for the prompt's <image> placeholders (multimodal models)
    images: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    multirun: bool = False
    # `llmkit <command> --help`: print that command's help (command_help.py), run nothing
    help: bool = False


def _is_override(word: str) -> bool:
    if "=" in word:
        # a model path may hold '=' (pip's cache names folders `pkg==1.0`)
        return not Path(word).exists()
    # Hydra's delete syntax `~key` (a path like `~/models/x` stays a path)
    return word.startswith("~") and "/" not in word and len(word) > 1


def parse_args(argv: Sequence[str]) -> CliArgs | None:
    """Split argv; ``None`` means: print the general usage (``llmkit --help``); a command's
    ``--help`` gives its ``CliArgs`` with ``help`` set."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        return None
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise UsageError(f"unknown command {command!r}; allowed: {', '.join(COMMANDS)}")
    args = CliArgs(command=command)
    if command == "bench" and rest and rest[0] in BENCH_SUBCOMMANDS:
        args.subcommand, rest = rest[0], rest[1:]
    elif command == "sim" and rest and rest[0] in SIM_SUBCOMMANDS:
        args.subcommand, rest = rest[0], rest[1:]
    elif command == "eval":
        if rest and rest[0] in ("-h", "--help"):
            return CliArgs(command=command, help=True)
        if not rest or rest[0] not in EVAL_SUBCOMMANDS:
            raise UsageError(f"eval needs a sub-command: {', '.join(EVAL_SUBCOMMANDS)}")
        args.subcommand, rest = rest[0], rest[1:]
    i = 0
    while i < len(rest):
        word = rest[i]
        i += 1
        if word in ("-h", "--help"):
            args.help = True
            return args
        if word == "--prompt":
            if i >= len(rest):
                raise UsageError("--prompt needs a value: --prompt TEXT")
            args.prompt = rest[i]
            i += 1
        elif word.startswith("--prompt="):
            args.prompt = word[len("--prompt="):]
        elif word == "--image":
            if i >= len(rest):
                raise UsageError("--image needs a file: --image PATH")
            args.images.append(rest[i])
            i += 1
        elif word.startswith("--image="):
            args.images.append(word[len("--image="):])
        elif word in ("-m", "--multirun"):
            args.multirun = True
        elif word.startswith("-") and len(word) > 1 and not _is_override(word):
            raise UsageError(f"unknown option {word!r}; options: --prompt TEXT, --image PATH, "
                             "-m, --help")
        elif _is_override(word):
            args.overrides.append(word)
        elif args.model is None:
            args.model = word
        else:
            raise UsageError(f"unexpected argument {word!r} (MODEL is already {args.model!r}; "
                             "overrides are key=value)")
    if args.prompt is not None and command != "generate":
        raise UsageError(f"--prompt only applies to generate, not {command}")
    if args.images and command != "generate":
        raise UsageError(f"--image only applies to generate, not {command}")
    return args


def load_config(args: CliArgs, overrides: Sequence[str] | None = None, *,
                tool: type | None = None):
    """Compose and validate the config for ``args`` (MODEL + overrides), then check that every
    component name is registered (``llmkit.engine.loop.components.validate_components``). Without
    ``tool``: the engine's root (``conf/config.yaml``); with one (``BenchToolConfig``,
    ``SimToolConfig``, ...): the tools' root (``conf/tools/``), as that tool's config with the
    engine's inside."""
    from llmkit.config.compose import build_config
    from llmkit.engine.loop.components import validate_components
    from llmkit.startup import startup_step

    overrides = args.overrides if overrides is None else overrides
    with startup_step("reading the configuration"):
        if tool is not None:
            from llmkit.tools.compose import build_tool_config

            cfg = build_tool_config(tool, args.model, overrides=overrides)
            validate_components(cfg.engine)
            return cfg
        cfg = build_config(args.model, overrides=overrides)
        validate_components(cfg)
    return cfg


def _tool_sections_named(overrides: Sequence[str]) -> list[str]:
    """The tools' sections (bench, hardware, sim, plan, eval, proxy) that ``overrides`` set."""
    from llmkit.tools.schema import TOOL_SECTIONS

    named = {o.lstrip("+~").partition("=")[0].partition(".")[0].partition("@")[0]
             for o in overrides}
    return [s for s in TOOL_SECTIONS if s in named]


def _cmd_config(args: CliArgs) -> int:
    """The engine's config; with the tools' sections that the command line sets (``llmkit
    config hardware=h100-sxm`` shows the hardware profile too). It composes the tools' root,
    which holds the engine's, so every key any command takes is shown and checked here."""
    from llmkit.config.compose import config_to_yaml, expand_overrides
    from llmkit.config.schema import EngineConfig
    from llmkit.tools.compose import TOOLS_ROOT
    from llmkit.tools.schema import AllToolsConfig

    runs = expand_overrides(args.overrides, TOOLS_ROOT) if args.multirun else [args.overrides]
    texts = []
    for overrides in runs:
        sections = _tool_sections_named(overrides)
        tool_cfg = load_config(args, overrides, tool=AllToolsConfig)
        if sections:
            data = tool_cfg.flat_dump(by_alias=True, mode="json")
            text = config_to_yaml({k: v for k, v in data.items()
                                   if k in EngineConfig.model_fields or k in sections})
        else:
            # The hardware `llmkit sim` models (an A100 by default) is no part of an engine that
            # runs here: shown only when asked for, named in a closing hint.
            text = (config_to_yaml(tool_cfg.engine) + _cpu_dispatch_comment(tool_cfg.engine)
                    + _kv_groups_comment(tool_cfg.engine))
            if tool_cfg.hardware is not None:
                text += (f"# hardware ({tool_cfg.hardware.name}): what `llmkit sim` models; "
                         "`llmkit config hardware=NAME` shows it\n")
        if args.multirun:
            text = f"# overrides: {' '.join(overrides) or '(none)'}\n{text}"
        texts.append(text)
    sys.stdout.write("---\n".join(texts))
    return 0


def _cpu_dispatch_comment(config) -> str:
    """The CPU dispatch table the engine's platform resolves (``platform.dispatch`` over the
    calibrated fields over the tier's defaults), each field with its source, as closing comment
    lines: which kernel runs at which row count is part of what the config means on this
    machine. Nothing for a CUDA or plugin platform."""
    platform = config.platform
    if platform.name not in ("auto", "cpu") or platform.target:
        return ""
    import textwrap

    from llmkit.config.cpu_dispatch import (describe_dispatch, describe_graph_rows,
                                            dispatch_sources, resolve_dispatch)
    from llmkit.config.cpu_isa import resolve_tier
    from llmkit.kernels.cpu_calibration import cached_fields

    tier = resolve_tier(platform.isa)
    calibrated, note = cached_fields(tier, platform)
    table = resolve_dispatch(tier, platform.dispatch, calibrated)
    sources = dispatch_sources(platform.dispatch, calibrated)
    head = (f"# CPU dispatch (tier {tier or 'none: no AVX2'}; platform.dispatch.KEY=N "
            f"overrides):\n#   ({note})\n")
    lines = []
    for group in describe_dispatch(table, sources).split(" | "):
        lines.append(textwrap.fill(group, 96, initial_indent="#   ",
                                   subsequent_indent="#     "))
    graphs = describe_graph_rows(table, tier, config.scheduler.max_num_seqs)
    if config.compilation.mode != "graphs":
        graphs += f" (compilation.mode={config.compilation.mode}: no graphs)"
    lines.append(textwrap.fill(graphs, 96, initial_indent="#   ", subsequent_indent="#     "))
    return head + "\n".join(lines) + "\n"


def _kv_groups_comment(config) -> str:
    """The model's KV-cache groups (its layers' specs read from its config, no weights), each
    with its layers and bytes per token and per block on one tensor-parallel rank, as closing
    comment lines; a note instead when the model's config cannot be read without fetching."""
    from llmkit.models.kv_specs import describe_kv_groups, kv_cache_specs_from_hf_config

    model = config.model
    if model.path is None:
        from llmkit.models.default_model import cached_package_file
        if not cached_package_file(model.package, model.package_file).exists():
            return "# KV-cache groups: the default model is not fetched yet\n"
    try:
        from llmkit.models.loader import resolve_model_source
        from llmkit.platforms import resolve_platform
        from llmkit.worker.model_setup import resolve_dtype, resolve_kv_cache_dtype

        hf = resolve_model_source(model).hf_config
        specs = kv_cache_specs_from_hf_config(hf, config.parallel.tensor_parallel_size,
                                              model.mla)
        dtype = resolve_kv_cache_dtype(config.kv_cache.cache_dtype,
                                       resolve_dtype(model.dtype, resolve_platform(
                                           config.platform)))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        return f"# KV-cache groups: cannot read the model's config ({type(e).__name__}: {e})\n"
    block = config.kv_cache.block_size
    head = (f"# KV-cache groups ({len(specs)} layers, {str(dtype).removeprefix('torch.')}, "
            f"block_size {block}, per tensor-parallel rank):\n")
    return head + "".join(f"#   {line}\n" for line in describe_kv_groups(specs, dtype, block))


def _set_openmp_env(args: CliArgs) -> None:
    """The OpenMP wait policy of a command that computes (``llmkit.config.openmp_env``): in
    the environment before torch loads, i.e. before the config is validated (which imports
    the components), and before this process spawns any other."""
    from llmkit.config.openmp_env import apply_engine_openmp_env

    platform = "auto"
    for o in args.overrides:
        key, _, value = o.partition("=")
        if key in ("platform", "platform.name"):
            platform = value
    apply_engine_openmp_env(platform)


def _show_progress() -> None:
    """The terminal commands print their slow start-up steps on stderr (llmkit.startup)."""
    from llmkit.startup import show_startup_progress

    show_startup_progress()


def _offline(name: str):
    # Looked up at call time so that tests can put a fake offline module in its place.
    return getattr(importlib.import_module("llmkit.entrypoints.offline"), name)


def _no_multirun(args: CliArgs) -> None:
    if args.multirun:
        raise UsageError(f"-m (multirun) is not supported by {args.command}; use it with "
                         "config or bench")


def _cmd_generate(args: CliArgs) -> int:
    if args.prompt is None:
        raise UsageError("generate needs --prompt TEXT")
    _no_multirun(args)
    _show_progress()
    for path in args.images:
        if not os.path.isfile(path):
            raise UsageError(f"--image {path!r}: no such file")
    if not any(o.lstrip("+~").startswith("compilation.compile_missing") for o in args.overrides):
        # one-shot: it ends long before step graphs would compile (saved ones still load)
        args.overrides.append("compilation.compile_missing=false")
    cfg = load_config(args)
    run = _offline("run_generate")
    return int((run(cfg, args.prompt, args.images) if args.images else run(cfg, args.prompt))
               or 0)


def _cmd_chat(args: CliArgs) -> int:
    _no_multirun(args)
    _show_progress()
    cfg = load_config(args)
    return int(_offline("run_chat")(cfg) or 0)


def _cmd_serve(args: CliArgs) -> int:
    _no_multirun(args)
    cfg = load_config(args)
    from llmkit.engine.process.client import EngineStartupError
    from llmkit.entrypoints.serve import run_server

    try:
        return int(run_server(cfg) or 0)
    except EngineStartupError as e:
        return _report_error(e, 1)


def _cmd_bench(args: CliArgs) -> int:
    from llmkit.tools.bench.cli import BenchError, run_bench

    try:
        return run_bench(args, load_config)
    except BenchError as e:
        return _report_error(e, e.code)


def _cmd_sim(args: CliArgs) -> int:
    from llmkit.tools.sim.cli import SimError, run_sim_command

    try:
        return run_sim_command(args, load_config)
    except SimError as e:
        return _report_error(e, e.code)


def _cmd_plan(args: CliArgs) -> int:
    from llmkit.tools.plan.cli import PlanError, run_plan_command

    try:
        return run_plan_command(args, load_config)
    except PlanError as e:
        return _report_error(e, e.code)


def _cmd_eval(args: CliArgs) -> int:
    _no_multirun(args)
    from llmkit.tools.schema import EvalToolConfig

    cfg = load_config(args, tool=EvalToolConfig)
    from llmkit.tools.eval.perplexity import run_eval_ppl

    return int(run_eval_ppl(cfg) or 0)


def _cmd_proxy(args: CliArgs) -> int:
    _no_multirun(args)
    from llmkit.tools.schema import ProxyToolConfig

    cfg = load_config(args, tool=ProxyToolConfig)
    from llmkit.tools.proxy import run_proxy

    return int(run_proxy(cfg.proxy) or 0)


HANDLERS = {
    "config": _cmd_config,
    "generate": _cmd_generate,
    "chat": _cmd_chat,
    "serve": _cmd_serve,
    "bench": _cmd_bench,
    "sim": _cmd_sim,
    "plan": _cmd_plan,
    "eval": _cmd_eval,
    "proxy": _cmd_proxy,
}


def _config_failure(e: BaseException) -> ConfigError | None:
    """A configuration failure (pydantic, Hydra, OmegaConf) as a ConfigError, else None."""
    if isinstance(e, ConfigError):
        return e
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        from llmkit.config.compose import validation_error_to_config_error
        return validation_error_to_config_error(e)
    if isinstance(e, (HydraException, OmegaConfBaseException)):
        from llmkit.config.compose import _hydra_error
        return _hydra_error(e, ())
    return None


def _report_error(err: object, code: int) -> int:
    """One line ``llmkit: error: <err>`` on stderr (after the traceback of the exception being
    handled, with ``LLMKIT_DEBUG=1``); returns the exit code ``code``."""
    if os.environ.get("LLMKIT_DEBUG") == "1":
        traceback.print_exc()
    print(f"llmkit: error: {err}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        if args is None:
            (sys.stdout if argv else sys.stderr).write(USAGE)
            return 0 if argv else EXIT_USAGE
        if args.help:
            from llmkit.entrypoints.command_help import command_help

            sys.stdout.write(command_help(args.command))
            return 0
        if args.command in COMPUTE_COMMANDS:
            _set_openmp_env(args)
        return HANDLERS[args.command](args)
    except UsageError as e:
        return _report_error(e, EXIT_USAGE)
    except Exception as e:  # noqa: BLE001 - configuration failures become one line
        err = _config_failure(e)
        if err is None:
            raise
        return _report_error(err, EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
