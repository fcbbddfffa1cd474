#!/usr/bin/env bash
# Builds .venv-llamacpp/ in the repo root: a separate virtual environment with
# llama-cpp-python, the llama.cpp peer of scripts/bench_decode.py. The package
# compiles llama.cpp from source (cmake + a C++ compiler, ~20 minutes on
# 2 busy cores). Idempotent: rerunning only installs what is
# missing. Never touches .venv/.
# GGML_NATIVE=ON (-march=native) built a library that dies with SIGILL here: the CPU reports AMX and
# AVX-512, which the virtual machine does not fully enable, so the build targets AVX2 + FMA + F16C.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-llamacpp"
PYTHON="${PYTHON:-python3.11}"
LLAMACPP="llama-cpp-python==0.3.36"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        "$VENV/bin/python" -m pip install --quiet --no-cache-dir "$LLAMACPP"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
