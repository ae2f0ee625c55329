#!/usr/bin/env python3
"""An MLP trained with SGD by numpy alone: the independent reference that
Shoal's training steps are checked against (tests/tests/parity.rs).

    scripts/reference_sgd.py CASE.json > RESULT.json

CASE.json holds the initial layers ({"w": [out][in], "b": [out]}, PyTorch's
and candle's layout: y = x w^T + b, ReLU between layers), the samples
("x": [n][features], "y": [n] class labels), the batches (lists of row
indices into x, one per step) and the optimizer ({"lr", "momentum",
"nesterov", "weight_decay"}; PyTorch's SGD: b = mu*b + g + wd*p,
p -= lr * (g + wd*p + mu*b if nesterov else b)).

The loss is the mean softmax cross-entropy over each batch. Everything is
computed in float64, written out by hand (forward, backward, update), and
shares no code with Shoal or candle. RESULT.json holds the final layers and
each step's loss.
"""
import json
import sys

import numpy as np


def forward_backward(layers, x, y):
    acts = [x]
    for i, (w, b) in enumerate(layers):
        z = acts[-1] @ w.T + b
        acts.append(np.maximum(z, 0.0) if i + 1 < len(layers) else z)
    logits = acts[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    n = len(y)
    loss = -logp[np.arange(n), y].mean()
    grad = np.exp(logp)
    grad[np.arange(n), y] -= 1.0
    grad /= n
    grads = [None] * len(layers)
    for i in reversed(range(len(layers))):
        w, _ = layers[i]
        grads[i] = (grad.T @ acts[i], grad.sum(axis=0))
        if i > 0:
            grad = (grad @ w) * (acts[i] > 0)
    return loss, grads


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        case = json.load(f)
    layers = [(np.array(l["w"], dtype=np.float64), np.array(l["b"], dtype=np.float64)) for l in case["layers"]]
    x = np.array(case["x"], dtype=np.float64)
    y = np.array(case["y"], dtype=np.int64)
    opt = case["optimizer"]
    lr, mu, nesterov, wd = opt["lr"], opt["momentum"], opt["nesterov"], opt["weight_decay"]
    bufs = [(np.zeros_like(w), np.zeros_like(b)) for w, b in layers]
    losses = []
    for batch in case["batches"]:
        idx = np.array(batch, dtype=np.int64)
        loss, grads = forward_backward(layers, x[idx], y[idx])
        losses.append(float(loss))
        new_layers, new_bufs = [], []
        for (w, b), (gw, gb), (bw, bb) in zip(layers, grads, bufs):
            out_p, out_b = [], []
            for p, g, buf in ((w, gw, bw), (b, gb, bb)):
                g = g + wd * p
                buf = mu * buf + g
                d = g + mu * buf if nesterov else buf
                out_p.append(p - lr * d)
                out_b.append(buf)
            new_layers.append(tuple(out_p))
            new_bufs.append(tuple(out_b))
        layers, bufs = new_layers, new_bufs
    json.dump({"layers": [{"w": w.tolist(), "b": b.tolist()} for w, b in layers], "losses": losses}, sys.stdout)


if __name__ == "__main__":
    main()
