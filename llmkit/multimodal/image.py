"""Images from what a request carries — a PIL image, encoded bytes, a ``data:`` URL, or an
``http(s)`` URL of an allowed host — with the size limits checked before decoding.

A request never names a file on the server's disk: ``file:`` URLs and paths are refused.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request

from PIL import Image, UnidentifiedImageError

__all__ = ["ImageError", "decode_image", "load_image_url"]


class ImageError(ValueError):
    """An image the request carries cannot be used (bad URL, too large, not an image)."""


def decode_image(data: bytes, *, max_bytes: int) -> Image.Image:
    """Encoded image bytes (PNG, JPEG, ...) -> an RGB image, or ``ImageError``."""
    if len(data) > max_bytes:
        raise ImageError(f"the image has {len(data)} bytes, more than "
                         f"multimodal.max_image_bytes={max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"the image cannot be decoded: {e}") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large: {e}") from None
    return image.convert("RGB")


def load_image_url(url: str, *, max_bytes: int, allowed_domains: list[str],
                   timeout_s: float = 10.0) -> Image.Image:
    """A ``data:image/...;base64,`` URL, or an ``http(s)`` URL whose host is in
    ``allowed_domains`` (``server.allowed_media_domains``)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("a data URL image must be 'data:image/<type>;base64,<data>'")
        if not header[5:].startswith("image/"):
            raise ImageError(f"a data URL of type {header[5:-7]!r} is not an image")
        if len(payload) > max_bytes * 4 // 3 + 4:
            raise ImageError(f"the image is larger than multimodal.max_image_bytes={max_bytes}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL's base64 payload is not valid") from None
        return decode_image(data, max_bytes=max_bytes)
    _check_remote_url(url, allowed_domains)
    opener = urllib.request.build_opener(_AllowedRedirects(allowed_domains))
    try:
        with opener.open(url, timeout=timeout_s) as resp:  # host (and redirects) checked
            data = resp.read(max_bytes + 1)
    except ImageError:
        raise
    except OSError as e:
        raise ImageError(f"the image URL could not be fetched: {e}") from None
    return decode_image(data, max_bytes=max_bytes)


def _check_remote_url(url: str, allowed_domains: list[str]) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ImageError(f"image URL scheme {parsed.scheme or '(none)'!r} is not allowed; give "
                         "a data: URL or an http(s) URL of an allowed host")
    host = (parsed.hostname or "").lower()
    if host not in {d.lower() for d in allowed_domains}:
        raise ImageError(f"image URLs of host {host!r} are not allowed "
                         "(server.allowed_media_domains); send the image as a data: URL")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to an allowed host: an allowed host must not lead the server
    to fetch from one that is not."""

    def __init__(self, allowed_domains: list[str]) -> None:
        self.allowed_domains = allowed_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_remote_url(newurl, self.allowed_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
