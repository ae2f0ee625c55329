//! Optimizers over flat `f32` slices.
//!
//! They work on plain slices, not candle variables, so that a shard owner can
//! run the optimizer for exactly the slice it owns and hold that slice's state,
//! and so that one node and N nodes run literally the same arithmetic. The
//! state is public ([`OptimizerState`]) so it can be checkpointed, cut into
//! shards and handed from one owner to another.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::error::{ModelError, Result};

/// Optimizer names accepted on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Sgd,
    #[default]
    Adamw,
}

impl FromStr for OptimizerKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sgd" => Ok(OptimizerKind::Sgd),
            "adamw" | "adam" => Ok(OptimizerKind::Adamw),
            other => Err(ModelError::Optimizer(format!("unknown optimizer `{other}`: expected sgd or adamw"))),
        }
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
        })
    }
}

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// SGD with (optionally Nesterov) momentum and L2 weight decay, as in
    /// PyTorch: `b = mu*b + (g + wd*p)`, `p -= lr * (g + mu*b if nesterov else b)`.
    Sgd { lr: f64, momentum: f64, nesterov: bool, weight_decay: f64 },
    /// AdamW (Loshchilov and Hutter) with decoupled weight decay and bias
    /// correction, as in candle-nn and PyTorch.
    Adamw { lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

impl OptimizerConfig {
    /// Sensible defaults for a learning rate.
    pub fn new(kind: OptimizerKind, lr: f64) -> Self {
        match kind {
            OptimizerKind::Sgd => OptimizerConfig::Sgd { lr, momentum: 0.9, nesterov: true, weight_decay: 0.0 },
            OptimizerKind::Adamw => {
                OptimizerConfig::Adamw { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-4 }
            }
        }
    }

    /// The default learning rate of each optimizer.
    pub fn default_lr(kind: OptimizerKind) -> f64 {
        match kind {
            OptimizerKind::Sgd => 0.05,
            OptimizerKind::Adamw => 2e-3,
        }
    }

    pub fn kind(&self) -> OptimizerKind {
        match self {
            OptimizerConfig::Sgd { .. } => OptimizerKind::Sgd,
            OptimizerConfig::Adamw { .. } => OptimizerKind::Adamw,
        }
    }

    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adamw { lr, .. } => *lr,
        }
    }

    /// The same optimizer with another weight decay (decoupled for AdamW,
    /// L2 for SGD).
    #[must_use]
    pub fn with_weight_decay(mut self, decay: f64) -> Self {
        match &mut self {
            OptimizerConfig::Sgd { weight_decay, .. } | OptimizerConfig::Adamw { weight_decay, .. } => {
                *weight_decay = decay
            }
        }
        self
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Optimizer(m));
        let lr = self.lr();
        if !(lr.is_finite() && lr > 0.0) {
            return bad(format!("learning rate {lr} must be finite and positive"));
        }
        match *self {
            OptimizerConfig::Sgd { momentum, weight_decay, .. } => {
                if !(0.0..1.0).contains(&momentum) {
                    return bad(format!("momentum {momentum} not in [0, 1)"));
                }
                if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
                    return bad(format!("weight decay {weight_decay} must be >= 0"));
                }
            }
            OptimizerConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
                if !(0.0..1.0).contains(&beta1) || !(0.0..1.0).contains(&beta2) {
                    return bad(format!("betas ({beta1}, {beta2}) not in [0, 1)"));
                }
                if !(eps > 0.0 && eps.is_finite()) {
                    return bad(format!("eps {eps} must be positive"));
                }
                if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
                    return bad(format!("weight decay {weight_decay} must be >= 0"));
                }
            }
        }
        Ok(())
    }

    /// The names of the per-element state slots.
    pub fn slot_names(&self) -> &'static [&'static str] {
        match self {
            OptimizerConfig::Sgd { .. } => &["momentum"],
            OptimizerConfig::Adamw { .. } => &["m", "v"],
        }
    }
}

/// An optimizer's full state for the slice it covers: step count plus one
/// vector per slot, each as long as the slice.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerState {
    pub config: OptimizerConfig,
    /// Number of steps taken (AdamW's bias correction needs it).
    pub step: u64,
    pub slots: Vec<(String, Vec<f32>)>,
}

impl OptimizerState {
    /// Number of parameters the state covers.
    pub fn len(&self) -> usize {
        self.slots.first().map(|(_, v)| v.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state of a sub-range (e.g. one shard of a full model's state).
    pub fn slice(&self, range: Range<usize>) -> Result<OptimizerState> {
        if range.end > self.len() || range.start > range.end {
            return Err(ModelError::Optimizer(format!("range {range:?} outside state of {} values", self.len())));
        }
        Ok(OptimizerState {
            config: self.config,
            step: self.step,
            slots: self.slots.iter().map(|(n, v)| (n.clone(), v[range.clone()].to_vec())).collect(),
        })
    }

    /// Concatenate shard states back into one (all must share config and step).
    pub fn concat(parts: &[OptimizerState]) -> Result<OptimizerState> {
        let first = parts.first().ok_or_else(|| ModelError::Optimizer("no parts to join".into()))?;
        let mut slots: Vec<(String, Vec<f32>)> = first.slots.iter().map(|(n, _)| (n.clone(), Vec::new())).collect();
        for p in parts {
            if p.config != first.config || p.step != first.step || p.slots.len() != slots.len() {
                return Err(ModelError::Optimizer("parts disagree on config, step or slots".into()));
            }
            for ((name, acc), (pname, v)) in slots.iter_mut().zip(&p.slots) {
                if name != pname {
                    return Err(ModelError::Optimizer(format!("slot {pname} where {name} expected")));
                }
                acc.extend_from_slice(v);
            }
        }
        Ok(OptimizerState { config: first.config, step: first.step, slots })
    }
}

/// An optimizer for a slice of `len` parameters.
#[derive(Debug, Clone)]
pub struct Optimizer {
    state: OptimizerState,
}

impl Optimizer {
    pub fn new(config: OptimizerConfig, len: usize) -> Result<Self> {
        config.validate()?;
        let slots = config.slot_names().iter().map(|n| (n.to_string(), vec![0.0f32; len])).collect();
        Ok(Self { state: OptimizerState { config, step: 0, slots } })
    }

    /// Resume from saved (or handed-off) state.
    pub fn from_state(state: OptimizerState) -> Result<Self> {
        state.config.validate()?;
        let names: Vec<&str> = state.slots.iter().map(|(n, _)| n.as_str()).collect();
        if names != state.config.slot_names() {
            return Err(ModelError::Optimizer(format!(
                "state has slots {names:?}, {} needs {:?}",
                state.config.kind(),
                state.config.slot_names()
            )));
        }
        let len = state.len();
        if state.slots.iter().any(|(_, v)| v.len() != len) {
            return Err(ModelError::Optimizer("state slots have different lengths".into()));
        }
        Ok(Self { state })
    }

    pub fn state(&self) -> &OptimizerState {
        &self.state
    }

    pub fn into_state(self) -> OptimizerState {
        self.state
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.state.config
    }

    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    pub fn set_lr(&mut self, new_lr: f64) -> Result<()> {
        match &mut self.state.config {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adamw { lr, .. } => *lr = new_lr,
        }
        self.state.config.validate()
    }

    /// One update: `params` and `grads` are the slice this optimizer covers.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<()> {
        let n = self.len();
        if params.len() != n || grads.len() != n {
            return Err(ModelError::Optimizer(format!(
                "step on {} params / {} grads, optimizer covers {n}",
                params.len(),
                grads.len()
            )));
        }
        self.state.step += 1;
        let t = self.state.step;
        match (self.state.config, self.state.slots.as_mut_slice()) {
            (OptimizerConfig::Sgd { lr, momentum, nesterov, weight_decay }, [(_, buf)]) => {
                let (lr, mu, wd) = (lr as f32, momentum as f32, weight_decay as f32);
                for ((p, &g), b) in params.iter_mut().zip(grads).zip(buf.iter_mut()) {
                    let g = g + wd * *p;
                    *b = mu * *b + g;
                    let d = if nesterov { g + mu * *b } else { *b };
                    *p -= lr * d;
                }
            }
            (OptimizerConfig::Adamw { lr, beta1, beta2, eps, weight_decay }, [(_, m), (_, v)]) => {
                let (b1, b2) = (beta1 as f32, beta2 as f32);
                let c1 = 1.0 / (1.0 - beta1.powi(t.min(i32::MAX as u64) as i32)) as f32;
                let c2 = 1.0 / (1.0 - beta2.powi(t.min(i32::MAX as u64) as i32)) as f32;
                let (lr, eps) = (lr as f32, eps as f32);
                let decay = 1.0 - lr * weight_decay as f32;
                for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    let m_hat = *m * c1;
                    let v_hat = *v * c2;
                    *p = *p * decay - lr * m_hat / (v_hat.sqrt() + eps);
                }
            }
            _ => return Err(ModelError::Optimizer("state slots do not match the optimizer".into())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * (1.0 + b.abs())
    }

    #[test]
    fn sgd_momentum_matches_hand_computation() {
        let cfg = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.0 };
        let Ok(mut opt) = Optimizer::new(cfg, 1) else { panic!("opt") };
        let mut p = [1.0f32];
        // b1 = 0.5, p = 1 - 0.05 = 0.95; b2 = 0.45 + 0.5 = 0.95, p = 0.95 - 0.095 = 0.855
        assert!(opt.step(&mut p, &[0.5]).is_ok());
        assert!(close(p[0], 0.95));
        assert!(opt.step(&mut p, &[0.5]).is_ok());
        assert!(close(p[0], 0.855), "{}", p[0]);
    }

    #[test]
    fn nesterov_looks_ahead() {
        let cfg = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.0 };
        let Ok(mut opt) = Optimizer::new(cfg, 1) else { panic!("opt") };
        let mut p = [1.0f32];
        // b = 0.5; d = 0.5 + 0.45 = 0.95; p = 1 - 0.095
        assert!(opt.step(&mut p, &[0.5]).is_ok());
        assert!(close(p[0], 0.905), "{}", p[0]);
    }

    #[test]
    fn adamw_first_step_moves_by_lr() {
        // With bias correction the first Adam step is lr * sign(g) (eps aside).
        let cfg = OptimizerConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let Ok(mut opt) = Optimizer::new(cfg, 2) else { panic!("opt") };
        let mut p = [1.0f32, -1.0];
        assert!(opt.step(&mut p, &[3.0, -0.2]).is_ok());
        assert!(close(p[0], 0.99) && close(p[1], -0.99), "{p:?}");
        assert_eq!(opt.state().step, 1);
    }

    #[test]
    fn sharded_state_steps_like_the_whole() {
        // Stepping two halves with sliced state equals stepping the whole.
        let cfg = OptimizerConfig::new(OptimizerKind::Adamw, 0.01);
        let grads: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.1).collect();
        let Ok(mut whole) = Optimizer::new(cfg, 10) else { panic!("opt") };
        let mut pw: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let mut ph = pw.clone();
        let (mut a, mut b) = (whole.clone(), whole.clone());
        for _ in 0..3 {
            assert!(whole.step(&mut pw, &grads).is_ok());
        }
        let Ok(sa) = a.state().slice(0..4) else { panic!() };
        let Ok(sb) = b.state().slice(4..10) else { panic!() };
        let (Ok(oa), Ok(ob)) = (Optimizer::from_state(sa), Optimizer::from_state(sb)) else { panic!() };
        a = oa;
        b = ob;
        for _ in 0..3 {
            let (l, r) = ph.split_at_mut(4);
            assert!(a.step(l, &grads[..4]).is_ok());
            assert!(b.step(r, &grads[4..]).is_ok());
        }
        assert_eq!(pw, ph);
        let joined = OptimizerState::concat(&[a.into_state(), b.into_state()]).ok();
        assert_eq!(joined.as_ref(), Some(whole.state()));
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(Optimizer::new(OptimizerConfig::new(OptimizerKind::Sgd, -1.0), 1).is_err());
        assert!(Optimizer::new(OptimizerConfig::new(OptimizerKind::Sgd, f64::NAN), 1).is_err());
        let Ok(mut o) = Optimizer::new(OptimizerConfig::new(OptimizerKind::Sgd, 0.1), 2) else { panic!() };
        assert!(o.step(&mut [0.0], &[0.0, 1.0]).is_err());
        let bad = OptimizerState { config: OptimizerConfig::new(OptimizerKind::Adamw, 0.1), step: 0, slots: vec![] };
        assert!(Optimizer::from_state(bad).is_err());
    }
}
