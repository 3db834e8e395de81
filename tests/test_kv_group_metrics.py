"""Per KV-cache group usage: the scheduler's stats snapshot, ``/metrics``'s
``llmkit:kv_cache_group_usage_perc{group}``, the engine page's summary and the data-parallel sum,
on the real engine core (executor=sim: no weights) and on a stand-in manager with two groups."""
from __future__ import annotations

from llmkit.engine.dp.stats import combine_scheduler_stats
from llmkit.engine.observe.step_summary import StepSummaryPublisher
from llmkit.entrypoints.openai.metrics import ServerMetrics
from llmkit.request import Request
from llmkit.sampling.params import SamplingParams
from llmkit.scheduler.base import SchedulerStats
from llmkit.scheduler.token_budget import MIN_INTERVAL_S, KVGroupUsage
from llmkit.tools.sim.replay import build_sim_engine

from helpers.sim_config import cfg_of


def _gauge_lines(stats: SchedulerStats) -> dict[str, float]:
    m = ServerMetrics("m")
    m.on_scheduler_stats(stats)
    out = {}
    for line in m.render().decode().splitlines():
        if line.startswith("llmkit:kv_cache_group_usage_perc{"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_one_group_model_reports_its_usage_per_group():
    core, _, _ = build_sim_engine(cfg_of("kv_cache.num_blocks=40", "kv_cache.block_size=16"))
    for i in range(3):
        core.add_request(Request(f"r{i}", list(range(10, 110)),
                                 SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()
    stats = core.stats()
    used = core.kv_cache_manager.usage
    assert used > 0
    assert stats.kv_usage == used and stats.kv_usage_by_group == {"0:full": used}
    assert _gauge_lines(stats) == {
        'llmkit:kv_cache_group_usage_perc{group="0:full",model_name="m"}': used}
    sent = []
    summary = StepSummaryPublisher(core, sent.append, 100.0).summary(None)
    assert summary.kv_usage_by_group == {"0:full": used}
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().kv_usage_by_group == {"0:full": 0.0}


class TwoGroups:
    """A manager with a full-attention and a sliding-window group."""

    num_groups = 2
    usage = 0.5

    def __init__(self) -> None:
        self.calls = 0
        self.value = {"0:full": 0.4, "1:sliding_window(8)": 0.1}

    def kv_usage_by_group(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.value)


def test_several_groups_each_reported_and_recomputed_a_few_times_a_second():
    kv, now = TwoGroups(), [0.0]
    usage = KVGroupUsage(kv, clock=lambda: now[0])
    assert usage() == {"0:full": 0.4, "1:sliding_window(8)": 0.1} and kv.calls == 1
    kv.value = {"0:full": 0.2, "1:sliding_window(8)": 0.05}
    now[0] += MIN_INTERVAL_S / 2
    assert usage()["0:full"] == 0.4 and kv.calls == 1  # walked at most every MIN_INTERVAL_S
    now[0] += MIN_INTERVAL_S
    assert usage() == kv.value and kv.calls == 2
    stats = SchedulerStats(2, 0, 0.5, 0, 0, 0, kv_usage_by_group=usage())
    assert _gauge_lines(stats) == {
        'llmkit:kv_cache_group_usage_perc{group="0:full",model_name="m"}': 0.2,
        'llmkit:kv_cache_group_usage_perc{group="1:sliding_window(8)",model_name="m"}': 0.05}


def test_an_emptied_pool_reports_zero_at_once():
    """The step that frees the last blocks, often the last before the engine idles, reports
    them free even within MIN_INTERVAL_S of the last walk (else /metrics and the engine page
    would show blocks held until the next request)."""
    kv, now = TwoGroups(), [0.0]
    usage = KVGroupUsage(kv, clock=lambda: now[0])
    assert usage()["0:full"] == 0.4
    kv.usage, kv.value = 0.0, {"0:full": 0.0, "1:sliding_window(8)": 0.0}
    now[0] += MIN_INTERVAL_S / 10
    assert usage() == kv.value and kv.calls == 2


def test_data_parallel_cores_weigh_each_group_by_their_blocks():
    a = SchedulerStats(1, 0, 0.5, 0, 0, 0, kv_usage_by_group={"0:full": 0.5, "1:mla": 0.25})
    b = SchedulerStats(1, 0, 0.1, 0, 0, 0, kv_usage_by_group={"0:full": 0.1})
    total = combine_scheduler_stats([a, b], [100, 300])
    assert total.kv_usage_by_group == {"0:full": (50 + 30) / 400, "1:mla": 25 / 400}


def test_hybrid_model_reports_one_series_per_group(tmp_path):
    """Bamba (3 Mamba-2 layers, 1 attention layer) on the real hybrid manager (executor=sim):
    four groups, each its share of the pool."""
    import json

    cfg = dict(model_type="bamba", architectures=["BambaForCausalLM"], vocab_size=1000,
               hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=4, attn_layer_indices=[1],
               mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
               max_position_embeddings=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    core, ex, _ = build_sim_engine(cfg_of(f"sim.model={tmp_path / 'config.json'}",
                                          "hardware=h200", "kv_cache.num_blocks=41"))
    core.add_request(Request("a", list(range(10, 310)),
                             SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()
    stats = core.stats()
    # 300 tokens in blocks of the raised size, one state block per Mamba layer; of 40 blocks
    # (the hybrid manager keeps one null block)
    attn_blocks = -(-300 // ex.block_size)
    assert stats.kv_usage_by_group == {"0:recurrent": 1 / 40, "1:recurrent": 1 / 40,
                                       "2:recurrent": 1 / 40, "3:full": attn_blocks / 40}
    lines = _gauge_lines(stats)
    assert len(lines) == 4
    assert lines['llmkit:kv_cache_group_usage_perc{group="3:full",model_name="m"}'] == \
        attn_blocks / 40
