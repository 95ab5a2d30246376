"""The router's HTTP/1.1 client to its replicas: keep-alive connections on asyncio streams, one
``write`` per request (head and body together), the response body relayed as it arrives (a
chunked body chunk by chunk, de-chunked: the bytes are the replica's body, unchanged).

Why not httpx on this path: on loopback each socket send costs more than the proxying itself,
and httpx (httpcore + h11) writes a request's head and body separately and adds about 0.3 ms of
Python a request (profile in docs/scaling.md). Health checks and ``/metrics`` scrapes still use
httpx.

Errors: ``ConnectFailed`` when no connection could be made (the replica never saw the request:
safe to retry elsewhere); ``UpstreamError`` for anything after (a 502 for the client). A pooled
keep-alive connection that the replica had closed (``EOF`` before any response byte) is retried
once on a fresh connection, as the replica cannot have started that request.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import time
import urllib.parse
from typing import AsyncIterator, Optional

#: A pooled connection idle longer than this is not reused (uvicorn's keep-alive default is 5 s).
IDLE_S = 4.0
#: Most idle connections kept per replica.
MAX_IDLE = 256
#: Largest response head (status line + headers) accepted, bytes.
MAX_HEAD = 1 << 16


class UpstreamError(Exception):
    """The replica failed after the request was sent (or its response is malformed)."""


class ConnectFailed(UpstreamError):
    """No connection to the replica (refused, unreachable, timed out): the request never started."""


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


class UpstreamResponse:
    """A replica's response: ``status``, ``headers`` (``(name, value)`` byte pairs as sent, names
    lower-cased), ``content_type``; the body through ``read()`` or ``iter_body()``, then
    ``aclose()`` (returns the connection to the pool when the body was read to its end)."""

    def __init__(self, pool: "UpstreamPool", conn: _Conn, status: int, headers: list[tuple[bytes, bytes]],
                 no_body: bool) -> None:
        self._pool = pool
        self._conn: Optional[_Conn] = conn
        self.status = status
        self.headers = headers
        self.content_type = b""
        self._length: Optional[int] = None
        self._chunked = False
        self._keep = True
        for k, v in headers:
            if k == b"content-type":
                self.content_type = v
            elif k == b"content-length":
                try:
                    self._length = int(v)
                except ValueError:
                    raise UpstreamError(f"bad content-length {v!r}") from None
            elif k == b"transfer-encoding":
                self._chunked = b"chunked" in v.lower()
            elif k == b"connection" and b"close" in v.lower():
                self._keep = False
        if no_body:
            self._length, self._chunked = 0, False
        elif not self._chunked and self._length is None:
            self._keep = False  # the body runs to the end of the connection
        self._done = False

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive.

        Raises:
            UpstreamError: the connection broke or the framing is malformed.
        """
        conn = self._conn
        assert conn is not None
        r = conn.reader
        try:
            if self._chunked:
                while True:
                    line = await r.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers
                            pass
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left > 0:
                    data = await r.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamError("the replica closed the connection mid-body")
                    left -= len(data)
                    yield data
            else:
                while True:
                    data = await r.read(1 << 16)
                    if not data:
                        break
                    yield data
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            self._keep = False
            raise UpstreamError(f"{type(e).__name__}: {e}") from None
        self._done = True

    async def read(self) -> bytes:
        """The whole body (see ``iter_body``)."""
        if self._length is not None and not self._chunked:
            conn = self._conn
            assert conn is not None
            try:
                data = await conn.reader.readexactly(self._length)
            except (OSError, asyncio.IncompleteReadError) as e:
                self._keep = False
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
            self._done = True
            return data
        return b"".join([c async for c in self.iter_body()])

    async def aclose(self) -> None:
        """Give the connection back (body read to its end, keep-alive) or close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep:
            self._pool.release(conn)
        else:
            conn.close()


class UpstreamPool:
    """Keep-alive connections to one replica (``base_url``: ``http(s)://host[:port][/prefix]``).

    Args:
        base_url: the replica's base URL.
        connect_timeout: seconds to wait for a new connection.
    """

    def __init__(self, base_url: str, connect_timeout: float = 5.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        self.https = u.scheme == "https"
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        hostport = self.host if u.port is None else f"{self.host}:{u.port}"
        self.host_header = hostport.encode()
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=ssl.create_default_context() if self.https
                                        else None, limit=MAX_HEAD), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return _Conn(reader, writer)

    def release(self, conn: _Conn) -> None:
        """Put ``conn`` back for reuse (closed when the pool is full)."""
        if len(self._idle) >= MAX_IDLE or conn.reader.at_eof():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _take(self) -> Optional[_Conn]:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if now - c.idle_since < IDLE_S and not c.reader.at_eof() and not c.writer.is_closing():
                return c
            c.close()
        return None

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> UpstreamResponse:
        """Send one request and read the response head.

        Args:
            method: ``GET``, ``POST``, ...
            target: the path and query (``/v1/models?x=1``), appended to the base URL's path.
            headers: the headers to send (no ``host``, ``content-length``, ``connection``,
                ``transfer-encoding``: set here).
            body: the request body (may be empty).

        Raises:
            ConnectFailed: no connection could be made.
            UpstreamError: the replica failed after the request was written.
        """
        head = [f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode(), b"host: ", self.host_header, b"\r\n"]
        for k, v in headers:
            head += [k, b": ", v, b"\r\n"]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        data = b"".join(head) + body
        conn = self._take()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(data)
                line = await conn.reader.readuntil(b"\r\n\r\n")
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                conn.close()
                partial = isinstance(e, asyncio.IncompleteReadError) and bool(e.partial)
                if reused and not partial:  # a keep-alive connection the replica had closed
                    conn, reused = None, False
                    continue
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
        lines = line[:-4].split(b"\r\n")
        try:
            version, code = lines[0].split(b" ", 2)[:2]
            status = int(code)
            hdrs = []
            for h in lines[1:]:
                k, v = h.split(b":", 1)
                hdrs.append((k.strip().lower(), v.strip()))
        except ValueError:
            conn.close()
            raise UpstreamError(f"malformed response head {lines[0][:80]!r}") from None
        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        resp = UpstreamResponse(self, conn, status, hdrs, no_body)
        if version != b"HTTP/1.1":
            resp._keep = False
        return resp

    def close(self) -> None:
        """Close every idle connection."""
        for c in self._idle:
            c.close()
        self._idle.clear()


__all__ = ["ConnectFailed", "UpstreamError", "UpstreamPool", "UpstreamResponse"]
