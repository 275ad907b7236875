"""Phase 5 communication: nccl-tests runner and parser, the model's message sizes on the measured curves.
The NCCL INFO log parser and the transport gate live in ``servelab.deploy.nccl_info`` and
``servelab.deploy.nccl_gate`` (every engine start of a gated target needs them). ``python -m servelab.analyse.nccl
--help`` for the CLI."""
