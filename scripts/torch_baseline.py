#!/usr/bin/env python3
"""PyTorch on the same work as Shoal, for the side-by-side benchmark.

The work: Fashion-MNIST read from the IDX files Shoal reads (pixels / 255,
no other normalisation), the MLP 784-256-128-10 or the CNN of `--model cnn`,
PyTorch's default init (which Shoal's init copies), SGD with momentum 0.9,
one epoch (`--epochs`). `--device cuda` puts the single-process run on a GPU.

  single: one process, `--threads` intra-op threads, every batch of the epoch.
  ddp:    `--world` processes with DistributedDataParallel over gloo on
          127.0.0.1; rank r trains on samples r, r+world, ... (Shoal's
          rank-strided partition), reshuffled per epoch, batch per rank.
  allreduce: `--world` processes over gloo on 127.0.0.1, no training: one
          all_reduce (sum) of `--mb` MB of f32 per round, one warm-up round
          then `--rounds` timed ones (the exchange `shoal bench exchange`
          measures on Shoal's side). Prints the median round's seconds and
          gb_per_s = MB / 1000 / seconds.

Prints one JSON object on stdout: samples_per_sec (training loop only, data
already in memory, process start excluded), accuracy on the 10k test set,
steps. Without torch it prints {"skipped": "..."} and exits 0.

Used by scripts/bench_pytorch.py; runnable alone:
  python3 scripts/torch_baseline.py --mode ddp --world 4 --data /usr/share/datasets/fashion-mnist
"""

import argparse
import gzip
import json
import math
import os
import struct
import sys
import time


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = struct.unpack(">I", raw[:4])[0]
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return raw[4 + 4 * ndim :], dims


def load(data_dir):
    import numpy as np

    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        img, dims = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
        lab, _ = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
        x = np.frombuffer(img, dtype=np.uint8).reshape(dims[0], 1, dims[1], dims[2]).astype(np.float32) / 255.0
        y = np.frombuffer(lab, dtype=np.uint8).astype(np.int64)
        out[split] = (x, y)
    return out


def build(model, torch):
    nn = torch.nn
    if model == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
        )
    # Shoal's CNN on 28x28: conv 5x5 pad 2 (1->16), relu, pool 2; conv 5x5 pad 2 (16->32), relu, pool 2;
    # linear 32*7*7 -> 128, relu, linear 128 -> 10.
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def evaluate(net, x, y, torch):
    net.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 512):
            correct += (net(x[i : i + 512]).argmax(1) == y[i : i + 512]).sum().item()
    return correct / len(x)


def train(rank, world, args, result_path):
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = load(args.data)
    device = torch.device(args.device)
    xtr, ytr = (torch.from_numpy(a).to(device) for a in data["train"])
    xte, yte = (torch.from_numpy(a).to(device) for a in data["test"])
    net = build(args.model, torch).to(device)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, nesterov=args.nesterov)
    loss_fn = torch.nn.CrossEntropyLoss()
    part = np.arange(rank, len(xtr), world)
    rng = np.random.default_rng(args.seed)
    batches = []
    per_epoch = 0
    for _ in range(max(1, args.epochs)):
        order = rng.permutation(part)
        batches += [
            torch.from_numpy(order[i : i + args.batch_size]).to(device) for i in range(0, len(order), args.batch_size)
        ]
        per_epoch = per_epoch or len(batches)
    if args.steps:
        batches = batches[: args.steps]
    if world > 1:
        dist.barrier()
    net.train()
    started = time.perf_counter()
    # From the second epoch on (first-use costs left out), as Shoal's
    # per-epoch lines after the first.
    steady_from = None
    for step, idx in enumerate(batches):
        if step == per_epoch and world == 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            steady_from = time.perf_counter()
        if args.cosine:
            # Shoal's `lr_decay = cosine`: from lr down to lr / 100 over the steps.
            floor = args.lr / 100
            t = min(step / len(batches), 1.0)
            for g in opt.param_groups:
                g["lr"] = floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * t))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
    if world > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ended = time.perf_counter()
    secs = ended - started
    samples = sum(len(b) for b in batches)
    steady = None
    if steady_from is not None and ended > steady_from:
        steady = sum(len(b) for b in batches[per_epoch:]) / (ended - steady_from)
    if rank == 0:
        acc = evaluate(net.module if world > 1 else net, xte, yte, torch)
        with open(result_path, "w") as f:
            json.dump(
                {"samples_per_sec": samples * world / secs, "steady_samples_per_sec": steady, "accuracy": acc,
                 "steps": len(batches), "secs": secs}, f
            )
    if world > 1:
        dist.destroy_process_group()


def allreduce(rank, world, args, result_path):
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = int(args.mb * 1e6) // 4
    x = torch.full((n,), float(rank + 1))
    secs = []
    for r in range(args.rounds + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(x)
        took = time.perf_counter() - started
        if r > 0:
            secs.append(took)
        x.fill_(float(rank + 1))
    # Every rank holds the sum of 1..world: a round that lost data would show.
    dist.all_reduce(x)
    want = world * (world + 1) / 2
    ok = bool(torch.all(x == want).item())
    # The slowest rank's time is the round's.
    worst = torch.tensor(secs)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = statistics.median(worst.tolist())
        with open(result_path, "w") as f:
            json.dump({"bytes": n * 4, "rounds": args.rounds, "secs": med, "secs_all": worst.tolist(),
                       "gb_per_s": n * 4 / 1e9 / med, "sum_correct": ok}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["single", "ddp", "allreduce"], default="single")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=0, help="cap on steps per rank (0: every step of --epochs)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--cosine", action="store_true", help="cosine decay to lr/100 over the steps (Shoal's lr_decay)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: cores / processes)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--epochs", type=int, default=1, help="epochs, each in a fresh order (--steps caps the total)")
    p.add_argument("--device", default="cpu", help="single mode: cpu or cuda[:N] (data and model on it)")
    p.add_argument("--mb", type=float, default=100.0, help="allreduce mode: MB (10^6 bytes) of f32 per round")
    p.add_argument("--rounds", type=int, default=5, help="allreduce mode: timed rounds after one warm-up")
    args = p.parse_args()
    if args.mode != "single" and args.device != "cpu":
        print("--device applies to --mode single only", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        print(json.dumps({"skipped": f"torch or numpy not installed ({e})"}))
        return 0
    import tempfile

    world = 1 if args.mode == "single" else args.world
    if world < 1:
        print("--world must be at least 1", file=sys.stderr)
        return 2
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        if args.mode == "allreduce" and (world < 2 or args.rounds < 1 or not (math.isfinite(args.mb) and args.mb > 0)):
            print("allreduce needs --world >= 2, --rounds >= 1 and a finite --mb > 0", file=sys.stderr)
            return 2
        if world == 1:
            train(0, 1, args, result)
        else:
            import torch.multiprocessing as mp

            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            fn = allreduce if args.mode == "allreduce" else train
            mp.spawn(fn, args=(world, args, result), nprocs=world, join=True)
        with open(result) as f:
            out = json.load(f)
    out.update({"mode": args.mode, "model": args.model, "world": world, "threads": args.threads, "device": args.device,
                "batch_size": args.batch_size, "torch": __import__("torch").__version__})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
