"""The compiled slice scanner (``analyse/trace/_scan.c``) is a fast path, not a second decoder: for every slice
it either hands the slice back (None) or yields exactly the frame and metadata events that msgspec's typed decode
gives. Checked on real traces (ours and, where present, the public ones), on hand-written edge cases and on
generated events of every shape the trace format allows (and some it does not)."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.analyse.trace import chunked as C, decode as D
from servelab.analyse.trace.chunked import parse_trace
from fuzz import examples

TP0 = "20261129203606-TP-0.trace.json.gz"


def _plain(frame: pl.DataFrame) -> pl.DataFrame:
    """Categoricals as strings: two frames built apart have their own category orders."""
    return frame.with_columns([pl.col(c).cast(pl.String) for c, t in frame.schema.items() if t == pl.Categorical])


def _same_as_msgspec(data: bytes, expect_native: bool | None = None) -> None:
    if expect_native is not None:
        assert (C._native.scan(data) is not None) == expect_native, data[:300]
    fast, slow = C._decode_chunk(data), C._decode_chunk(data, native=False)
    assert (fast is None) == (slow is None)
    if fast is None:
        return
    a, b = _plain(fast[0]), _plain(slow[0])
    assert a.schema == b.schema
    assert a.equals(b), [c for c in b.columns if not a[c].equals(b[c])]
    assert fast[1] == slow[1]


def _slices(path: Path, chunk_bytes: int) -> list[bytes]:
    out: list[bytes] = []
    got = C._stream_events(path, chunk_bytes, lambda i, data: out.append(data))
    assert got is not None and len(out) == got[2]
    return out


def test_the_scanner_is_built():
    """`make env` (pip install -e .) compiles it; without it the loader is correct but about 3× slower."""
    assert C._native is not None, "the trace scanner is not built: run `make env` (needs a C compiler)"


@pytest.mark.skipif(C._native is None, reason="the trace scanner is not built (test_the_scanner_is_built says why)")
class TestScanner:
    def test_real_slices(self, h200x2: Path):
        slices = [s for f in sorted((h200x2 / "traces").glob("*.trace.json.gz")) for s in _slices(f, 256 << 10)]
        assert len(slices) > 20
        for data in slices:
            _same_as_msgspec(data, expect_native=True)

    def test_public_traces(self, thirdparty: Path):
        files = sorted(thirdparty.rglob("*.json.gz"))
        assert files
        for f in files:
            events = json.loads(D._read_bytes(f)).get("traceEvents")
            if isinstance(events, list):
                for ascii_only in (True, False):
                    _same_as_msgspec(json.dumps(events, ensure_ascii=ascii_only).encode(), expect_native=True)

    def test_whole_parse_is_the_same_without_it(self, h200x2: Path, monkeypatch: pytest.MonkeyPatch):
        path = h200x2 / "traces" / TP0
        fast, meta_fast = parse_trace(path, workers=1)
        monkeypatch.setattr(C, "_native", None)
        slow, meta_slow = parse_trace(path, workers=1)
        assert _plain(fast).equals(_plain(slow)) and meta_fast == meta_slow

    @pytest.mark.parametrize("events, native", [
        ([], True),
        ([{}], True),                                                   # every field missing
        ([{"ph": "X", "name": "a\"b\\c\u00e9\u4e2d", "cat": "k\u00fc"}], True),     # escaped / non-ASCII: msgspec
        ([{"ph": "X", "pid": "Spans", "tid": "PyTorch Profiler"}], True),         # string pid / tid: pid_label
        ([{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "GPU 3", "labels": ["x"]}}], True),
        ([{"ph": "X", "cat": "kernel", "ts": 1, "dur": 0, "args": {"graph id": 1.0, "bytes": "8"}}], True),
        ([{"ph": "X", "cat": "gpu_memcpy", "args": {"bytes": 4096, "graph id": True}}], True),
        ([{"ts": 1e-7, "dur": 123456789012345678901234567890.5}, {"ts": -0.0, "dur": 5e300}], True),
        ([{"ts": 1711000000000000.123, "dur": 0.001}, {"ts": 4.9e-324}], True),
        ([{"cat": "kernel", "args": {"Collective name": "allreduce", "In msg nelems": 4, "dtype": "Float",
                                      "Process Group Ranks": [0, 1], "Seq": 9, "Group size": 2}}], True),
        ([{"args": {"Collective name": None, "External id": -1, "correlation": 2**63 - 1}}], True),
        ([{"args": {"External id": 2**63}}], False),                    # beyond int64: msgspec decides
        ([{"args": {"correlation": "7"}}], False),                      # a typed field of another type
        ([{"pid": 1.5}], False),
        ([{"cat": "gpu_memcpy", "args": {"bytes": 2**64}}], False),
        ([{"cat": "kernel", "args": {"Collective name": "x", "Seq": 2**70, "In msg nelems": -(2**63)}},
          {"cat": "kernel", "args": {"Collective name": "y", "Seq": -(2**64), "Group size": 2**63}}], True),
        ([{"ts": None}], False),
        ([{"args": None}], False),
        ([{"name": 3}], False),
        ([{"args": {"Collective name": 5}}], False),
        ([{"x": [[[[[]]]]], "y": {"z": [1, -2.5e-3, True, False, None, "s"]}, "ph": "X"}], True),
    ])
    def test_edge_cases(self, events: list, native: bool):
        for indent in (None, 2):
            _same_as_msgspec(json.dumps(events, indent=indent).encode(), expect_native=native)

    @pytest.mark.parametrize("text", [
        b"", b"[", b"[{}", b"[{},]", b"[{}] x", b"{}", b"[1]", b'[{"a":01}]', b'[{"a":1.}]', b'[{"a":-}]',
        b'[{"a":"\x01"}]', b'[{"a":"\\x"}]', b'[{"a":"\\u12g4"}]', b'[{"a":tru}]', b'[{"a" 1}]',
        b'[{"name":"\xff"}]', b'[{"name":"\xc3"}]', b'[{"a":"\xed\xa0\x80"}]', b'[{"a":1,}]', b"[" + b"[" * 600 + b"]" * 600 + b"]",
    ])
    def test_broken_text_goes_to_msgspec(self, text: bytes):
        assert C._native.scan(text) is None
        _same_as_msgspec(text)

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def test_generated_events(self, data):
        events = data.draw(st.lists(_event(typed=data.draw(st.booleans())), max_size=12))
        text = json.dumps(events, ensure_ascii=data.draw(st.booleans()), indent=data.draw(st.sampled_from([None, 1])))
        _same_as_msgspec(text.encode())


_INT64 = st.integers(-(2**63) + 1, 2**63 - 1)
_TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(["X", "M", "kernel", "ac2g", ""])
_JSON = st.recursive(st.none() | st.booleans() | _INT64 | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)


def _event(typed: bool):
    """One trace event: the fields the scanner reads with their trace types (``typed``), or any JSON value."""
    num = st.floats(allow_nan=False, allow_infinity=False) | _INT64
    def field(good):
        return good if typed else good | _JSON
    args = st.fixed_dictionaries({}, optional={
        "External id": field(_INT64), "correlation": field(_INT64), "Collective name": field(st.none() | _TEXT),
        "bytes": _JSON, "graph id": _JSON, "In msg nelems": _JSON, "Process Group Ranks": _JSON, "dtype": _JSON,
        "name": _JSON, "labels": _JSON, "Input Dims": _JSON})
    return st.fixed_dictionaries({}, optional={
        "ph": field(_TEXT), "cat": field(_TEXT), "name": field(_TEXT), "pid": field(_INT64 | _TEXT),
        "tid": field(_INT64 | _TEXT), "ts": field(num), "dur": field(num), "args": field(args), "id": _JSON,
        "extra": _JSON})
