"""Fuzzing llmkit's server from its own OpenAPI schema (schemathesis), every operation.

``fuzz_server(base_url, api_key, examples_per_operation)`` generates requests for each
operation of ``/openapi.json`` — valid ones (``positive``) and ones that break the schema
(``negative``), after the examples the schema itself declares (every one, so each operation
gets at least its documented valid request whatever hypothesis draws) — sends them, and checks every answer (``seed`` fixes what is generated):

- no 5xx (``not_a_server_error``);
- the status code is one the schema declares, the content type too, and a body that the schema
  describes conforms to it (schemathesis' ``status_code_conformance``,
  ``content_type_conformance``, ``response_schema_conformance``);
- every error (status >= 400) is OpenAI's body, exactly ``{"error": {"message", "type",
  "param", "code"}}`` with a non-empty message.

``GET /v1/engine/events`` never ends by design (server-sent events): its cases are sent with a
streamed read that checks the status and content type, then hangs up.

Used by ``tests/test_server_fuzz.py`` (a few hundred requests) and ``benchmarks/soak.py``
(thousands). Loopback only: the caller passes the base URL of a server it started.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FuzzReport", "fuzz_server", "openai_error_problem"]

STREAMING_ENDLESS = {"/v1/engine/events"}


@dataclass
class FuzzReport:
    requests: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # one line each (capped)
    skipped: list[str] = field(default_factory=list)  # operation (mode) with no such case
    num_failures: int = 0
    server_errors: int = 0  # 5xx answers
    duration_s: float = 0.0

    def add_failure(self, line: str) -> None:
        self.num_failures += 1
        if len(self.failures) < 50:
            self.failures.append(line)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "failures": self.num_failures,
                "server_errors": self.server_errors,
                "by_status": dict(sorted(self.by_status.items())),
                "operations": len(self.by_operation), "skipped": self.skipped,
                "duration_s": round(self.duration_s, 1)}


def openai_error_problem(status: int, content_type: str, body: bytes) -> str | None:
    """Why an error answer is not in OpenAI's shape (None when it is)."""
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"error with content type {content_type!r}"
    try:
        doc = json.loads(body)
    except ValueError:
        return "error body is not JSON"
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"error body is not {{'error': {{...}}}}: {body[:200]!r}"
    err = doc["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}"
    if not isinstance(err["message"], str) or not err["message"]:
        return "error without a message"
    if not isinstance(err["type"], str):
        return "error type is not a string"
    return None


def _describe(case: Any) -> str:
    body = getattr(case, "body", None)
    text = json.dumps(body, default=str)[:300] if body is not None else ""
    query = getattr(case, "query", None)
    return f"{case.method} {case.path}{' ?' + str(query) if query else ''} {text}"


def fuzz_server(base_url: str, api_key: str | None, examples_per_operation: int, *,
                modes: tuple[str, ...] = ("positive", "negative"), seed: int = 0,
                timeout_s: float = 120.0, paths: tuple[str, ...] | None = None) -> FuzzReport:
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    session = requests.Session()
    start = time.monotonic()
    operations = [r.ok() for r in schema.get_all_operations()]
    if paths is not None:  # only these paths' operations
        operations = [op for op in operations if op.path in paths]
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        runs = []
        if "positive" in modes:  # the schema's own examples, each sent once
            runs += [(f"{label} (example)", st, 1) for st in
                     schema.get_strategies_from_examples(op)]
        runs += [(f"{label} ({m})", op.as_strategy(generation_mode=GenerationMode(m)),
                  examples_per_operation) for m in modes]
        for run_label, strategy, max_examples in runs:

            @hyp_seed(seed)
            @settings(max_examples=max_examples, deadline=None, database=None,
                      phases=[Phase.generate], derandomize=False,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case) -> None:
                report.requests += 1
                report.by_operation[label] += 1
                try:
                    if op.path in STREAMING_ENDLESS:
                        status, ctype, body = _call_streaming(case, base_url, headers, session)
                        response = None
                    else:
                        response = case.call(base_url=base_url, headers=headers,
                                             session=session, timeout=timeout_s)
                        status = response.status_code
                        ctype = response.headers.get("content-type", [""])
                        ctype = ctype[0] if isinstance(ctype, list) else ctype
                        body = response.content or b""
                except Exception as e:  # noqa: BLE001 - a hang or a dropped connection
                    report.add_failure(f"{label}: no answer ({type(e).__name__}: {e}) for "
                                       f"{_describe(case)}")
                    return
                report.by_status[status] += 1
                if status >= 500:
                    report.server_errors += 1
                problem = openai_error_problem(status, ctype, body)
                if problem:
                    report.add_failure(f"{label} -> {status}: {problem} for {_describe(case)}")
                if response is not None:
                    try:
                        case.validate_response(response, checks=checks, headers=headers)
                    except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - its failures
                        subs = getattr(e, "exceptions", None) or [e]
                        why = "; ".join(f"{getattr(x, 'title', type(x).__name__)}: "
                                        f"{' '.join(str(getattr(x, 'message', x)).split())[:300]}"
                                        for x in subs)
                        report.add_failure(f"{label} -> {status}: {why} for {_describe(case)}")

            try:
                run()
            except Unsatisfiable:  # no invalid request exists (no parameters, no body)
                report.skipped.append(run_label)
    report.duration_s = time.monotonic() - start
    return report


def _call_streaming(case: Any, base_url: str, headers: dict, session) -> tuple[int, str, bytes]:
    """Send a case to an endless event stream: read the head (and an error body), hang up."""
    url = base_url + case.formatted_path
    resp = session.get(url, params=case.query or None, headers={**headers,
                                                                **(case.headers or {})},
                       stream=True, timeout=30)
    try:
        ctype = resp.headers.get("content-type", "")
        body = resp.content if resp.status_code >= 400 else b""
        if resp.status_code == 200 and not ctype.startswith("text/event-stream"):
            body = b"(not an event stream)"
        return resp.status_code, ctype, body
    finally:
        resp.close()
