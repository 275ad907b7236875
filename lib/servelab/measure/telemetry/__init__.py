"""Phase 2 telemetry acquisition: what each collector runs on a node (``collectors``), starting and stopping a case's
collectors on every node around its measurement window (``runner``), the stdlib-only sampler sent to the nodes
(``sampler_program``). Reading, windowing and summarising what they wrote is :mod:`servelab.analyse.telemetry`.
"""
