"""Phase 5 communication: nccl-tests runner and parser, NCCL INFO log parser, the transport gate,
the model's message sizes on the measured curves. ``python -m servelab.analyse.nccl --help`` for the CLI."""
