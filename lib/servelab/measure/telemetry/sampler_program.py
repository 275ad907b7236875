"""A stdlib-only program that collectors send to a node as ``python3 -c <source> <json config>``.

Nodes of a cluster do not have servelab installed, and commands are argv lists (never shell strings),
so periodic sampling that no standard tool does by itself runs through this small program. Its source
is read with ``sampler_source()`` and passed as one argv element; the JSON config is the next one.

Modes (``config["mode"]``):

- ``commands``: every ``interval_s``, run each argv of ``commands`` and write one framed block
  per command: ``### ts_ns=<int> rc=<int> argv=<json>`` then the command's output verbatim.
  Used for ``ethtool -S <dev>`` and ``numastat -p <pid>`` time series.
- ``files``: every ``interval_s``, read each path of ``files`` (cumulative counters such as
  ``/sys/class/infiniband/<hca>/ports/<p>/counters/port_xmit_data``) and write one block:
  ``### ts_ns=<int> files`` then ``<path> <value>`` lines (``<path> ERR <reason>`` when unreadable).
- ``stamp``: run ``argv`` once and prefix every line of its stdout with the receive time
  ``<ts_ns> `` (``dcgmi dmon`` prints no timestamps of its own).

``ts_ns`` is ``time.time_ns()`` on the node (wall clock, UTC epoch, ns). The program exits with
status 3 when nothing it samples exists (so a required collector fails closed), stops on SIGTERM
or SIGINT, and flushes after every block so that a killed sampler leaves complete blocks behind.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

STOP = []


def _stop(signum, frame):
    STOP.append(signum)


def _sleep_until(deadline_ns):
    while not STOP:
        left = (deadline_ns - time.time_ns()) / 1e9
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def run_commands(cfg, out):
    interval_ns = int(float(cfg.get("interval_s", 1.0)) * 1e9)
    commands = cfg["commands"]
    next_ns = time.time_ns()
    while not STOP:
        for argv in commands:
            ts = time.time_ns()
            try:
                proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, interval_ns / 1e9), check=False)
                rc, text = proc.returncode, proc.stdout.decode("utf-8", "replace")
            except FileNotFoundError:
                out.write("### ts_ns=%d rc=127 argv=%s\nnot found: %s\n" % (ts, json.dumps(argv), argv[0]))
                out.flush()
                return 127
            except subprocess.TimeoutExpired:
                rc, text = 124, "timeout\n"
            out.write("### ts_ns=%d rc=%d argv=%s\n" % (ts, rc, json.dumps(argv)))
            out.write(text if text.endswith("\n") or not text else text + "\n")
        out.flush()
        next_ns += interval_ns
        _sleep_until(next_ns)
    return 0


def run_files(cfg, out):
    interval_ns = int(float(cfg.get("interval_s", 1.0)) * 1e9)
    files = []
    for pattern in cfg["files"]:
        files += sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else \
            ([pattern] if os.path.exists(pattern) else [])
    if not files:
        out.write("### no file exists: %s\n" % json.dumps(cfg["files"][:8]))
        out.flush()
        return 3
    next_ns = time.time_ns()
    while not STOP:
        ts = time.time_ns()
        lines = ["### ts_ns=%d files" % ts]
        for path in files:
            try:
                with open(path) as f:
                    lines.append("%s %s" % (path, f.read().strip()))
            except OSError as exc:
                lines.append("%s ERR %s" % (path, exc.strerror or exc))
        out.write("\n".join(lines) + "\n")
        out.flush()
        next_ns += interval_ns
        _sleep_until(next_ns)
    return 0


def run_stamp(cfg, out):
    try:
        proc = subprocess.Popen(cfg["argv"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        out.write("not found: %s\n" % cfg["argv"][0])
        out.flush()
        return 127
    for raw in iter(proc.stdout.readline, b""):
        out.write("%d %s" % (time.time_ns(), raw.decode("utf-8", "replace")))
        out.flush()
        if STOP:
            break
    if STOP and proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main(argv):
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cfg = json.loads(argv[1])
    out = sys.stdout
    mode = cfg.get("mode")
    if mode == "commands":
        return run_commands(cfg, out)
    if mode == "files":
        return run_files(cfg, out)
    if mode == "stamp":
        return run_stamp(cfg, out)
    out.write("unknown sampler mode %r\n" % (mode,))
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
