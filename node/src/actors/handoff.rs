//! Shard handoff on the wire: converting a shard's state (parameters,
//! optimizer state, version) to and from [`shoal_protocol::Handoff`], and
//! delivering one with retries.

use std::time::Duration;

use anyhow::{bail, Context};
use shoal_models::{OptimizerConfig, OptimizerState};
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{
    Encoding, ErrorCode, Handoff, HandoffKind, OptimizerSlot, Payload, RunId, ShardRequest, ShardResponse,
};
use tokio::time::Instant;

use crate::actors::aggregator::ShardState;
use crate::actors::net::NetworkHandle;

/// Encode a shard's state as a handoff message (F32: nothing is lost in a move).
pub fn to_wire(
    run: &RunId,
    me: PeerId,
    incarnation: u64,
    kind: HandoffKind,
    state: &ShardState,
) -> anyhow::Result<Handoff> {
    let slots = state
        .optimizer
        .slots
        .iter()
        .map(|(name, v)| Ok(OptimizerSlot { name: name.clone(), tensor: Payload::encode(v, Encoding::F32)? }))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Handoff {
        run: run.clone(),
        shard: state.shard,
        epoch: 0,
        kind,
        from: me,
        from_incarnation: incarnation,
        version: state.version,
        params: Payload::encode(&state.params, Encoding::F32)?,
        optimizer: shoal_protocol::OptimizerState {
            kind: state.optimizer.config.kind().to_string(),
            step: state.optimizer.step,
            slots,
        },
    })
}

/// Decode a received handoff. The optimizer's hyper-parameters are this
/// node's own (the run's config hash makes them equal on every node); the
/// sender's optimizer kind must match.
pub fn from_wire(h: &Handoff, config: OptimizerConfig) -> anyhow::Result<ShardState> {
    let ours = config.kind().to_string();
    if h.optimizer.kind != ours {
        bail!("handoff of shard {} carries {} optimizer state, this run uses {ours}", h.shard, h.optimizer.kind);
    }
    let slots = h
        .optimizer
        .slots
        .iter()
        .map(|s| Ok((s.name.clone(), s.tensor.decode().with_context(|| format!("optimizer slot {}", s.name))?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(ShardState {
        shard: h.shard,
        version: h.version,
        params: h.params.decode().context("handoff parameters")?,
        optimizer: OptimizerState { config, step: h.optimizer.step, slots },
    })
}

/// Send a handoff to `to`, retrying transport failures and `Busy` until
/// `deadline`. `Fenced` (the receiver holds a copy at least as new) counts
/// as delivered: there is nothing more to move.
#[allow(clippy::too_many_arguments)]
pub async fn send(
    net: &NetworkHandle,
    to: PeerId,
    run: &RunId,
    me: PeerId,
    incarnation: u64,
    kind: HandoffKind,
    state: &ShardState,
    deadline: Instant,
) -> anyhow::Result<()> {
    let req = ShardRequest::Handoff(to_wire(run, me, incarnation, kind, state)?);
    let mut backoff = Duration::from_millis(20);
    loop {
        let err = match net.request(to, req.clone()).await {
            Ok(ShardResponse::HandoffAck { .. }) | Ok(ShardResponse::Fenced { .. }) => return Ok(()),
            Ok(ShardResponse::Error(e)) if e.code == ErrorCode::Busy => format!("busy: {}", e.message),
            Ok(other) => bail!("{to} answered a handoff with {}", other.kind()),
            Err(e) => e.to_string(),
        };
        if Instant::now() + backoff >= deadline {
            bail!("handoff of shard {} to {to} kept failing: {err}", state.shard);
        }
        // Back-off between retries of a failed request, not synchronisation.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_models::{Optimizer, OptimizerKind};

    #[test]
    fn round_trip_keeps_params_optimizer_state_and_version() -> anyhow::Result<()> {
        let cfg = OptimizerConfig::new(OptimizerKind::Adamw, 1e-3);
        let mut opt = Optimizer::new(cfg, 3)?;
        let mut params = vec![0.5f32, -1.0, 2.0];
        opt.step(&mut params, &[0.1, 0.2, -0.3])?;
        let state = ShardState { shard: 2, version: 7, params: params.clone(), optimizer: opt.state().clone() };
        let run = RunId::new("t").map_err(|e| anyhow::anyhow!("{e}"))?;
        let wire = to_wire(&run, PeerId::random(), 1, HandoffKind::Transfer, &state)?;
        let back = from_wire(&wire, cfg)?;
        assert_eq!((back.shard, back.version), (2, 7));
        assert_eq!(back.params, params);
        assert_eq!(&back.optimizer, opt.state());
        let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        assert!(from_wire(&wire, sgd).is_err(), "a different optimizer is refused");
        Ok(())
    }
}
