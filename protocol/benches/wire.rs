//! `cargo bench -p shoal-protocol --bench wire`: shard transfer throughput
//! (raw TCP baseline, TCP+noise+yamux, QUIC) and payload codec throughput
//! (memcpy baseline). Prints a table; see docs/benchmarks.md.
#![allow(clippy::print_stdout)]

use shoal_protocol::bench::{run_wire_bench, WireBenchOptions};

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; flags are ignored. Environment:
    // SHOAL_BENCH_SHARD_MB (default 100), SHOAL_BENCH_SKIP_QUIC, SHOAL_BENCH_SKIP_CODECS.
    let mut opts = WireBenchOptions::default();
    if let Ok(mb) = std::env::var("SHOAL_BENCH_SHARD_MB") {
        opts.shard_bytes = mb.parse::<usize>()? * 1_000_000;
    }
    opts.quic = std::env::var_os("SHOAL_BENCH_SKIP_QUIC").is_none();
    opts.codecs = std::env::var_os("SHOAL_BENCH_SKIP_CODECS").is_none();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(run_wire_bench(opts))?;
    println!("{report}");
    Ok(())
}
