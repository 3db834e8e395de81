"""The ``scheduler`` section and the service-level objectives (``slo``) the SLO scheduler
serves to."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmkit.config.sections.strict import _Component, _Strict

__all__ = ["SchedulerConfig", "SloConfig", "check_slo_scheduler"]


class SchedulerConfig(_Component):
    name: str = "token_budget"
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_policy: Literal["lifo", "fewest_computed_tokens"] = "lifo"
    enable_chunked_prefill: bool = True
    # Speculative decoders reserve KV slots for draft tokens through this seam.
    num_lookahead_tokens: int = Field(default=0, ge=0)
    # A prefill longer than this is cut into chunks of at most this many tokens (0 = off).
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    # Multimodal models (vLLM's names): the encoder cache holds this many image tokens'
    # encoder outputs (an image repeated while cached is encoded once); a step encodes images
    # of at most this many tokens in all (an image is never split across steps).
    encoder_cache_size: int = Field(default=8192, ge=1)
    max_num_encoder_input_tokens: int = Field(default=8192, ge=1)
    # scheduler=slo only: what happens to a request that the cost model predicts cannot meet
    # slo.* when it waits for admission: off = it waits its turn (ordered by TTFT slack),
    # defer = it goes behind every request that still can (counted once), reject = it ends
    # unserved (HTTP 429, finish_reason "abort" offline; counted).
    slo_admission: Literal["off", "defer", "reject"] = "off"
    # scheduler=slo only: the hardware profile its cost model predicts step times with: null =
    # the profile `llmkit sim calibrate` cached for this machine (else the shipped, uncalibrated
    # cpu-local one; start-up says which), a name in conf/tools/hardware/, or a YAML path.
    cost_profile: str | None = None
    # scheduler=slo only: how fast its predictions follow the steps it measures (the weight of
    # the latest step in an average of measured over predicted step time, per decode-only and
    # mixed step; 0 = predict with the profile alone). docs/slo.md
    slo_correction_weight: float = Field(default=0.2, ge=0.0, le=1.0)
    # scheduler=slo only: what slo.tpot_ms bounds. step = every step a decoding request takes;
    # mean = each request's mean time per output token, as bench serve counts TPOT (a step may
    # take longer by the time a request's tokens so far are ahead of that mean). docs/slo.md
    slo_tpot: Literal["step", "mean"] = "step"


class SloConfig(_Strict):
    """Service-level objectives (ms; null = no objective on that metric). ``bench serve`` and
    ``llmkit sim`` count a request toward goodput only if it succeeded and meets every
    objective that is set; ``scheduler=slo`` serves to them (TTFT and TPOT; E2EL bounds its
    admission estimate)."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


def check_slo_scheduler(s: SchedulerConfig, slo: SloConfig) -> None:
    """The SLO scheduler's keys do nothing under another scheduler, and it needs an objective
    to serve to: either mistake fails at start-up naming the key (a ValueError here becomes a
    ConfigError naming the first dotted key of its message)."""
    if s.name != "slo":
        if s.slo_admission != "off":
            raise ValueError(f"scheduler.slo_admission={s.slo_admission} needs scheduler=slo; "
                             f"with scheduler={s.name} only off is allowed")
        if s.cost_profile is not None:
            raise ValueError(f"scheduler.cost_profile needs scheduler=slo; with "
                             f"scheduler={s.name} only null is allowed")
        default = SchedulerConfig.model_fields["slo_correction_weight"].default
        if s.slo_correction_weight != default:
            raise ValueError(f"scheduler.slo_correction_weight={s.slo_correction_weight} needs "
                             f"scheduler=slo; with scheduler={s.name} only {default} is "
                             "allowed")
        if s.slo_tpot != "step":
            raise ValueError(f"scheduler.slo_tpot={s.slo_tpot} needs scheduler=slo; with "
                             f"scheduler={s.name} only step is allowed")
        return
    if slo.tpot_ms is None and slo.ttft_ms is None:
        raise ValueError("slo.tpot_ms and slo.ttft_ms are both null; scheduler=slo needs one "
                         "or both (milliseconds > 0): it sizes each step to slo.tpot_ms and "
                         "orders waiting requests by slo.ttft_ms")
