//! A gradient as an owner holds it for a round: dense, or sparse as it
//! arrived (the kept entries of a `topk` or `sparseloco` push). A sparse
//! push is never densified for the mean: its norm, its addition into the
//! round's update and its memory all cost its kept entries, not the shard.
//! Only the rules that sort coordinates (trimmed mean, median, centered
//! clip, mixing) and the contribution check's agreement read it dense.

use std::borrow::Cow;

use shoal_protocol::{Dtype, Payload, ProtocolError};

use crate::policy::robust::SumSquares;

/// One push's gradient.
#[derive(Debug, Clone, PartialEq)]
pub enum Contribution {
    Dense(Vec<f32>),
    /// `len` values, zero except at `indices` (strictly increasing).
    Sparse {
        len: usize,
        indices: Vec<u32>,
        values: Vec<f32>,
    },
}

/// An empty dense gradient (what a gradient taken out of its place leaves).
impl Default for Contribution {
    fn default() -> Contribution {
        Contribution::Dense(Vec::new())
    }
}

impl From<Vec<f32>> for Contribution {
    fn from(g: Vec<f32>) -> Contribution {
        Contribution::Dense(g)
    }
}

impl Contribution {
    /// A pushed payload, checked (checksum, finiteness, index order) and
    /// taken out of the frame in the same pass: a sparse one as its kept
    /// entries, any other decoded whole.
    pub fn decode(payload: &Payload) -> Result<Contribution, ProtocolError> {
        let len = usize::try_from(payload.numel())
            .map_err(|_| ProtocolError::InvalidTensor("numel does not fit in memory".into()))?;
        match payload.meta().dtype()? {
            Dtype::TopK | Dtype::Sparse2 => {
                let kept = payload.stored() as usize;
                let (mut indices, mut values) = (Vec::with_capacity(kept), Vec::with_capacity(kept));
                payload.for_each_stored(|i, v| {
                    // One entry at a time, and every index is below `numel`
                    // (checked), so it fits a u32 as the wire's does.
                    indices.push(i as u32);
                    values.extend_from_slice(v);
                })?;
                Ok(Contribution::Sparse { len, indices, values })
            }
            _ => payload.decode().map(Contribution::Dense),
        }
    }

    /// The shard's length.
    pub fn len(&self) -> usize {
        match self {
            Contribution::Dense(g) => g.len(),
            Contribution::Sparse { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values held: what one pass over it visits.
    pub fn stored(&self) -> usize {
        match self {
            Contribution::Dense(g) => g.len(),
            Contribution::Sparse { values, .. } => values.len(),
        }
    }

    /// L2 norm, the same bits as the densified gradient's [`robust::norm`](crate::policy::robust::norm).
    pub fn norm(&self) -> f32 {
        let mut s = SumSquares::new(self.len());
        match self {
            Contribution::Dense(g) => s.add(0, g),
            Contribution::Sparse { indices, values, .. } => {
                for (&i, v) in indices.iter().zip(values) {
                    s.add(i as usize, std::slice::from_ref(v));
                }
            }
        }
        s.norm()
    }

    /// `acc += weight * self`, visiting only the stored values. `acc` has
    /// [`Self::len`] values (the owner checks a push's length on arrival).
    pub fn add_scaled_into(&self, acc: &mut [f32], weight: f32) {
        match self {
            Contribution::Dense(g) => {
                for (a, x) in acc.iter_mut().zip(g) {
                    *a += weight * x;
                }
            }
            Contribution::Sparse { indices, values, .. } => {
                for (&i, x) in indices.iter().zip(values) {
                    if let Some(a) = acc.get_mut(i as usize) {
                        *a += weight * x;
                    }
                }
            }
        }
    }

    /// The whole gradient: borrowed when dense, built when sparse.
    pub fn dense(&self) -> Cow<'_, [f32]> {
        match self {
            Contribution::Dense(g) => Cow::Borrowed(g),
            Contribution::Sparse { len, .. } => {
                let mut g = vec![0.0; *len];
                self.add_scaled_into(&mut g, 1.0);
                Cow::Owned(g)
            }
        }
    }

    pub fn into_dense(self) -> Vec<f32> {
        match self {
            Contribution::Dense(g) => g,
            sparse => sparse.dense().into_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::policy::robust;
    use shoal_protocol::Encoding;

    fn gradient(n: usize) -> Vec<f32> {
        let mut rng = shoal_models::rng::DetRng::new(5);
        (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
    }

    #[test]
    fn a_sparse_push_is_held_as_its_kept_entries_and_acts_as_its_decoded_vector() {
        let g = gradient(10_000);
        for encoding in [Encoding::TopK { k: 150 }, Encoding::Sparse2 { chunk: 4096, k: 62 }] {
            let payload = Payload::encode(&g, encoding).unwrap();
            let decoded = payload.decode().unwrap();
            let c = Contribution::decode(&payload).unwrap();
            assert!(matches!(c, Contribution::Sparse { .. }), "{encoding:?}");
            assert_eq!(c.len(), g.len());
            assert_eq!(c.stored() as u64, payload.stored());
            assert!(c.stored() < g.len() / 50, "{encoding:?} holds {} values", c.stored());
            assert_eq!(c.dense().as_ref(), decoded.as_slice());
            assert_eq!(c.norm().to_bits(), robust::norm(&decoded).to_bits());
            // Added into an update as the dense mean adds it: the same bits.
            let mut sparse_acc = gradient(10_000);
            let mut dense_acc = sparse_acc.clone();
            c.add_scaled_into(&mut sparse_acc, 0.25);
            Contribution::Dense(decoded.clone()).add_scaled_into(&mut dense_acc, 0.25);
            assert!(sparse_acc.iter().zip(&dense_acc).all(|(a, b)| a.to_bits() == b.to_bits()), "{encoding:?}");
        }
        let dense = Payload::encode(&g, Encoding::Int8 { block: 256 }).unwrap();
        assert_eq!(Contribution::decode(&dense).unwrap(), Contribution::Dense(dense.decode().unwrap()));
    }

    #[test]
    fn a_push_that_fails_its_checks_is_refused() {
        let payload = Payload::encode(&gradient(100), Encoding::TopK { k: 5 }).unwrap();
        let mut bytes = payload.data().to_vec();
        bytes[0] ^= 1;
        let bad = Payload::from_parts(payload.meta().clone(), bytes.into(), u64::MAX).unwrap();
        assert!(Contribution::decode(&bad).is_err());
    }
}
