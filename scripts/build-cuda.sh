#!/usr/bin/env bash
# Build `shoal --features cuda` on a machine WITHOUT a GPU, for a Linux x86-64 machine
# with an NVIDIA driver for CUDA 13 (e.g. driver 580) and an sm_90 GPU (H100/H200).
# See docs/operations.md ("A CUDA build"). On 2 cores it takes 20-30 minutes, most of
# it nvcc compiling candle's kernels; CI does not run it.
#
# Needs: cargo, gcc, python3 with pip reaching PyPI. No apt packages, no GPU, no root.
# Run from the project's root:  scripts/build-cuda.sh
# Env: CUDA_COMPUTE_CAP (default 90), CARGO_TARGET_DIR (default target/cuda),
#      CUDA_PREFIX (default target/cuda-toolkit: the CUDA 13.0 tree assembled from PyPI wheels),
#      CUDNN (default 1: convolutions through cuDNN 9, from PyPI's nvidia-cudnn-cu13 wheel,
#      the feature `cudnn`; 0: without it).
#
# The binary links libcuda.so.1 (from the driver) and libcublas.so.13, libcublasLt.so.13,
# libcurand.so.10, libcudart.so.13, and with cuDNN libcudnn.so.9. On the GPU machine, point
# LD_LIBRARY_PATH at a CUDA 13 runtime and cuDNN 9, e.g. the lib/ folders of pip's wheels
# (nvidia/cu13/lib and nvidia/cudnn/lib in a venv holding torch for CUDA 13). The stripped
# binary is ~72 MB; gzip makes it ~20 MB.
set -euo pipefail
ROOT=$(pwd)
[ -f Cargo.toml ] && [ -d node ] || { echo "run from the project's root" >&2; exit 2; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target/cuda}
CUDA=${CUDA_PREFIX:-$ROOT/target/cuda-toolkit}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}

if [ ! -x "$CUDA/bin/nvcc" ]; then
  echo "== assembling a CUDA 13.0 tree from PyPI wheels in $CUDA"
  WHL=$(mktemp -d); PIP=$CUDA/pip
  rm -rf "$CUDA"; mkdir -p "$PIP" "$CUDA/lib64/stubs"
  # The oldest 13.0 libraries, so the binary needs nothing newer than a CUDA 13.0 driver has.
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHL" \
    --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --python-version 3.11 \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-cccl==13.0.85 \
    nvidia-cublas==13.0.0.19 nvidia-curand==10.4.0.35
  for w in "$WHL"/*.whl; do python3 -m zipfile -e "$w" "$PIP"; done
  P=$PIP/nvidia/cu13
  chmod +x "$P"/bin/* "$P"/nvvm/bin/*            # unzipping drops the exec bits
  for d in bin include nvvm; do ln -s "$P/$d" "$CUDA/$d"; done
  for f in "$P"/lib/*; do ln -s "$f" "$CUDA/lib64/"; done
  ( cd "$CUDA/lib64"
    ln -s libcublas.so.13 libcublas.so; ln -s libcublasLt.so.13 libcublasLt.so
    ln -s libcudart.so.13 libcudart.so; ln -s libcurand.so.10 libcurand.so
    ln -s libnvrtc.so.13 libnvrtc.so )
  # Link-time stand-in for the driver's libcuda.so.1: every cu* entry point of cuda.h.
  ( cd "$CUDA/lib64/stubs"
    gcc -E -P -D__CUDA_API_VERSION_INTERNAL=0 -I"$CUDA/include" "$CUDA/include/cuda.h" -o cuda_pp.h
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' cuda_pp.h | sed 's/\s*($//' | sort -u |
      while read -r s; do echo "int $s(void){return 34;}"; done > libcuda_stub.c
    gcc -shared -fPIC -o libcuda.so.1 -Wl,-soname,libcuda.so.1 libcuda_stub.c
    ln -sf libcuda.so.1 libcuda.so )
  rm -rf "$WHL"
fi

FEATURES=cuda
if [ "${CUDNN:-1}" = 1 ]; then
  FEATURES=cuda,cudnn
  if [ ! -e "$CUDA/lib64/libcudnn.so" ]; then
    echo "== adding cuDNN 9 for CUDA 13 from PyPI to $CUDA"
    WHL=$(mktemp -d); PIP=$CUDA/pip
    # The first cuDNN built for CUDA 13 (the one torch's CUDA 13 wheels took), for the same
    # reason as the 13.0 libraries above. No headers: cudarc carries its own bindings.
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHL" \
      --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --python-version 3.11 \
      nvidia-cudnn-cu13==9.13.0.50
    for w in "$WHL"/*.whl; do python3 -m zipfile -e "$w" "$PIP"; done
    for f in "$PIP"/nvidia/cudnn/lib/*; do ln -sf "$f" "$CUDA/lib64/"; done
    ln -sf libcudnn.so.9 "$CUDA/lib64/libcudnn.so"
    rm -rf "$WHL"
  fi
fi

echo "== building --features $FEATURES (cudarc reads the CUDA version from nvcc; candle-kernels uses nvcc from PATH)"
export CUDA_HOME=$CUDA PATH=$CUDA/bin:$PATH
nvcc --version | tail -1
cargo build --release -p shoal-node --features "$FEATURES"

OUT=$CARGO_TARGET_DIR/dist; mkdir -p "$OUT"
strip -o "$OUT/shoal" "$CARGO_TARGET_DIR/release/shoal"
gzip -9 -c "$OUT/shoal" > "$OUT/shoal.gz"
ls -l "$OUT/shoal" "$OUT/shoal.gz"
readelf -d "$OUT/shoal" | grep NEEDED
echo "on the GPU machine: gunzip -c shoal.gz > shoal; chmod +x shoal; LD_LIBRARY_PATH=<CUDA 13 and cuDNN 9 lib dirs> ./shoal train --device cuda"
