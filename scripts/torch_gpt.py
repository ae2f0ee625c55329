#!/usr/bin/env python3
"""PyTorch on the same language-model work as `shoal train --model gpt`.

The work: a UTF-8 text file read as bytes (vocabulary 256); the last 10%
held out for validation in back-to-back windows; training windows of
context + 1 bytes at random offsets in the first 90%, 2 per `context`
bytes, reshuffled each epoch (Shoal's text data set, models/src/data/text.rs);
the GPT of models/src/gpt.rs (pre-layer-norm blocks of causal self-attention
and a 4x GELU MLP, a head tied to the token embedding, GPT-2 init);
AdamW (betas 0.9/0.999, eps 1e-8, weight decay 1e-4 on every parameter, as
Shoal's), `--steps` steps of `--batch-size` windows.

Prints one JSON object on stdout: tokens_per_sec and samples_per_sec
(training loop only, data already in memory), the validation loss in bits
per byte, steps. Without torch it prints {"skipped": "..."} and exits 0.

  python3 scripts/torch_gpt.py --text models/data/gpl-3.0.txt --layers 4 --heads 4 --width 128
"""

import argparse
import json
import math
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError:
        print(json.dumps({"skipped": "torch is not installed"}))
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)

    data = open(args.text, "rb").read()
    data.decode("utf-8")  # the same check as Shoal's
    cut = round(len(data) * 0.9)
    train, valid = data[:cut], data[cut:]
    ctx, window = args.context, args.context + 1
    g = torch.Generator().manual_seed(args.seed)
    count = max(1, 2 * len(train) // ctx)
    starts = torch.randint(0, len(train) - window + 1, (count,), generator=g)
    train_t = torch.tensor(list(train), dtype=torch.long)
    windows = torch.stack([train_t[s : s + window] for s in starts.tolist()]).to(dev)
    valid_t = torch.tensor(list(valid), dtype=torch.long)
    n_valid = len(valid) // window
    valid_w = valid_t[: n_valid * window].view(n_valid, window).to(dev)

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.h = h

        def forward(self, x):
            n, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(n, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.width
            self.wte, self.wpe = nn.Embedding(256, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d, args.heads) for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(d)
            for name, prm in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(prm)
                elif "ln" in name:
                    nn.init.ones_(prm)
                else:
                    std = 0.02 / (math.sqrt(2 * args.layers) if name.endswith("proj.weight") else 1)
                    nn.init.normal_(prm, 0.0, std)

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
            for b in self.blocks:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.t()

    model = Gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)

    def loss_of(w):
        logits = model(w[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))

    def batches():
        while True:
            for idx in torch.randperm(len(windows), generator=g).split(args.batch_size):
                yield windows[idx.to(dev)]

    it = batches()
    for _ in range(3):  # warm-up, not timed (Shoal's bench does the same)
        loss_of(next(it)).backward()
        opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    samples = 0
    for _ in range(args.steps):
        w = next(it)
        loss = loss_of(w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        samples += len(w)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    with torch.no_grad():
        val = sum(loss_of(valid_w[i : i + 512]).item() * len(valid_w[i : i + 512]) for i in range(0, n_valid, 512))
    bpb = val / n_valid / math.log(2)
    print(json.dumps({
        "samples_per_sec": samples / secs,
        "tokens_per_sec": samples * ctx / secs,
        "bits_per_byte": bpb,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
