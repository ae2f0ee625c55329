//! Compute threads: how many a node's tensor work may use, and the pools
//! that hold it to that.
//!
//! candle's CPU backend sizes its pools from `RAYON_NUM_THREADS` (matrix
//! products, through rayon) and `CANDLE_NUM_THREADS` (element-wise kernels),
//! both defaulting to every core. Several nodes on one host that each take
//! every core slow each other down (issue 14 measured 2.5x on 16 cores), so:
//!
//! - each node gets `training.threads`, by default the host's cores divided
//!   by the nodes that this process (or this testnet) starts;
//! - a process sets both variables once, before any tensor work, to the
//!   share of one of its nodes (a variable the user set wins);
//! - each trainer runs its tensor work inside a rayon pool of its own
//!   `threads` threads, so in-process nodes do not share one pool.

use anyhow::Context;

/// The cores this process may use.
pub fn available() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// One node's share of the host when `nodes` nodes share it: at least 1.
pub fn share(nodes: usize) -> usize {
    (available() / nodes.max(1)).max(1)
}

/// The threads a node uses: the configured number, or its share of the host.
pub fn resolve(configured: Option<usize>, nodes_on_host: usize) -> usize {
    configured.unwrap_or_else(|| share(nodes_on_host)).max(1)
}

/// Size candle's process-wide pools to `threads`, unless the user set
/// `RAYON_NUM_THREADS` or `CANDLE_NUM_THREADS`. Call it first thing in a
/// command, before any thread or tensor exists: the pools are built on first
/// use and environment writes race with reads on other threads. Returns the
/// value candle will use for matrix products.
pub fn configure_process(threads: usize) -> usize {
    let threads = threads.max(1).to_string();
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, &threads);
        }
    }
    std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(1)
}

/// The tokio runtime of a process whose nodes have `threads` compute
/// threads in all: that many workers (at least 2, so that the network keeps
/// moving while a worker encrypts a large frame).
pub fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(2))
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

/// A pool of `threads` threads for one trainer's tensor work; `None` for a
/// single thread, whose work then runs on the trainer's own thread.
pub fn compute_pool(threads: usize, name: &str) -> anyhow::Result<Option<rayon::ThreadPool>> {
    if threads <= 1 {
        return Ok(None);
    }
    let name = name.to_string();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("compute-{name}-{i}"))
        .build()
        .map(Some)
        .context("building the compute thread pool")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_divide_the_host_and_never_reach_zero() {
        let cores = available();
        assert_eq!(share(1), cores);
        assert_eq!(share(0), cores);
        assert_eq!(share(cores * 4), 1);
        assert_eq!(resolve(Some(3), 8), 3);
        assert_eq!(resolve(None, 1), cores);
        assert_eq!(resolve(Some(0), 1), 1);
    }

    #[test]
    fn a_pool_has_the_threads_asked_for() {
        let pool = compute_pool(3, "t").ok().flatten();
        assert_eq!(pool.map(|p| p.install(rayon::current_num_threads)), Some(3));
        assert!(compute_pool(1, "t").ok().flatten().is_none());
    }
}
