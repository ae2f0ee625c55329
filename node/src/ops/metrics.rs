//! `/metrics`: a node's status in the Prometheus text exposition format
//! (version 0.0.4), following Prometheus' naming conventions so that
//! `promtool check metrics` finds nothing:
//!
//! - every metric has `# HELP` and `# TYPE` lines;
//! - counters end in `_total`, and nothing else does;
//! - values are in base units: seconds, bytes, ratios from 0 to 1.
//!
//! Pure: a [`StatusSnapshot`] and the fault settings in, text out.

use std::fmt::Write as _;

use crate::handles::status::StatusSnapshot;
use crate::ops::faults::Faults;

/// Content type of [`metrics_text`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Prefix of every metric name.
const PREFIX: &str = "shoal_";

/// Builds an exposition one metric family at a time.
#[derive(Debug, Default)]
struct Exposition {
    out: String,
}

impl Exposition {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        debug_assert_eq!(kind == "counter", name.ends_with("_total"), "{name}: only counters end in _total");
        let _ = writeln!(self.out, "# HELP {PREFIX}{name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {PREFIX}{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(PREFIX);
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(&number(value));
        self.out.push('\n');
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.head(name, "gauge", help);
        self.sample(name, &[], value);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.head(name, "counter", help);
        self.sample(name, &[], value as f64);
    }

    /// A family with one label, one sample per value.
    fn labelled(&mut self, name: &str, kind: &str, help: &str, label: &str, samples: &[(&str, f64)]) {
        self.head(name, kind, help);
        for (v, x) in samples {
            self.sample(name, &[(label, v)], *x);
        }
    }
}

/// A sample value as Prometheus writes it (`NaN`, `+Inf`, `-Inf`).
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn ms_to_seconds(ms: Option<f64>) -> f64 {
    ms.map_or(f64::NAN, |m| m / 1000.0)
}

/// The snapshot in Prometheus text format.
pub fn metrics_text(s: &StatusSnapshot, faults: &Faults) -> String {
    let mut m = Exposition::default();
    m.gauge("step", "Training steps done.", s.step as f64);
    if let (Some(rss), Some(peak)) = (s.rss_bytes, s.peak_rss_bytes) {
        m.gauge("resident_memory_bytes", "Resident memory of this process (VmRSS).", rss as f64);
        m.gauge("resident_memory_peak_bytes", "Most resident memory since this process started (VmHWM).", peak as f64);
    }
    m.gauge(
        "error_feedback_residual_bytes",
        "Memory held by the residuals of error feedback (a lossy push encoding).",
        s.residual_bytes as f64,
    );
    m.gauge("total_steps", "Training steps of the run.", s.total_steps as f64);
    m.gauge("model_version", "Smallest shard version of this node's model.", s.model_version as f64);
    m.counter("samples_total", "Training samples processed.", s.samples);
    m.gauge("samples_per_second", "Training samples per second since the first step.", s.samples_per_sec);
    m.gauge("loss", "Training loss of the last step.", s.last_loss.map_or(f64::NAN, f64::from));
    m.gauge("test_accuracy", "Last test-set accuracy, from 0 to 1.", s.last_accuracy.map_or(f64::NAN, f64::from));
    if let Some(bpb) = s.last_bits_per_byte {
        m.gauge("test_bits_per_byte", "Language models: last validation loss in bits per byte.", f64::from(bpb));
    }
    if let Some(ppl) = s.last_perplexity {
        m.gauge("test_perplexity", "Language models: last validation perplexity (exp of the loss per token).", ppl);
    }
    m.counter("bytes_out_total", "Tensor payload bytes sent.", s.bytes_out);
    m.counter("bytes_in_total", "Tensor payload bytes received.", s.bytes_in);
    m.gauge("push_latency_seconds", "Push latency, moving average.", ms_to_seconds(s.push_latency_ms));
    m.gauge("pull_latency_seconds", "Pull latency, moving average.", ms_to_seconds(s.pull_latency_ms));
    m.gauge("compute_seconds", "Seconds spent computing gradients since the first step.", s.compute_secs);
    m.gauge("communication_seconds", "Seconds spent exchanging shards since the first step.", s.comm_secs);
    m.gauge("owned_shards", "Shards this node owns.", s.owned_shards.len() as f64);
    m.gauge("known_peers", "Nodes in the roster.", s.known_peers as f64);
    m.gauge("max_staleness", "Largest staleness, in versions, this node's shards accepted.", s.max_staleness as f64);
    m.counter("role_changes_total", "Role changes of this node.", s.role_changes.len() as u64);
    m.counter("handoffs_out_total", "Shards handed to a new owner.", s.handoffs_out);
    m.counter("handoffs_in_total", "Shards received from an old owner.", s.handoffs_in);
    m.counter("rounds_forced_total", "BSP rounds closed at the round timeout.", s.rounds_forced);
    m.counter(
        "delta_mismatches_total",
        "Delta pulls whose update did not lead to the owner's shard (each pulled the shard whole).",
        s.delta_mismatches,
    );
    m.counter("owner_steps_total", "Optimizer steps this node's shards took.", s.owner_steps);
    m.gauge(
        "owner_passes",
        "Passes over the shard this node's shards made for their steps so far (loops over a shard's length).",
        s.owner_passes,
    );
    m.gauge("aggregators", "Shard owners in this node's placement.", s.aggregators as f64);
    let mut explored: Vec<(&str, f64)> = Vec::new();
    for e in &s.exploration {
        match explored.iter_mut().find(|(a, _)| *a == e.action) {
            Some((_, n)) => *n += 1.0,
            None => explored.push((e.action, 1.0)),
        }
    }
    m.labelled(
        "exploration_decisions_total",
        "counter",
        "Decisions on the number of aggregators (try, keep, revert).",
        "action",
        &explored,
    );
    m.labelled(
        "restored_shards_total",
        "counter",
        "Shards taken over without a transfer.",
        "from",
        &[("replica", s.restored_from_replica as f64), ("worker_copy", s.restored_from_worker_copy as f64)],
    );
    m.gauge("max_version_regression", "Largest drop of a shard version seen.", s.max_version_regression as f64);
    let rejected: Vec<(&str, f64)> = s.rejected_contributions.iter().map(|(p, n)| (p.as_str(), *n as f64)).collect();
    m.labelled(
        "rejected_contributions_total",
        "counter",
        "Gradients this node's shards rejected with the norm check, by worker.",
        "peer",
        &rejected,
    );
    m.gauge("suspect_peers", "Workers whose gradients were rejected several times in a row.", s.suspects.len() as f64);
    m.counter("checkpoints_written_total", "Shard checkpoints written.", s.checkpoints_written);
    m.counter("checkpoint_failures_total", "Shard checkpoints that failed to write.", s.checkpoint_failures);
    let role = serde_json::to_value(s.role).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
    m.labelled("role", "gauge", "Current role (the labelled series is 1).", "role", &[(role.as_str(), 1.0)]);
    m.gauge("fault_serve_delay_seconds", "Injected serve delay.", faults.serve_delay().as_secs_f64());
    m.gauge("fault_slowdown", "Injected compute slowdown factor (1: none).", faults.slowdown());
    m.gauge(
        "fault_serve_uplink_bytes_per_second",
        "Injected serving uplink (0: none).",
        faults.serve_mbps() * 1e6 / 8.0,
    );
    m.out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conventions `promtool check metrics` enforces, checked without
    /// promtool (the live-node test in `node/tests/cli.rs` runs promtool).
    pub(crate) fn lint(text: &str) -> Vec<String> {
        let mut faults = Vec::new();
        let mut helped = std::collections::BTreeSet::new();
        let mut typed = std::collections::BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                helped.insert(rest.split(' ').next().unwrap_or_default().to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut p = rest.split(' ');
                typed.insert(p.next().unwrap_or_default().to_string(), p.next().unwrap_or_default().to_string());
            } else if !line.is_empty() {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                if !helped.contains(name) {
                    faults.push(format!("{name}: no HELP"));
                }
                match typed.get(name).map(String::as_str) {
                    None => faults.push(format!("{name}: no TYPE")),
                    Some("counter") if !name.ends_with("_total") => {
                        faults.push(format!("{name}: counter without _total"))
                    }
                    Some(k) if k != "counter" && name.ends_with("_total") => {
                        faults.push(format!("{name}: {k} with _total"))
                    }
                    _ => {}
                }
                // promtool's list of abbreviated units.
                for unit in ["s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d", "mbps"] {
                    if name.split('_').any(|t| t == unit) {
                        faults.push(format!("{name}: abbreviated unit {unit}"));
                    }
                }
                let value = line.rsplit(' ').next().unwrap_or_default();
                if !matches!(value, "NaN" | "+Inf" | "-Inf") && value.parse::<f64>().is_err() {
                    faults.push(format!("{name}: value {value:?}"));
                }
            }
        }
        faults
    }

    #[test]
    fn metrics_follow_the_prometheus_conventions() {
        let s =
            StatusSnapshot { step: 7, samples: 224, handoffs_in: 2, push_latency_ms: Some(2.5), ..Default::default() };
        let f = Faults::new(25, 1.0).unwrap_or_default();
        let text = metrics_text(&s, &f);
        assert_eq!(lint(&text), Vec::<String>::new(), "{text}");
        assert!(text.contains("shoal_step 7\n"), "{text}");
        assert!(text.contains("# TYPE shoal_samples_total counter\nshoal_samples_total 224\n"), "{text}");
        assert!(text.contains("shoal_handoffs_in_total 2\n"), "{text}");
        assert!(text.contains("shoal_push_latency_seconds 0.0025\n"), "{text}");
        assert!(text.contains("shoal_pull_latency_seconds NaN\n"), "{text}");
        assert!(text.contains("shoal_fault_serve_delay_seconds 0.025\n"), "{text}");
        assert!(text.contains(r#"shoal_role{role="starting"} 1"#), "{text}");
    }

    /// Every metric the Grafana dashboard (`testnet/grafana/shoal.json`)
    /// queries is one this code exports, and every panel has a query.
    #[test]
    fn the_dashboard_queries_only_metrics_that_exist() {
        let text = metrics_text(&StatusSnapshot::default(), &Faults::default());
        let exported: std::collections::BTreeSet<&str> =
            text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../../testnet/grafana/shoal.json")).unwrap_or_default();
        let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
        assert!(panels.len() >= 10, "{} panels", panels.len());
        let mut queried = std::collections::BTreeSet::new();
        for p in &panels {
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
            for t in targets {
                let expr = t["expr"].as_str().unwrap_or_default().to_string();
                let names: Vec<String> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.starts_with(PREFIX))
                    .map(str::to_string)
                    .collect();
                assert!(!names.is_empty(), "panel {}: {expr} queries no shoal metric", p["title"]);
                queried.extend(names);
            }
        }
        let missing: Vec<&String> = queried.iter().filter(|n| !exported.contains(n.as_str())).collect();
        assert!(missing.is_empty(), "the dashboard queries metrics that do not exist: {missing:?}");
        assert!(
            queried.contains("shoal_rounds_forced_total") && queried.contains("shoal_rejected_contributions_total")
        );
    }

    #[test]
    fn the_lint_finds_what_promtool_finds() {
        let bad = "# HELP shoal_x_ms x\n# TYPE shoal_x_ms gauge\nshoal_x_ms 1\nshoal_y_total 2\n\
                   # HELP shoal_z z\n# TYPE shoal_z counter\nshoal_z 3\n";
        let faults = lint(bad);
        assert_eq!(faults.len(), 4, "{faults:?}");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(escape_label("a\"b\\"), "a\\\"b\\\\");
    }
}
