"""Image decoding (Pillow) and image sources: bytes, base64, ``data:`` URLs, ``file://`` paths (only
under ``allowed_local_media_path``, vLLM's ``--allowed-local-media-path``) and ``http(s)`` URLs (only
for hosts in ``allowed_media_domains``, vLLM's ``--allowed-media-domains``; refused otherwise), with
size and time limits. Every failure is an ``InputValidationError`` naming the request field.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from pagedllm.engine.input_processor import InputValidationError

#: largest encoded image accepted (bytes), from any source
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: largest decoded image accepted (pixels, width * height); Pillow's own bomb limit is 89 M
MAX_IMAGE_PIXELS = 40_000_000
#: seconds a remote image fetch may take
FETCH_TIMEOUT_S = 10.0


def decode_image(data: bytes, field: str) -> Any:
    """Encoded image bytes (PNG, JPEG, WebP, GIF, ...) -> an RGB ``PIL.Image``.

    Raises:
        InputValidationError: (param ``field``) more than ``MAX_IMAGE_BYTES`` bytes, more than
            ``MAX_IMAGE_PIXELS`` pixels, or bytes Pillow cannot decode.
    """
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise InputValidationError(f"{field}: the image is {len(data)} bytes, more than the limit of "
                                   f"{MAX_IMAGE_BYTES} bytes", field)
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_IMAGE_PIXELS:
            raise InputValidationError(f"{field}: the image is {w}x{h} pixels, more than the limit of "
                                       f"{MAX_IMAGE_PIXELS} pixels", field)
        img.load()
    except InputValidationError:
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, truncated files, decompression bombs
        from PIL import UnidentifiedImageError

        if isinstance(e, UnidentifiedImageError):  # (its message is the repr of our BytesIO)
            raise InputValidationError(f"{field}: cannot decode the image: not a format Pillow reads (PNG, "
                                       "JPEG, WebP, GIF, BMP, TIFF, ...)", field) from None
        raise InputValidationError(f"{field}: cannot decode the image ({e.__class__.__name__}: {e})", field) from None
    return img.convert("RGB")


def check_image(img: Any, field: str) -> Any:
    """A ``PIL.Image`` given directly (offline ``multi_modal_data``) -> RGB, size-checked.

    Raises:
        InputValidationError: not a PIL image, or over ``MAX_IMAGE_PIXELS``.
    """
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise InputValidationError(f"{field}: image input needs the pillow package", field) from None
    if not isinstance(img, Image.Image):
        raise InputValidationError(f"{field}: expected a PIL.Image.Image, got {type(img).__name__}", field)
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS or w < 1 or h < 1:
        raise InputValidationError(f"{field}: the image is {w}x{h} pixels (limit {MAX_IMAGE_PIXELS})", field)
    return img if img.mode == "RGB" else img.convert("RGB")


def image_hash(img: Any, kwargs: Optional[dict] = None) -> str:
    """Hex sha256 of an RGB image's pixels (mode, size, raw bytes) and the processor kwargs."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    if kwargs:
        h.update(repr(sorted(kwargs.items())).encode())
    return h.hexdigest()


def decode_base64_image(b64: str, field: str) -> Any:
    """Base64 (standard alphabet, padding optional) -> RGB image.

    Raises:
        InputValidationError: not base64, or not an image (``decode_image``).
    """
    if not isinstance(b64, str):
        raise InputValidationError(f"{field}: expected a base64 string, got {type(b64).__name__}", field)
    if len(b64) > MAX_IMAGE_BYTES * 4 // 3 + 8:
        raise InputValidationError(f"{field}: the image is larger than the limit of {MAX_IMAGE_BYTES} bytes", field)
    try:
        data = base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InputValidationError(f"{field}: not valid base64 image data", field) from None
    return decode_image(data, field)


class MediaConnector:
    """Loads images from URLs under the server's media settings.

    Args:
        allowed_local_media_path: a directory; ``file://`` URLs must resolve inside it ("" = refuse
            every ``file://`` URL).
        allowed_media_domains: hosts whose ``http(s)`` URLs may be fetched (None or empty = refuse
            remote media).
    """

    def __init__(self, allowed_local_media_path: str = "", allowed_media_domains: Optional[list[str]] = None) -> None:
        self.local_root = os.path.realpath(allowed_local_media_path) if allowed_local_media_path else ""
        self.domains = {d.lower() for d in allowed_media_domains or ()}

    def load_image_url(self, url: Any, field: str) -> Any:
        """``data:image/...;base64,...``, ``file://PATH`` or ``http(s)://...`` -> RGB image.

        Raises:
            InputValidationError: (param ``field``) a malformed or refused URL, a file outside the
                allowed directory, a failed or oversized fetch, or undecodable data.
        """
        if not isinstance(url, str) or not url:
            raise InputValidationError(f"{field}: the image URL must be a non-empty string", field)
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or ";base64" not in head:
                raise InputValidationError(f"{field}: a data URL must be 'data:<mime>;base64,<data>'", field)
            return decode_base64_image(payload, field)
        parsed = urlparse(url)
        if parsed.scheme == "file":
            if not self.local_root:
                raise InputValidationError(f"{field}: file:// image URLs need the server's --allowed-local-media-path",
                                           field)
            path = os.path.realpath(unquote(parsed.path))
            if os.path.commonpath([path, self.local_root]) != self.local_root:
                raise InputValidationError(f"{field}: the file is not under --allowed-local-media-path", field)
            try:
                if os.path.getsize(path) > MAX_IMAGE_BYTES:
                    raise InputValidationError(f"{field}: the image file is larger than {MAX_IMAGE_BYTES} bytes", field)
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError as e:
                raise InputValidationError(f"{field}: cannot read the image file ({e.strerror})", field) from None
            return decode_image(data, field)
        if parsed.scheme in ("http", "https"):
            host = (parsed.hostname or "").lower()
            if not self.domains:
                raise InputValidationError(f"{field}: remote image URLs are disabled on this server (start it with "
                                           "--allowed-media-domains HOST to allow them); send the image as a "
                                           "base64 data URL", field)
            if host not in self.domains:
                raise InputValidationError(f"{field}: the host {host!r} is not in --allowed-media-domains", field)
            return decode_image(self._fetch(url, field), field)
        raise InputValidationError(f"{field}: unsupported image URL scheme {parsed.scheme!r} (data:, file://, "
                                   "http(s)://)", field)

    @staticmethod
    def _fetch(url: str, field: str) -> bytes:
        import httpx

        try:
            with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as r:
                if r.status_code != 200:
                    raise InputValidationError(f"{field}: fetching the image gave HTTP {r.status_code}", field)
                buf = bytearray()
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > MAX_IMAGE_BYTES:
                        raise InputValidationError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes", field)
                return bytes(buf)
        except httpx.HTTPError as e:
            raise InputValidationError(f"{field}: fetching the image failed ({e.__class__.__name__})", field) from None


def load_image_part(part: dict, media: "MediaConnector", field: str) -> Any:
    """One image content part -> RGB image: OpenAI ``{"type": "image_url", "image_url": {"url": ...}}``
    (or a plain URL string), Responses ``{"type": "input_image", "image_url": ...}``, vLLM's offline
    ``{"type": "image_pil", "image_pil": PIL.Image}``, Anthropic's ``{"type": "image", "source":
    {"type": "base64", "data": ...}}`` or ``{"type": "image", "image": PIL.Image | URL}``.

    Raises:
        InputValidationError: (param ``field``) a part of none of these shapes or a bad image.
    """
    ptype = part.get("type")
    if ptype in ("image_url", "input_image"):
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        return media.load_image_url(url, field)
    if ptype == "image_pil":
        return check_image(part.get("image_pil"), field)
    src = part.get("source")
    if isinstance(src, dict):
        if src.get("type") == "base64":
            return decode_base64_image(src.get("data"), field)
        if src.get("type") == "url":
            return media.load_image_url(src.get("url"), field)
        raise InputValidationError(f"{field}: image source type must be 'base64' or 'url', got {src.get('type')!r}",
                                   field)
    img = part.get("image")
    if isinstance(img, str):
        return media.load_image_url(img, field)
    if img is not None:
        return check_image(img, field)
    raise InputValidationError(f"{field}: an image part needs image_url, image_pil, source or image", field)
