#!/usr/bin/env bash
# Builds .venv-llamacpp/ in the repo root: a separate virtual environment with
# llama-cpp-python, the llama.cpp peer of scripts/bench_decode.py. The package
# compiles llama.cpp from source (cmake + a C++ compiler, ~20 minutes on
# 2 busy cores). Idempotent: rerunning only installs what is
# missing. Never touches .venv/.
# GGML_NATIVE=ON (-march=native) built a library that dies with SIGILL here: the CPU reports AMX and
# AVX-512, which the virtual machine does not fully enable, so the build targets AVX2 + FMA + F16C.
# `peer_llamacpp.sh avx512` builds .venv-llamacpp-avx512/ instead: AVX-512 with VNNI and BF16 named
# one by one (no AMX), the peer of our VNNI kernels on CPUs that have them.
# `peer_llamacpp.sh tools` builds llama.cpp's own programs (llama-server, llama-bench,
# llama-perplexity) from the llama.cpp source inside the same PyPI sdist, with the same AVX2 flags,
# into .venv-llamacpp/bin/ (~15 minutes on 2 cores): the peers of scripts/bench_serve_peers.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
LLAMACPP="llama-cpp-python==0.3.36"
COMMON="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"
if [ "${1:-}" = tools ]; then
    BIN="$ROOT/.venv-llamacpp/bin"
    if "$BIN/llama-server" --version >/dev/null 2>&1 && "$BIN/llama-bench" --help >/dev/null 2>&1; then
        "$BIN/llama-server" --version 2>&1 | head -n 1
        exit 0
    fi
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$WORK" "$LLAMACPP"
    tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
    SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $COMMON -DGGML_AVX512=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >/dev/null
    cmake --build "$WORK/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target llama-server llama-bench llama-perplexity
    mkdir -p "$BIN"
    cp "$WORK"/build/bin/llama-server "$WORK"/build/bin/llama-bench "$WORK"/build/bin/llama-perplexity "$BIN/"
    "$BIN/llama-server" --version 2>&1 | head -n 1
    exit 0
fi

if [ "${1:-}" = avx512 ]; then
    VENV="$ROOT/.venv-llamacpp-avx512"
    FLAGS="$COMMON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"
    WANT=1   # the built library must report AVX512
else
    VENV="$ROOT/.venv-llamacpp"
    FLAGS="$COMMON -DGGML_AVX512=OFF"
    WANT=0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# (re)build unless the library reports AVX512 exactly when wanted (a -march=native build reports it)
if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(int(b'AVX512 = 1' in llama_cpp.llama_print_system_info()) != $WANT)" \
        2>/dev/null; then
    CMAKE_ARGS="${CMAKE_ARGS:-$FLAGS}" \
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
