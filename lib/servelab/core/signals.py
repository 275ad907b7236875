"""Signals that always stop: SIGTERM (and SIGINT where asked) end a process in bounded time, whatever catches what.

:func:`stop_on` makes the first SIGTERM a ``KeyboardInterrupt`` in the main thread — the Ctrl-C path, where every
``ProcessTracker`` stops what it started and the case being measured writes what it has. A raised exception can be
swallowed (a broad ``except`` in a library, an exception raised inside ``__del__`` or a callback is only printed),
so the first signal also arms a watchdog: if the process is still alive :data:`HARD_STOP_S` later, the registered
stoppers (every open tracker's processes, see :func:`register`) get :data:`STOPPERS_S` more, and the process exits
with ``128 + signal`` — the status a shell shows for a process killed by that signal. A second signal while the
first is being handled does not interrupt the clean-up (the watchdog bounds it instead).

:func:`exit_status` is that status for a CLI that caught the interrupt itself (130 for Ctrl-C, 143 for SIGTERM).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable

# after the first signal, the clean-up's own time (SERVELAB_HARD_STOP_S overrides it); then the stoppers run
HARD_STOP_S = float(os.environ.get("SERVELAB_HARD_STOP_S", "") or 25.0)
STOPPERS_S = 8.0            # the stoppers' time before the process exits regardless

_lock = threading.Lock()
_received: list[int] = []
_stoppers: dict[int, Callable[[], Any]] = {}
_forward: set[int] = set()


def received() -> int | None:
    """The first stopping signal this process got through :func:`stop_on` (None: none)."""
    return _received[0] if _received else None


def exit_status(default: int = 130) -> int:
    """``128 + signal`` of the signal that stopped this process; ``default`` (Ctrl-C's 130) when none did."""
    return 128 + _received[0] if _received else default


def register(key: int, fn: Callable[[], Any]) -> None:
    """``fn`` runs (once, in the watchdog's thread) when a signalled process has not ended in time."""
    with _lock:
        _stoppers[key] = fn


def unregister(key: int) -> None:
    with _lock:
        _stoppers.pop(key, None)


def forward_to(pid: int) -> None:
    """The first stopping signal is also sent to process ``pid`` at once (the CLI's notebook kernel: it stops its
    engines and writes what it measured without waiting for papermill's graceful shutdown to give up first). While
    a process is forwarded to, the signal raises nothing here: the kernel's failed cell ends the notebook, and the
    caller asks :func:`received` (the watchdog still bounds the wait)."""
    with _lock:
        _forward.add(pid)


def stop_forwarding(pid: int | None = None) -> None:
    """Forget ``pid`` (None: every forwarded process — the kernel has ended; its pid may be reused)."""
    with _lock:
        if pid is None:
            _forward.clear()
        else:
            _forward.discard(pid)


def _run_stoppers() -> None:
    with _lock:
        fns = list(_stoppers.values())
    for fn in reversed(fns):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (the next stopper still runs; the process exits next anyway)
            print(f"servelab: stopping after a signal: {exc}", file=sys.stderr, flush=True)


def _watchdog(signum: int, hard_stop_s: float) -> None:
    time.sleep(hard_stop_s)
    name = signal.Signals(signum).name
    print(f"servelab: still running {hard_stop_s:.0f} s after {name}: stopping every tracked process and exiting "
          f"with status {128 + signum}", file=sys.stderr, flush=True)
    th = threading.Thread(target=_run_stoppers, daemon=True, name="servelab-signal-stoppers")
    th.start()
    th.join(STOPPERS_S)
    os._exit(128 + signum)


def _handler(signum: int, frame: Any) -> None:
    with _lock:
        first = not _received
        if first:
            _received.append(signum)
    if not first:
        return                  # already stopping: a second signal must not break the clean-up under way
    with _lock:
        forwarded = list(_forward)
    for pid in forwarded:
        try:
            os.kill(pid, signum)
        except OSError:
            pass
    threading.Thread(target=_watchdog, args=(signum, HARD_STOP_S), daemon=True,
                     name="servelab-signal-watchdog").start()
    if forwarded:
        # the kernel stops itself and fails its cell, which ends the notebook through the kernel's own messages;
        # an interrupt here would make papermill shut the kernel down while it is still writing what it measured
        # (its sockets closed under it: a ZMQError instead of an INTERRUPTED case). The caller checks received().
        return
    raise KeyboardInterrupt(f"signal {signum} ({signal.Signals(signum).name})")


def stop_on(signums: tuple[int, ...] = (signal.SIGTERM,), only_default: bool = True) -> dict[int, Any]:
    """Install the stopping handler for ``signums`` (main thread only); with ``only_default``, only where the signal
    still has its default action (SIG_DFL, or Python's own SIGINT handler) — a handler someone else installed, or an
    ignored SIGINT (a background job), is kept. Returns ``{signal: previous handler}`` of what was changed, for
    :func:`restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    changed: dict[int, Any] = {}
    for s in signums:
        before = signal.getsignal(s)
        if before is _handler:
            continue
        if only_default and before not in (signal.SIG_DFL, signal.default_int_handler):
            continue
        signal.signal(s, _handler)
        changed[s] = before
    return changed


def restore(changed: dict[int, Any]) -> None:
    """Put back the handlers :func:`stop_on` replaced (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s, before in changed.items():
        if signal.getsignal(s) is _handler:
            signal.signal(s, before)
