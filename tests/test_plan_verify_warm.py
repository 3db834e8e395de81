"""`llmkit plan`'s verification serves each candidate with its step graphs in place before the
measured run (compilation.background=false): a candidate whose graphs were not saved yet would
otherwise compile them beside the measured requests and measure a cold start (docs/plan.md).
No server is started here: the child process and the client are fakes."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmkit.tools.plan import verify


class _FakeProc:
    def __init__(self, cmd, **kwargs) -> None:
        self.cmd = cmd
        self.returncode = 0

    def poll(self):
        return 0


@pytest.fixture
def served(monkeypatch):
    seen: list[list[str]] = []

    def popen(cmd, **kwargs):
        seen.append(list(cmd))
        return _FakeProc(cmd, **kwargs)

    monkeypatch.setattr(verify.subprocess, "Popen", popen)
    monkeypatch.setattr(verify, "_wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(verify, "_stop", lambda proc: None)
    import llmkit.tools.bench.results as results
    import llmkit.tools.bench.serve as serve
    monkeypatch.setattr(serve, "run_serve", lambda cfg: {"summary": {"goodput": 1.0}})
    monkeypatch.setattr(results, "write_result", lambda result, out_dir, name: None)
    return seen


def _cfg():
    bench = SimpleNamespace(model_copy=lambda update: SimpleNamespace(**update))
    cfg = SimpleNamespace(plan=SimpleNamespace(server_timeout_s=1.0), bench=bench)
    cfg.model_copy = lambda update: cfg
    return cfg


def _measure(tmp_path: Path, overrides: list[str]) -> None:
    verify.measure(_cfg(), tmp_path / "r.yaml", model=None, overrides=overrides,
                   out_dir=tmp_path, name="candidate-1", log=lambda s: None)


def test_verification_server_waits_for_its_step_graphs(tmp_path, served):
    _measure(tmp_path, ["model.dtype=float32"])
    (cmd,) = served
    assert "compilation.background=false" in cmd
    assert "model.dtype=float32" in cmd
    assert cmd.index("compilation.background=false") > cmd.index("serve")


@pytest.mark.parametrize("given", ["compilation.background=true", "+compilation.background=true"])
def test_a_given_compilation_background_wins(tmp_path, served, given):
    _measure(tmp_path, [given])
    (cmd,) = served
    assert given in cmd and "compilation.background=false" not in cmd
