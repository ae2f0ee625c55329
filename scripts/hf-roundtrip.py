#!/usr/bin/env python3
"""The round trip of a Llama through Hugging Face `transformers` and Shoal,
over bytes and over a BPE tokenizer that Shoal trained.

For each vocabulary:
1. `transformers` writes a small LlamaForCausalLM with random weights
   (`save_pretrained`, safetensors, float32); for the BPE, the
   `tokenizer.json` of `shoal data train-tokenizer` goes beside it.
2. `shoal eval` on it must equal `transformers`' loss on the same text
   within 0.5%. Both read the whole text in consecutive windows of
   `context + 1` tokens (the BPE's ids from the `tokenizers` library,
   with the end-of-text token after the text, as Shoal cuts a document).
3. Shoal fine-tunes it (`shoal train --init-hf ... --output-hf ...`).
4. `transformers` loads the result and gets the loss `shoal eval` printed,
   within 0.5%; `AutoTokenizer` loads the tokenizer Shoal wrote and
   encodes text as Shoal does.

Usage: hf-roundtrip.py SHOAL_BINARY TEXT_FILE WORK_DIR [--json PATH]
Exits 0 when every check holds; prints each figure.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

CONTEXT = 64
BPE_VOCAB = 512


def windows(ids: list, context: int) -> torch.Tensor:
    w = context + 1
    n = len(ids) // w
    return torch.tensor([ids[i * w:(i + 1) * w] for i in range(n)], dtype=torch.long)


def hf_loss(model_dir: Path, ids: list) -> float:
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    data = windows(ids, CONTEXT)
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


def random_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
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
    return model


def main() -> int:
    shoal, text_file, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    json_path = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    text = Path(text_file).read_bytes()
    failures = []
    figures = {}

    def check(name: str, a: float, b: float) -> None:
        rel = abs(a - b) / abs(b)
        ok = rel <= 0.005
        print(f"{name}: transformers {b:.6f}, shoal {a:.6f}, relative difference {rel:.2e} {'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(name)

    def round_trip(label: str, vocab: int, ids: list, tokenizer: Path | None) -> None:
        source = work / f"{label}-from-transformers"
        random_llama(vocab, 7).save_pretrained(source, safe_serialization=True)
        extra = []
        if tokenizer is not None:
            (source / "tokenizer.json").write_bytes(tokenizer.read_bytes())
            extra = ["--tokenizer", str(tokenizer)]
        theirs = hf_loss(source, ids)
        ours = shoal_eval(shoal, source, text_file)
        check(f"{label}: loss of the model transformers wrote", ours, theirs)
        tuned = work / f"{label}-fine-tuned"
        subprocess.run(
            [shoal, "train", "--model", "llama", "--init-hf", str(source), "--dataset", f"text:{text_file}",
             "--steps", "40", "--eval-every", "40", "--batch-size", "16", "--lr", "1e-3",
             "--output-hf", str(tuned), *extra],
            check=True, stdout=subprocess.DEVNULL,
        )
        after_ours = shoal_eval(shoal, tuned, text_file)
        after_theirs = hf_loss(tuned, ids)
        check(f"{label}: loss of the model shoal fine-tuned", after_ours, after_theirs)
        if not after_theirs < theirs:
            print(f"{label}: fine-tuning did not lower the loss: {theirs:.4f} -> {after_theirs:.4f} FAILED")
            failures.append(f"{label}: fine-tuning")
        figures[label] = {
            "transformers_loss": theirs, "shoal_loss": ours,
            "fine_tuned_transformers_loss": after_theirs, "fine_tuned_shoal_loss": after_ours,
            "tokens": len(ids),
        }
        # The tokenizer Shoal wrote loads in transformers and cuts text as
        # Shoal does.
        tok = AutoTokenizer.from_pretrained(tuned)
        whole = text.decode("utf-8")
        got = tok(whole)["input_ids"]
        want = ids if tokenizer is None else ids[:-1]  # the text's ids, without the end of text
        if got != want:
            print(f"{label}: the tokenizer Shoal wrote does not encode text as Shoal does FAILED")
            failures.append(f"{label}: tokenizer")
        elif tok.decode(got, clean_up_tokenization_spaces=False) != whole:
            print(f"{label}: the tokenizer Shoal wrote does not decode back to the text FAILED")
            failures.append(f"{label}: tokenizer")
        else:
            print(f"{label}: AutoTokenizer reads the tokenizer.json Shoal wrote, encodes the text as Shoal does and decodes it back ok")

    round_trip("bytes", 256, list(text), None)

    # A BPE that Shoal trained, read by the tokenizers library.
    from tokenizers import Tokenizer

    bpe = work / "tokenizer.json"
    subprocess.run([shoal, "data", "train-tokenizer", "--vocab", str(BPE_VOCAB), "--output", str(bpe), text_file],
                   check=True, stdout=subprocess.DEVNULL)
    tk = Tokenizer.from_file(str(bpe))
    eos = tk.token_to_id("<|endoftext|>")
    ids = tk.encode(text.decode("utf-8")).ids + [eos]
    if tk.get_vocab_size() != BPE_VOCAB or eos is None:
        print(f"the trained tokenizer has {tk.get_vocab_size()} tokens and end of text {eos} FAILED")
        failures.append("bpe: tokenizer")
    print(f"bpe: {len(text)} bytes are {len(ids)} tokens ({len(text) / len(ids):.2f} bytes per token)")
    round_trip("bpe", BPE_VOCAB, ids, bpe)

    if json_path:
        Path(json_path).write_text(json.dumps({**figures, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
