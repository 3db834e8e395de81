"""A served model with several KV-cache groups (a tiny Bamba: Mamba-2 state groups beside an
attention group) shows each group's share of the pool on the engine page, in a real headless
browser, with the figures of ``/v1/engine/stats`` and ``/metrics`` (issue 33: per-group KV
usage on /metrics and the engine page)."""
from __future__ import annotations

import re
import threading

import httpx
import pytest

from helpers.processes import wait_for
from helpers.server_process import SERVER_THREADS, ServerProcess
from helpers.tiny_bamba import build_bamba_dir
from helpers.web_browser import ARTIFACTS, open_page, record_first, recorded


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    model_dir = build_bamba_dir(tmp_path_factory.mktemp("tiny-bamba"), tiny_tokenizer)
    with ServerProcess(model_dir, "kv_cache.num_blocks=64", "server.engine_events_per_s=20",
                       SERVER_THREADS, log_path=tmp_path_factory.mktemp("server") /
                       "server.log") as srv:
        yield srv


def _group_shares(text: str) -> dict[str, float]:
    """The KV card's groups line, ``'0:recurrent 1.6% · 2:full 4.8%'``, as a dict."""
    return {g: float(p) / 100 for g, p in re.findall(r"(\d+:\S+) ([\d.]+)%", text)}


def _checked_stats(server) -> dict:
    """The engine's state now, after the KV integrity check of every group."""
    resp = httpx.get(server.url("/v1/engine/stats"), params={"check_kv": "true"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["latest"]


def test_engine_page_shows_each_groups_share_while_a_request_runs(browser, server):
    groups = _checked_stats(server)["kv_usage_by_group"]
    kinds = {g.split(":", 1)[1] for g in groups}
    assert len(groups) > 1 and kinds == {"recurrent", "full"}, groups
    page, problems = open_page(browser, server, "/engine")
    page.wait_for_selector("#status:text-is('live')")

    model = httpx.get(server.url("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 900,
            "temperature": 0.0, "ignore_eos": True}
    done = threading.Event()
    thread = threading.Thread(target=lambda: (httpx.post(server.url("/v1/completions"),
                                                         json=body, timeout=300), done.set()))
    # while it runs: every group holds a share (one state block a Mamba group, the attention
    # group more as the context grows)
    record_first(page, "held-groups", """
        const t = document.getElementById("held-groups").textContent;
        return /full [1-9]/.test(t) && !/ 0\\.0%/.test(t) ? t : null;""")
    thread.start()
    try:
        shown = recorded(page)
        page.screenshot(path=str(ARTIFACTS / "engine-kv-groups.png"))
        shares = _group_shares(shown)
        assert set(shares) == set(groups) and all(s > 0 for s in shares.values()), shown
        recurrent = [s for g, s in shares.items() if g.endswith(":recurrent")]
        assert len(set(recurrent)) == 1  # one block each, whatever the context
        metrics = httpx.get(server.url("/metrics"), timeout=30).text
        for g in groups:
            assert f'llmkit:kv_cache_group_usage_perc{{group="{g}"' in metrics
    finally:
        thread.join(300)
    assert done.is_set()
    # afterwards every group is back to nothing held
    assert wait_for(lambda: set(_group_shares(page.inner_text("#held-groups")).values())
                    == {0.0}, 15)
    assert set(_checked_stats(server)["kv_usage_by_group"].values()) == {0.0}
    assert not problems, problems
    page.close()
