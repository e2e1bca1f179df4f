#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize from the sources vendored in
# the llama-cpp-python sdist, for the side-by-side bench (bench/bench_llamacpp.py).
#
#   scripts/build_llamacpp.sh            # builds once, then returns at once
#
# Binaries land in ${OSD_CACHE:-~/.cache/osd}/llama.cpp/<version>/bin. The sdist is the only
# download (PyPI through pip); the build runs under `nice -n 19` with 2 jobs (about 8 minutes
# on 2 idle cores; 13 minutes with other work running beside it). Environment:
# LLAMACPP_PY_VERSION (the sdist version, default 0.3.36), PYTHON (the interpreter whose pip
# downloads; default .venv/bin/python, else python3), LLAMACPP_JOBS (default 2).
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
JOBS="${LLAMACPP_JOBS:-2}"
CACHE="${OSD_CACHE:-$HOME/.cache/osd}/llama.cpp/$VERSION"
BIN="$CACHE/bin"
TARGETS=(llama-server llama-bench llama-quantize)

have_all() {
    local t
    for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

if have_all; then
    echo "llama.cpp $VERSION: cached in $BIN"
    exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if have_all; then  # another run built it while we waited for the lock
    echo "llama.cpp $VERSION: cached in $BIN"
    exit 0
fi

SDIST_DIR="$CACHE/sdist"
mkdir -p "$SDIST_DIR"
SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    echo "llama.cpp $VERSION: downloading the llama-cpp-python==$VERSION sdist"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
    SDIST="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz)"
fi

SRC="$CACHE/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    echo "llama.cpp $VERSION: extracting vendor/llama.cpp from $(basename "$SDIST")"
    rm -rf "$SRC" "$CACHE/extract"
    mkdir -p "$CACHE/extract"
    tar -xzf "$SDIST" -C "$CACHE/extract" --wildcards "*/vendor/llama.cpp/*"
    mv "$CACHE/extract"/llama_cpp_python-"$VERSION"/vendor/llama.cpp "$SRC"
    rm -rf "$CACHE/extract"
fi

BUILD="$CACHE/build"
echo "llama.cpp $VERSION: configuring in $BUILD"
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
# ggml's AMX tile kernels (built under -march=native where the CPU advertises AMX) fault
# with a general protection error at their first tile load on some virtual machines that
# advertise AMX (Sapphire Rapids guests), killing llama-server at its first prefill. They
# serve only multi-row matmuls (prefill, verify blocks; ggml decodes one row with
# AVX512-VNNI either way), so the build leaves them out: -mno-amx-* overrides -march=native.
NO_AMX=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "llama.cpp $VERSION: the CPU advertises AMX; building without ggml's AMX kernels"
fi
nice -n 19 cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$CACHE/configure.log" 2>&1 || {
    tail -30 "$CACHE/configure.log"
    exit 1
}

echo "llama.cpp $VERSION: building ${TARGETS[*]} with $JOBS jobs under nice -n 19 (8-15 minutes on 2 cores; log: $CACHE/build.log)"
START=$SECONDS
set +e
nice -n 19 cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" \
    2>&1 | tee "$CACHE/build.log" | grep --line-buffered -E '^\[[0-9]+/[0-9]+\]' \
    | awk '{ if (NR % 20 == 0) { print "  " $1 " " $NF; fflush() } }'
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    tail -40 "$CACHE/build.log"
    echo "llama.cpp $VERSION: build failed (log: $CACHE/build.log)" >&2
    exit "$status"
fi

mkdir -p "$BIN.tmp"
for t in "${TARGETS[@]}"; do
    cp "$BUILD/bin/$t" "$BIN.tmp/$t"
done
rm -rf "$BIN"
mv "$BIN.tmp" "$BIN"
echo "$VERSION" >"$BIN/VERSION"
echo "llama.cpp $VERSION: built in $((SECONDS - START)) s, binaries in $BIN"
