"""A paced OpenAI-compatible ``/v1/completions`` SSE server that keeps its schedule: the target for measuring how
much a benchmark *client* distorts inter-token latency (``bench_client_overhead.py``, ``tests/test_validity.py``).

It does no inference. Every POST streams ``max_tokens`` one-token chunks, one every ``ITL_MS`` on an absolute
schedule from the moment the request was read (chunk i is due at t0 + i × ITL, i = 1 … n, so a late write does
not shift the next one), then a usage chunk, ``[DONE]`` and the terminal chunk of the chunked transfer coding.
Each token chunk carries ``server_ts_ns``: ``time.time_ns()`` taken just before the socket write, so a client on
the same machine can tell its own error from the server's. ``GET /health`` answers ``ok``, ``GET /v1/models``
one model ``m``; any other GET is a 404. Connections are kept alive unless the request says ``Connection: close``.

Why not an asyncio server with one coroutine and one ``sleep`` per stream: at 512 streams whose chunks fall due
in the same millisecond, the event loop fires 512 timers in heap order — an order that changes from one tick to
the next — and wakes, writes and drains each stream separately (~25 µs each), so a stream's chunk lands
anywhere in a ~13 ms burst and its gaps jitter by milliseconds: measured 4.5 ms p99 schedule lag, more than
the 1 ms any client is asked to resolve. Here one loop owns every socket:
- streams wait in one FIFO ordered by due time (all share one ITL, so a written stream re-queued at the back
  keeps the order) and a tick writes every due stream in the same order as the tick before — a stream's
  place in the burst, hence its gap, is stable;
- a write is one non-blocking ``send``; what the socket does not take waits for ``EPOLLOUT`` (a slow reader
  never blocks the others);
- the wait for the next due chunk sleeps in ``epoll`` until 1 ms before it and then polls without blocking
  (epoll's timeout has millisecond resolution), so chunks leave within microseconds of their time
  (``--spin-ms 0``: no polling, chunks up to ~1 ms late, for tests on a shared machine).
The server's own accuracy is measured, not assumed: the client side computes it from ``server_ts_ns``.
Its core is busy while it spins: pin it (``taskset``) to a core of its own.

Loopback only by default; ``--host`` takes another address of this machine.

    python benchmarks/paced_sse_server.py PORT ITL_MS [--host 127.0.0.1] [--spin-ms 1.0] [--reuse-port]
"""
from __future__ import annotations

import argparse
import collections
import json
import select
import socket
import time

HEAD_LIMIT = 64 * 1024

STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
TOKEN = (b'data: {"id":"x","object":"text_completion","created":0,"model":"m","server_ts_ns":%d,'
         b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n')


def frame(data: bytes) -> bytes:
    """One chunk of the chunked transfer coding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def response(status: str, body: bytes, ctype: str = "text/plain") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(), ctype.encode(), len(body), body)


class Conn:
    """One client connection: its unread request bytes, its unsent output, and its stream when one runs."""
    __slots__ = ("sock", "fd", "inbuf", "out", "left", "sent", "due", "ptoks", "close_after", "want_out")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.fd = sock, sock.fileno()
        self.inbuf, self.out = b"", b""
        self.left = self.sent = self.due = self.ptoks = 0
        self.close_after = self.want_out = False


class PacedServer:
    def __init__(self, host: str, port: int, itl_ms: float, spin_ms: float = 1.0, reuse_port: bool = False) -> None:
        if itl_ms <= 0 or spin_ms < 0:
            raise ValueError("ITL_MS must be > 0 and --spin-ms >= 0")
        self.itl_ns = round(itl_ms * 1e6)
        self.spin_ns = round(spin_ms * 1e6)      # poll without blocking for this long before a chunk is due
        self.listener = socket.create_server((host, port), backlog=4096, family=socket.AF_INET6 if ":" in host
                                             else socket.AF_INET, reuse_port=reuse_port)
        self.listener.setblocking(False)
        self.ep = select.epoll()
        self.ep.register(self.listener.fileno(), select.EPOLLIN)
        self.conns: dict[int, Conn] = {}
        self.queue: collections.deque[Conn] = collections.deque()   # streaming connections, by due time

    # ------------------------------------------------------------------ requests
    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Conn(sock)
            self.conns[c.fd] = c
            self.ep.register(c.fd, select.EPOLLIN)

    def read(self, c: Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close(c)
            return
        c.inbuf += data
        if not c.left:      # what a client sends while its stream runs waits for the stream's end
            self.requests(c)

    def requests(self, c: Conn) -> None:
        """Answer every complete request in the buffer; a POST starts a stream and waits for it to end."""
        while not c.left and c.fd in self.conns:
            end = c.inbuf.find(b"\r\n\r\n")
            if end < 0:
                if len(c.inbuf) > HEAD_LIMIT:
                    self.send(c, response("431 Request Header Fields Too Large", b"head too large"))
                    self.close(c)
                return
            lines = c.inbuf[:end].decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                length = -1
            if len(parts) != 3 or length < 0:
                self.send(c, response("400 Bad Request", b"bad request line or Content-Length"))
                self.close(c)
                return
            if len(c.inbuf) < end + 4 + length:
                return
            body, c.inbuf = c.inbuf[end + 4:end + 4 + length], c.inbuf[end + 4 + length:]
            c.close_after = headers.get("connection", "").lower() == "close"
            method, path = parts[0], parts[1]
            if method == "POST":
                self.start_stream(c, body)
                return
            if path.startswith("/health"):
                self.send(c, response("200 OK", b"ok"))
            elif path.startswith("/v1/models"):
                self.send(c, response("200 OK", json.dumps({"object": "list", "data": [
                    {"id": "m", "object": "model"}]}).encode(), "application/json"))
            else:
                self.send(c, response("404 Not Found", b"not found"))
            if c.close_after:
                self.close_when_sent(c)
                return

    def start_stream(self, c: Conn, body: bytes) -> None:
        try:
            req = json.loads(body) if body else {}
            n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        except (ValueError, TypeError, AttributeError):
            self.send(c, response("400 Bad Request", b"the body is not a JSON object with an integer max_tokens"))
            self.close(c)
            return
        prompt = req.get("prompt", "")
        c.ptoks = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        c.left, c.sent = max(1, n), 0
        c.due = time.perf_counter_ns() + self.itl_ns
        self.send(c, STREAM_HEAD)
        self.queue.append(c)        # due one ITL from now: after every stream already queued

    # ------------------------------------------------------------------ writing
    def send(self, c: Conn, data: bytes) -> None:
        if c.out:                    # earlier output still waits for the socket: keep the order
            c.out += data
            return
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.close(c)
            return
        if n < len(data):
            c.out = data[n:]
            if not c.want_out:
                c.want_out = True
                self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)

    def flush(self, c: Conn) -> None:
        data, c.out = c.out, b""
        self.send(c, data)
        if not c.out and c.want_out and c.fd in self.conns:
            c.want_out = False
            self.ep.modify(c.fd, select.EPOLLIN)
            if c.close_after and not c.left:
                self.close(c)

    def close_when_sent(self, c: Conn) -> None:
        if c.out:
            c.close_after = True     # flush() closes it once the rest is out
        else:
            self.close(c)

    def close(self, c: Conn) -> None:
        if self.conns.pop(c.fd, None) is None:
            return
        try:
            self.ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        c.sock.close()
        c.left = 0

    def tick(self, now: int) -> None:
        """Write every due chunk, in queue order."""
        q, itl = self.queue, self.itl_ns
        while q and q[0].due <= now:
            c = q.popleft()
            if c.fd not in self.conns:
                continue
            c.sent += 1
            self.send(c, frame(TOKEN % time.time_ns()))
            if c.sent < c.left:
                c.due += itl
                q.append(c)
                continue
            usage = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": c.ptoks, "completion_tokens": c.left,
                               "total_tokens": c.ptoks + c.left}}
            self.send(c, frame(b"data: " + json.dumps(usage).encode() + b"\n\n") + frame(b"data: [DONE]\n\n")
                      + b"0\r\n\r\n")
            c.left = 0
            if c.fd not in self.conns:
                continue
            if c.close_after:
                self.close_when_sent(c)
            elif c.inbuf:
                self.requests(c)      # a pipelined next request

    # ------------------------------------------------------------------ the loop
    def serve_forever(self) -> None:
        listen_fd = self.listener.fileno()
        while True:
            now = time.perf_counter_ns()
            self.tick(now)
            if self.queue:
                wait_ns = self.queue[0].due - time.perf_counter_ns()
                timeout = 0.0 if wait_ns <= self.spin_ns else (wait_ns - self.spin_ns) / 1e9
            else:
                timeout = -1
            for fd, ev in self.ep.poll(timeout, 1024):
                if fd == listen_fd:
                    self.accept()
                    continue
                c = self.conns.get(fd)
                if c is None:
                    continue
                if ev & select.EPOLLOUT and c.out:
                    self.flush(c)
                if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and fd in self.conns:
                    self.read(c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("itl_ms", type=float, help="one token per stream every ITL_MS milliseconds")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    ap.add_argument("--spin-ms", type=float, default=1.0,
                    help="poll without sleeping this long before each due chunk (0: sleep in epoll to the ms, "
                         "chunks up to ~1 ms late, no core kept busy: for tests on a shared machine)")
    ap.add_argument("--reuse-port", action="store_true",
                    help="SO_REUSEPORT: several servers (each on its own core) share the port; the kernel deals the "
                         "connections out (bench_client_processes.py: a server side that outlasts many clients)")
    args = ap.parse_args()
    try:
        server = PacedServer(args.host, args.port, args.itl_ms, args.spin_ms, args.reuse_port)
    except (OSError, ValueError) as e:
        ap.exit(2, f"paced_sse_server: cannot serve on {args.host}:{args.port}: {e}\n")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
