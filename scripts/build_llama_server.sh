#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the CPU serving baseline of benchmarks/serving.py) from the
# llama.cpp vendored in the llama-cpp-python sdist, so it needs only the package registry, no
# GitHub and no network at build time.
#
#   scripts/build_llama_server.sh            # builds once, prints the binary's path (last line)
#   LLAMA_SERVER=$(scripts/build_llama_server.sh)
#   scripts/build_llama_server.sh --print-path   # only says where it goes (built or not)
#
# The binary lands in
#   ${ENGINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/engine}/llama.cpp/<version>-<cpu>/llama-server
# where <cpu> is a short hash of this CPU's /proc/cpuinfo flags line: the build is -march=native
# (GGML_NATIVE=ON), so a machine with other CPU features gets its own build. An existing binary
# is reused (nothing is downloaded or built). Progress goes to stderr; stdout is only the path.
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  llama-cpp-python sdist to build from   [0.3.36, llama.cpp 0.5.0-dev]
#   JOBS                      parallel compile jobs                  [2]
#   PYTHON                    python whose pip downloads the sdist   [.venv/bin/python, python3]
#   KEEP_BUILD=1              keep the build folder after installing
#   LLAMA_ISA=avx2            build for AVX2 + FMA + F16C only (no AVX-512), whatever this CPU
#                             has: llama.cpp as it runs on an AVX2-only EPYC, to compare the
#                             engine's AVX2 kernels (ENGINE_CPU_ISA=avx2) with; its own folder
#                             (<version>-avx2)
#
# Needs: cmake >= 3.14 (else `pip install cmake` into the venv is tried), a C and a C++ compiler
# (gcc/g++ or clang/clang++). Compiles under `nice -n 19`. Takes ~15-20 min on 2 cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ENGINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/engine}/llama.cpp"

log() { echo "build_llama_server: $*" >&2; }
die() { echo "build_llama_server: error: $*" >&2; exit 1; }

# --- where the binary goes: keyed by version and CPU features --------------------------------
if [[ -r /proc/cpuinfo ]] && grep -q -m1 '^flags' /proc/cpuinfo; then
    CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | sed 's/^flags[[:space:]]*:[[:space:]]*//')"
else
    CPU_FLAGS="$(uname -m) $(uname -s)"   # no /proc/cpuinfo (macOS, ...): per architecture
fi
CPU_HASH="$(printf '%s' "$CPU_FLAGS" | sha256sum | cut -c1-12)"
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON); TAG="$CPU_HASH" ;;
    avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                     -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
          TAG="avx2" ;;
    *) die "LLAMA_ISA=$ISA: expected native or avx2" ;;
esac
DEST_DIR="$CACHE/$VERSION-$TAG"
DEST="$DEST_DIR/llama-server"

case "${1:-}" in
    --print-path) echo "$DEST"; exit 0 ;;
    "") ;;
    *) die "unknown argument: $1 (usage: $0 [--print-path])" ;;
esac

if [[ -x "$DEST" ]]; then
    log "already built: $DEST"
    echo "$DEST"
    exit 0
fi

# --- tools -----------------------------------------------------------------------------------
if [[ -n "${PYTHON:-}" ]]; then
    :
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON="$ROOT/.venv/bin/python"
else
    PYTHON="$(command -v python3 || true)"
fi
[[ -n "$PYTHON" ]] || die "no python found to run pip (set PYTHON=...)"

cmake_ok() {  # cmake >= 3.14 (llama.cpp's cmake_minimum_required)
    local v
    v="$("$1" --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+' | head -1)" || return 1
    [[ -n "$v" ]] || return 1
    local major="${v%%.*}" minor="${v#*.}"
    (( major > 3 || (major == 3 && minor >= 14) ))
}
CMAKE_ENV="${CMAKE:-}"
CMAKE=""
for c in "$CMAKE_ENV" "$(command -v cmake || true)" "$(dirname "$PYTHON")/cmake"; do
    if [[ -n "$c" && -x "$c" ]] && cmake_ok "$c"; then CMAKE="$c"; break; fi
done
if [[ -z "$CMAKE" ]]; then
    log "no cmake >= 3.14 on PATH; trying: $PYTHON -m pip install cmake"
    if "$PYTHON" -m pip install --quiet cmake >&2 && [[ -x "$(dirname "$PYTHON")/cmake" ]]; then
        CMAKE="$(dirname "$PYTHON")/cmake"
    else
        die "cmake >= 3.14 is needed: install it (apt-get install cmake, or pip install cmake)"
    fi
fi

CXX_BIN="${CXX:-$(command -v g++ || command -v clang++ || command -v c++ || true)}"
CC_BIN="${CC:-$(command -v gcc || command -v clang || command -v cc || true)}"
[[ -n "$CXX_BIN" ]] && command -v "$CXX_BIN" >/dev/null \
    || die "no C++ compiler found (install g++ or clang++, e.g. apt-get install build-essential)"
[[ -n "$CC_BIN" ]] && command -v "$CC_BIN" >/dev/null \
    || die "no C compiler found (install gcc or clang, e.g. apt-get install build-essential)"
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

log "llama-cpp-python $VERSION -> $DEST"
log "cmake: $CMAKE ($("$CMAKE" --version | head -1)); CC=$CC_BIN; CXX=$CXX_BIN; jobs: $JOBS"

# --- source: the llama-cpp-python sdist's vendor/llama.cpp ----------------------------------
SRC_ROOT="$CACHE/src"
SRC="$SRC_ROOT/llama_cpp_python-$VERSION"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    mkdir -p "$SRC_ROOT"
    DL="$(mktemp -d "$SRC_ROOT/download.XXXXXX")"
    trap 'rm -rf "$DL"' EXIT
    log "downloading the llama-cpp-python==$VERSION sdist"
    "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps \
        -d "$DL" >&2 \
        || die "pip could not download the llama-cpp-python==$VERSION sdist"
    SDIST="$(ls "$DL"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)"
    [[ -n "$SDIST" ]] || die "pip download gave no llama_cpp_python-*.tar.gz in $DL"
    tar -xzf "$SDIST" -C "$DL"
    [[ -f "$DL/llama_cpp_python-$VERSION/vendor/llama.cpp/CMakeLists.txt" ]] \
        || die "the sdist has no vendor/llama.cpp"
    rm -rf "$SRC"
    mv "$DL/llama_cpp_python-$VERSION" "$SRC"
    rm -rf "$DL"
    trap - EXIT
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"

# --- build -----------------------------------------------------------------------------------
# Kept in the cache (not /tmp) so an interrupted build resumes where it stopped.
BUILD="$CACHE/build-$VERSION-$TAG"
START=$(date +%s)
# LLAMA_CURL: pre-0.4 llama.cpp downloads models with libcurl (deprecated and ignored later);
# LLAMA_OPENSSL: newer llama.cpp's HTTPS client; LLAMA_USE_PREBUILT_UI: newer llama.cpp
# fetches the web UI from Hugging Face at build time. All off: no network, no extra libraries.
# Static libraries, so the one installed file runs without the build folder.
nice -n 19 "$CMAKE" -S "$LLAMA_SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
    "${ISA_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    >&2 || die "cmake configure failed (build folder: $BUILD)"
nice -n 19 "$CMAKE" --build "$BUILD" --target llama-server -j "$JOBS" >&2 \
    || die "build failed (build folder: $BUILD; rerun to resume)"

BIN="$BUILD/bin/llama-server"
[[ -x "$BIN" ]] || BIN="$(find "$BUILD" -type f -name llama-server -perm -u+x | head -1)"
[[ -n "$BIN" && -x "$BIN" ]] || die "built, but no llama-server binary in $BUILD"
"$BIN" --version >&2 2>&1 || die "the built $BIN does not run"

mkdir -p "$DEST_DIR"
cp "$BIN" "$DEST.tmp.$$"
mv -f "$DEST.tmp.$$" "$DEST"
{
    echo "llama-cpp-python $VERSION (vendor/llama.cpp)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //')"
    echo "cpu flags: $CPU_FLAGS"
    echo "built: $(date -u +%FT%TZ) in $(( $(date +%s) - START ))s with $("$CXX_BIN" --version | head -1)"
} > "$DEST_DIR/BUILD_INFO"
[[ "${KEEP_BUILD:-0}" == 1 ]] || rm -rf "$BUILD"
log "built in $(( $(date +%s) - START ))s"
echo "$DEST"
