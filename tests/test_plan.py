"""``llmkit plan``: the search space (what the cores allow), the ranking (goodput, then cost,
then the search's order), the recipe it writes (``recipe=PATH`` gives back the chosen values),
the plan's keys' errors, and (slow) one candidate verified on a live tiny-model server."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from llmkit.config.errors import ConfigError
from llmkit.entrypoints import cli
from llmkit.tools.compose import compose_tool_config
from llmkit.tools.plan.rank import rank
from llmkit.tools.plan.recipe import agreement_line
from llmkit.tools.plan.runner import Prediction
from llmkit.tools.plan.space import Candidate, build_space
from llmkit.tools.schema import PlanConfig, PlanToolConfig

REPO = Path(__file__).resolve().parents[1]
# a tiny space on a modelled GPU: cheap, deterministic, no calibration, nothing to serve
SMALL = ["llama-2-7b", "hardware=h100-sxm", "plan.verify_top=0", "plan.max_num_seqs=[2,16]",
         "plan.max_num_batched_tokens=[64,512]", "plan.speculative=[none]",
         "plan.scheduler=[token_budget]", "bench.num_requests=24", "bench.rate=8",
         "bench.input_len=256", "bench.output_len=32",
         "slo.ttft_ms=200", "slo.tpot_ms=40"]


# --------------------------------------------------------------------------- the space

def test_parallel_sizes_are_limited_to_the_cores():
    plan = PlanConfig(max_num_seqs=[8], max_num_batched_tokens=[256], speculative=["none"],
                      scheduler=["token_budget"],
                      tensor_parallel_size=[1, 2, 4], data_parallel_size=[1, 2],
                      pipeline_parallel_size=[1, 2])
    space = build_space(plan, cores=2)
    sizes = {(c.tensor_parallel_size, c.pipeline_parallel_size, c.data_parallel_size)
             for c in space.candidates}
    assert sizes == {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert space.skipped == {"TP x PP x DP > 2 cores": 12 - 4}
    assert len(build_space(plan, cores=16).candidates) == 12
    with pytest.raises(ConfigError, match=r"^plan.tensor_parallel_size: .*at most 2"):
        build_space(PlanConfig(tensor_parallel_size=[4], speculative=["none"]), cores=2)


def test_speculation_off_takes_one_k_and_none_under_pipeline_parallel():
    plan = PlanConfig(max_num_seqs=[4], max_num_batched_tokens=[128], scheduler=["token_budget"],
                      speculative=["none", "ngram"], num_speculative_tokens=[2, 4],
                      pipeline_parallel_size=[1, 2])
    space = build_space(plan, cores=2)
    got = [(c.speculative, c.num_speculative_tokens, c.pipeline_parallel_size)
           for c in space.candidates]
    assert got == [("none", 0, 1), ("none", 0, 2), ("ngram", 2, 1), ("ngram", 4, 1)]
    assert space.skipped == {"speculation under pipeline parallelism": 2}
    assert set(space.varied) == {"speculative", "num_speculative_tokens",
                                 "pipeline_parallel_size"}


@pytest.mark.parametrize("override, key", [
    ("plan.bogus=1", "plan.bogus"), ("plan.verify_top=-1", "plan.verify_top"),
    ("plan.max_num_seqs=[0,8]", "plan.max_num_seqs"),
    ("plan.kv_cache_dtype=[fp4]", "plan.kv_cache_dtype"), ("plan.policy=[lifo]", "plan.policy"),
    ("plan.max_num_seqs=[]", "plan.max_num_seqs")])
def test_bad_plan_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}"):
        compose_tool_config(PlanToolConfig, [override])


def test_bad_group_names_in_the_space_name_the_key(capsys):
    with pytest.raises(ConfigError, match=r"^plan.scheduler: got 'fast'.*token_budget"):
        build_space(PlanConfig(scheduler=["fast"]), cores=2)
    with pytest.raises(ConfigError, match=r"^plan.speculative: got 'magic'.*ngram"):
        build_space(PlanConfig(speculative=["none", "magic"]), cores=2)
    assert cli.main(["plan", "plan.scheduler=[fast]"]) == 2
    assert "plan.scheduler: got 'fast'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the ranking

def _pred(seqs: int, goodput: float, tokens: float, error: str | None = None) -> Prediction:
    summary = None if error else {"goodput": goodput, "total_output_tokens": tokens,
                                  "duration_s": 1.0}
    return Prediction(Candidate(seqs, 64), summary=summary, error=error, cores=2)


def test_rank_is_goodput_then_tokens_per_core_second_then_search_order():
    preds = [_pred(1, 0.5, 100), _pred(2, 0.9, 50), _pred(3, 0.0, 0, error="x"),
             _pred(4, 0.9, 80), _pred(5, 0.5, 100), _pred(6, 0.9, 80)]
    assert [p.candidate.max_num_seqs for p in rank(preds)] == [4, 6, 2, 1, 5, 3]
    assert rank(preds)[0].tokens_per_core_s == 40.0  # 80 tokens / (1 s x 2 cores)
    assert [p.candidate.max_num_seqs for p in rank(list(reversed(preds)))] == [6, 4, 2, 5, 1, 3]


def test_agreement_line_says_whether_within_20_percent():
    assert "(+10%): within 20%" in agreement_line(1.1, 1.0)
    assert "(-30%): NOT within 20%" in agreement_line(0.7, 1.0)
    assert "NOT within 20%" in agreement_line(0.5, 0.0)


def test_plan_searches_ranks_and_writes_a_recipe_that_loads(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", *SMALL, f"plan.output_dir={out}"]) == 0
    io = capsys.readouterr()
    assert "[4/4] " in io.err and "plan: 4 candidates of llama-2-7b on h100-sxm" in io.err
    doc = json.loads((out / "plan.json").read_text())
    rows = doc["candidates"]
    keys = [(-r["predicted"]["goodput"], -r["tokens_per_core_s"]) for r in rows]
    assert keys == sorted(keys)  # goodput first, then cost
    assert len({r["predicted"]["goodput"] for r in rows}) > 1  # the knobs matter here
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "table.txt").read_text().splitlines()[0].split()[:3] == ["#", "seqs", "tokens"]
    # deterministic: the same plan again gives the same table
    assert cli.main(["plan", *SMALL, f"plan.output_dir={tmp_path / 'again'}"]) == 0
    capsys.readouterr()
    assert (tmp_path / "again" / "table.txt").read_text() == (out / "table.txt").read_text()
    # the recipe holds the chosen (best) config: llmkit config recipe=PATH gives it back
    chosen = rows[doc["chosen"] - 1]
    text = (out / "recipe.yaml").read_text()
    assert "# predicted: goodput" in text and "# measured: not verified" in text
    assert cli.main(["config", f"recipe={out / 'recipe.yaml'}"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["scheduler"]["max_num_seqs"] == chosen["max_num_seqs"]
    assert cfg["scheduler"]["max_num_batched_tokens"] == chosen["max_num_batched_tokens"]
    assert cfg["speculative"]["name"] == "none" and cfg["recipe"] == str(out / "recipe.yaml")


def test_plan_workload_file_replaces_the_workload(tmp_path, capsys):
    result = {"config": {"bench": {"num_requests": 6, "rate": "Infinity", "input_len": 40,
                                   "output_len": 8, "output_dir": "elsewhere"},
                         "slo": {"ttft_ms": 900, "tpot_ms": None, "e2el_ms": None}}}
    (tmp_path / "r.json").write_text(json.dumps(result))
    out = tmp_path / "plan"
    assert cli.main(["plan", *SMALL[:6], f"plan.trace={tmp_path / 'r.json'}",
                     "plan.max_num_seqs=[4]", f"plan.output_dir={out}"]) == 0
    err = capsys.readouterr().err
    assert "6 requests, random 40 tokens in / 8 out" in err and "TTFT <= 900 ms" in err
    assert cli.main(["plan", *SMALL, f"plan.trace={tmp_path / 'none.json'}"]) == 2
    assert "plan.trace: got" in capsys.readouterr().err


def test_plan_short_workload_keys_and_recipe_output(tmp_path, capsys):
    """API.md's form: plan.rate / num_requests / input_len / output_len replace bench.*, and
    plan.output says where the recipe goes."""
    recipe = tmp_path / "mine" / "served.yaml"
    assert cli.main(["plan", *SMALL[:6], "plan.rate=3", "plan.num_requests=7",
                     "plan.input_len=48", "plan.output_len=9", "plan.max_num_seqs=[4]",
                     f"plan.output={recipe}", f"plan.output_dir={tmp_path / 'plan'}"]) == 0
    err = capsys.readouterr().err
    assert "7 requests, random 48 tokens in / 9 out" in err and "at 3.0 req/s" in err
    assert "# predicted: goodput" in recipe.read_text()
    assert not (tmp_path / "plan" / "recipe.yaml").exists()
    assert cli.main(["plan", *SMALL, "plan.rate=0"]) == 2
    assert "plan.rate" in capsys.readouterr().err


def test_plan_searches_the_slo_scheduler_and_its_recipe_serves_to_the_slo(tmp_path, capsys):
    """scheduler=slo is one more value of the space (the simulator runs the real scheduler with
    its own cost model); a recipe choosing it carries the slo section it serves to."""
    out = tmp_path / "plan"
    assert cli.main(["plan", *SMALL, "plan.scheduler=[token_budget,slo]",
                     "plan.max_num_seqs=[16]", f"plan.output_dir={out}"]) == 0
    io = capsys.readouterr()
    assert "plan: 4 candidates" in io.err
    rows = json.loads((out / "plan.json").read_text())["candidates"]
    slo_rows = [r for r in rows if r["scheduler"] == "slo"]
    assert len(slo_rows) == 2 and not any(r["error"] for r in rows)
    best_slo = min(slo_rows, key=lambda r: r["rank"])
    from llmkit.tools.plan.recipe import recipe_text
    cand = Candidate(16, best_slo["max_num_batched_tokens"], "slo")
    text = recipe_text(cand, objectives={"ttft_ms": 200.0, "tpot_ms": 40.0, "e2el_ms": None})
    recipe = tmp_path / "slo.yaml"
    recipe.write_text(text)
    assert cli.main(["config", f"recipe={recipe}"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["scheduler"]["name"] == "slo" and cfg["slo"]["tpot_ms"] == 40.0


def test_plan_leaves_out_the_slo_scheduler_without_an_objective(tmp_path, capsys):
    no_slo = [o for o in SMALL if not o.startswith("slo.")]
    assert cli.main(["plan", *no_slo, "plan.scheduler=[token_budget,slo]",
                     f"plan.output_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert "plan: 4 candidates" in err
    assert "left out 4: scheduler=slo without slo.ttft_ms / slo.tpot_ms" in err


# --------------------------------------------------------------------------- verification

@pytest.mark.slow
def test_plan_verifies_the_best_on_a_live_server(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    profile = tmp_path / "cpu-local.yaml"  # the shipped placeholder: no calibration here
    shutil.copy(REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml", profile)
    out = tmp_path / "plan"
    rc = cli.main(["plan", str(model), "kv_cache.num_blocks=256",
                   f"sim.calibrate_output={profile}", "plan.max_profile_error=null",
                   "plan.verify_top=1", "plan.max_num_seqs=[2,4]",
                   "plan.max_num_batched_tokens=[64]", "plan.speculative=[none]",
                   "bench.num_requests=4", "bench.rate=inf", "bench.input_len=16",
                   "bench.output_len=6", "slo.ttft_ms=60000", "bench.warmup_requests=0",
                   f"plan.output_dir={out}"])
    io = capsys.readouterr()
    assert rc == 0, io.err
    assert "calibrated profile" in io.err and "verify candidate-1" in io.err
    assert "predicted vs measured goodput:" in io.out
    text = (out / "recipe.yaml").read_text()
    assert "# measured: goodput" in text and "# predicted: goodput" in text
    assert "# predicted vs measured goodput:" in text
    doc = json.loads((out / "plan.json").read_text())
    assert doc["candidates"][0]["measured"]["completed"] == 4
    assert (out / "verify" / "candidate-1.json").is_file()
    # the server recorded its steps: what a miss is refitted from (plan.recalibrate_error)
    assert (out / "verify" / "candidate-1-trace.json").is_file()


# --------------------------------------------------------------------------- calibration

# (the check of a cached profile is tested in tests/test_plan_profile_check.py)
TINY = ["plan.verify_top=0", "plan.max_num_seqs=[2]", "plan.max_num_batched_tokens=[64]",
        "plan.speculative=[none]", "bench.num_requests=3", "bench.input_len=16",
        "bench.output_len=4", "kv_cache.num_blocks=64", "plan.max_profile_error=null"]


def test_an_uncalibrated_machine_is_calibrated_first_in_a_child(tiny_model_dir, tmp_path,
                                                                 monkeypatch, capsys):
    import subprocess

    model = tiny_model_dir("llama")
    profile = tmp_path / "cpu-local.yaml"
    calls = []

    class FakeCalibrate:
        """`llmkit sim calibrate MODEL ...` as a child: writes the profile it is told to."""

        def __init__(self, cmd, **kw):
            calls.append(cmd)
            out = next(a for a in cmd if a.startswith("sim.calibrate_output="))
            shutil.copy(REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml",
                        out.partition("=")[2])
            self.stdout = iter(["fit over 9 step shapes\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeCalibrate)
    out = tmp_path / "plan"
    argv = ["plan", str(model), f"sim.calibrate_output={profile}", *TINY,
            f"plan.output_dir={out}"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len(calls) == 1 and calls[0][3:7] == ["sim", "calibrate", str(model),
                                                  f"sim.calibrate_output={profile}"]
    assert "kv_cache.num_blocks=64" in calls[0]  # the engine keys go along
    assert "running `llmkit sim calibrate engine` first" in err and "  fit over 9" in err
    # cached: the next plan uses it
    assert cli.main(argv) == 0
    assert len(calls) == 1 and f"calibrated profile {profile}" in capsys.readouterr().err
    # plan.calibrate=false plans on the placeholder and says so
    argv = ["plan", str(model), f"sim.calibrate_output={tmp_path / 'none.yaml'}", *TINY,
            "plan.calibrate=false", f"plan.output_dir={out}"]
    assert cli.main(argv) == 0
    assert len(calls) == 1 and "plan.calibrate=false" in capsys.readouterr().err


def test_a_served_trace_calibrates_again_with_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """plan sim.calibrate_trace=TRACE: the profile exists, but plan calibrates again in a child
    with the served trace (the front end's share of the cores), which it passes on."""
    import subprocess

    model = tiny_model_dir("llama")
    profile = tmp_path / "cpu-local.yaml"
    shutil.copy(REPO / "conf" / "tools" / "hardware" / "cpu-local.yaml", profile)
    trace = tmp_path / "served.trace.json"
    trace.write_text("[]")
    calls = []

    class FakeCalibrate:
        def __init__(self, cmd, **kw):
            calls.append(cmd)
            self.stdout = iter([])

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeCalibrate)
    argv = ["plan", str(model), f"sim.calibrate_output={profile}", f"sim.calibrate_trace={trace}",
            *TINY, f"plan.output_dir={tmp_path / 'plan'}"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert len(calls) == 1 and f"sim.calibrate_trace={trace.resolve()}" in calls[0]
    assert f"with the served trace {trace}" in err
    assert cli.main([*argv, "plan.calibrate=false"]) == 0
    assert len(calls) == 1 and "is not used" in capsys.readouterr().err


def test_plan_searches_the_slo_schedulers_keys_and_its_recipe_carries_them(tmp_path, capsys):
    """plan.slo_admission / plan.slo_tpot multiply the scheduler=slo candidates only (the
    token-budget scheduler takes their defaults); the recipe of an slo candidate sets both."""
    out = tmp_path / "plan"
    assert cli.main(["plan", *SMALL, "plan.scheduler=[token_budget,slo]",
                     "plan.max_num_seqs=[16]", "plan.max_num_batched_tokens=[512]",
                     "plan.slo_admission=[off,reject]", "plan.slo_tpot=[step,mean]",
                     f"plan.output_dir={out}"]) == 0
    io = capsys.readouterr()
    assert "plan: 5 candidates" in io.err
    rows = json.loads((out / "plan.json").read_text())["candidates"]
    assert sorted((r["scheduler"], r["slo_admission"], r["slo_tpot"]) for r in rows) == [
        ("slo", "off", "mean"), ("slo", "off", "step"), ("slo", "reject", "mean"),
        ("slo", "reject", "step"), ("token_budget", "off", "step")]
    assert not any(r["error"] for r in rows)
    from llmkit.tools.plan.recipe import recipe_text
    cand = Candidate(16, 512, "slo", slo_admission="reject", slo_tpot="mean")
    recipe = tmp_path / "slo.yaml"
    recipe.write_text(recipe_text(cand, objectives={"ttft_ms": 200.0, "tpot_ms": 40.0,
                                                    "e2el_ms": None}))
    assert cli.main(["config", f"recipe={recipe}"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["scheduler"]["slo_admission"] == "reject" and cfg["scheduler"]["slo_tpot"] == "mean"
