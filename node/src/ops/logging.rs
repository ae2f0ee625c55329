//! tracing-subscriber set-up: `RUST_LOG` filters, `--log-format` picks the format.
//! Logs go to stderr so that stdout carries only the command's own output.

use shoal_protocol::PeerId;
use tracing_subscriber::EnvFilter;

use crate::cmd::cli::LogFormat;

/// `default_level` applies when RUST_LOG is unset (`shoal demo` uses `warn`
/// so that its progress display stays readable).
pub fn init(format: LogFormat, default_level: &str) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let res = match format {
        LogFormat::Pretty => builder.compact().try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    res.map_err(|e| anyhow::anyhow!("{e}"))
}

/// The last six characters of a peer id, as logs and node names show it.
pub fn short(p: &PeerId) -> String {
    let s = p.to_string();
    s[s.len().saturating_sub(6)..].to_string()
}
