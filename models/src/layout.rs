//! [`ParamLayout`]: a model's parameters as one ordered flat vector, and
//! [`ShardPlan`]: that vector cut into contiguous shards.
//!
//! Both are pure functions of the model config, so every peer computes the
//! same layout and the same plan without talking to anyone; the plan's
//! [`ShardPlan::fingerprint`] lets peers check that they agree.

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};
use crate::rng::stable_hash64;

/// One named tensor's place in the flat vector.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// Always `f32` today; recorded so that the wire and checkpoints can say so.
    pub dtype: String,
    /// Offset in elements from the start of the flat vector.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl ParamEntry {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The ordered flat view of a model's parameters (sorted by name).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    total: usize,
}

impl ParamLayout {
    /// Build from `(name, shape)` pairs; the order is by name, whatever the
    /// input order, so a `HashMap`-backed `VarMap` gives a stable layout.
    pub fn from_shapes(mut shapes: Vec<(String, Vec<usize>)>) -> Result<Self> {
        shapes.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = shapes.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ModelError::Invalid(format!("duplicate parameter name {}", w[0].0)));
        }
        let mut offset = 0usize;
        let entries = shapes
            .into_iter()
            .map(|(name, shape)| {
                let len = shape.iter().product();
                let e = ParamEntry { name, shape, dtype: "f32".into(), offset, len };
                offset += len;
                e
            })
            .collect();
        Ok(Self { entries, total: offset })
    }

    pub fn from_varmap(varmap: &VarMap) -> Result<Self> {
        let data = lock(varmap)?;
        for (name, var) in data.iter() {
            if var.dtype() != DType::F32 {
                return Err(ModelError::Invalid(format!(
                    "parameter {name} is {:?}; only f32 parameters are supported",
                    var.dtype()
                )));
            }
        }
        Self::from_shapes(data.iter().map(|(n, v)| (n.clone(), v.dims().to_vec())).collect())
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn entry(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.binary_search_by(|e| e.name.as_str().cmp(name)).ok().map(|i| &self.entries[i])
    }

    /// Number of f32 values in the flat vector.
    pub fn total_len(&self) -> usize {
        self.total
    }

    pub fn total_bytes(&self) -> usize {
        self.total * 4
    }

    /// Copy every variable into one flat vector.
    pub fn flatten_vars(&self, varmap: &VarMap) -> Result<Vec<f32>> {
        let data = lock(varmap)?;
        let mut out = vec![0.0f32; self.total];
        for e in &self.entries {
            let var = data.get(&e.name).ok_or_else(|| missing(&e.name))?;
            self.check_shape(e, var.dims())?;
            copy_out(var.as_tensor(), &mut out[e.range()])?;
        }
        Ok(out)
    }

    /// Write a flat vector back into the variables. On the CPU the values
    /// are copied straight over each variable's storage; elsewhere they go
    /// to the device as a tensor first.
    pub fn write_vars(&self, varmap: &VarMap, flat: &[f32]) -> Result<()> {
        self.check_len(flat)?;
        let data = lock(varmap)?;
        for e in &self.entries {
            let var = data.get(&e.name).ok_or_else(|| missing(&e.name))?;
            self.check_shape(e, var.dims())?;
            let values = &flat[e.range()];
            if var.device().is_cpu() && var.dtype() == DType::F32 {
                var.as_tensor().inplace_op1(&Overwrite(values))?;
            } else {
                var.set(&Tensor::from_slice(values, e.shape.as_slice(), var.device())?)?;
            }
        }
        Ok(())
    }

    /// Flatten the gradients of the variables. A variable with no gradient
    /// (not on the loss's path) contributes zeros.
    pub fn flatten_grads(&self, varmap: &VarMap, grads: &GradStore) -> Result<Vec<f32>> {
        let data = lock(varmap)?;
        let mut out = vec![0.0f32; self.total];
        for e in &self.entries {
            let var = data.get(&e.name).ok_or_else(|| missing(&e.name))?;
            if let Some(g) = grads.get(var.as_tensor()) {
                self.check_shape(e, g.dims())?;
                copy_out(g, &mut out[e.range()])?;
            }
        }
        Ok(out)
    }

    /// Build a candle `GradStore` from flat gradients (e.g. aggregated ones),
    /// for use with candle optimizers.
    pub fn to_grad_store(&self, varmap: &VarMap, flat: &[f32]) -> Result<GradStore> {
        self.check_len(flat)?;
        let data = lock(varmap)?;
        let mut store = GradStore::default();
        for e in &self.entries {
            let var = data.get(&e.name).ok_or_else(|| missing(&e.name))?;
            let g = Tensor::from_slice(&flat[e.range()], e.shape.as_slice(), var.device())?;
            store.insert(var.as_tensor(), g);
        }
        Ok(store)
    }

    fn check_len(&self, flat: &[f32]) -> Result<()> {
        if flat.len() != self.total {
            return Err(ModelError::FlatLength { expected: self.total, got: flat.len() });
        }
        Ok(())
    }

    fn check_shape(&self, e: &ParamEntry, dims: &[usize]) -> Result<()> {
        if dims != e.shape.as_slice() {
            return Err(ModelError::Invalid(format!(
                "parameter {} has shape {dims:?}, layout says {:?}",
                e.name, e.shape
            )));
        }
        Ok(())
    }

    /// A stable hash of names, shapes and offsets.
    pub fn fingerprint(&self) -> u64 {
        let mut bytes = Vec::new();
        for e in &self.entries {
            bytes.extend_from_slice(e.name.as_bytes());
            bytes.push(0);
            for d in &e.shape {
                bytes.extend_from_slice(&(*d as u64).to_le_bytes());
            }
        }
        stable_hash64(&bytes)
    }
}

fn lock(varmap: &VarMap) -> Result<std::sync::MutexGuard<'_, std::collections::HashMap<String, candle_core::Var>>> {
    varmap.data().lock().map_err(|_| ModelError::Invalid("variable map lock poisoned".into()))
}

fn missing(name: &str) -> ModelError {
    ModelError::Invalid(format!("variable map has no parameter {name}"))
}

/// Copies its values over a CPU f32 tensor's storage, in place: what
/// `Var::set` does, without building a tensor of the values first (one
/// allocation and one copy of the model less each time parameters load).
struct Overwrite<'a>(&'a [f32]);

impl candle_core::InplaceOp1 for Overwrite<'_> {
    fn name(&self) -> &'static str {
        "overwrite"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(dst) = storage else {
            return Err(candle_core::Error::Msg("overwrite: the tensor is not f32".into()));
        };
        match layout.contiguous_offsets() {
            Some((a, b)) if b - a == self.0.len() && b <= dst.len() => {
                dst[a..b].copy_from_slice(self.0);
                Ok(())
            }
            _ => Err(candle_core::Error::Msg(format!(
                "overwrite: {} values for a tensor of shape {:?} (contiguous: {})",
                self.0.len(),
                layout.shape(),
                layout.is_contiguous()
            ))),
        }
    }
}

/// Copy a tensor's values into `out` (as long as the tensor), for
/// `flatten_vars` and `flatten_grads`: straight from
/// a contiguous CPU buffer, without the intermediate vector `to_vec1` makes;
/// other devices and layouts go through `to_vec1`.
fn copy_out(t: &Tensor, out: &mut [f32]) -> Result<()> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            if let Ok(src) = cpu.as_slice::<f32>() {
                if b - a == out.len() {
                    out.copy_from_slice(&src[a..b]);
                    return Ok(());
                }
            }
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    if v.len() != out.len() {
        return Err(ModelError::Invalid(format!("tensor of {} values for a slot of {}", v.len(), out.len())));
    }
    out.copy_from_slice(&v);
    Ok(())
}

/// One shard: a contiguous range of the flat vector.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shard {
    pub id: u32,
    /// Element range in the flat vector.
    pub start: usize,
    pub end: usize,
}

impl Shard {
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The flat vector cut into `S` contiguous shards whose sizes differ by at
/// most one element. Tensors are split across shard boundaries freely: what
/// moves on the wire is bytes, and equal shards balance the owners' load.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardPlan {
    total: usize,
    shards: Vec<Shard>,
}

impl ShardPlan {
    pub fn new(total: usize, num_shards: usize) -> Result<Self> {
        if num_shards == 0 {
            return Err(ModelError::ShardPlan("need at least one shard".into()));
        }
        if num_shards > total {
            return Err(ModelError::ShardPlan(format!(
                "{num_shards} shards for {total} parameters: a shard would be empty"
            )));
        }
        if num_shards > u32::MAX as usize {
            return Err(ModelError::ShardPlan(format!("{num_shards} shards is too many")));
        }
        let base = total / num_shards;
        let extra = total % num_shards;
        let mut start = 0;
        let shards = (0..num_shards)
            .map(|i| {
                let len = base + usize::from(i < extra);
                let s = Shard { id: i as u32, start, end: start + len };
                start += len;
                s
            })
            .collect();
        Ok(Self { total, shards })
    }

    pub fn for_layout(layout: &ParamLayout, num_shards: usize) -> Result<Self> {
        Self::new(layout.total_len(), num_shards)
    }

    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    pub fn shard(&self, id: u32) -> Option<&Shard> {
        self.shards.get(id as usize)
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    pub fn total_len(&self) -> usize {
        self.total
    }

    /// Cut a flat vector into per-shard slices.
    pub fn split<'a>(&self, flat: &'a [f32]) -> Result<Vec<&'a [f32]>> {
        if flat.len() != self.total {
            return Err(ModelError::FlatLength { expected: self.total, got: flat.len() });
        }
        Ok(self.shards.iter().map(|s| &flat[s.range()]).collect())
    }

    /// Reassemble a flat vector from per-shard slices, in shard order.
    pub fn join(&self, parts: &[&[f32]]) -> Result<Vec<f32>> {
        if parts.len() != self.shards.len() {
            return Err(ModelError::ShardPlan(format!("{} parts for {} shards", parts.len(), self.shards.len())));
        }
        let mut out = Vec::with_capacity(self.total);
        for (s, p) in self.shards.iter().zip(parts) {
            if p.len() != s.len() {
                return Err(ModelError::ShardPlan(format!(
                    "shard {} has {} values, expected {}",
                    s.id,
                    p.len(),
                    s.len()
                )));
            }
            out.extend_from_slice(p);
        }
        Ok(out)
    }

    /// Which parameter tensors (and which of their elements) a shard covers.
    pub fn pieces<'a>(&self, layout: &'a ParamLayout, id: u32) -> Vec<(&'a ParamEntry, Range<usize>)> {
        let Some(s) = self.shard(id) else { return Vec::new() };
        layout
            .entries()
            .iter()
            .filter_map(|e| {
                let lo = e.offset.max(s.start);
                let hi = (e.offset + e.len).min(s.end);
                (lo < hi).then(|| (e, lo - e.offset..hi - e.offset))
            })
            .collect()
    }

    /// A stable hash of the plan, for peers to check they agree.
    pub fn fingerprint(&self) -> u64 {
        let mut bytes = Vec::with_capacity(8 + self.shards.len() * 16);
        bytes.extend_from_slice(&(self.total as u64).to_le_bytes());
        for s in &self.shards {
            bytes.extend_from_slice(&(s.start as u64).to_le_bytes());
            bytes.extend_from_slice(&(s.end as u64).to_le_bytes());
        }
        stable_hash64(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn plans_cover_exactly_and_balance(total in 1usize..100_000, s in 1usize..64) {
            prop_assume!(s <= total);
            let plan = ShardPlan::new(total, s).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(plan.len(), s);
            prop_assert_eq!(plan.shards()[0].start, 0);
            prop_assert_eq!(plan.shards()[s - 1].end, total);
            for w in plan.shards().windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let lens: Vec<usize> = plan.shards().iter().map(|x| x.len()).collect();
            let (min, max) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
            prop_assert!(max - min <= 1);
            // Two independent constructions agree.
            let again = ShardPlan::new(total, s).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(plan.fingerprint(), again.fingerprint());
            prop_assert_eq!(plan, again);
        }

        #[test]
        fn split_join_round_trips_bit_exactly(values in proptest::collection::vec(any::<u32>(), 1..2000), s in 1usize..16) {
            prop_assume!(s <= values.len());
            // Arbitrary bit patterns, NaNs included: the round trip is bytes, not arithmetic.
            let flat: Vec<f32> = values.iter().map(|&b| f32::from_bits(b)).collect();
            let plan = ShardPlan::new(flat.len(), s).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let parts = plan.split(&flat).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back = plan.join(&parts).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(
                back.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                flat.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn bad_plans_are_errors() {
        assert!(ShardPlan::new(10, 0).is_err());
        assert!(ShardPlan::new(3, 4).is_err());
        let plan = ShardPlan::new(10, 2).ok();
        assert!(plan.as_ref().map(|p| p.split(&[0.0; 9]).is_err()).unwrap_or(false));
        assert!(plan.map(|p| p.join(&[&[0.0; 5]]).is_err()).unwrap_or(false));
    }

    #[test]
    fn layout_is_sorted_and_pieces_cover_shards() {
        let layout = ParamLayout::from_shapes(vec![
            ("b.weight".into(), vec![3, 4]),
            ("a.bias".into(), vec![5]),
            ("b.bias".into(), vec![3]),
        ]);
        let Ok(layout) = layout else { panic!("layout") };
        let names: Vec<&str> = layout.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a.bias", "b.bias", "b.weight"]);
        assert_eq!(layout.total_len(), 20);
        let Ok(plan) = ShardPlan::for_layout(&layout, 3) else { panic!("plan") };
        for s in plan.shards() {
            let covered: usize = plan.pieces(&layout, s.id).iter().map(|(_, r)| r.len()).sum();
            assert_eq!(covered, s.len());
        }
        assert!(ParamLayout::from_shapes(vec![("x".into(), vec![1]), ("x".into(), vec![2])]).is_err());
    }

    #[test]
    fn overwrite_writes_only_its_view_and_refuses_a_wrong_length() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let t = Tensor::arange(0f32, 12.0, &dev)?;
        // A view starting at element 4: the write lands at 4..8 of the storage.
        let view = t.narrow(0, 4, 4)?;
        view.inplace_op1(&Overwrite(&[-1.0, -2.0, -3.0, -4.0]))?;
        let mut expect: Vec<f32> = (0..12).map(|i| i as f32).collect();
        expect[4..8].copy_from_slice(&[-1.0, -2.0, -3.0, -4.0]);
        assert_eq!(t.to_vec1::<f32>()?, expect);
        assert!(view.inplace_op1(&Overwrite(&[1.0; 3])).is_err());
        assert!(Tensor::arange(0u32, 4, &dev)?.inplace_op1(&Overwrite(&[1.0; 4])).is_err());
        assert_eq!(t.to_vec1::<f32>()?, expect, "a refused write changes nothing");
        Ok(())
    }

    #[test]
    fn written_vars_read_back_and_reach_tensors_that_share_them() -> Result<()> {
        let varmap = VarMap::new();
        let dev = candle_core::Device::Cpu;
        let w = varmap.get((3, 4), "b.weight", candle_nn::Init::Const(0.0), DType::F32, &dev)?;
        varmap.get(5, "a.bias", candle_nn::Init::Const(0.0), DType::F32, &dev)?;
        let layout = ParamLayout::from_varmap(&varmap)?;
        let flat: Vec<f32> = (0..layout.total_len()).map(|i| i as f32 * 0.5 - 3.0).collect();
        layout.write_vars(&varmap, &flat)?;
        assert_eq!(layout.flatten_vars(&varmap)?, flat);
        // `w` was taken before the write: it is the variable, and sees it.
        let e = layout.entry("b.weight").map(|e| e.range()).unwrap_or_default();
        assert_eq!(w.flatten_all()?.to_vec1::<f32>()?, flat[e].to_vec());
        // A vector of the wrong length is an error and writes nothing.
        assert!(layout.write_vars(&varmap, &flat[1..]).is_err());
        assert_eq!(layout.flatten_vars(&varmap)?, flat);
        Ok(())
    }
}
