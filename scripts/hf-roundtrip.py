#!/usr/bin/env python3
"""The round trip of a Llama through Hugging Face `transformers` and Shoal.

1. `transformers` writes a small LlamaForCausalLM with random weights
   (`save_pretrained`, safetensors, float32).
2. `shoal eval` on it must equal `transformers`' loss on the same text
   (Shoal's validation windows: the last 10% of the file, back to back,
   `context + 1` bytes each) within 0.5%.
3. Shoal fine-tunes it (`shoal train --init-hf ... --output-hf ...`).
4. `transformers` loads the result and gets the loss `shoal eval` printed,
   within 0.5%; the tokenizer Shoal wrote encodes text as its bytes.

Usage: hf-roundtrip.py SHOAL_BINARY TEXT_FILE WORK_DIR [--json PATH]
Exits 0 when every check holds; prints each figure.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONTEXT = 64


def windows(text: bytes, context: int) -> torch.Tensor:
    cut = round(len(text) * 0.9)
    valid = text[cut:]
    w = context + 1
    n = len(valid) // w
    return torch.tensor([list(valid[i * w:(i + 1) * w]) for i in range(n)], dtype=torch.long)


def hf_loss(model_dir: Path, text: bytes) -> float:
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    data = windows(text, CONTEXT)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.split(64):
            logits = model(input_ids=batch[:, :-1]).logits.double()
            targets = batch[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += targets.numel()
    return total / count


def shoal_eval(shoal: str, model_dir: Path, text_file: str) -> float:
    out = subprocess.run(
        [shoal, "eval", "--model", str(model_dir), "--dataset", f"text:{text_file}", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["loss"]


def main() -> int:
    shoal, text_file, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    json_path = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    text = Path(text_file).read_bytes()
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    )
    # Weights larger than the init's, so that the loss is far from uniform
    # and every layer matters.
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    source = work / "from-transformers"
    model.save_pretrained(source, safe_serialization=True)
    failures = []

    def check(name: str, a: float, b: float) -> None:
        rel = abs(a - b) / abs(b)
        ok = rel <= 0.005
        print(f"{name}: transformers {b:.6f}, shoal {a:.6f}, relative difference {rel:.2e} {'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(name)

    theirs = hf_loss(source, text)
    ours = shoal_eval(shoal, source, text_file)
    check("loss of the model transformers wrote", ours, theirs)

    tuned = work / "fine-tuned"
    subprocess.run(
        [shoal, "train", "--model", "llama", "--init-hf", str(source), "--dataset", f"text:{text_file}",
         "--steps", "40", "--eval-every", "40", "--batch-size", "16", "--lr", "1e-3", "--output-hf", str(tuned)],
        check=True, stdout=subprocess.DEVNULL,
    )
    after_ours = shoal_eval(shoal, tuned, text_file)
    after_theirs = hf_loss(tuned, text)
    check("loss of the model shoal fine-tuned", after_ours, after_theirs)
    if not after_theirs < theirs:
        print(f"fine-tuning did not lower the loss: {theirs:.4f} -> {after_theirs:.4f} FAILED")
        failures.append("fine-tuning")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tuned)
    sample = text[:300].decode("utf-8")
    ids = tok(sample)["input_ids"]
    if ids != list(sample.encode("utf-8")):
        print("the tokenizer Shoal wrote does not encode text as its bytes FAILED")
        failures.append("tokenizer")
    elif tok.decode(ids) != sample:
        print("the tokenizer Shoal wrote does not decode its bytes back to the text FAILED")
        failures.append("tokenizer")
    else:
        print("tokenizer.json: encodes 300 bytes of text as their bytes and decodes them back ok")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "transformers_loss": theirs, "shoal_loss": ours,
            "fine_tuned_transformers_loss": after_theirs, "fine_tuned_shoal_loss": after_ours,
            "failures": failures,
        }))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
