"""Features join the scheduler through named hooks, registered only while they are on: with
every feature off no hook is walked; each feature adds only the hooks it overrides."""
from __future__ import annotations

from llmkit.config.schema import SchedulerConfig
from llmkit.kv_cache import KVCacheManager
from llmkit.outputs import ModelRunnerOutput
from llmkit.request import Request
from llmkit.sampling import SamplingParams
from llmkit.scheduler.hooks import _HOOKS, FeatureHooks, SchedulerFeature
from llmkit.scheduler.token_budget import TokenBudgetScheduler


def make(**kw):
    kv = KVCacheManager(64, 4, enable_prefix_caching=True, max_model_len=256)
    return TokenBudgetScheduler(SchedulerConfig(), kv, max_model_len=256, **kw)


def walked(sched):
    return {name: [h.__self__.name for h in getattr(sched.hooks, name)] for name in _HOOKS
            if getattr(sched.hooks, name)}


def test_features_off_register_no_hook():
    assert walked(make()) == {}


def test_each_feature_registers_only_its_hooks():
    sched = make(max_loras=2)
    assert set(walked(sched)) == {"limit_running", "pass_over", "admitted", "scheduled",
                                  "finished", "fill_stats", "begin_step"}
    sched = make(drop_last_cached_block=True)
    assert walked(sched) == {"trim_prefix_hit": ["eagle"]}


def test_drafts_turn_on_with_the_first_drafts():
    sched = make()
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=4)))
    sched.schedule()
    sched.update_draft_token_ids({"a": []})
    assert walked(sched) == {}
    sched.update_draft_token_ids({"a": [1, 2]})
    assert "drafts" in walked(sched)["extra_tokens"]
    assert sched.running[0].spec_token_ids == [1, 2]


def test_hooks_run_in_feature_order_whatever_the_order_turned_on():
    class Probe(SchedulerFeature):
        def __init__(self, name):
            self.name = name

        def scheduled(self, req, n):
            pass

    hooks = FeatureHooks({"connector": Probe("connector"), "lora": Probe("lora"),
                          "drafts": Probe("drafts")})
    assert [h.__self__.name for h in hooks.scheduled] == ["lora", "drafts", "connector"]
    assert hooks.end_step == ()


def test_lora_slots_running_request_without_a_slot_sits_the_step_out():
    # Three adapters running (admitted while three slots were allowed), then two slots: the
    # running phase schedules the first two adapters' requests and skips the third's.
    sched = make(max_loras=3)
    for i, lora in enumerate((1, 2, 3, 1)):
        sched.add_request(Request(f"r{i}", list(range(8)), SamplingParams(max_tokens=8),
                                  lora_id=lora))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r2", "r3"}
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [[5] for _ in ids]))
    sched._features["lora"].max_loras = 2
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r3"}
