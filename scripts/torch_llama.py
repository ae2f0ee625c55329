#!/usr/bin/env python3
"""transformers' LlamaForCausalLM on the same work as `shoal train --model llama`.

The work: a UTF-8 text file read as bytes (vocabulary 256); the last 10%
held out for validation in back-to-back windows; training windows of
context + 1 bytes at random offsets in the first 90%, 2 per `context`
bytes, reshuffled each epoch (Shoal's text data set). With --tokenizer
(a `tokenizer.json`, as `shoal train --tokenizer`), the text's tokens
instead, cut as Shoal cuts them: the last 10% of the tokens (at most
2^18) held out, windows of context + 1 tokens every `context` tokens,
bits per byte through the text's bytes per token. The model: the Llama of
models/src/llama.rs, as transformers' own `LlamaForCausalLM` with the same
config (RMS norm eps 1e-5, rope theta 10000, no biases, SiLU, tied head
unless --untied); AdamW (betas 0.9/0.999, eps 1e-8, weight decay 1e-4 on
every parameter, as Shoal's), `--steps` steps of `--batch-size` windows.

Prints one JSON object on stdout: tokens_per_sec and samples_per_sec
(training loop only, data already in memory, 3 untimed warm-up steps),
the validation loss in bits per byte, steps. Without torch or transformers
it prints {"skipped": "..."} and exits 0.

  python3 scripts/torch_llama.py --text models/data/gpl-3.0.txt --threads 2
"""

import argparse
import json
import math
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True)
    p.add_argument("--tokenizer", help="a tokenizer.json to cut the text with (default: bytes)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--ff", type=int, default=352)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                   help="bf16: matrix products under torch.autocast (f32 weights and optimizer state), as Shoal's --dtype bf16")
    args = p.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(json.dumps({"skipped": f"not installed: {e}"}))
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)

    data = open(args.text, "rb").read()
    text = data.decode("utf-8")
    ctx, window = args.context, args.context + 1
    g = torch.Generator().manual_seed(args.seed)
    if args.tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(args.tokenizer)
        ids = tok.encode(text).ids
        eos = tok.token_to_id("<|endoftext|>")
        if eos is not None:
            ids.append(eos)
        vocab, bytes_per_token = tok.get_vocab_size(), len(data) / len(ids)
        held = min(round(len(ids) * 0.1), 1 << 18)
        cut = len(ids) - held
        all_t = torch.tensor(ids, dtype=torch.long)
        windows = torch.stack([all_t[i * ctx : i * ctx + window] for i in range((cut - 1) // ctx)]).to(dev)
        valid_w = torch.stack([all_t[cut + i * ctx : cut + i * ctx + window] for i in range((held - 1) // ctx)]).to(dev)
    else:
        vocab, bytes_per_token = 256, 1.0
        cut = round(len(data) * 0.9)
        train, valid = data[:cut], data[cut:]
        count = max(1, 2 * len(train) // ctx)
        starts = torch.randint(0, len(train) - window + 1, (count,), generator=g)
        train_t = torch.tensor(list(train), dtype=torch.long)
        windows = torch.stack([train_t[s : s + window] for s in starts.tolist()]).to(dev)
        valid_t = torch.tensor(list(valid), dtype=torch.long)
        valid_w = valid_t[: len(valid) // window * window].view(-1, window).to(dev)
    n_valid = len(valid_w)

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.width, intermediate_size=args.ff, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=ctx,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=not args.untied,
    )
    model = LlamaForCausalLM(config).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)

    low = args.dtype == "bf16"

    def loss_of(w):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=low):
            logits = model(input_ids=w[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, vocab), w[:, 1:].reshape(-1))

    def batches():
        while True:
            for idx in torch.randperm(len(windows), generator=g).split(args.batch_size):
                yield windows[idx.to(dev)]

    it = batches()
    model.train()
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
    model.eval()
    with torch.no_grad():
        val = sum(loss_of(valid_w[i : i + 512]).item() * len(valid_w[i : i + 512]) for i in range(0, n_valid, 512))
    bpb = val / n_valid / math.log(2) / bytes_per_token
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
