#!/usr/bin/env bash
# Builds .venv-llmc/ in the repo root: a separate virtual environment for the
# llm-compressor peer (scripts/peer_llmcompressor.py). llm-compressor pins
# transformers <= 5.17 and compressed-tensors == 0.19.0, which clash with the
# main .venv (transformers 5.24), so it lives on its own. Idempotent: rerunning
# only installs what is missing. Never touches .venv/.
#
# torch is pinned to 2.13.0 in EVERY pip command: a bare torch would pull a
# multi-GB CUDA build (here pip finds the 2.13.0+cpu wheel in its find-links).
#
# Versions this resolved to (2026-11-30, python 3.11.7):
#   llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0,
#   torch 2.13.0+cpu, datasets 5.2.0, accelerate 1.15.0, auto-round 0.15.1
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-llmc"
PYTHON="${PYTHON:-python3.11}"
TORCH="torch==2.13.0"
LLMC="llmcompressor==0.14.0.1"
TRANSFORMERS="transformers>=5.15.0,<=5.17.0"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "${PIP[@]}" "$TORCH"
fi
if ! "$VENV/bin/python" -c "import llmcompressor" 2>/dev/null; then
    "${PIP[@]}" "$TORCH" "$LLMC" "$TRANSFORMERS"
fi

"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
names = ["llmcompressor", "compressed-tensors", "transformers", "torch", "datasets", "accelerate"]
print(" ".join(f"{n}=={version(n)}" for n in names))
EOF
