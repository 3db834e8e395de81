"""The default model's shape for cost-model tests, and a served run's step trace synthesised
from a cost model (each step timed as the model prices it under the tokens streamed lately)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from llmkit.cost_model.model_shape import ModelShape
from llmkit.cost_model.step_cost import CostModel
from llmkit.engine.observe.step_trace import StepRecord, StepTrace
from llmkit.tools.sim.frontend_cost import StreamRate, step_work


def smol_shape() -> ModelShape:
    """SmolLM2-135M's shape."""
    return ModelShape.from_hf_config({
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192}, name="smol")


def write_served_trace(path: Path, served: CostModel,
                       shapes: Sequence[tuple[int, int, int, int, int, int]]) -> StepTrace:
    """Steps of ``(prefill_reqs, prefill_tokens, prefill_context, decode_reqs, decode_tokens,
    decode_context)``, each taking what ``served`` prices it at, written to ``path``."""
    trace = StepTrace(path)
    stream, t = StreamRate(), 0.0
    for i, (pr, pt, pc, dr, dt, dc) in enumerate(shapes):
        rec = StepRecord(step=i, start_s=t, schedule_ms=0.0, execute_ms=0.0, update_ms=0.0,
                         num_reqs=pr + dr, scheduled_tokens=pt + dt, prefill_reqs=pr,
                         prefill_tokens=pt, decode_reqs=dr, decode_tokens=dt, num_preempted=0,
                         num_running=pr + dr, num_waiting=0, kv_usage=0.1, prefill_context=pc,
                         decode_context=dc)
        work = step_work(rec.to_dict())
        rec.execute_ms = 1e3 * served.step(work, stream_rate=stream.at(t)).total_s
        t += rec.execute_ms / 1e3
        stream.add(t, len(work))
        trace.steps.append(rec)
    trace.write()
    return trace
