"""Re-capture the greedy-output fixtures of this folder from real engines (see README.md).

    .venv/bin/python tests/data/greedy/capture.py llamacpp     # A, B batch_size=32, B --rope-freq-base 1000
    .venv/bin/python tests/data/greedy/capture.py sglang       # local-sglang (SGLang 0.5.23 on CPU)
    .venv/bin/python tests/data/greedy/capture.py vllm         # local-vllm (vLLM 0.32 on CPU)
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from servelab.deploy.targets import load_target
from servelab.measure.launch_variants import serving, with_launch

HERE = Path(__file__).resolve().parent
RUNS = {
    "llamacpp": ("local-tiny", [("llamacpp_a.json", {}), ("llamacpp_b_batch32.json", {"batch_size": 32}),
                                ("llamacpp_b_rope1000.json", {"extra_args": ["--rope-freq-base", "1000"]})]),
    "sglang": ("local-sglang", [("sglang_a.json", {})]),
    "vllm": ("local-vllm", [("vllm_a.json", {})]),
}


def main(which: str) -> None:
    name, variants = RUNS[which]
    target = load_target(name)
    for file, changes in variants:
        with tempfile.TemporaryDirectory() as logs:
            with serving(with_launch(target, changes) if changes else target, Path(logs)) as srv:
                out = srv.facts["greedy_outputs"]
        (HERE / file).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(file, out["seconds"], "s")


if __name__ == "__main__":
    main(sys.argv[1])
