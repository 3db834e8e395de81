"""How an executor sends a step to its workers: ``SchedulerOutput`` as msgpack (msgspec),
encoded once per step however many workers read it; a numpy array (the grammar bitmask)
travels as its dtype, shape and raw bytes."""
from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from llmkit.outputs import ModelRunnerOutput
from llmkit.scheduler.base import SchedulerOutput


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"a {type(obj).__name__} cannot be sent to the workers")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray:
        dtype, shape, raw = obj
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode a {typ}")


class StepEncoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, scheduler_output: SchedulerOutput) -> bytes:
        return self._enc.encode(scheduler_output)

    def encode_output(self, output: ModelRunnerOutput) -> bytes:
        return self._enc.encode(output)


class StepDecoder:
    def __init__(self) -> None:
        self._dec = msgspec.msgpack.Decoder(SchedulerOutput, dec_hook=_dec_hook)
        self._out = msgspec.msgpack.Decoder(ModelRunnerOutput)

    def decode(self, data: bytes | memoryview) -> SchedulerOutput:
        return self._dec.decode(data)

    def decode_output(self, data: bytes | memoryview) -> ModelRunnerOutput:
        return self._out.decode(data)
