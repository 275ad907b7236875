"""A lean streaming HTTP/1.1 POST on an asyncio ``Protocol``: the client's ``raw`` transport for SSE responses.

Why it exists: with aiohttp every socket read goes through its stream reader — a buffer append, a waiter
future woken, the awaiting task resumed, ``readany`` returning — about 15–20 µs a chunk in Python before the
client can take the next read. Here each read reaches :meth:`_StreamProtocol.data_received` straight from the
event loop, and the hot path is one ``perf_counter_ns()`` and two list appends (the quick-ACK switch is set once
per request, :func:`quickack_once`).
The HTTP framing (status line, headers, chunked transfer coding) is undone after the response
(:func:`dechunk`), mapping every body byte back to the read that delivered it — so a line's timestamp stays the
read that completed it, exactly as with aiohttp.

Scope: plain ``http://`` (loopback, a cluster's internal address), one connection per request, no redirects,
no proxies, no TLS (``https`` targets use the aiohttp transport). A response ends at its terminal chunk, at
its ``Content-Length`` or when the server closes the connection (an error when a chunked or sized body
was cut short: the server died mid-stream). Header names and values are checked for
CR/LF before anything is sent, so no caller can inject a header or a second request.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024


class HTTPStreamError(OSError):
    """The connection failed or closed before a complete response head (a ``connection`` error)."""


@dataclass
class StreamResponse:
    """What the transport learnt: status, lower-cased headers, when the head arrived (perf ns), and whether the
    body was chunked (the raw reads then still carry the chunk framing until :func:`dechunk`)."""
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    headers_ns: int = 0
    chunked: bool = False


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an ``http://`` URL; ValueError for anything else."""
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"the raw transport speaks plain http://host[:port]/path only, not '{url}' "
                         "(use transport='aiohttp' for https)")
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, u.port or 80, path


def request_head(host: str, port: int, path: str, headers: dict[str, str], body_len: int) -> bytes:
    """The request head; ValueError for a header name or value holding CR, LF or NUL (header injection)."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}" if ":" not in host else f"Host: [{host}]:{port}",
             f"Content-Length: {body_len}", "Connection: close"]
    for k, v in headers.items():
        if any(c in str(k) + str(v) for c in "\r\n\0") or not str(k) or ":" in str(k):
            raise ValueError(f"header {k!r} is not a valid HTTP header (CR, LF, NUL or ':' in it)")
        if str(k).lower() not in ("host", "content-length", "connection", "transfer-encoding"):
            lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def quickack_once(sock: Any) -> bool:
    """Make sure the kernel does not delay this connection's ACKs: set ``TCP_QUICKACK`` once, after the request
    was written (Linux; False elsewhere or when the option cannot be set). ``sock``: a socket or a transport.

    Why: a server that writes small SSE chunks without ``TCP_NODELAY`` (cpp-httplib's default, llama.cpp built
    without it) has each write held by Nagle until the previous segment is ACKed. Linux delays an ACK (40 ms and
    more) only in its interactive ("pingpong") mode, which a socket enters when it sends data soon after
    receiving some — a request written on a connection that has just received (a kept-alive connection's next
    request, a server that speaks first) — and leaves when ``TCP_QUICKACK`` is set or a delayed-ACK timer fires.
    Out of that mode, reading a small pushed segment ACKs it at once. So one setting after the request — this
    side's last send — keeps every ACK of the response immediate; it is not undone until this side sends again,
    which a streaming client does not. Measured on Linux 6.18 (a socket that received before it sent, then
    read 40 chunks 20 ms apart from a Nagle writer): with no quick-ACK one or two gaps of 41 ms; set once after
    the send, none (max 20.5 ms) — the same as re-arming after every read, which the client did before at
    2–7 µs of CPU a read (the development VM; an H200 host); ``tests/test_http_stream.py`` repeats this. First
    observed: a 64-token prompt on the tiny model got its first chunk after ~280 ms instead of ~3 ms on a
    kept-alive connection.
    """
    if not hasattr(socket, "TCP_QUICKACK"):
        return False
    if not hasattr(sock, "setsockopt"):
        sock = sock.get_extra_info("socket")
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    except (AttributeError, OSError):
        return False
    return True


class CompletionQueue:
    """Hands complete responses to their waiting requests one per turn of the event loop, so the reads that
    arrive meanwhile are taken — and timestamped — first.

    Why: a request's completion costs the loop ~50–70 µs (its task resumes through its coroutines, its deadline is
    cancelled, its connection closed), against ~10 µs for a read. When hundreds of streams end in the same few
    milliseconds (a wave whose streams started together), their completions ran back to back between two polls
    of the sockets, and the last chunks of the streams still running were read late: measured at 512 paced
    streams on a 16-core host, each wave's p99 error over its steady gaps was a median 0.36 ms with every stream's
    last gap and 0.05 ms without (the bare reader's: 0.16 and 0.10). Here each completion is one callback; the
    loop polls the sockets between two of them (asyncio's and uvloop's loops run what was queued before a turn,
    then poll), so a read waits for at most one completion. Nothing is held back while the loop is otherwise
    idle: a lone completion runs on the next turn, as before.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: collections.deque[_StreamProtocol] = collections.deque()
        self.scheduled = False

    def add(self, proto: "_StreamProtocol") -> None:
        self.queue.append(proto)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._step)

    def _step(self) -> None:
        self.queue.popleft()._finish(None)
        if self.queue:
            self.loop.call_soon(self._step)
        else:
            self.scheduled = False


class _StreamProtocol(asyncio.Protocol):
    """Collects one response: the head parsed once, then every body read as (perf ns, bytes) in two lists."""

    def __init__(self, ts: list[int], data: list[bytes], done: asyncio.Future,
                 completions: CompletionQueue | None = None) -> None:
        self.ts_append, self.data_append, self.done = ts.append, data.append, done
        self.completions = completions
        self.completing = False          # complete, waiting in ``completions`` for its turn
        self.head = b""
        self.in_body = False
        self.resp = StreamResponse()
        self.length = -1                 # Content-Length, -1: none (chunked or until close)
        self.got = 0
        self.data = data
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter_ns()
        if self.in_body:
            self._body(t, data)
        else:
            self._head(t, data)

    def _body(self, t: int, data: bytes) -> None:
        self.ts_append(t)
        self.data_append(data)
        if self.resp.chunked:
            if (data.endswith(b"0\r\n\r\n") or (len(data) < 7 and data.endswith(b"\r\n"))) and _terminal(self.data):
                self._complete()
        elif self.length >= 0:
            self.got += len(data)
            if self.got >= self.length:
                self._complete()

    def _head(self, t: int, data: bytes) -> None:
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > MAX_HEAD_BYTES:
                self._finish(HTTPStreamError(f"response head longer than {MAX_HEAD_BYTES} bytes"))
            return
        lines = self.head[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            self._finish(HTTPStreamError(f"not an HTTP response: {lines[0][:100]!r}"))
            return
        self.resp.status, self.resp.headers_ns = int(parts[1]), t
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.resp.headers[k.strip().lower()] = v.strip()
        self.resp.chunked = "chunked" in self.resp.headers.get("transfer-encoding", "").lower()
        if not self.resp.chunked and self.resp.headers.get("content-length", "").isdigit():
            self.length = int(self.resp.headers["content-length"])
        rest, self.head, self.in_body = self.head[end + 4:], b"", True
        if rest:
            self._body(t, rest)
        elif self.length == 0:
            self._complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done() or self.completing:
            # a complete response (terminal chunk, Content-Length reached) or one already failed: nothing to
            # check — and nothing to do on the hot path, where other streams' chunks are still arriving (this
            # used to re-parse the whole chunked body, ~0.1 ms a stream, which made the last chunks of a burst
            # of completions late by milliseconds)
            return
        why = f": {exc}" if exc else ""
        if not self.in_body:
            self._finish(HTTPStreamError(f"connection closed before a response head{why}"))
        elif self.resp.chunked and not _chunk_spans(b"".join(self.data))[1]:
            self._finish(HTTPStreamError(f"connection closed before the end of the chunked body{why}"))
        elif 0 <= self.got < self.length:
            self._finish(HTTPStreamError(f"connection closed after {self.got} of {self.length} body bytes{why}"))
        else:
            self._finish(None)                 # a body delimited by the connection's close

    def _complete(self) -> None:
        """The response is complete: finish now, or in its turn of ``completions``."""
        if self.completing or self.done.done():
            return
        if self.completions is None:
            self._finish(None)
        else:
            self.completing = True
            self.completions.add(self)

    def _finish(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


def _chunk_spans(raw: bytes) -> tuple[list[tuple[int, int]], bool]:
    """The (start, end) offsets of every chunk's data in a chunked body, and whether the terminal chunk came."""
    spans: list[tuple[int, int]] = []
    p, n = 0, len(raw)
    while p < n:
        eol = raw.find(b"\r\n", p)
        if eol < 0:
            break
        try:
            size = int(raw[p:eol].split(b";", 1)[0].strip(), 16)
        except ValueError:
            break
        if size == 0:
            return spans, True
        start = eol + 2
        spans.append((start, min(start + size, n)))
        p = start + size + 2
    return spans, False


def _terminal(data: list[bytes]) -> bool:
    """Whether the body read so far ends with the terminal chunk ``0\\r\\n\\r\\n`` right after a complete chunk (its
    trailing CRLF), whatever reads it was split over (cpp-httplib writes ``0\\r\\n`` and ``\\r\\n`` apart) — checked
    only when a read ends like one, on the last few bytes: the framing is undone after the response, never on the
    hot path nor while other streams are still arriving. Chunk data that itself ends in ``\\r\\n0\\r\\n`` would be
    taken for the end; an SSE event ends in a blank line, never so. A miss costs nothing: the server's close then
    ends the response, checked exactly (:meth:`_StreamProtocol.connection_lost`)."""
    tail = b""
    for d in reversed(data):
        tail = d + tail
        if len(tail) >= 7:
            break
    return tail.endswith(b"\r\n0\r\n\r\n") or tail == b"0\r\n\r\n"


def dechunk(ts: list[int], data: list[bytes]) -> tuple[list[int], list[bytes]]:
    """Undo the chunked transfer coding of a body read as ``data`` at times ``ts``: the payload bytes, each
    kept with the time of the read that delivered it (a read that held only framing yields nothing)."""
    raw = b"".join(data)
    ends, acc = [], 0
    for d in data:
        acc += len(d)
        ends.append(acc)
    out: dict[int, list[bytes]] = {}
    for s, e in _chunk_spans(raw)[0]:
        while s < e:
            i = bisect.bisect_right(ends, s)           # the read holding byte s
            cut = min(e, ends[i])
            out.setdefault(i, []).append(raw[s:cut])
            s = cut
    keys = sorted(out)
    return [ts[i] for i in keys], [b"".join(out[i]) for i in keys]


async def post_stream(url: str, body: bytes, headers: dict[str, str], ts: list[int], data: list[bytes],
                      timeout_s: float, quickack: bool = True, resp: StreamResponse | None = None,
                      completions: CompletionQueue | None = None) -> StreamResponse:
    """POST ``body`` to ``url`` and collect the response body's reads into ``ts``/``data`` (raw; call
    :func:`dechunk` when ``chunked``) and its head into ``resp`` (filled as it arrives, so a caller keeps what
    came before a timeout). Raises ``TimeoutError`` past ``timeout_s``, ``OSError`` (incl.
    :class:`HTTPStreamError`) when the connection fails, ``ValueError`` for a bad URL or header — before anything
    is sent. ``completions``: the run's :class:`CompletionQueue` (None: finish at the read that completed it)."""
    host, port, path = split_url(url)
    head = request_head(host, port, path, headers, len(body))
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    proto = _StreamProtocol(ts, data, done, completions)
    if resp is not None:
        proto.resp = resp
    transport = None
    try:
        async with asyncio.timeout(timeout_s):
            transport, _ = await loop.create_connection(lambda: proto, host, port)
            transport.write(head + body)
            if quickack:
                quickack_once(transport)
            await done
    except TimeoutError:
        if not proto.completing:         # complete before the deadline, its turn came after it: not a timeout
            raise
    finally:
        if transport is not None and not transport.is_closing():
            transport.close()
    return proto.resp
