#!/usr/bin/env bash
# Cross-builds `shoal` for aarch64 Linux (CPU backend) on an x86-64 Debian or
# Ubuntu machine, and prints the binary's path on its last line.
#
#   scripts/build-aarch64.sh [--profile release|cross]   (default: cross)
#
# The `cross` profile (Cargo.toml) is release with opt-level 1 and no debug
# info: it compiles in about half the time, which is what CI runs under qemu.
# Ship `--profile release` to real boards.
#
# Needs: rustup's aarch64-unknown-linux-gnu target and Debian's
# gcc-aarch64-linux-gnu (installed here when missing and running as root).
# Only the path goes to stdout (callers take it with `$(...)`): everything
# else, the installers' output included, goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=cross
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="${2:?--profile needs a value}"; shift 2 ;;
    *) echo "build-aarch64.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

target=aarch64-unknown-linux-gnu
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >&2
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    {
      apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
        || { apt-get update && apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross; }
    } >&2
  else
    echo "build-aarch64.sh: aarch64-linux-gnu-gcc is missing: apt-get install gcc-aarch64-linux-gnu" >&2
    exit 1
  fi
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
cargo build --profile "$profile" -p shoal-node --bin shoal --target "$target" >&2

dir="$profile"
[ "$profile" = dev ] && dir=debug
echo "target/$target/$dir/shoal"
