#!/usr/bin/env python3
"""Shoal beside PyTorch on the same work, in one run (issue 14's table).

    python3 scripts/bench_pytorch.py [--shoal target/release/shoal] [--runs 3] [--json out.json]

Cases (Fashion-MNIST, SGD lr 0.05 momentum 0.9 Nesterov: Shoal's default
SGD; batch 64 per worker; one epoch split over the workers):
  mlp-1: `shoal train` against PyTorch in one process with as many threads;
  cnn-1: the same with the CNN;
  mlp-4: `shoal demo --nodes 4 --steps 235` (4 nodes in one process on
         loopback TCP, BSP) against DistributedDataParallel over gloo with 4
         processes on 127.0.0.1 (scripts/torch_baseline.py), both at the
         demo's defaults: lr 0.15 with cosine decay to lr/100;
  mlp-4k: the same at a constant lr 0.05 on both sides (issue 14's work);
  mlp-4c: the same at lr 0.2 (0.05 x 4 workers, the linear scaling rule)
         with cosine decay to lr/100, on both sides.
  exchange-4: `shoal bench exchange` (push and pull of a 100 MB model
         across 4 in-process nodes, f32; then int8 pushes with bf16 pulls)
         against gloo's all_reduce of the same 100 MB across 4 processes
         (scripts/torch_baseline.py --mode allreduce). Its "samples/s"
         column is the model's GB/s (bytes over a round's time; higher is
         better) and its accuracy columns are the compressed case's GB/s
         on Shoal's side and 0 on PyTorch's.
  llama-1: `shoal train --model llama` (4 layers, 4 query and 2 key/value
         heads, width 128, MLP 352, tied head, context 64; AdamW lr 2e-3;
         200 steps of 32 windows; 2 compute threads) against transformers'
         LlamaForCausalLM with the same config and 2 threads
         (scripts/torch_llama.py). Its "samples" are windows of 64 tokens;
         its "accuracy" column shows validation bits per byte (lower is
         better).
  llama-256: the same at issue 45's sizes over bytes: width 256, MLP 688,
         context 128, 100 steps of 16 windows (samples: windows of 128).
  llama-bpe: issue 45's measure whole: llama-256 over the tokens of a
         512-token byte-level BPE that `shoal data train-tokenizer` learns
         from the same text, given to both sides (`--tokenizer`).
With --device cuda the llama cases train on the GPU on both sides (a CUDA
build of Shoal, torch with CUDA); the other cases stay on the CPU. With
--dtype bf16 their matrix products are bf16 on both sides (Shoal's --dtype
bf16, PyTorch's autocast), weights and optimizer state f32.
Each case runs `--runs` times, alternating Shoal and PyTorch; the table shows
medians and the ratio Shoal / PyTorch of the medians. Accuracy is the test
accuracy after the epoch (for mlp-4: the lowest node's).

Without torch the script says so and exits 0: torch is optional (see
docs/benchmarks.md for how to install it).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def shoal_train(shoal, model, data):
    out = run([shoal, "train", "--dataset", "fashion-mnist", "--data-dir", data, "--model", model,
               "--optimizer", "sgd", "--lr", "0.05", "--epochs", "1", "--batch-size", "64"])
    sps = float(re.search(r"([0-9.]+) samples/s", out).group(1))
    acc = float(re.search(r"final test accuracy ([0-9.]+)%", out).group(1)) / 100
    return {"samples_per_sec": sps, "accuracy": acc}


def shoal_demo(shoal, data, extra=()):
    out = run([shoal, "demo", "--nodes", "4", "--dataset", "fashion-mnist", "--data-dir", data,
               "--batch-size", "64", "--steps", "235", *extra])
    rows = re.findall(r"test accuracy ([0-9.]+)% after .* ([0-9.]+) samples/s", out)
    if len(rows) != 4:
        raise SystemExit(f"could not read 4 nodes from shoal demo:\n{out}")
    return {"samples_per_sec": sum(float(s) for _, s in rows), "accuracy": min(float(a) for a, _ in rows) / 100}


TEXT = os.path.join(HERE, "..", "models", "data", "gpl-3.0.txt")


LLAMA_ARGS = ["--layers", "4", "--heads", "4", "--kv-heads", "2", "--width", "128", "--ff", "352",
              "--steps", "200", "--batch-size", "32"]
# The sizes of issue 45's measure (its 512-token vocabulary aside: bytes).
LLAMA_256_ARGS = ["--layers", "4", "--heads", "4", "--kv-heads", "2", "--width", "256", "--ff", "688",
                  "--steps", "100", "--batch-size", "16"]


def bpe_tokenizer(shoal, vocab=512):
    """A byte-level BPE of `vocab` tokens learnt from TEXT by Shoal, once per run."""
    path = os.path.join(bpe_tokenizer.dir.name, f"tokenizer-{vocab}.json")
    if not os.path.exists(path):
        run([shoal, "data", "train-tokenizer", "--vocab", str(vocab), "--output", path, TEXT])
    return path


bpe_tokenizer.dir = tempfile.TemporaryDirectory()


# --device: where the llama cases train (both sides); cpu unless told.
# --dtype: their matrix products' dtype (both sides); f32 unless told.
DEVICE = ["cpu"]
DTYPE = ["f32"]


def shoal_llama(shoal, threads, args=LLAMA_ARGS, context=64, tokenizer=None):
    extra = (["--tokenizer", tokenizer] if tokenizer else []) + ["--device", DEVICE[0], "--dtype", DTYPE[0]]
    out = run([shoal, "train", "--model", "llama", "--dataset", f"text@{context}:{TEXT}", "--eval-every",
               args[args.index("--steps") + 1], "--threads", str(threads), *extra, *args])
    sps = float(re.search(r"([0-9.]+) samples/s", out).group(1))
    bpb = float(re.search(r"final test bits/byte ([0-9.]+)", out).group(1))
    return {"samples_per_sec": sps, "accuracy": bpb}


def torch_llama(threads, args=LLAMA_ARGS, context=64, tokenizer=None):
    extra = (["--tokenizer", tokenizer] if tokenizer else []) + ["--device", DEVICE[0], "--dtype", DTYPE[0]]
    out = run([sys.executable, os.path.join(HERE, "torch_llama.py"), "--text", TEXT, "--threads", str(threads),
               "--context", str(context), *extra, *args])
    r = json.loads(out.strip().splitlines()[-1])
    if "skipped" in r:
        raise SystemExit(f"torch_llama.py: {r['skipped']}")
    return {"samples_per_sec": r["samples_per_sec"], "accuracy": r["bits_per_byte"]}


def shoal_exchange(shoal):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "exchange.json")
        run([shoal, "bench", "exchange", "--json", path])
        with open(path) as f:
            r = json.load(f)
    by = {c["case"]: c["effective_gb_per_s"] for c in r["cases"]}
    f32 = next(v for k, v in by.items() if k.startswith("f32"))
    small = next((v for k, v in by.items() if not k.startswith("f32")), 0.0)
    return {"samples_per_sec": f32, "accuracy": small}


def torch_allreduce():
    out = run([sys.executable, os.path.join(HERE, "torch_baseline.py"), "--mode", "allreduce", "--world", "4",
               "--mb", "100"])
    r = json.loads(out.strip().splitlines()[-1])
    if not r.get("sum_correct"):
        raise SystemExit(f"gloo's all_reduce gave a wrong sum: {r}")
    return {"samples_per_sec": r["gb_per_s"], "accuracy": 0.0}


def torch_case(args_list):
    out = run([sys.executable, os.path.join(HERE, "torch_baseline.py"), "--nesterov", *args_list])
    return json.loads(out.strip().splitlines()[-1])


def quality(case, value):
    """Accuracy as a percentage; a Llama's bits per byte and the exchange's GB/s as they are."""
    if case.startswith("llama"):
        return f"{value:>9.3f}b"
    if case.startswith("exchange"):
        return f"{value:>7.3f}GB/s"
    return f"{value * 100:>9.2f}%"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shoal", default=os.path.join(HERE, "..", "target", "release", "shoal"))
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cases", default="mlp-1,cnn-1,mlp-4,mlp-4k,llama-1")
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--device", default="cpu",
                   help="where the llama cases train, both sides: cpu, or cuda on a CUDA build of Shoal")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                   help="the llama cases' matrix products, both sides: f32, or bf16 (Shoal's --dtype, torch.autocast)")
    args = p.parse_args()
    DEVICE[0] = args.device
    DTYPE[0] = args.dtype
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skipped: torch is not installed (pip install torch numpy)")
        return 0
    if not os.path.exists(args.shoal):
        raise SystemExit(f"{args.shoal} not found: cargo build --release first, or pass --shoal")
    cores = os.cpu_count() or 1
    cases = {
        "mlp-1": (lambda: shoal_train(args.shoal, "mlp", args.data),
                  lambda: torch_case(["--mode", "single", "--model", "mlp", "--data", args.data])),
        "cnn-1": (lambda: shoal_train(args.shoal, "cnn", args.data),
                  lambda: torch_case(["--mode", "single", "--model", "cnn", "--data", args.data])),
        "mlp-4": (lambda: shoal_demo(args.shoal, args.data),
                  lambda: torch_case(["--mode", "ddp", "--world", "4", "--data", args.data,
                                      "--lr", "0.15", "--cosine"])),
        "mlp-4k": (lambda: shoal_demo(args.shoal, args.data, ["--lr", "0.05", "--lr-decay", "none"]),
                   lambda: torch_case(["--mode", "ddp", "--world", "4", "--data", args.data])),
        "mlp-4c": (lambda: shoal_demo(args.shoal, args.data, ["--lr", "0.2", "--lr-decay", "cosine"]),
                   lambda: torch_case(["--mode", "ddp", "--world", "4", "--data", args.data,
                                       "--lr", "0.2", "--cosine"])),
        "llama-1": (lambda: shoal_llama(args.shoal, min(2, cores)), lambda: torch_llama(min(2, cores))),
        "llama-256": (lambda: shoal_llama(args.shoal, min(2, cores), LLAMA_256_ARGS, 128),
                      lambda: torch_llama(min(2, cores), LLAMA_256_ARGS, 128)),
        "llama-bpe": (lambda: shoal_llama(args.shoal, min(2, cores), LLAMA_256_ARGS, 128, bpe_tokenizer(args.shoal)),
                      lambda: torch_llama(min(2, cores), LLAMA_256_ARGS, 128, bpe_tokenizer(args.shoal))),
        "exchange-4": (lambda: shoal_exchange(args.shoal), torch_allreduce),
    }
    results = {}
    print(f"shoal vs pytorch on {cores} cores, {args.runs} runs per case (medians)")
    print(f"{'case':<7} {'shoal smp/s':>12} {'torch smp/s':>12} {'ratio':>7} {'shoal acc':>10} {'torch acc':>10}")
    for name in args.cases.split(","):
        if name not in cases:
            raise SystemExit(f"unknown case {name}: expected one of {', '.join(cases)}")
        shoal_fn, torch_fn = cases[name]
        shoal_runs, torch_runs = [], []
        for _ in range(args.runs):
            shoal_runs.append(shoal_fn())
            torch_runs.append(torch_fn())
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        row = {
            "shoal_samples_per_sec": med(shoal_runs, "samples_per_sec"),
            "torch_samples_per_sec": med(torch_runs, "samples_per_sec"),
            "shoal_accuracy": med(shoal_runs, "accuracy"),
            "torch_accuracy": med(torch_runs, "accuracy"),
            "shoal_runs": shoal_runs,
            "torch_runs": torch_runs,
        }
        row["ratio"] = row["shoal_samples_per_sec"] / row["torch_samples_per_sec"]
        results[name] = row
        rate = ".3f" if name.startswith("exchange") else ".0f"
        print(f"{name:<7} {row['shoal_samples_per_sec']:>12{rate}} {row['torch_samples_per_sec']:>12{rate}} "
              f"{row['ratio']:>6.2f}x {quality(name, row['shoal_accuracy'])} {quality(name, row['torch_accuracy'])}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "pytorch", "cores": cores, "runs": args.runs, "cases": results}, f, indent=2)
        print(f"numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
