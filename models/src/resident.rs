//! The optimizer kept on the model's device, for single-node training on a
//! GPU: parameters, gradients and optimizer state stay where the model is,
//! and nothing crosses to the host between steps. [`crate::LocalTrainer`]
//! uses it on every device but the CPU (where the flat optimizer of
//! [`crate::optim`] is faster) and copies back to the host only when asked
//! for parameters or a checkpoint: one copy per round of steps, not per step.
//!
//! The update is the flat optimizer's, written as tensor ops over each
//! variable; tests check that the two agree.

use candle_core::{backprop::GradStore, Tensor};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};
use crate::layout::ParamLayout;
use crate::optim::{Optimizer, OptimizerConfig, OptimizerState};

/// Optimizer state as one tensor per slot per variable, in layout order.
#[derive(Debug)]
pub struct ResidentOptimizer {
    config: OptimizerConfig,
    step: u64,
    slot_names: Vec<String>,
    /// `slots[s][e]`: slot `s` of layout entry `e`.
    slots: Vec<Vec<Tensor>>,
}

impl ResidentOptimizer {
    /// Move a flat optimizer's state onto the variables' device.
    pub fn new(opt: &Optimizer, layout: &ParamLayout, varmap: &VarMap) -> Result<Self> {
        let state = opt.state();
        if state.len() != layout.total_len() {
            return Err(ModelError::Optimizer(format!(
                "optimizer covers {} parameters, the model has {}",
                state.len(),
                layout.total_len()
            )));
        }
        let device = device_of(varmap)?;
        let slots = state
            .slots
            .iter()
            .map(|(_, flat)| {
                layout
                    .entries()
                    .iter()
                    .map(|e| Ok(Tensor::from_slice(&flat[e.range()], e.shape.as_slice(), &device)?))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: state.config,
            step: state.step,
            slot_names: state.slots.iter().map(|(n, _)| n.clone()).collect(),
            slots,
        })
    }

    pub fn set_lr(&mut self, new_lr: f64) {
        match &mut self.config {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::Adamw { lr, .. } => *lr = new_lr,
        }
    }

    /// One update of every variable from `grads` (a variable without a
    /// gradient is updated as if its gradient were zero, as the flat
    /// optimizer does).
    pub fn step(&mut self, layout: &ParamLayout, varmap: &VarMap, grads: &GradStore) -> Result<()> {
        let data = varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))?;
        self.step += 1;
        let t = self.step.min(i32::MAX as u64) as i32;
        for (i, e) in layout.entries().iter().enumerate() {
            let var = data.get(&e.name).ok_or_else(|| ModelError::Invalid(format!("variable {} vanished", e.name)))?;
            let p = var.as_tensor();
            let g = match grads.get(p) {
                Some(g) => g.clone(),
                None => p.zeros_like()?,
            };
            let new_p = match (self.config, self.slots.as_mut_slice()) {
                (OptimizerConfig::Sgd { lr, momentum, nesterov, weight_decay }, [buf]) => {
                    let g = (g + (p * weight_decay)?)?;
                    let b = ((&buf[i] * momentum)? + &g)?;
                    let d = if nesterov { (&g + (&b * momentum)?)? } else { b.clone() };
                    buf[i] = b;
                    (p - (d * lr)?)?
                }
                (OptimizerConfig::Adamw { lr, beta1, beta2, eps, weight_decay }, [m, v]) => {
                    let c1 = 1.0 / (1.0 - beta1.powi(t));
                    let c2 = 1.0 / (1.0 - beta2.powi(t));
                    let mi = ((&m[i] * beta1)? + (&g * (1.0 - beta1))?)?;
                    let vi = ((&v[i] * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let update = ((&mi * c1)? / ((&vi * c2)?.sqrt()? + eps)?)?;
                    m[i] = mi;
                    v[i] = vi;
                    ((p * (1.0 - lr * weight_decay))? - (update * lr)?)?
                }
                _ => return Err(ModelError::Optimizer("state slots do not match the optimizer".into())),
            };
            var.set(&new_p)?;
        }
        Ok(())
    }

    /// The state as a flat optimizer's (one copy to the host per slot and variable).
    pub fn to_state(&self, layout: &ParamLayout) -> Result<OptimizerState> {
        let mut slots = Vec::with_capacity(self.slots.len());
        for (name, tensors) in self.slot_names.iter().zip(&self.slots) {
            let mut flat = vec![0f32; layout.total_len()];
            for (e, t) in layout.entries().iter().zip(tensors) {
                let values: Vec<f32> = t.flatten_all()?.to_vec1()?;
                flat[e.range()].copy_from_slice(&values);
            }
            slots.push((name.clone(), flat));
        }
        Ok(OptimizerState { config: self.config, step: self.step, slots })
    }
}

fn device_of(varmap: &VarMap) -> Result<candle_core::Device> {
    let data = varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))?;
    Ok(data.values().next().map(|v| v.device().clone()).unwrap_or(candle_core::Device::Cpu))
}
