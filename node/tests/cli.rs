//! The `shoal` binary end to end: real processes, real files.

use std::process::{Command, Output};

fn shoal(args: &[&str]) -> Output {
    match Command::new(env!("CARGO_BIN_EXE_shoal")).args(args).env("RUST_LOG", "warn").output() {
        Ok(o) => o,
        Err(e) => panic!("cannot run shoal: {e}"),
    }
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn train_saves_then_resumes_from_checkpoint() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let ckpt = dir.path().join("run.safetensors");
    let ckpt = ckpt.to_str().unwrap_or_default();

    let first = shoal(&["train", "--epochs", "1", "--checkpoint", ckpt]);
    let (out, err) = text(&first);
    assert!(first.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("epoch 1/1") && out.contains("test accuracy"), "{out}");
    assert!(std::path::Path::new(ckpt).is_file());

    let second = shoal(&["train", "--epochs", "2", "--resume", ckpt, "--checkpoint", ckpt]);
    let (out, err) = text(&second);
    assert!(second.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("epoch 2/2"), "{out}");
    assert!(!out.contains("epoch 1/2"), "resume must not redo epoch 1: {out}");
    // 1438 samples / 32 = 45 steps per epoch.
    assert!(out.contains("after 90 steps"), "{out}");
}

#[test]
fn resume_with_another_model_or_garbage_is_refused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let ckpt = dir.path().join("mlp.safetensors");
    let ckpt = ckpt.to_str().unwrap_or_default();
    assert!(shoal(&["train", "--epochs", "1", "--checkpoint", ckpt]).status.success());

    let wrong = shoal(&["train", "--model", "cnn", "--resume", ckpt]);
    let (_, err) = text(&wrong);
    assert!(!wrong.status.success());
    assert!(err.contains("requested") && !err.contains("panicked"), "{err}");

    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"this is not a checkpoint").unwrap_or_else(|e| panic!("{e}"));
    let bad = shoal(&["train", "--resume", junk.to_str().unwrap_or_default()]);
    let (_, err) = text(&bad);
    assert!(!bad.status.success());
    assert!(err.contains("checkpoint") && !err.contains("panicked"), "{err}");
}

/// `shoal eval --json`'s accuracy for a model file.
fn eval_accuracy(model: &str) -> f64 {
    let o = shoal(&["eval", "--json", "--model", model]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v["accuracy"].as_f64().unwrap_or(-1.0)
}

#[test]
fn train_output_is_read_back_by_eval_and_fine_tuned_with_init() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let model = dir.path().join("m.safetensors");
    let model = model.to_str().unwrap_or_default();
    let first = shoal(&["train", "--epochs", "1", "--output", model]);
    let (out, err) = text(&first);
    assert!(first.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("model written to"), "{out}");
    // The accuracy train printed (two decimals of a percentage) is what eval finds.
    let printed: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("final test accuracy "))
        .and_then(|l| l.split('%').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no final accuracy in {out}"));
    let evaluated = eval_accuracy(model);
    assert!((evaluated * 100.0 - printed).abs() <= 0.01, "eval {evaluated}, train printed {printed}%");
    assert!(evaluated > 0.85, "one epoch on digits reaches 85%: {evaluated}");

    // Fine-tuning starts from the file's weights, not from scratch: one
    // step at a tiny learning rate keeps the accuracy the file had.
    let tuned = dir.path().join("tuned.safetensors");
    let tuned = tuned.to_str().unwrap_or_default();
    let again = shoal(&["train", "--epochs", "1", "--lr", "1e-9", "--init", model, "--output", tuned]);
    let (out, err) = text(&again);
    assert!(again.status.success(), "stdout: {out}\nstderr: {err}");
    assert!((eval_accuracy(tuned) - evaluated).abs() < 0.02, "{out}");

    // A model that does not fit is refused with both names, never a panic.
    let wrong = shoal(&["train", "--model", "cnn", "--init", model]);
    let (_, err) = text(&wrong);
    assert!(!wrong.status.success());
    assert!(err.contains("was requested") && err.contains("m.safetensors") && !err.contains("panicked"), "{err}");
}

#[test]
fn a_llama_trains_writes_its_summary_and_a_hugging_face_directory_that_eval_reads() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (json, hf) = (dir.path().join("summary.json"), dir.path().join("hf"));
    let text_file = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/data/gpl-3.0.txt");
    let dataset = format!("text@32:{text_file}");
    #[rustfmt::skip]
    let o = shoal(&[
        "train", "--model", "llama", "--layers", "1", "--heads", "2", "--width", "16", "--ff", "24", "--untied",
        "--dataset", &dataset, "--steps", "30", "--eval-every", "15", "--batch-size", "8",
        "--json", json.to_str().unwrap_or_default(), "--output-hf", hf.to_str().unwrap_or_default(),
        "--output", dir.path().join("model.safetensors").to_str().unwrap_or_default(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("llama[l1 h2/2 d16 ff24 ctx32 vocab256]"), "{out}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_default()).unwrap_or_default();
    assert_eq!(summary["steps"], 30, "{summary}");
    let (sps, tps) = (summary["samples_per_sec"].as_f64(), summary["tokens_per_sec"].as_f64());
    // serde_json's float parsing may be an ulp off: compare within 1e-9.
    let (sps, tps) = (sps.unwrap_or(0.0), tps.unwrap_or(0.0));
    assert!(sps > 0.0 && (tps - 32.0 * sps).abs() <= 1e-9 * tps, "{summary}");
    let val = summary["val_loss"].as_f64().unwrap_or(f64::NAN);
    let ppl = summary["perplexity"].as_f64().unwrap_or(f64::NAN);
    assert!((ppl - val.exp()).abs() < 1e-3 * ppl && summary["train_loss"].as_f64().is_some(), "{summary}");
    // The directory's config is a LlamaForCausalLM, and eval reads the
    // directory back to the loss train printed.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap_or_default()).unwrap_or_default();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM", "{config}");
    assert_eq!(config["tie_word_embeddings"], false, "{config}");
    // eval reads the whole text in consecutive windows of 33 bytes, the
    // directory to the loss of the model file written beside it.
    let eval = |model: &std::path::Path| {
        let e = shoal(&["eval", "--json", "--model", model.to_str().unwrap_or_default()]);
        let (eout, eerr) = text(&e);
        assert!(e.status.success(), "stdout: {eout}\nstderr: {eerr}");
        serde_json::from_str::<serde_json::Value>(&eout).unwrap_or_default()
    };
    let (from_hf, from_file) = (eval(&hf), eval(&dir.path().join("model.safetensors")));
    assert_eq!(from_hf["loss"], from_file["loss"], "{from_hf} against {from_file}");
    let windows = std::fs::metadata(text_file).map(|m| m.len()).unwrap_or_default() / 33;
    assert_eq!(
        (from_hf["samples"].as_u64(), from_hf["tokens"].as_u64()),
        (Some(windows), Some(windows * 32)),
        "{from_hf}"
    );
    let loss = from_hf["loss"].as_f64().unwrap_or(f64::NAN);
    assert!((from_hf["perplexity"].as_f64().unwrap_or(0.0) - loss.exp()).abs() < 1e-3 * loss.exp(), "{from_hf}");
    // Another model's flags with --output-hf are refused before training.
    let wrong = shoal(&["train", "--model", "mlp", "--steps", "1", "--output-hf", hf.to_str().unwrap_or_default()]);
    let (_, werr) = text(&wrong);
    assert!(!wrong.status.success() && werr.contains("--output-hf") && werr.contains("llama"), "{werr}");
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_default()).unwrap_or_default()
}

#[test]
fn a_trained_tokenizer_and_its_token_directory_train_a_llama_that_carries_them_to_hugging_face() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = |name: &str| dir.path().join(name).to_str().unwrap_or_default().to_string();
    let text_file = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/data/gpl-3.0.txt");
    let text_len = std::fs::metadata(text_file).map(|m| m.len()).unwrap_or_default();
    let run = |args: &[&str]| {
        let o = shoal(args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}\nstdout: {out}\nstderr: {err}");
        out
    };
    let out = run(&["data", "train-tokenizer", "--vocab", "512", "--output", &path("tokenizer.json"), text_file]);
    assert!(out.contains("512 tokens"), "{out}");
    let out = run(&[
        "data",
        "tokenize",
        "--tokenizer",
        &path("tokenizer.json"),
        "--output",
        &path("tokens"),
        text_file,
        text_file,
    ]);
    assert!(out.contains("2 document(s)"), "{out}");
    let index = read_json(&dir.path().join("tokens/index.json"));
    assert_eq!(
        (index["width"].as_str(), index["vocab_size"].as_u64(), index["documents"].as_u64()),
        (Some("u16"), Some(512), Some(2)),
        "{index}"
    );
    let tokens = index["tokens"].as_u64().unwrap_or_default();
    assert!(
        tokens > 0 && tokens < 2 * text_len * 3 / 4,
        "{tokens} tokens for twice {text_len} bytes: the BPE did not merge"
    );
    assert_eq!(index["text_bytes"].as_u64(), Some(2 * text_len), "{index}");
    // A tokenizer that wrote other ids is refused by name.
    let again =
        shoal(&["data", "tokenize", "--tokenizer", &path("tokenizer.json"), "--output", &path("tokens"), text_file]);
    assert!(!again.status.success() && text(&again).1.contains("already holds"), "{}", text(&again).1);

    let dataset = format!("tokens@32:{}", path("tokens"));
    #[rustfmt::skip]
    let out = run(&[
        "train", "--model", "llama", "--layers", "1", "--heads", "2", "--width", "16", "--ff", "24",
        "--dataset", &dataset, "--steps", "20", "--eval-every", "20", "--batch-size", "8",
        "--json", &path("summary.json"), "--output-hf", &path("hf"),
    ]);
    assert!(out.contains("vocab512"), "{out}");
    let summary = read_json(&dir.path().join("summary.json"));
    let val = summary["val_loss"].as_f64().unwrap_or(f64::NAN);
    // Bits per byte counts the bytes each token stands for.
    let bytes_per_token = (2 * text_len) as f64 / tokens as f64;
    let bpb = summary["bits_per_byte"].as_f64().unwrap_or(f64::NAN);
    assert!((bpb - val / std::f64::consts::LN_2 / bytes_per_token).abs() < 1e-4, "{summary}");
    // The directory carries the tokenizer and its end-of-text token.
    let (theirs, ours) =
        (read_json(&dir.path().join("hf/tokenizer.json")), read_json(&dir.path().join("tokenizer.json")));
    assert_eq!(theirs, ours);
    let config = read_json(&dir.path().join("hf/config.json"));
    assert_eq!(config["vocab_size"], 512, "{config}");
    assert!(config["eos_token_id"].as_u64().is_some(), "{config}");

    // eval takes the tokenizer from the directory and reads the whole text.
    let e = run(&["eval", "--json", "--model", &path("hf"), "--dataset", &format!("text@32:{text_file}")]);
    let report: serde_json::Value = serde_json::from_str(&e).unwrap_or_default();
    let windows = report["samples"].as_u64().unwrap_or_default();
    assert_eq!(
        windows,
        (tokens / 2) / 33,
        "{report}: one copy of the text and its end-of-text token, in windows of 33"
    );
    assert_eq!(report["tokens"].as_u64(), Some(windows * 32), "{report}");
    // ... and the token directory whole, two copies.
    let e = run(&["eval", "--json", "--model", &path("hf"), "--dataset", &dataset]);
    let report: serde_json::Value = serde_json::from_str(&e).unwrap_or_default();
    assert_eq!(report["samples"].as_u64(), Some(tokens / 33), "{report}");

    // generate decodes tokens into text after the prompt.
    let g = run(&["generate", "--model", &path("hf"), "--prompt", "The GNU", "--tokens", "12", "--temperature", "0"]);
    assert!(g.starts_with("The GNU") && g.trim_end().len() > "The GNU".len(), "{g}");
    // A text cut by the same tokenizer trains the same vocabulary, here
    // with an LM trainer's step options.
    #[rustfmt::skip]
    let out = run(&[
        "train", "--model", "llama", "--layers", "1", "--heads", "2", "--width", "16", "--ff", "24",
        "--dataset", &format!("text@32:{text_file}"), "--tokenizer", &path("tokenizer.json"), "--steps", "6",
        "--warmup-steps", "2", "--lr-decay", "cosine", "--clip-grad", "1.0", "--accumulate", "2",
        "--weight-decay", "0.01",
    ]);
    assert!(out.contains("vocab512") && out.contains("after 6 steps"), "{out}");
    let bad = shoal(&["train", "--steps", "1", "--clip-grad=-1"]);
    assert!(!bad.status.success() && text(&bad).1.contains("--clip-grad"), "{}", text(&bad).1);
    let wrong = shoal(&["train", "--dataset", "digits", "--tokenizer", &path("tokenizer.json"), "--steps", "1"]);
    assert!(!wrong.status.success() && text(&wrong).1.contains("--tokenizer"), "{}", text(&wrong).1);
}

#[test]
fn eval_refuses_missing_truncated_and_checkpoint_files_clearly() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let missing = shoal(&["eval", "--model", "/nonexistent/model.safetensors"]);
    let (_, err) = text(&missing);
    assert!(!missing.status.success());
    assert!(err.contains("/nonexistent/model.safetensors") && !err.contains("panicked"), "{err}");

    let model = dir.path().join("m.safetensors");
    let ckpt = dir.path().join("c.safetensors");
    let o = shoal(&[
        "train",
        "--epochs",
        "1",
        "--output",
        model.to_str().unwrap_or_default(),
        "--checkpoint",
        ckpt.to_str().unwrap_or_default(),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let bytes = std::fs::read(&model).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap_or_else(|e| panic!("{e}"));
    let cut = shoal(&["eval", "--model", model.to_str().unwrap_or_default()]);
    let (_, err) = text(&cut);
    assert!(!cut.status.success());
    assert!(err.contains("m.safetensors") && err.contains("safetensors file") && !err.contains("panicked"), "{err}");

    let wrong = shoal(&["eval", "--model", ckpt.to_str().unwrap_or_default()]);
    let (_, err) = text(&wrong);
    assert!(!wrong.status.success());
    assert!(err.contains("shoal train --resume"), "a checkpoint is named as one: {err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_names_the_feature() {
    let o = shoal(&["train", "--device", "cuda", "--epochs", "1"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn missing_fashion_mnist_says_how_to_fetch_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let o = shoal(&["train", "--dataset", "fashion-mnist", "--data-dir", dir.path().to_str().unwrap_or_default()]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("shoal data fetch fashion-mnist"), "{err}");
}

#[test]
fn bad_flags_are_rejected_before_work() {
    for args in [
        &["train", "--model", "transformer"][..],
        &["train", "--epochs", "0"],
        &["train", "--batch-size", "0"],
        &["train", "--lr", "-1"],
        &["train", "--optimizer", "lion"],
        &["bench", "train", "--model", "gpt"],
        &["bench", "exchange", "--mb", "inf"],
        &["bench", "exchange", "--mb", "0"],
        &["bench", "exchange", "--cases", "f32,fp8"],
        &["bench", "exchange", "--nodes", "1"],
        &["bench", "robust", "--byzantine", "5"],
        &["bench", "robust", "--nodes", "2", "--byzantine", "1"],
        &["bench", "robust", "--attacks", "none"],
        &["bench", "robust", "--attacks", "stale:0"],
        &["bench", "robust", "--rules", "trimmed_mean:0.5"],
        &["bench", "robust", "--runs", "0"],
        &["demo", "--straggler", "--mode", "gossip"],
        &["demo", "--straggler", "--nodes", "1"],
        &["demo", "--output-hf", "hf"],
    ] {
        let o = shoal(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.trim().is_empty(), "{args:?} gave no message");
    }
}

/// `shoal demo --straggler`: an owner that starts answering late is
/// demoted, ends the run owning nothing, and its shards all have other
/// owners; the summary says so.
#[test]
fn the_straggler_demo_demotes_the_slow_owner_and_says_what_happened() {
    let o = shoal(&["demo", "--straggler", "--steps", "600"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    eprintln!("{out}");
    let pages = out.lines().find(|l| l.starts_with("live charts (status pages): ")).unwrap_or_default();
    assert_eq!(pages.matches(" http://127.0.0.1:").count(), 4, "each node's status page is named: {out}");
    let line = out.lines().find(|l| l.starts_with("straggler: ")).unwrap_or_default();
    let name = line.trim_start_matches("straggler: ").split(',').next().unwrap_or_default().to_string();
    assert!(!name.is_empty() && line.contains("answers 25 ms late"), "no straggler line: {out}");
    assert!(out.contains("  demoted at step "), "the slow owner was not demoted: {out}");
    assert!(out.contains("cluster samples/s: before "), "{out}");
    let end = out.lines().find(|l| l.starts_with(&format!("{name}: "))).unwrap_or_default();
    assert!(end.contains("owned shards []"), "the straggler still owns shards at the end: {end}");
    let mut owned: Vec<u32> = out
        .lines()
        .filter(|l| l.starts_with("node") && l.contains("owned shards ["))
        .flat_map(|l| {
            let list = l.split("owned shards [").nth(1).and_then(|r| r.split(']').next()).unwrap_or_default();
            list.split(", ").filter_map(|x| x.trim().parse().ok()).collect::<Vec<u32>>()
        })
        .collect();
    owned.sort_unstable();
    assert_eq!(owned, (0..8).collect::<Vec<u32>>(), "every shard owned once at the end: {out}");
}

/// `shoal demo --model llama --output-hf DIR`: the first node's model as
/// a Hugging Face directory, which `shoal eval` reads.
#[test]
fn a_llama_demo_writes_a_hugging_face_directory() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let hf = dir.path().join("hf");
    let text_file = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/data/gpl-3.0.txt");
    let dataset = format!("text@32:{text_file}");
    #[rustfmt::skip]
    let o = shoal(&[
        "demo", "--model", "llama", "--dataset", &dataset, "--nodes", "2", "--steps", "10", "--batch-size", "4",
        "--output-hf", hf.to_str().unwrap_or_default(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("Hugging Face directory of node0 written to"), "{out}");
    let config = read_json(&hf.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLM", "{config}");
    let e = shoal(&["eval", "--json", "--model", hf.to_str().unwrap_or_default(), "--dataset", &dataset]);
    let (eout, eerr) = text(&e);
    assert!(e.status.success(), "stdout: {eout}\nstderr: {eerr}");
    let loss = serde_json::from_str::<serde_json::Value>(&eout).unwrap_or_default()["loss"].as_f64();
    assert!(loss.is_some_and(f64::is_finite), "{eout}");
}

/// The text of a tmux session's pane.
fn capture(session: &str) -> String {
    let o = Command::new("tmux").args(["capture-pane", "-p", "-t", session]).output();
    o.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
}

/// Wait (at most 60 s, reading the pane every 200 ms) until the pane shows
/// what `done` looks for; returns the last capture.
fn pane_until(session: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let text = capture(session);
        if done(&text) || std::time::Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// `shoal top` in a real terminal (tmux), through one node of a 2-node
/// cluster: a row per node, `s` re-sorts, the arrow keys select, `q`
/// quits. Skips without tmux unless `SHOAL_REQUIRE_TMUX=1` (CI).
#[test]
fn shoal_top_shows_every_node_in_a_terminal_and_answers_its_keys() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(std::env::var_os("SHOAL_REQUIRE_TMUX").is_none(), "SHOAL_REQUIRE_TMUX is set and tmux is missing");
        eprintln!("skipped: no tmux");
        return;
    }
    let common = ["--min-peers", "2", "--run-id", "top", "--steps", "100000", "--http", "127.0.0.1:0"];
    let (mut a, mut lines, addr) = spawn_listening(&mut node_cmd(&common));
    let http = lines
        .find_map(|l| l.strip_prefix("status on http://").map(|r| r.trim_end_matches('/').to_string()))
        .unwrap_or_else(|| panic!("node A printed no status address"));
    let mut b = node_cmd(&common)
        .args(["--bootstrap", &addr])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start node B: {e}"));
    let session = format!("shoal-top-{}", std::process::id());
    let top = format!("{} top --node {http} --interval-ms 200", env!("CARGO_BIN_EXE_shoal"));
    let started =
        Command::new("tmux").args(["new-session", "-d", "-s", &session, "-x", "120", "-y", "30", &top]).status();
    assert!(started.is_ok_and(|s| s.success()), "tmux did not start");
    let keys = |k: &str| {
        let _ = Command::new("tmux").args(["send-keys", "-t", &session, k]).status();
    };
    // Both nodes, once B is in A's view and training.
    let two = pane_until(&session, |t| t.contains("2 nodes through"));
    keys("s");
    let sorted = pane_until(&session, |t| t.contains("s sort: role"));
    keys("Down");
    let selected = pane_until(&session, |t| t.contains("│peer 12D3KooW"));
    keys("q");
    let ended = pane_until(&session, |t| t.is_empty());
    let alive = Command::new("tmux").args(["has-session", "-t", &session]).status().is_ok_and(|s| s.success());
    let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
    let _ = a.kill();
    let _ = b.kill();
    let _ = (a.wait(), b.wait());
    eprintln!("{two}\n{selected}");
    assert!(two.contains("2 nodes through"), "not both nodes: {two}");
    for column in ["role", "shards", "step", "samples/s", "loss", "link"] {
        assert!(two.contains(column), "no `{column}` column: {two}");
    }
    assert!(two.contains('*'), "the node asked is not marked: {two}");
    assert!(sorted.contains("s sort: role"), "`s` did not change the sort: {sorted}");
    assert!(selected.contains("│peer 12D3KooW"), "the arrow key selected nothing: {selected}");
    assert!(ended.is_empty() && !alive, "`q` did not end shoal top: {ended}");
}

/// A `shoal node` child process on loopback with mDNS off and short timeouts.
fn node_cmd(extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shoal"));
    c.args(["node", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"]).args(extra).env("RUST_LOG", "warn");
    c
}

#[test]
fn node_rejects_a_bad_config_file_naming_the_key() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("node.toml");
    std::fs::write(&path, "[training]\nbatch = 3\n").unwrap_or_else(|e| panic!("{e}"));
    let o = shoal(&["node", "--config", path.to_str().unwrap_or_default()]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("batch") && err.contains("node.toml"), "{err}");
    let o = shoal(&["node", "--sync", "dssp:4-1"]);
    assert!(!o.status.success(), "a reversed dssp range must be refused");
}

#[test]
fn node_with_unreachable_bootstrap_peer_fails_fast() {
    let o = node_cmd(&[
        "--start-timeout-ms",
        "4000",
        "--bootstrap",
        "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWE54zcAJi8KBgsrkiLYdhnwPWLmxSj7RHddoJ4dVNpcEg",
    ])
    .output()
    .unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("bootstrap peer") && err.contains("unreachable"), "{err}");
}

/// Two real node processes, one with another model: both give up with a
/// clear message within the start timeout instead of hanging.
#[test]
fn nodes_with_mismatched_model_or_run_refuse_to_train_together() {
    use std::io::{BufRead, BufReader};
    // A waits longer than B and C, so it is still up while they try.
    let mut a = node_cmd(&["--min-peers", "2", "--run-id", "mm", "--start-timeout-ms", "12000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let stdout = a.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    let addr = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("listening on ").map(str::to_string))
        .unwrap_or_else(|| panic!("node A printed no address"));

    let short = ["--min-peers", "2", "--start-timeout-ms", "4000", "--bootstrap", &addr];
    let b = node_cmd(&short).args(["--run-id", "mm", "--model", "cnn"]).output().unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&b.stderr);
    assert!(!b.status.success());
    assert!(err.contains("no agreed roster") && err.contains("different model/training config"), "{err}");

    let c = node_cmd(&short).args(["--run-id", "other-run"]).output().unwrap_or_else(|e| panic!("{e}"));
    let err = String::from_utf8_lossy(&c.stderr);
    assert!(!c.status.success());
    assert!(err.contains("no agreed roster") && err.contains("other-run"), "{err}");

    let out = a.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.status.success(), "node A never had a valid peer and must fail too");
}

/// Spawn a node with its stdout piped; returns the child, the rest of its
/// stdout lines, and the address it printed after "listening on ".
fn spawn_listening(cmd: &mut Command) -> (std::process::Child, impl Iterator<Item = String>, String) {
    use std::io::{BufRead, BufReader};
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{e}"));
    let mut lines =
        BufReader::new(child.stdout.take().unwrap_or_else(|| panic!("no stdout"))).lines().map_while(Result::ok);
    let addr = lines
        .by_ref()
        .find_map(|l| l.strip_prefix("listening on ").map(str::to_string))
        .unwrap_or_else(|| panic!("the node printed no address"));
    (child, lines, addr)
}

/// The deployment form: three `shoal node` processes on loopback TCP. B and
/// C know only A; they find each other through Kademlia and train together.
#[test]
fn three_node_processes_train_together_over_tcp() {
    let common =
        ["--min-peers", "3", "--run-id", "procs", "--steps", "150", "--lr", "0.1", "--start-timeout-ms", "30000"];
    let (mut a, lines, addr) = spawn_listening(&mut node_cmd(&common));
    // One of them also lists a bootstrap peer that is down, first: one
    // that answers is enough.
    let dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWE54zcAJi8KBgsrkiLYdhnwPWLmxSj7RHddoJ4dVNpcEg";
    let others: Vec<_> = [vec!["--bootstrap", &addr], vec!["--bootstrap", dead, "--bootstrap", &addr]]
        .into_iter()
        .map(|boot| node_cmd(&common).args(boot).stdout(std::process::Stdio::piped()).spawn())
        .map(|c| c.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let mut finals: Vec<String> = lines.filter(|l| l.contains("test accuracy")).collect();
    assert!(a.wait().map(|s| s.success()).unwrap_or(false), "node A failed");
    for c in others {
        let o = c.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
        assert!(o.status.success(), "a bootstrapped node failed");
        finals.extend(
            String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.contains("test accuracy")).map(str::to_string),
        );
    }
    assert_eq!(finals.len(), 3, "{finals:?}");
    for line in &finals {
        let pct: f32 = line
            .split("test accuracy ")
            .nth(1)
            .and_then(|r| r.split('%').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(pct >= 90.0, "{line}");
    }
}

/// A writer killed (SIGKILL) while it writes a shard checkpoint leaves the
/// previous checkpoint intact and readable; the half-written file is a
/// `.tmp` that readers ignore.
#[test]
fn a_writer_killed_mid_checkpoint_leaves_the_previous_file_intact() {
    use shoal_models::{ArchKind, ImageShape, ModelConfig, ShardDir, ShardOf};
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["bench", "checkpoint", "--shard-mb", "200", "--repeats", "5", "--dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    // Wait (bounded) for the moment a second write is under way: a complete
    // file and a temporary one side by side.
    let find = |suffix: &str| -> Vec<std::path::PathBuf> {
        let Ok(top) = std::fs::read_dir(dir.path()) else { return Vec::new() };
        top.filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read_dir(e.path().join("ckpt")).ok())
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect()
    };
    let started = std::time::Instant::now();
    while find(".safetensors").len() != 1 || find(".tmp").is_empty() {
        assert!(started.elapsed() < std::time::Duration::from_secs(120), "no second write began");
        assert!(child.try_wait().ok().flatten().is_none(), "the bench ended before it could be killed");
        std::thread::yield_now();
    }
    child.kill().unwrap_or_else(|e| panic!("{e}"));
    let _ = child.wait();
    let done = find(".safetensors");
    assert!(!done.is_empty());
    let folder = done[0].parent().map(|p| p.to_path_buf()).unwrap_or_default();
    let of = ShardOf {
        run_id: "bench".into(),
        model: ModelConfig::new(ArchKind::Mlp, ImageShape { channels: 1, height: 8, width: 8 }, 10),
        shards: 1,
    };
    let scan = ShardDir::new(&folder, of, 2).scan().unwrap_or_else(|e| panic!("{e}"));
    assert!(scan.skipped.is_empty(), "every complete file reads back: {:?}", scan.skipped);
    assert_eq!(scan.shards.get(&0).map(Vec::len), Some(done.len()), "the killed write is not counted");
    assert_eq!(scan.shards[&0][0].params.len(), 50_000_000);
}

/// A node reachable beyond loopback with neither a PSK nor an allowlist
/// says so; loopback, or a PSK, is quiet.
#[test]
fn a_node_open_to_any_peer_warns_and_a_closed_one_does_not() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let psk = dir.path().join("psk.toml");
    let key = "ab".repeat(32);
    std::fs::write(&psk, format!("[network]\nquic = false\n\n[network.admission]\npsk = \"{key}\"\n"))
        .unwrap_or_else(|e| panic!("{e}"));
    // Each waits for a second node that never comes, and gives up by itself.
    let wait = ["--no-mdns", "--min-peers", "2", "--start-timeout-ms", "1500", "--http", "off"];
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .arg("node")
            .args(wait)
            .args(extra)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        text(&o)
    };
    let (out, err) = run(&["--listen", "/ip4/0.0.0.0/tcp/0"]);
    assert!(out.contains("warning: any peer may join: /ip4/0.0.0.0/tcp/0"), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("this node accepts any peer"), "the log says it too: {err}");
    let (out, err) = run(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
    assert!(out.contains("listening on") && !out.contains("any peer may join"), "stdout: {out}\nstderr: {err}");
    let (out, err) = run(&["--listen", "/ip4/0.0.0.0/tcp/0", "--config", psk.to_str().unwrap_or_default()]);
    assert!(out.contains("listening on") && !out.contains("any peer may join"), "stdout: {out}\nstderr: {err}");
}

/// GET `path` from a node's HTTP endpoint (loopback, bounded).
fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let timeout = std::time::Duration::from_secs(5);
    let sock: std::net::SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// A live node's `/metrics`, taken while two nodes train over TCP, passes
/// `promtool check metrics`. Without promtool on the PATH the test says it
/// skipped; `.ci/run` installs it and sets SHOAL_REQUIRE_PROMTOOL=1.
#[test]
fn a_live_node_s_metrics_pass_promtool() {
    let promtool = std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join("promtool")).find(|f| f.is_file()));
    let Some(promtool) = promtool else {
        assert!(
            std::env::var("SHOAL_REQUIRE_PROMTOOL").is_err(),
            "SHOAL_REQUIRE_PROMTOOL is set but promtool is not on the PATH"
        );
        eprintln!("skipped: promtool not found (Debian: apt-get install prometheus)");
        return;
    };
    let common = ["--min-peers", "2", "--run-id", "metrics", "--steps", "400", "--start-timeout-ms", "30000"];
    let (mut a, mut lines, addr) = spawn_listening(node_cmd(&common).args(["--http", "127.0.0.1:0"]));
    let http = lines
        .by_ref()
        .find_map(|l| l.strip_prefix("status on http://").map(|h| h.trim_end_matches('/').to_string()))
        .unwrap_or_else(|| panic!("node A printed no status address"));
    let mut b = node_cmd(&common)
        .args(["--http", "off", "--bootstrap", &addr])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));

    // Scrape until A has trained 20 steps and exchanged shards, within 60 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let metrics = loop {
        let text = http_get(&http, "/metrics").unwrap_or_default();
        let value = |name: &str| {
            text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok()).unwrap_or(0.0)
        };
        if value("shoal_step") >= 20.0 && value("shoal_bytes_in_total") > 0.0 {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "node A did not reach step 20 within 60 s:\n{text}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let _ = a.kill();
    let _ = b.kill();
    let _ = a.wait();
    let _ = b.wait();

    assert!(metrics.contains("# TYPE shoal_push_latency_seconds gauge"), "{metrics}");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    {
        use std::io::Write;
        let mut stdin = check.stdin.take().unwrap_or_else(|| panic!("no stdin"));
        stdin.write_all(metrics.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    }
    let o = check.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let (out, err) = text(&o);
    assert!(o.status.success(), "promtool check metrics found problems:\n{out}{err}\n--- the metrics:\n{metrics}");
}

/// The environment `pid` runs under now (after any `exec`), as NAME=VALUE.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn environ(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| b.split(|c| *c == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect())
        .unwrap_or_default()
}

/// Starts a long `shoal train` with `tunables` (None: unset) and returns
/// its `GLIBC_TUNABLES` once it has printed its first line, which comes
/// after any re-execution.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tunables_of_a_running_node(tunables: Option<&str>) -> Option<String> {
    use shoal_node::ops::allocator::TUNABLES_VAR;
    use std::io::BufRead;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shoal"));
    cmd.args(["train", "--steps", "100000", "--eval-every", "100000", "--threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    match tunables {
        Some(t) => cmd.env(TUNABLES_VAR, t),
        None => cmd.env_remove(TUNABLES_VAR),
    };
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot run shoal: {e}"));
    // The first line is printed after argument parsing, so after the
    // re-execution: the environment read now is the one it trains under.
    let stdout = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
    let first = std::io::BufReader::new(stdout).lines().next();
    let env = environ(child.id());
    let _ = child.kill();
    let _ = child.wait();
    assert!(matches!(first, Some(Ok(ref l)) if l.starts_with("training ")), "shoal train did not start: {first:?}");
    env.iter().find_map(|v| v.strip_prefix(&format!("{TUNABLES_VAR}=")).map(str::to_owned))
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn the_binary_runs_under_its_allocator_tunables_unless_the_user_set_some() {
    // glibc parses the variable in place and cuts it at the first `:` in
    // the process's initial environment (its own copy, which children
    // inherit, is whole), so /proc shows the first tunable only.
    let tuned = tunables_of_a_running_node(None);
    let ours = shoal_node::ops::allocator::tunables();
    let first = ours.split(':').next().unwrap_or_default();
    assert_eq!(tuned.as_deref(), Some(first), "re-executed with {ours}");
    let own = tunables_of_a_running_node(Some("glibc.malloc.arena_max=2"));
    assert_eq!(own.as_deref(), Some("glibc.malloc.arena_max=2"), "a user's setting is kept");
    let off = tunables_of_a_running_node(Some(""));
    assert_eq!(off.as_deref(), Some(""), "an empty value keeps glibc's defaults");
}

/// Runs `shoal` with `args` and `--json PATH`, which must succeed: its
/// stdout, and the JSON it wrote (as text and parsed).
fn bench_json(args: &[&str]) -> (String, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let json = dir.path().join("bench.json");
    let path = json.to_string_lossy().into_owned();
    let o = shoal(&[args, &["--json", &path]].concat());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let raw = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{e}"));
    let v: serde_json::Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{e}: {raw}"));
    (out, raw, v)
}

/// `shoal bench exchange` on a small model: every worker's push and pull
/// moves (n-1)/n of the model each way in f32, the compressed cases move
/// well under half of that, and all report a rate. Owners make a pass per
/// dense push and a bounded few for a round of sparse ones.
#[test]
fn bench_exchange_moves_the_bytes_an_all_reduce_would() {
    let (out, raw, v) = bench_json(&["bench", "exchange", "--mb", "2", "--steps", "3", "--shards", "8"]);
    let model = v["model_bytes"].as_f64().unwrap_or(0.0);
    assert!((model - 2e6).abs() < 2e3, "the model is about 2 MB: {model}");
    let cases = v["cases"].as_array().cloned().unwrap_or_default();
    assert_eq!(cases.len(), 3, "{raw}");
    let wire = |i: usize| cases[i]["wire_bytes_per_step"].as_f64().unwrap_or(0.0);
    // 4 workers, each pushing and pulling 3/4 of the model: 6 models per
    // step, plus the payloads' few header bytes.
    let f32_wire = wire(0);
    assert!(f32_wire >= 6.0 * model && f32_wire < 6.0 * model * 1.01, "f32 wire {f32_wire} for a {model}-byte model");
    // int8 pushes (1.016 B per value) and bf16 pulls (2 B): about 0.38x.
    assert!(wire(1) < 0.45 * f32_wire, "compressed {} against f32 {f32_wire}", wire(1));
    // Sparse pushes (1.5% of the entries, 2.25 B each) and bf16 pulls.
    assert!(wire(2) < 0.3 * f32_wire, "sparse {} against f32 {f32_wire}", wire(2));
    let passes = |i: usize| cases[i]["owner_passes_per_step"].as_f64().unwrap_or(0.0);
    // Each of the 4 dense pushes taken in and added, then the update
    // zeroed and the optimizer's loop.
    assert!(passes(0) >= 10.0 - 1e-9, "f32 rounds took {} passes", passes(0));
    // The same loops over the update, and 1.5% of the shard per push.
    assert!((2.0..3.0).contains(&passes(2)), "sparse rounds took {} passes", passes(2));
    for c in &cases {
        let rate = c["effective_gb_per_s"].as_f64().unwrap_or(0.0);
        assert!(rate.is_finite() && rate > 0.0, "{c}");
    }
    assert!(out.contains("x raw TCP"), "{out}");
}

/// `shoal bench train --model llama`: only the Llama is measured, and its
/// JSON gives the training rate and the hand-written step's gradients
/// against candle's graph's, both measured in the run.
#[test]
fn bench_train_measures_one_model_against_the_graph() {
    let (out, raw, v) = bench_json(&[
        "bench",
        "train",
        "--model",
        "llama",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--matmul-size",
        "32",
        "--threads",
        "1",
    ]);
    let models = v["models"].as_array().cloned().unwrap_or_default();
    assert_eq!(models.len(), 1, "{raw}");
    assert_eq!(models[0]["arch"], "llama", "{raw}");
    for key in ["train_samples_per_sec", "grads_samples_per_sec", "graph_grads_samples_per_sec", "grads_over_graph"] {
        let x = models[0][key].as_f64().unwrap_or(0.0);
        assert!(x.is_finite() && x > 0.0, "{key}: {raw}");
    }
    assert!(!out.contains("fashion-mnist"), "no image data set is loaded for the Llama alone: {out}");
}

/// `shoal bench comm --workload llama`, small: dense against one
/// SparseLoCo case on loopback. The JSON has issue 46's fields for each
/// case; the sparse case moves over 50x fewer bytes; an unknown case is an
/// error that names the cases.
#[test]
fn bench_comm_llama_reports_bytes_and_loss_per_case() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let plot = dir.path().join("bytes-loss.png");
    let (out, raw, v) = bench_json(&[
        "bench",
        "comm",
        "--workload",
        "llama",
        "--steps",
        "60",
        "--links",
        "0",
        "--cases",
        "sparseloco H=30 delta-sparse",
        "--plot",
        &plot.to_string_lossy(),
    ]);
    let png = std::fs::read(&plot).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&png[..4], b"\x89PNG", "the bytes-against-loss plot");
    eprintln!("{out}");
    let cases = v["cases"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = cases.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, ["dense", "sparseloco H=30 delta-sparse"], "{raw}");
    for c in &cases {
        let loss = c["val_loss"].as_f64().unwrap_or(f64::NAN);
        assert!(loss > 0.0 && loss < 6.0, "{raw}");
        let util = c["utilization"].as_f64().unwrap_or(0.0);
        assert!(util > 0.0 && util <= 1.0, "{raw}");
        assert_eq!(c["link_mbps"].as_f64(), Some(0.0), "{raw}");
        assert_eq!(c["recommended"].as_bool(), Some(false), "{raw}");
        assert!(c["bytes_total"].as_u64().unwrap_or(0) > 0, "{raw}");
        assert_eq!(c["delta_mismatches"].as_u64(), Some(0), "{raw}");
    }
    assert_eq!(cases[1]["delta"].as_str(), Some("sparseloco:0.015"), "{raw}");
    assert_eq!((cases[1]["outer_lr"].as_f64(), cases[1]["outer_momentum"].as_f64()), (Some(1.0), Some(0.0)), "{raw}");
    let fewer = cases[1]["fewer_bytes_than_dense"].as_f64().unwrap_or(0.0);
    assert!(fewer > 1000.0, "sparse pushes and delta pulls every 30 steps: {fewer}x fewer bytes than dense; {raw}");
    let o = shoal(&["bench", "comm", "--workload", "llama", "--cases", "nope"]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("no llama case `nope`") && err.contains("sparseloco H=30"), "{err}");
}

/// `shoal bench robust`, small: one bad peer in 5. The plain mean under a
/// 100x attacker fails visibly, the median holds within 5 points of the
/// fault-free run measured beside it, and the JSON has every case.
#[test]
fn bench_robust_measures_each_attack_against_the_fault_free_run() {
    let (out, raw, v) = bench_json(&[
        "bench",
        "robust",
        "--nodes",
        "5",
        "--byzantine",
        "1",
        "--steps",
        "150",
        "--attacks",
        "scale:100,zeros",
        "--rules",
        "mean,median",
    ]);
    eprintln!("{out}");
    let base = v["fault_free_accuracy"].as_f64().unwrap_or(0.0);
    assert!(base >= 0.9, "fault-free {base}");
    let cases = v["attacks"].as_array().cloned().unwrap_or_default();
    let case = |attack: &str, rule: &str| {
        let c = cases.iter().find(|c| c["attack"] == attack && c["rule"] == rule);
        c.and_then(|c| c["honest_accuracy"].as_f64()).unwrap_or_else(|| panic!("no {attack} under {rule}: {raw}"))
    };
    assert_eq!(cases.len(), 4, "{raw}");
    assert!(case("scale:100", "mean") < 0.5, "the mean should fail under a 100x attacker: {raw}");
    assert!(case("scale:100", "median") >= base - 0.05, "the median should hold: {raw}");
    assert!(case("zeros", "median") >= base - 0.05, "{raw}");
    assert!(out.contains("vs fault-free"), "{out}");
}

/// Writes `bytes` of English-looking text: lines of words drawn from the
/// GPL's vocabulary by a fixed generator, so that a 10 MiB text is the first
/// 10 MiB of the 1 GiB one.
fn write_generated_text(path: &std::path::Path, bytes: u64) -> std::io::Result<()> {
    use std::io::Write;
    let source = include_str!("../../models/data/gpl-3.0.txt");
    let words: Vec<&str> = source.split_whitespace().collect();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    let (mut state, mut written, mut line) = (0x9E37_79B9_7F4A_7C15u64, 0u64, String::new());
    while written < bytes {
        // xorshift64*: a fixed stream of word choices.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let word = words[(state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % words.len()];
        line.push_str(word);
        if line.len() > 72 {
            line.push('\n');
            out.write_all(line.as_bytes())?;
            written += line.len() as u64;
            line.clear();
        } else {
            line.push(' ');
        }
    }
    out.flush()
}

/// A token directory of `copies` times the tokens of `small` (a directory
/// `shoal data tokenize` wrote), as if a text of `copies` times the small
/// one had been tokenized: the ids are the same, so there is no need to
/// spend minutes cutting a gigabyte of text to test how training reads it.
fn repeat_token_directory(
    small: &std::path::Path,
    large: &std::path::Path,
    copies: u64,
) -> shoal_models::data::TokenIndex {
    use shoal_models::data::tokens::{TokenIndex, TokenWriter};
    let index = TokenIndex::read(small).unwrap_or_else(|e| panic!("{e}"));
    let tokenizer =
        shoal_models::tokenizer::Tokenizer::from_file(&small.join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}"));
    let bytes = std::fs::read(small.join(&index.shards[0].file)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(index.shards.len(), 1, "the small set is one shard");
    let ids: Vec<u32> = bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).collect();
    let mut writer = TokenWriter::create(large, &tokenizer).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..copies {
        writer.push(&ids).unwrap_or_else(|e| panic!("{e}"));
    }
    writer.finish(index.text_bytes * copies).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[ignore = "writes a token directory of a gigabyte of text (about 650 MB of disk): .ci/run runs it"]
fn a_token_directory_of_a_gigabyte_trains_in_the_memory_of_ten_megabytes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = |name: &str| dir.path().join(name).to_str().unwrap_or_default().to_string();
    let run = |args: &[&str]| {
        let started = std::time::Instant::now();
        let o = shoal(args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}\nstdout: {out}\nstderr: {err}");
        eprintln!("{:?} in {:.1} s: {}", &args[..2], started.elapsed().as_secs_f64(), out.trim());
    };
    let text_file = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/data/gpl-3.0.txt");
    run(&["data", "train-tokenizer", "--vocab", "1024", "--output", &path("tokenizer.json"), text_file]);
    write_generated_text(&dir.path().join("small.txt"), 10 << 20).unwrap_or_else(|e| panic!("{e}"));
    run(&[
        "data",
        "tokenize",
        "--tokenizer",
        &path("tokenizer.json"),
        "--output",
        &path("small-tokens"),
        &path("small.txt"),
    ]);
    let large = repeat_token_directory(&dir.path().join("small-tokens"), &dir.path().join("large-tokens"), 103);
    assert!(large.text_bytes >= 1 << 30, "{} bytes of text", large.text_bytes);
    let mut peaks = Vec::new();
    for name in ["small", "large"] {
        let json = path(&format!("{name}.json"));
        #[rustfmt::skip]
        run(&[
            "train", "--model", "llama", "--layers", "1", "--heads", "2", "--width", "32", "--ff", "64",
            "--dataset", &format!("tokens@64:{}", path(&format!("{name}-tokens"))), "--steps", "40",
            "--eval-every", "40", "--batch-size", "16", "--threads", "2", "--json", &json,
        ]);
        let summary = read_json(std::path::Path::new(&json));
        let peak = summary["peak_rss_bytes"].as_u64().unwrap_or_else(|| panic!("no peak_rss_bytes in {summary}"));
        eprintln!("{name}: peak RSS {:.1} MiB, {summary}", peak as f64 / 1048576.0);
        peaks.push(peak);
    }
    eprintln!(
        "peak RSS: {:.1} MiB on 10 MiB of text, {:.1} MiB on {:.2} GiB",
        peaks[0] as f64 / 1048576.0,
        peaks[1] as f64 / 1048576.0,
        large.text_bytes as f64 / (1u64 << 30) as f64
    );
    assert!(
        peaks[1] <= 2 * peaks[0],
        "peak RSS {} MiB on 1 GiB of text against {} MiB on 10 MiB",
        peaks[1] >> 20,
        peaks[0] >> 20
    );
}
