//! The round trip of a Llama through Hugging Face `transformers`
//! (`scripts/hf-roundtrip.py`), over bytes and over a BPE that `shoal data
//! train-tokenizer` learned: `shoal eval` on a model `transformers` wrote
//! equals `transformers`' loss on the same text within 0.5%; Shoal
//! fine-tunes it and writes it back with `--output-hf`; `transformers`
//! loads the result and gets the loss `shoal eval` prints, within 0.5%;
//! `AutoTokenizer` reads the tokenizer Shoal wrote and cuts text as Shoal
//! does.
//!
//! Ignored in the README's test command; `.ci/run` runs it. Needs a
//! Python with torch and transformers: `SHOAL_HF_PYTHON` names
//! it (`.ci/run` builds one in a cache folder outside the clone), else
//! `python3`. Without them the test says so and passes, unless
//! `SHOAL_REQUIRE_TRANSFORMERS=1`, where it fails.

use std::path::PathBuf;
use std::process::Command;

fn python() -> Option<String> {
    let python = std::env::var("SHOAL_HF_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch, transformers, tokenizers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var("SHOAL_REQUIRE_TRANSFORMERS").as_deref() == Ok("1") {
        panic!("SHOAL_REQUIRE_TRANSFORMERS=1 but {python} has no torch, transformers and tokenizers");
    }
    ok.then_some(python)
}

#[test]
#[ignore = "needs torch and transformers (about 5.6 GB): .ci/run builds them and runs this"]
fn a_llama_goes_through_transformers_and_back_with_the_same_loss() {
    let Some(python) = python() else {
        eprintln!("skipped: no Python with torch and transformers (set SHOAL_HF_PYTHON)");
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let work = tempfile::tempdir().expect("temp dir");
    let json = work.path().join("figures.json");
    let out = Command::new(python)
        .arg(root.join("scripts/hf-roundtrip.py"))
        .arg(env!("CARGO_BIN_EXE_shoal"))
        .arg(root.join("models/data/gpl-3.0.txt"))
        .arg(work.path())
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run the round trip");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the round trip failed:\n{stdout}");
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("figures")).expect("figures are JSON");
    assert_eq!(figures["failures"], serde_json::json!([]), "{figures}");
    for vocab in ["bytes", "bpe"] {
        let f = &figures[vocab];
        for (a, b) in [("transformers_loss", "shoal_loss"), ("fine_tuned_transformers_loss", "fine_tuned_shoal_loss")] {
            let (Some(theirs), Some(ours)) = (f[a].as_f64(), f[b].as_f64()) else {
                panic!("no {vocab} losses in {figures}")
            };
            assert!((theirs - ours).abs() <= 0.005 * theirs, "{vocab}: {b} {ours} against {a} {theirs}");
        }
    }
    let (bytes, tokens) = (figures["bytes"]["tokens"].as_f64(), figures["bpe"]["tokens"].as_f64());
    assert!(tokens.zip(bytes).is_some_and(|(t, b)| t < 0.75 * b), "the BPE did not merge: {figures}");
}
