//! The dtype of a model's matrix products (`--dtype`).
//!
//! Mixed precision as PyTorch's autocast does it: under `bf16` every matrix
//! product (the linear layers, the convolutions, attention's two products)
//! takes bf16 operands and gives a bf16 result, which is widened back to
//! f32 at once. Everything else stays f32: the weights themselves (the
//! master copy), the norms, softmax, the loss, the gradients the optimizer
//! sees, and the optimizer's state. Backward runs the same products in
//! bf16 (candle's gradient of a dtype cast is the cast back).
//!
//! On a GPU the bf16 products run on its tensor cores. On the CPU candle
//! widens bf16 operands to f32 for its gemm, so `bf16` there gives bf16's
//! rounding at more than f32's cost: it is for testing what a GPU run
//! will do, not for speed. The hand-written CPU steps are f32 only, so a
//! `bf16` model takes candle's graph on every device.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};

/// What a model computes its matrix products in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Precision {
    /// f32 throughout.
    #[default]
    F32,
    /// bf16 operands and results for the matrix products, f32 for the rest.
    Bf16,
}

impl Precision {
    /// `a @ b` in this precision, the result in `a`'s dtype.
    pub fn matmul(self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok(match self.narrow(a.dtype()) {
            None => a.matmul(b)?,
            Some(low) => a.to_dtype(low)?.matmul(&b.to_dtype(low)?)?.to_dtype(a.dtype())?,
        })
    }

    /// The dtype to compute in instead of `dtype`; `None`: `dtype` itself.
    /// Only f32 is narrowed (the f64 models of the gradient tests stay f64).
    pub fn narrow(self, dtype: DType) -> Option<DType> {
        match (self, dtype) {
            (Precision::Bf16, DType::F32) => Some(DType::BF16),
            _ => None,
        }
    }
}

impl FromStr for Precision {
    type Err = ModelError;
    /// `f32` or `bf16`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            _ => Err(ModelError::Config(format!("unknown dtype `{s}`: use f32 or bf16"))),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl From<Precision> for String {
    fn from(p: Precision) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for Precision {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn names_parse_and_print_back() {
        for p in [Precision::F32, Precision::Bf16] {
            assert_eq!(p.to_string().parse::<Precision>().ok(), Some(p));
        }
        assert_eq!("BF16".parse::<Precision>().ok(), Some(Precision::Bf16));
        let err = "f16".parse::<Precision>().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("use f32 or bf16"), "{err}");
    }

    /// A bf16 product rounds its operands and result to bf16's 8-bit
    /// mantissa: within a few parts in 1,000 of f32's, and not equal to it.
    #[test]
    fn a_bf16_product_is_f32_within_bf16_rounding() -> Result<()> {
        let dev = Device::Cpu;
        let a =
            Tensor::from_vec((0..64 * 48).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect(), (64, 48), &dev)?;
        let b = Tensor::from_vec((0..48 * 32).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect(), (48, 32), &dev)?;
        let exact = Precision::F32.matmul(&a, &b)?;
        let low = Precision::Bf16.matmul(&a, &b)?;
        assert_eq!(low.dtype(), DType::F32);
        let (e, l) = (exact.flatten_all()?.to_vec1::<f32>()?, low.flatten_all()?.to_vec1::<f32>()?);
        let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = e.iter().zip(&l).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst > 0.0, "bf16 rounded nothing");
        assert!(worst < 1e-2 * scale, "bf16 product off by {worst} at scale {scale}");
        Ok(())
    }
}
