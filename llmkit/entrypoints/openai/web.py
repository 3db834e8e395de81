"""The pages for people: ``/`` (chat playground) and ``/engine`` (live engine view), with their
assets under ``/ui/``. Plain HTML, CSS and JavaScript shipped inside the package
(``pages/``); nothing is fetched from elsewhere at run time, nothing is built at install time.

Pages and assets are public (they hold no data); what they show comes from ``/v1/...``, which
needs the API key when one is set (the pages ask for it and keep it in the browser's
localStorage). A strict Content-Security-Policy keeps them to their own origin.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from llmkit.entrypoints.openai.errors import OpenAIError

__all__ = ["add_web_routes"]

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _load_pages() -> dict[str, tuple[bytes, str]]:
    """Every file of ``pages/`` by name: (content, media type). Read once, at start-up."""
    files = {}
    for entry in resources.files("llmkit.entrypoints.openai").joinpath("pages").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            files[entry.name] = (entry.read_bytes(), _MEDIA_TYPES[suffix])
    return files


def add_web_routes(app: FastAPI) -> None:
    pages = _load_pages()

    def page(name: str) -> Response:
        try:
            body, media_type = pages[name]
        except KeyError:
            raise OpenAIError(404, f"no such page: {name}", code="not_found") from None
        return Response(body, media_type=media_type, headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return page("chat.html")

    @app.get("/engine", include_in_schema=False)
    async def engine_page() -> Response:
        return page("engine.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        # Only the files listed at start-up: a name is a dict key, never a path.
        return page(name)
