"""The explain guide's example: Llama-2-70B planned for 16 nodes x 8 A100-80GB, as `xirang plan` prints it.

    python benchmarks/explain_llama70b.py

Runs ``xirang plan examples/catalog.py:llama2_70b --world 16x8 --global-batch 1024`` in this process
(Hugging Face's LlamaForCausalLM at Llama-2-70B's shape, on ``meta``) and prints exactly what the
command prints on stdout: the table of configurations, memory by pipeline rank, why this plan, the
runners-up and the notes. Every figure in it is a cost-model prediction, not a measurement.
``python benchmarks/make_docs.py record explain_llama70b`` records it and writes it into
docs/guides/explain.md (its ``recorded`` block), so the guide shows what the planner prints today.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is a folder of the repository

COMMAND = ["plan", "examples/catalog.py:llama2_70b", "--world", "16x8", "--global-batch", "1024"]


def main() -> int:
    import os

    from xirang.cli import main as xirang_main
    os.chdir(ROOT)  # the model path is relative to the repository, as in the guide
    return xirang_main(COMMAND)


if __name__ == "__main__":
    sys.exit(main())
