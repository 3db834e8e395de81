"""Layer-by-layer KV loads overlapped with the forward (issue 24, item 1): the model calls the
connector's ``wait_for_layer_load(i)`` just before layer i and ``save_kv_layer(i)`` just after,
in order; a host-tier load of layer k still in flight does not keep layers < k from
computing; the tokens are those of recomputing the prefix."""
from __future__ import annotations

import random
import threading

import pytest

from llmkit import LLM, SamplingParams
from llmkit.kv_transfer.offload import OffloadingConnector

BLOCK = 4
NUM_LAYERS = 4
SLOW_LAYER = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class LayerGatedConnector(OffloadingConnector):
    """The offload tiers, instrumented: records the per-layer calls, and the transfer thread
    copies layer ``SLOW_LAYER`` of a load only once the forward has finished every layer
    below it (it waits for their ``save_kv_layer``): a runner that waited for every layer
    before the forward would keep that from ever happening (the gate would time out)."""

    instances: list["LayerGatedConnector"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.saved = [threading.Event() for _ in range(NUM_LAYERS)]
        self.gated_loads = 0
        self.gate_timeouts = 0
        LayerGatedConnector.instances.append(self)

    def _record(self, what: str, layer: int) -> None:
        with self.lock:
            self.calls.append((what, layer))

    def start_load_kv(self) -> None:
        for e in self.saved:
            e.clear()
        self._record("start", -1)
        super().start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        self._record("wait", layer)
        super().wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_layer) -> None:
        self._record("save", layer)
        self.saved[layer].set()
        super().save_kv_layer(layer, kv_layer)

    def _transfer_layer(self, layer: int, stores: list, loads: list) -> None:
        if loads and layer == SLOW_LAYER:
            self.gated_loads += 1
            if not self.saved[layer - 1].wait(timeout=20):
                self.gate_timeouts += 1
        super()._transfer_layer(layer, stores, loads)
        self._record("loaded" if loads else "copied", layer)


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(3)
    return ([rng.randrange(5, 600) for _ in range(30)],
            [rng.randrange(5, 600) for _ in range(30)])


def _llm(model_dir, num_blocks: int, **offload) -> LLM:
    groups = {"kv_offload": offload} if offload else {}
    return LLM(str(model_dir), dtype="float32", attention="torch",
               kv_cache={"num_blocks": num_blocks, "block_size": BLOCK}, **groups)


def _gen(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=NUM_LAYERS)


def test_layer_loads_overlap_the_forward_in_order(model, monkeypatch):
    a, b = _prompts()
    ref = _llm(model, 64)
    expected = {"a": _gen(ref, a), "b": _gen(ref, b)}
    ref.shutdown()

    import llmkit.engine.loop.core_builder as core

    LayerGatedConnector.instances.clear()
    real = core.kv_connector_class
    monkeypatch.setattr(core, "kv_connector_class",
                        lambda config: LayerGatedConnector if real(config) else None)
    llm = _llm(model, 12, host_gib=0.01)  # one 30-token prompt fits, two do not
    worker = llm.engine.executor.runner.kv_connector
    assert isinstance(worker, LayerGatedConnector)
    assert _gen(llm, a) == expected["a"]
    assert _gen(llm, b) == expected["b"]  # evicts a's blocks into the host tier
    worker.calls.clear()
    assert _gen(llm, a) == expected["a"]  # a's prefix loads from the host tier
    assert llm.engine.kv_connector.stats.hits_per_tier.get("host", 0) > 0
    assert worker.gated_loads >= 1 and worker.gate_timeouts == 0

    # Each forward: start, then wait(i), save(i) for i = 0.. in order (from the main thread;
    # the transfer thread's records interleave).
    steps: list[list[tuple[str, int]]] = []
    for what, layer in worker.calls:
        if what == "start":
            steps.append([])
        elif what in ("wait", "save"):
            steps[-1].append((what, layer))
    forward = [c for i in range(NUM_LAYERS) for c in (("wait", i), ("save", i))]
    assert steps and all(s == forward for s in steps if s), steps
    # The slow layer's load landed after the layers below it had computed, and before the
    # slow layer's wait returned (its save comes after).
    calls = worker.calls
    loaded = calls.index(("loaded", SLOW_LAYER))
    assert calls.index(("save", SLOW_LAYER - 1)) < loaded < calls.index(("save", SLOW_LAYER))
    llm.shutdown()
