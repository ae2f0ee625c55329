//! How actors reach each other: each actor's cloneable handle and the
//! messages on its channels. An actor module imports these, never another
//! actor module, so the actors form no import cycle (see
//! `docs/architecture.md` for what may import what). The handles import
//! only [`crate::policy`] types and each other, in this order, without a
//! cycle: `handoff` → `aggregator` → `net`; `membership`, `election`,
//! `status`, `trainer` and `leave` stand alone.

pub mod aggregator;
pub mod checkpoint;
pub mod election;
pub mod handoff;
pub mod leave;
pub mod membership;
pub mod net;
pub mod status;
pub mod trainer;
