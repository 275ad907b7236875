"""Phase 2 telemetry read back: the collectors' raw files (written by :mod:`servelab.measure.telemetry`) parsed,
cut to a case's measurement window, summarised and drawn.

Every parser returns a tidy frame with ``frames.COLUMNS``: node, source, metric, device, ts_ns, value,
interval_ns — one row per sample per device. Metric names carry their unit (``power_w``, ``net_tx_gbps``).
``interval_ns`` is 0 for instantaneous readings and the averaging interval for rates (the sample then
describes ``(ts_ns - interval_ns, ts_ns]``).
"""
