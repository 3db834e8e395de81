"""Start-up steps that take longer than a second say so (llmkit.startup); quick ones stay
quiet, so a warm start prints nothing extra."""
from __future__ import annotations

import io
import logging
import time

from llmkit.startup import logger, show_startup_progress, startup_step


def test_slow_step_is_announced_with_its_duration(caplog):
    with caplog.at_level(logging.INFO, logger="llmkit.startup"):
        with startup_step("building things", after_s=0.05):
            time.sleep(0.3)
        with startup_step("a quick step", after_s=0.5):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "llmkit.startup"]
    assert lines[0] == "building things ..."
    assert lines[1].startswith("building things: done in ") and lines[1].endswith(" s")
    assert len(lines) == 2  # the quick step said nothing


def test_a_step_left_by_an_exception_says_stopped_not_done(caplog):
    """A background compile stopped at exit (or failing) is not reported as done."""
    with caplog.at_level(logging.INFO, logger="llmkit.startup"):
        try:
            with startup_step("compiling", after_s=0.05):
                time.sleep(0.3)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "llmkit.startup"]
    assert lines[0] == "compiling ..."
    assert lines[1].startswith("compiling: stopped after ") and lines[1].endswith(" s")


def test_terminal_commands_print_the_steps_on_stderr(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logger.level)
    show_startup_progress(stream)
    show_startup_progress(stream)  # once only
    with startup_step("loading the model", after_s=0.01):
        time.sleep(0.1)
    out = stream.getvalue().splitlines()
    assert out[0] == "llmkit: loading the model ..." and len(out) == 2
    assert out[1].startswith("llmkit: loading the model: done in ")


def test_the_stderr_handler_follows_a_replaced_stderr(monkeypatch):
    # One process runs many commands (the test suite does): the stderr of the command that
    # installed the handler may be closed when a later command logs a step.
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logger.level)
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    show_startup_progress()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    with startup_step("reading the configuration", after_s=0.01):
        time.sleep(0.1)
    out = second.getvalue().splitlines()
    assert out[0] == "llmkit: reading the configuration ..." and len(out) == 2
