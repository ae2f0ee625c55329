//! Shoal's training arithmetic against an independent reference.
//!
//! `scripts/reference_sgd.py` trains the same MLP with numpy alone, in
//! float64, from the same initial weights on the same batches with
//! PyTorch's SGD rule. After several steps every parameter of Shoal's model
//! must match it within 1e-5, and every step's loss too. This pins the
//! forward pass, the loss, the backward pass, the flattening of gradients
//! and the optimizer in one go; `training.rs` then shows that a BSP cluster
//! takes exactly the single-node step on the workers' concatenated batch.
//!
//! Needs python3 with numpy. Without them the test says so and passes,
//! unless `SHOAL_REQUIRE_NUMPY=1` (set by `.ci/run`), where it fails.

use std::path::PathBuf;
use std::process::Command;

use candle_core::Device;
use shoal_models::{data, ArchKind, DatasetKind, LocalTrainer, ModelConfig, OptimizerConfig};

fn numpy_available() -> bool {
    let ok = Command::new("python3").args(["-c", "import numpy"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !ok && std::env::var("SHOAL_REQUIRE_NUMPY").as_deref() == Ok("1") {
        panic!("SHOAL_REQUIRE_NUMPY=1 but python3 with numpy is not available");
    }
    ok
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/reference_sgd.py")
}

/// Train `steps` steps of `batch` with Shoal and with numpy; return the
/// largest absolute difference in parameters and in losses.
fn compare(opt: OptimizerConfig, hidden: Vec<usize>, steps: usize, batch: usize) -> (f64, f64) {
    let split = data::load(&DatasetKind::Digits, None).expect("digits are embedded");
    let mut config = ModelConfig::for_dataset(ArchKind::Mlp, &split.train);
    config.arch = shoal_models::Arch::Mlp { hidden };
    let mut trainer = LocalTrainer::new(config, opt, 7, batch, &Device::Cpu).expect("model");
    let initial = trainer.params().to_vec();
    let batches: Vec<Vec<usize>> =
        split.train.epoch_batches(batch, 7, 0).expect("batches").into_iter().take(steps).collect();

    // The samples the batches use, renumbered 0..n for the reference.
    let used: Vec<usize> = batches.iter().flatten().copied().collect();
    let (x, y) = split.train.batch(&used, &Device::Cpu).expect("batch");
    let x = x.flatten_from(1).and_then(|x| x.to_vec2::<f32>()).expect("images");
    let y = y.to_vec1::<u32>().expect("labels");
    let mut next = 0usize;
    let local: Vec<Vec<usize>> = batches
        .iter()
        .map(|b| {
            let r = (next..next + b.len()).collect();
            next += b.len();
            r
        })
        .collect();

    // Initial layers in the layout's order: fc0.weight, fc0.bias, fc1.weight, ...
    let layout = trainer.model().layout().clone();
    let layer = |params: &[f32], i: usize| -> (Vec<Vec<f32>>, Vec<f32>) {
        let w = layout.entry(&format!("fc{i}.weight")).expect("weight");
        let b = layout.entry(&format!("fc{i}.bias")).expect("bias");
        let cols = w.shape[1];
        let rows = params[w.range()].chunks(cols).map(<[f32]>::to_vec).collect();
        (rows, params[b.range()].to_vec())
    };
    let n_layers = layout.entries().len() / 2;
    let layers: Vec<serde_json::Value> = (0..n_layers)
        .map(|i| {
            let (w, b) = layer(&initial, i);
            serde_json::json!({ "w": w, "b": b })
        })
        .collect();
    let OptimizerConfig::Sgd { lr, momentum, nesterov, weight_decay } = opt else { panic!("SGD only") };
    let case = serde_json::json!({
        "layers": layers, "x": x, "y": y, "batches": local,
        "optimizer": { "lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay },
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("case.json");
    std::fs::write(&path, serde_json::to_vec(&case).expect("json")).expect("write case");

    let mut losses = Vec::new();
    for b in &batches {
        losses.push(trainer.train_batch(&split.train, b).expect("step"));
    }

    let out = Command::new("python3").arg(script()).arg(&path).output().expect("running the reference");
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).expect("reference output");
    let mut max_param = 0.0f64;
    let finals = trainer.params();
    for i in 0..n_layers {
        let (w, b) = layer(finals, i);
        let rw = &reference["layers"][i]["w"];
        let rb = &reference["layers"][i]["b"];
        for (r, row) in w.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let want = rw[r][c].as_f64().expect("number");
                max_param = max_param.max((*v as f64 - want).abs());
            }
        }
        for (c, v) in b.iter().enumerate() {
            max_param = max_param.max((*v as f64 - rb[c].as_f64().expect("number")).abs());
        }
    }
    // The parameters moved: the comparison is not of two untouched copies.
    let moved = initial.iter().zip(finals).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    assert!(moved > 1e-3, "training did not move the parameters ({moved})");
    let ref_losses = reference["losses"].as_array().expect("losses");
    assert_eq!(ref_losses.len(), losses.len());
    let max_loss =
        losses.iter().zip(ref_losses).map(|(a, b)| (*a as f64 - b.as_f64().expect("loss")).abs()).fold(0.0, f64::max);
    (max_param, max_loss)
}

#[test]
fn sgd_steps_match_an_independent_numpy_reference() {
    if !numpy_available() {
        eprintln!("skipped: python3 with numpy is not available");
        return;
    }
    let cases = [
        ("sgd momentum", OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, nesterov: false, weight_decay: 0.0 }),
        ("sgd nesterov + decay", OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 1e-3 }),
    ];
    for (name, opt) in cases {
        let (param, loss) = compare(opt, vec![64, 32], 8, 32);
        eprintln!("{name}: max |param diff| {param:.2e}, max |loss diff| {loss:.2e} after 8 steps");
        assert!(param <= 1e-5, "{name}: parameters differ from the numpy reference by {param:e}");
        assert!(loss <= 1e-5, "{name}: losses differ from the numpy reference by {loss:e}");
    }
}
