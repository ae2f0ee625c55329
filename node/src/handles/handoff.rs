//! What a shard handoff carries: a shard's state (parameters, optimizer
//! state, version), and its conversion to and from
//! [`shoal_protocol::Handoff`]. The aggregator actor sends handoffs; the
//! network actor decodes the ones it receives.

use anyhow::{bail, Context};
use shoal_models::{OptimizerConfig, OptimizerState};
use shoal_protocol::libp2p::PeerId;
use shoal_protocol::{Encoding, Handoff, HandoffKind, OptimizerSlot, Payload, RunId};

/// One shard's state in flight or at rest: what a handoff carries.
#[derive(Debug, Clone)]
pub struct ShardState {
    pub shard: u32,
    pub version: u64,
    pub params: Vec<f32>,
    pub optimizer: OptimizerState,
    /// A restored BSP shard that has not closed a round: its catch-up room
    /// ([`shoal_protocol::Handoff::catch_up_room`]); 0 otherwise.
    pub catch_up_room: u64,
}

/// Encode a shard's state as a handoff message (F32: nothing is lost in a
/// move). `hops`: how many times a transfer has been forwarded (see
/// [`Handoff::hops`]); 0 for a replica.
pub fn to_wire(
    run: &RunId,
    me: PeerId,
    incarnation: u64,
    kind: HandoffKind,
    hops: u64,
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
        hops,
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
        catch_up_room: state.catch_up_room,
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
        catch_up_room: h.catch_up_room,
    })
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
        let optimizer = opt.state().clone();
        let state = ShardState { shard: 2, version: 7, params: params.clone(), optimizer, catch_up_room: 12 };
        let run = RunId::new("t").map_err(|e| anyhow::anyhow!("{e}"))?;
        let wire = to_wire(&run, PeerId::random(), 1, HandoffKind::Transfer, 2, &state)?;
        assert_eq!(wire.hops, 2);
        let back = from_wire(&wire, cfg)?;
        assert_eq!((back.shard, back.version, back.catch_up_room), (2, 7, 12));
        assert_eq!(back.params, params);
        assert_eq!(&back.optimizer, opt.state());
        let sgd = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
        assert!(from_wire(&wire, sgd).is_err(), "a different optimizer is refused");
        Ok(())
    }
}
