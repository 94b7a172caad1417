#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-batched-bench and llama-quantize once, into
# peers/llama.cpp-<version>/bin under localpaged's cache folder, from the llama.cpp sources
# vendored in the llama-cpp-python sdist (pip downloads it; nothing else is fetched).
# The benchmarks compare against these binaries; they are never a dependency of localpaged.
# About 10 minutes on two cores. Run again: it does nothing when the binaries are there.
set -euo pipefail
PY=${PY:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PEERS=$("$PY" -c 'from localpaged import locations; print(locations.peers_cache_dir())')
DEST="$PEERS/llama.cpp-$VERSION"
BINARIES=(llama-server llama-batched-bench llama-quantize)

if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-batched-bench" ] && [ -x "$DEST/bin/llama-quantize" ]; then
    echo "llama.cpp (from llama-cpp-python $VERSION) is built: $DEST/bin"
    exit 0
fi
WORK=$(mktemp -d "$PEERS/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "downloading the llama-cpp-python $VERSION sdist ..."
"$PY" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
echo "building ${BINARIES[*]} (about 10 minutes on two cores) ..."
# -march=native, less AMX: on the virtual machines this runs on the CPU reports amx_tile and the kernel
# grants the permission, yet the first tile instruction faults (llama-server died with SIGILL in
# ggml's AMX matmul, tilezero). localpaged's kernels use no AMX either, so the comparison stays like
# for like. GCC lets an explicit -mno-* win over -march=native whatever their order.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF > "$WORK/cmake.log" 2>&1 || { tail -20 "$WORK/cmake.log"; exit 1; }
cmake --build "$WORK/build" -j "$(nproc)" --target "${BINARIES[@]}" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
mkdir -p "$DEST/bin"
for b in "${BINARIES[@]}"; do install -m 0700 "$WORK/build/bin/$b" "$DEST/bin/$b"; done
echo "built: $DEST/bin"
