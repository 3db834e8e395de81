"""Every way of reaching an engine implements the protocol its front end programs against
(``llmkit.engine.client``): ``LLM`` steps ``EngineCore`` or ``DataParallelEngine``,
``AsyncLLM`` hears from ``MPClient`` or ``DPClient``. Checked on the classes, by name and
parameters, so no engine has to start."""
from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from llmkit.engine.client import EngineClient, EngineProcessClient, SteppedEngineClient
from llmkit.engine.loop.core import EngineCore
from llmkit.engine.process.client import MPClient
from llmkit.engine.dp.client import DPClient
from llmkit.engine.dp.engine import DataParallelEngine


def protocol_members(proto: type) -> dict[str, object]:
    members: dict[str, object] = {}
    for klass in reversed(proto.__mro__):
        if klass is object or klass is Protocol or EngineClient not in klass.__mro__:
            continue
        members.update({n: None for n in inspect.get_annotations(klass)})
        members.update({n: v for n, v in vars(klass).items() if not n.startswith("_")})
    return members


def mismatches(cls: type, proto: type) -> list[str]:
    """What ``cls`` lacks of ``proto``: a member (a method, property or attribute its
    ``__init__`` sets), or a parameter of a method (extra parameters need defaults)."""
    source = inspect.getsource(cls)
    wrong = []
    for name, want in protocol_members(proto).items():
        if not hasattr(cls, name):
            if f"self.{name} =" not in source and f"self.{name}: " not in source:
                wrong.append(f"{name}: missing")
            continue
        have = inspect.getattr_static(cls, name)
        if not inspect.isfunction(want) or not inspect.isfunction(have):
            continue
        want_params = list(inspect.signature(want).parameters.values())[1:]
        have_params = inspect.signature(have).parameters
        for p in want_params:
            if p.name not in have_params or have_params[p.name].kind != p.kind:
                wrong.append(f"{name}: parameter {p.name!r}")
        for name_, p in list(have_params.items())[1:]:
            if name_ not in {q.name for q in want_params} and p.default is p.empty \
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                wrong.append(f"{name}: extra parameter {name_!r} without a default")
    return wrong


@pytest.mark.parametrize("cls, proto", [
    (EngineCore, SteppedEngineClient),
    (DataParallelEngine, SteppedEngineClient),
    (MPClient, EngineProcessClient),
    (DPClient, EngineProcessClient),
])
def test_each_client_implements_its_protocol(cls, proto):
    assert mismatches(cls, proto) == []


def test_the_check_can_fail():
    class Partial:
        def model_facts(self):
            ...

        def step(self, extra):
            ...

    wrong = mismatches(Partial, SteppedEngineClient)
    assert "add_requests: missing" in wrong and "shutdown: missing" in wrong
    assert "step: extra parameter 'extra' without a default" in wrong
