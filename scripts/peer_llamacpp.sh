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
# A library built with -march=native reports AVX512/AMX in its system info: rebuild that one too.
if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(b'AVX512 = 1' in llama_cpp.llama_print_system_info())" \
        2>/dev/null; then
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        "$VENV/bin/python" -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
        --no-binary llama-cpp-python "$LLAMACPP"
fi
# the library's own dependencies (pip install --no-deps above skips them), pinned
if ! "$VENV/bin/python" -c "import diskcache, jinja2, numpy, typing_extensions" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet diskcache==5.6.3 Jinja2==3.1.6 MarkupSafe==3.0.4 numpy==2.4.6 \
        typing_extensions==4.16.0
fi
# llama.cpp's OpenAI server (python -m llama_cpp.server, the peer of scripts/bench_serve_peers.py):
# the [server] extra's dependencies, pinned, installed beside the library (never rebuilding it).
if ! "$VENV/bin/python" -c "import llama_cpp.server.app" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet uvicorn==0.54.0 fastapi==0.165.0 pydantic-settings==2.16.3 \
        sse-starlette==3.7.0 starlette-context==0.3.6 PyYAML==6.0.4
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
