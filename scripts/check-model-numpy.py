#!/usr/bin/env python3
"""Read a Shoal model file with numpy alone and check its accuracy.

    scripts/check-model-numpy.py MODEL.safetensors FASHION_MNIST_DIR EXPECTED_ACCURACY

The model file is plain safetensors: an 8-byte little-endian header length,
a JSON header (tensor names, dtypes, shapes, byte offsets, and Shoal's
metadata), then raw little-endian data. This script parses it by hand, runs
the MLP's forward pass on the Fashion-MNIST test split (images scaled to
[0, 1], as Shoal does), and exits non-zero unless its accuracy is within 0.1
points of EXPECTED_ACCURACY (a fraction, from `shoal eval --json`). It proves
that software outside Rust can use what Shoal trains.
"""
import gzip
import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n :]
    tensors = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {t['dtype']}, expected F32")
        lo, hi = t["data_offsets"]
        tensors[name] = np.frombuffer(data[lo:hi], dtype="<f4").reshape(t["shape"])
    return tensors, meta


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw[4 + 4 * ndim :], dtype=np.uint8).reshape(dims)


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    model_path, data_dir, expected = sys.argv[1], sys.argv[2], float(sys.argv[3])
    tensors, meta = read_safetensors(model_path)
    if meta.get("shoal.format") != "shoal-model-1":
        raise SystemExit(f"{model_path}: not a Shoal model file (format {meta.get('shoal.format')!r})")
    config = json.loads(meta["shoal.model"])
    if config["arch"]["kind"] != "mlp":
        raise SystemExit(f"this check runs MLPs; the file holds {config['arch']['kind']}")
    layers = len(config["arch"]["hidden"]) + 1
    images = read_idx(f"{data_dir}/t10k-images-idx3-ubyte.gz").reshape(-1, 28 * 28).astype(np.float32) / 255.0
    labels = read_idx(f"{data_dir}/t10k-labels-idx1-ubyte.gz")
    x = images
    for i in range(layers):
        w, b = tensors[f"fc{i}.weight"], tensors[f"fc{i}.bias"]  # w: [out, in]
        x = x @ w.T + b
        if i < layers - 1:
            x = np.maximum(x, 0.0)
    accuracy = float((x.argmax(axis=1) == labels).mean())
    print(
        f"numpy: {model_path} ({len(tensors)} tensors, run {meta.get('shoal.run_id')}, step {meta.get('shoal.step')}) "
        f"accuracy {accuracy * 100:.2f}% on {len(labels)} test images; shoal eval said {expected * 100:.2f}%"
    )
    if abs(accuracy - expected) > 0.001:
        raise SystemExit(f"accuracy differs from shoal eval by {abs(accuracy - expected) * 100:.2f} points (limit 0.1)")


if __name__ == "__main__":
    main()
