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

/// Below this many multiply-adds in a step's forward pass, one thread
/// trains faster than several: waking the pool's workers for every small
/// product costs more than they save. Measured with `shoal train --model
/// mlp` on Fashion-MNIST on 2 cores (2026-12-06): at batch 64 (15M) one
/// thread ran 70.5k samples/s against 56k on two, at batch 256 (60M) the
/// same, at 1,024 (240M) two ran 144k against 94k; the CNN at batch 64
/// (193M) 2,630 against 2,328.
pub const SMALL_STEP_MACS: u64 = 64 << 20;

/// The threads of a process that trains alone: the configured number;
/// else one for a step of fewer than [`SMALL_STEP_MACS`] multiply-adds
/// (`step_macs`, when known before the data is loaded), every core
/// otherwise.
pub fn for_training(configured: Option<usize>, step_macs: Option<u64>) -> usize {
    match (configured, step_macs) {
        (Some(n), _) => n.max(1),
        (None, Some(macs)) if macs < SMALL_STEP_MACS => 1,
        (None, _) => available(),
    }
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

/// The CPU time the calling thread has run so far, where the OS reports it
/// (Linux: `CLOCK_THREAD_CPUTIME_ID`; `/proc/thread-self/schedstat` lags a
/// running thread by up to a scheduler tick); `None` elsewhere. Unlike a
/// wall clock it does not count the time the thread waited for a core that
/// other nodes on the host held.
#[cfg(target_os = "linux")]
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    Some(std::time::Duration::from(t))
}

/// See the Linux version: no thread clock here.
#[cfg(not(target_os = "linux"))]
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    None
}

/// A pool of `threads` threads (at least 1) for one trainer's tensor work.
/// The trainer's loop runs inside it, so the rayon loops candle starts (a
/// convolution's) stay in it too: with one thread, every part of a step
/// runs on that thread, none in rayon's global pool.
pub fn compute_pool(threads: usize, name: &str) -> anyhow::Result<rayon::ThreadPool> {
    let name = name.to_string();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(move |i| format!("compute-{name}-{i}"))
        .build()
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
    fn training_alone_takes_one_thread_for_a_small_step_and_every_core_otherwise() {
        let cores = available();
        assert_eq!(for_training(Some(3), Some(1)), 3, "the configured number wins");
        assert_eq!(for_training(Some(0), None), 1);
        assert_eq!(for_training(None, Some(SMALL_STEP_MACS - 1)), 1);
        assert_eq!(for_training(None, Some(SMALL_STEP_MACS)), cores);
        assert_eq!(for_training(None, None), cores, "unknown work (text) takes every core");
    }

    #[test]
    fn a_pool_has_the_threads_asked_for() {
        let pool = compute_pool(3, "t").ok();
        assert_eq!(pool.map(|p| p.install(rayon::current_num_threads)), Some(3));
        // One thread: a rayon loop started inside runs on the caller's thread.
        let one = compute_pool(0, "t").ok();
        let same = one.map(|p| {
            p.install(|| {
                use rayon::prelude::*;
                let me = std::thread::current().id();
                (0..64).into_par_iter().all(|_| std::thread::current().id() == me)
            })
        });
        assert_eq!(same, Some(true));
    }

    #[test]
    fn a_threads_cpu_time_grows_with_its_work_and_not_with_its_sleep() {
        let Some(start) = thread_cpu_time() else { return }; // not Linux
        std::thread::sleep(std::time::Duration::from_millis(50));
        let slept = thread_cpu_time().map(|t| t.saturating_sub(start));
        assert!(slept.is_some_and(|d| d < std::time::Duration::from_millis(25)), "{slept:?}");
        // Busy until the clock shows 25 ms of work (however long the host
        // makes that take, up to a minute).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut x = 0u64;
        let worked = loop {
            x = std::hint::black_box(x.wrapping_add(1));
            let worked = thread_cpu_time().map(|t| t.saturating_sub(start));
            if worked.is_some_and(|d| d >= std::time::Duration::from_millis(25)) || std::time::Instant::now() > deadline
            {
                break worked;
            }
        };
        assert!(worked.is_some_and(|d| d >= std::time::Duration::from_millis(25)), "{worked:?} after {x} turns");
    }
}
