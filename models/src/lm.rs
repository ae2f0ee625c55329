//! What every language model shares: its input windows split into tokens
//! and next-token targets, and sampling the next token.

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::rng::DetRng;

/// Windows `[n, .., context + 1]` (f32 token values) as inputs
/// `[n, context]` and next-token targets `[n * context]`, both u32: what
/// every language model (`what`, for the error) reads.
pub(crate) fn split_windows(windows: &Tensor, context: usize, what: &str) -> Result<(Tensor, Tensor)> {
    let tokens = windows.flatten_from(1)?.to_dtype(DType::U32)?;
    let w = tokens.dim(1)?;
    if w != context + 1 {
        return Err(ModelError::Invalid(format!(
            "{what} windows of {w} tokens; this model reads {context} plus the next one"
        )));
    }
    Ok((tokens.narrow(1, 0, context)?, tokens.narrow(1, 1, context)?.flatten_all()?))
}

/// Index drawn from softmax(logits / temperature); the argmax at 0.
pub(crate) fn sample(logits: &[f32], temperature: f64, rng: &mut DetRng) -> usize {
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best })
        .0;
    if temperature == 0.0 {
        return argmax;
    }
    let max = logits[argmax] as f64;
    let weights: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.next_f32() as f64 * total;
    for (i, w) in weights.iter().enumerate() {
        if draw < *w {
            return i;
        }
        draw -= w;
    }
    argmax
}
