"""``llmkit serve [MODEL] [key=value ...]``: the OpenAI-compatible server.

Two processes (the seed's ch. 03): this one runs FastAPI + uvicorn and an ``AsyncLLM``
(tokenize, detokenize, stream; torch limited to one thread here, the cores belong to the
engine); the engine core runs in a child process and blocks while idle.

Shutdown on SIGINT / SIGTERM: stop accepting connections, let requests in flight finish for up
to ``server.shutdown_timeout`` seconds, abort the rest, stop the engine process (ask, then
terminate, then kill), exit 0. A second Ctrl-C skips the wait. If this process is killed
outright, the engine process notices its parent is gone within a second and exits too.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys

from llmkit.config.schema import EngineConfig

logger = logging.getLogger("llmkit.serve")

API_KEY_ENV = "LLMKIT_API_KEY"


def resolve_api_key(config: EngineConfig) -> str | None:
    """``server.api_key``, else the ``LLMKIT_API_KEY`` environment variable, else none."""
    return config.server.api_key or os.environ.get(API_KEY_ENV) or None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts: a busy port fails in a second,
    not after the model has loaded. ``port=0`` picks a free port."""
    from llmkit.config.errors import ConfigError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError("server.host", host, "", message=f"cannot listen on {host}: "
                          f"{e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError("server.port", port, "", message=f"cannot listen on {host}:{port}: "
                          f"{e.strerror or e}") from None
    return sock


def startup_line(pids: list[int], model_name: str, host: str, port: int) -> str:
    """The line that says the server is up: where to point a browser (the chat page ``/``,
    the engine view ``/engine``) and the API docs, not only the API's address."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    which = ("s " if len(pids) > 1 else "=") + ",".join(map(str, pids))
    return (f"engine core process pid{which}; serving {model_name} on {base} (chat page "
            f"{base}/, engine view {base}/engine, API docs {base}/docs)")


def engine_core_states(engine) -> list:
    """Each data-parallel engine core's (alive, latest stats), for ``/metrics``'s per-engine
    series; empty with one engine core."""
    return [] if engine is None else engine.engine_core.core_states()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a handled SIGINT/SIGTERM ends in a normal return (exit 0)
        instead of being re-raised once the graceful shutdown is done."""

        @contextlib.contextmanager
        def capture_signals(self):
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

    return Server


def run_server(config: EngineConfig) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(asctime)s [api pid=%(process)d] %(name)s: "
                               "%(message)s")
    srv = config.server
    from llmkit.entrypoints.openai.tool_parsers import check_tool_call_parser
    check_tool_call_parser(srv.tool_call_parser)
    from llmkit.entrypoints.openai.reasoning import check_reasoning_parser
    check_reasoning_parser(srv.reasoning_parser)
    sock = bind_socket(srv.host, srv.port)
    port = sock.getsockname()[1]
    # Start the engine process first: it imports torch and loads the model while this
    # process imports the web stack and loads the tokenizer.
    from llmkit.engine.dp.client import start_engine_cores

    try:
        engine_core = start_engine_cores(config)
    except BaseException:
        sock.close()
        raise
    try:
        import torch
        import uvicorn

        from llmkit.engine.async_llm import AsyncLLM
        from llmkit.entrypoints.openai.metrics import ServerMetrics
        from llmkit.entrypoints.openai.server import build_app, served_model_names

        from prometheus_client import disable_created_metrics

        # The API process tokenizes and detokenizes; compute threads belong to the engine.
        torch.set_num_threads(1)
        disable_created_metrics()  # no `*_created` series: noise for scrapers
        model_name = served_model_names(config)[0]
        holder: dict = {}
        metrics = ServerMetrics(model_name, engine_alive=lambda: bool(
            holder.get("engine") and holder["engine"].is_running),
            max_loras=config.lora.max_loras if config.lora.enabled else None,
            engine_cores=lambda: engine_core_states(holder.get("engine")))
        engine = AsyncLLM.from_config(config, stat_logger=metrics, engine_core=engine_core)
        holder["engine"] = engine
    except BaseException:
        engine_core.shutdown(timeout=2.0)
        sock.close()
        raise
    try:
        app = build_app(engine, config, metrics=metrics, api_key=resolve_api_key(config),
                        engine_stop_timeout=5.0)
        logger.info("%s", startup_line(engine.engine_core.pids, model_name, srv.host, port))
        uv_config = uvicorn.Config(app, host=srv.host, port=port, log_level="info",
                                   timeout_graceful_shutdown=srv.shutdown_timeout,
                                   lifespan="on")
        server = _server_class()(uv_config)
        server.run(sockets=[sock])
        return 0 if server.started else 1
    finally:
        engine.shutdown()
        sock.close()
