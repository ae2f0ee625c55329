//! What a forward/backward pass gives back: the loss, the flat gradients
//! and, for fully connected layers, their sufficient factors. A leaf module:
//! the model and the hand-written CPU steps both produce these.

/// Result of one forward/backward pass.
#[derive(Debug, Clone)]
pub struct GradOutput {
    /// Mean cross-entropy over the batch.
    pub loss: f32,
    /// Number of samples in the batch (the weight of these gradients when
    /// peers aggregate).
    pub samples: usize,
    /// Gradients of the mean loss, flattened by the model's
    /// [`ParamLayout`](crate::layout::ParamLayout).
    pub grads: Vec<f32>,
    /// The fully connected layers' weight gradients as their sufficient
    /// factors (`TrainableModel::gradients_factored`; empty otherwise).
    pub factors: Vec<LayerFactors>,
}

/// A fully connected layer's weight gradient over a batch as its
/// sufficient factors (Poseidon): `grad[r][c] = sum_b delta[b][r] *
/// input[b][c]`, `batch x (rows + cols)` values for `rows x cols`.
#[derive(Debug, Clone)]
pub struct LayerFactors {
    /// Where the `[rows, cols]` weight starts in the flat layout.
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    /// `batch x rows`: the gradient of the mean loss with respect to the
    /// layer's output.
    pub delta: Vec<f32>,
    /// `batch x cols`: the layer's input.
    pub input: Vec<f32>,
}
