#!/usr/bin/env bash
# Build the `shoal:testnet` Docker image without pulling anything from a registry.
#
#   testnet/docker/build-image.sh
#
# 1. builds `cargo build --release -p shoal-node` (skipped when SHOAL_BIN
#    points at an existing binary);
# 2. assembles a root file system in target/shoal-image/rootfs: /shoal (debug
#    info stripped unless SHOAL_STRIP=0), every shared library `ldd` lists
#    (copied to the same absolute path, the dynamic loader included), the
#    fixed testnet identity of node0 in /keys/node0.key, and an empty /tmp;
# 3. `docker build`s testnet/docker/Dockerfile (FROM scratch) on it.
#
# Environment: SHOAL_BIN (use this binary, do not build), SHOAL_IMAGE (tag,
# default shoal:testnet), SHOAL_STRIP (1 default, 0 keeps debug info).
# Idempotent: reruns rebuild the root file system and let Docker's cache
# reuse the layer when nothing changed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

image="${SHOAL_IMAGE:-shoal:testnet}"
strip_bin="${SHOAL_STRIP:-1}"
say() { printf '[build-image] %s\n' "$*"; }

# The bootstrap node's identity: 32 bytes (an ed25519 secret seed). It is a
# public, test-only key so that the compose file can name node0's peer id.
# Changing it changes the peer id below and in testnet/docker-compose.yml.
node0_seed='shoal-docker-testnet-node0-key!!'
node0_peer='12D3KooWSsfpkTY79hyrLKYUKqoawdsmvBEJ2Qeq9P2n8q9wiGWp'

if [[ -n "${SHOAL_BIN:-}" ]]; then
    bin="$SHOAL_BIN"
    [[ -x "$bin" ]] || { echo "[build-image] error: SHOAL_BIN=$bin is not an executable file" >&2; exit 1; }
    say "using SHOAL_BIN=$bin (not building)"
else
    say "cargo build --release -p shoal-node"
    cargo build --release -p shoal-node
    bin="$root/target/release/shoal"
fi

command -v ldd >/dev/null || { echo "[build-image] error: ldd not found" >&2; exit 1; }
command -v docker >/dev/null || { echo "[build-image] error: docker not found" >&2; exit 1; }

ctx="$root/target/shoal-image"
rootfs="$ctx/rootfs"
say "assembling $rootfs"
rm -rf "$ctx"
mkdir -p "$rootfs/tmp" "$rootfs/keys"
chmod 1777 "$rootfs/tmp"

if [[ "$strip_bin" != 0 ]] && command -v strip >/dev/null; then
    say "copying $bin -> /shoal (strip --strip-debug)"
    strip --strip-debug -o "$rootfs/shoal" "$bin"
else
    say "copying $bin -> /shoal"
    cp "$bin" "$rootfs/shoal"
fi
chmod 0755 "$rootfs/shoal"

# Every library ldd resolves: "name => /path (addr)" or "/path (addr)" (the
# loader). linux-vdso has no file and is skipped. A "not found" is fatal.
if ldd "$bin" | grep -q 'not found'; then
    ldd "$bin" >&2
    echo "[build-image] error: the binary needs a library that is not installed" >&2
    exit 1
fi
libs="$(ldd "$bin" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) { print $i; break } }')"
for lib in $libs; do
    dest="$rootfs$lib"
    mkdir -p "$(dirname "$dest")"
    # -L: copy the file a symlink points at, under the name ldd printed.
    cp -L "$lib" "$dest"
    say "copied library $lib"
done
# /lib64/ld-linux-x86-64.so.2 is the PT_INTERP path; make sure it is there even
# if ldd printed it under another name.
interp="$( (readelf -l "$bin" 2>/dev/null || true) | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
if [[ -n "$interp" && ! -e "$rootfs$interp" ]]; then
    mkdir -p "$(dirname "$rootfs$interp")"
    cp -L "$interp" "$rootfs$interp"
    say "copied loader $interp"
fi

printf '%s' "$node0_seed" > "$rootfs/keys/node0.key"
[[ "$(wc -c < "$rootfs/keys/node0.key")" -eq 32 ]] || { echo "[build-image] error: node0 seed must be 32 bytes" >&2; exit 1; }
chmod 0444 "$rootfs/keys/node0.key"
say "wrote /keys/node0.key (peer id $node0_peer)"

say "rootfs: $(du -sh "$rootfs" | cut -f1)"
say "docker build -t $image -f testnet/docker/Dockerfile $ctx"
# No buildx here: the classic builder is enough for FROM scratch + COPY.
docker build -t "$image" -f "$here/Dockerfile" "$ctx"

# Smoke-check the image: the binary starts (loader and libraries resolve).
say "checking: docker run --rm --network none $image --version"
docker run --rm --network none "$image" --version
say "image $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{ printf "%.1f MB", $1 / 1e6 }')"
