//! Pure policy: decisions computed from plain data, free of tokio and
//! libp2p (peer ids come as plain ids). Every rule here is tested without a
//! runtime.

pub mod assign;
pub mod backoff;
pub mod compress;
pub mod contribution;
pub mod delta;
pub mod exchange;
pub mod explore;
#[cfg(test)]
mod explorer;
pub mod fit;
pub mod health;
pub mod history;
pub mod placement;
pub mod resume;
pub mod robust;
pub mod schedule;
pub mod sync;
pub mod view;
