#!/usr/bin/env bash
# Make Fashion-MNIST available, the same two ways `shoal data fetch fashion-mnist` does:
#   - as root: apt-get install -y dataset-fashion-mnist  (-> /usr/share/datasets/fashion-mnist)
#   - otherwise: apt-get download + dpkg-deb -x into ./data (or $1)
# Then verify the decompressed sizes.
set -euo pipefail

PKG=dataset-fashion-mnist
SYS=/usr/share/datasets/fashion-mnist
DEST=${1:-data}

verify() {
  local dir=$1 ok=0
  while read -r name size; do
    local got
    got=$(gzip -dc "$dir/$name" | wc -c) || { echo "cannot read $dir/$name" >&2; return 1; }
    if [ "$got" != "$size" ]; then
      echo "$dir/$name decompresses to $got bytes, expected $size" >&2
      ok=1
    fi
  done <<LIST
train-images-idx3-ubyte.gz 47040016
train-labels-idx1-ubyte.gz 60008
t10k-images-idx3-ubyte.gz 7840016
t10k-labels-idx1-ubyte.gz 10008
LIST
  return $ok
}

if [ -f "$SYS/train-images-idx3-ubyte.gz" ]; then
  verify "$SYS" && { echo "fashion-mnist present and verified in $SYS"; exit 0; }
fi

if [ "$(id -u)" = 0 ]; then
  apt-get install -y "$PKG" || { apt-get update && apt-get install -y "$PKG"; }
  verify "$SYS"
  echo "fashion-mnist installed and verified in $SYS"
else
  mkdir -p "$DEST/.download"
  (cd "$DEST/.download" && apt-get download "$PKG")
  dpkg-deb -x "$DEST"/.download/"$PKG"_*.deb "$DEST"
  rm -rf "$DEST/.download"
  verify "$DEST/usr/share/datasets/fashion-mnist"
  echo "fashion-mnist extracted and verified in $DEST/usr/share/datasets/fashion-mnist"
fi
