"""A structured-output backend for tests (named by ``structured_output._target_``): xgrammar,
except that a regex containing ``FAILS_IN_ENGINE`` passes the front end's check and then fails
to compile inside the engine core — the rare failure the core must report, not die of."""
from __future__ import annotations

from llmkit.structured_output import GrammarCompileError
from llmkit.structured_output.xgrammar_backend import XgrammarBackend

FAILS_IN_ENGINE = "fails-in-the-engine"


class FailInEngineBackend(XgrammarBackend):
    def compile(self, key):
        if FAILS_IN_ENGINE in key[1]:
            raise GrammarCompileError(f"structured_outputs.regex: cannot compile "
                                      f"{FAILS_IN_ENGINE!r} (a test's failure)")
        return super().compile(key)
