"""The raw records of a measured case: what ``requests.jsonl`` holds, one :class:`RequestRecord` per request, and
one client execution (:class:`ClientRun`: its records, its measurement window, the client's own integrity samples).

The streaming client (:mod:`servelab.measure.client`) fills them; everything downstream — request metrics, the case
record, the analyses, the pages — reads them from here (and ``requests.jsonl`` through :func:`read_records`), so a
reader of records never depends on the client that sends requests.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """The raw record of one request (what ``requests.jsonl`` holds, one per line)."""
    request_id: str
    index: int
    role: str
    expected_input_tokens: int
    requested_output_tokens: int
    api: str = "completions"
    repeat: int = 0
    group: int | None = None
    scheduled_ns: int = 0
    ready_ns: int = 0                        # open loop: the arrival timer fired (0 in records before it existed)
    dispatch_ns: int = 0
    send_ns: int = 0
    headers_ns: int | None = None
    end_ns: int = 0                          # stream closed (or error raised)
    wall_offset_ns: int = 0                  # wall_ns = perf_ns + wall_offset_ns
    http_status: int | None = None
    error: str = ""
    error_kind: str = ""                     # "" | http | timeout | connection | stream
    chunk_ns: list[int] = field(default_factory=list)
    chunk_text: list[str] = field(default_factory=list)
    chunk_choices: list[bool] = field(default_factory=list)   # the event had a non-empty choices list
    chunk_tokens: list[int | None] = field(default_factory=list)  # server token delta, None = not given
    done_ns: int | None = None               # "data: [DONE]" arrival; None = missing
    usage_ns: int | None = None              # arrival of the event that carried usage
    usage: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int | None = None         # from usage / meta_info
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    chunk_extra: list[dict[str, Any]] = field(default_factory=list)  # ClientConfig.keep_fields per chunk

    @property
    def ok(self) -> bool:
        return self.http_status == 200 and not self.error_kind

    @property
    def chunk_wall_ns(self) -> list[int]:
        return [t + self.wall_offset_ns for t in self.chunk_ns]

    @property
    def send_wall_ns(self) -> int:
        return self.send_ns + self.wall_offset_ns

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_wall_ns"] = self.chunk_wall_ns
        d["send_wall_ns"] = self.send_wall_ns
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class ClientRun:
    """One execution of the client: its records and the measurement window (perf_counter ns)."""
    records: list[RequestRecord]
    window_start_ns: int
    window_end_ns: int
    wall_offset_ns: int
    mode: str                                # closed | poisson | constant
    concurrency: int | None
    rate_rps: float | None
    client_cpu_s: float = 0.0                # process CPU time spent during the window
    loop_lag_ns: list[int] = field(default_factory=list)     # monitor: how late each wake-up came
    inflight: list[int] = field(default_factory=list)        # monitor: requests in flight at each wake-up
    monitor_interval_s: float = 0.0
    sizing: dict[str, Any] = field(default_factory=dict)     # min_duration_s, min_requests, issued, met
    event_loop: str = ""                     # uvloop | asyncio: the loop the run's reads were timed on
    # a run sent from several client processes (measure.multiclient): each process's own run, judged on its own
    processes: list["ClientRun"] = field(default_factory=list)
    process: str = ""                        # one process's run: which ("client process 2 of 4 (pid …)")

    @property
    def duration_s(self) -> float:
        return (self.window_end_ns - self.window_start_ns) / 1e9


def write_records(path: Any, records: list[RequestRecord], mode: str = "w") -> None:
    """Write records as JSON lines (flushed and fsynced: raw data first, summaries after)."""
    with open(path, mode) as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Any) -> list[RequestRecord]:
    """Read ``requests.jsonl``; raises ``ValueError`` naming the file and line on a bad line."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(RequestRecord.from_json(json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"{path}:{no}: not a request record ({exc})") from None
    return out
