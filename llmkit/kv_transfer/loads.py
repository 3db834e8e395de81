"""The worker side's background loads, as the transfer connectors keep them: one future per
request, giving (loaded, blocks, seconds)."""
from __future__ import annotations

from concurrent.futures import Future

from llmkit.outputs import KVConnectorOutput


def collect_finished_loads(loads: dict[str, Future], out: KVConnectorOutput,
                           block_nbytes: int) -> None:
    """Move the finished loads of ``loads`` into ``out`` (a failed load is also listed in
    ``failed_recving``: its request recomputes)."""
    for rid, fut in list(loads.items()):
        if not fut.done():
            continue
        del loads[rid]
        ok, n, seconds = fut.result()
        out.finished_recving.append(rid)
        if not ok:
            out.failed_recving.append(rid)
        out.num_loaded_blocks += n
        out.loaded_bytes += n * block_nbytes
        out.load_s += seconds
