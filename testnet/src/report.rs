//! The report a testnet leaves behind: `summary.json` and `plot.png`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;

use crate::scenario::Scenario;

/// Samples grouped by node, in time order.
type ByNode<'a> = BTreeMap<&'a str, Vec<&'a Sample>>;

fn by_node(samples: &[Sample]) -> ByNode<'_> {
    let mut m = ByNode::new();
    for s in samples {
        m.entry(s.node.as_str()).or_default().push(s);
    }
    m
}

/// One reading of one node's `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the testnet started.
    pub secs: f64,
    pub node: String,
    pub step: u64,
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub samples_per_sec: f64,
    /// BSP rounds this node closed at the round timeout (`/status`
    /// `rounds_forced`; a restarted node counts from 0 again).
    pub rounds_forced: u64,
    /// Its role (`/status` `role`: starting, joining, worker, aggregator,
    /// leaving, done).
    pub role: String,
    /// The hash of the live members its placement counts, and their number
    /// (`/status` `placement_members`, `placement_live`).
    pub members: Option<String>,
    pub live: u64,
}

/// One reading of one node process's resources (process backend; Linux
/// `/proc`), every [`crate::process::RESOURCE_EVERY_SECS`] seconds.
#[derive(Debug, Clone, Serialize)]
pub struct ResourceSample {
    /// Seconds since the testnet started.
    pub secs: f64,
    pub node: String,
    /// The process: a restarted node is a new process with the same name.
    pub pid: u32,
    /// Resident set size (`VmRSS`).
    pub rss_bytes: u64,
    /// The most the process has had resident in its life (`VmHWM`).
    pub peak_rss_bytes: u64,
    /// Open file descriptors (entries of `/proc/PID/fd`).
    pub open_fds: u64,
}

/// `VmRSS` from the text of `/proc/PID/status`, in bytes.
pub fn vm_rss_bytes(status: &str) -> Option<u64> {
    kb_field_bytes(status, "VmRSS:")
}

/// The `VmHWM` (peak resident set) of a `/proc/PID/status` text, in bytes.
pub fn vm_hwm_bytes(status: &str) -> Option<u64> {
    kb_field_bytes(status, "VmHWM:")
}

/// The line of `text` that starts with `key` (`VmRSS:`, `MemAvailable:`),
/// as in `/proc/PID/status` and `/proc/meminfo`: a count of kB, in bytes.
pub fn kb_field_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let mut parts = line[key.len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

/// A role change seen by the launcher.
#[derive(Debug, Clone, Serialize)]
pub struct RoleRecord {
    pub secs: f64,
    pub node: String,
    pub role: String,
    pub owned: Vec<u64>,
}

/// A fault applied (or a partition healed).
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    /// Seconds since the testnet started.
    pub secs: f64,
    /// Seconds after training started when it was applied.
    pub at_secs: f64,
    /// The training step the scenario placed it at (`at_step`), if any.
    pub at_step: Option<u64>,
    /// Line of the event in the scenario (0: a heal).
    pub line: usize,
    pub action: String,
    pub outcome: String,
    /// A kill, freeze, restart, add or leave: who is in the run changed.
    pub membership: bool,
    /// A kill, freeze or stop: nodes went without a goodbye.
    pub failure: bool,
    /// Mean steps/s per live node in the 10 s before and after.
    pub steps_per_sec_before: Option<f64>,
    pub steps_per_sec_after: Option<f64>,
}

/// How a node ended.
#[derive(Debug, Clone, Serialize)]
pub struct NodeOutcome {
    pub name: String,
    pub peer_id: String,
    /// `exited`, `killed`, `failed: ...`.
    pub exit: String,
    pub killed: bool,
    /// From the node's last line; `None` if killed (or a language model).
    pub final_accuracy: Option<f64>,
    /// A language model's test bits per byte, from its last line.
    pub final_bits_per_byte: Option<f64>,
    pub steps: Option<u64>,
    pub left: bool,
    /// Resumed from checkpoints after a full stop, at this step (its last
    /// `/status`).
    pub resumed_at_step: Option<u64>,
    /// The node's trained model, relative to the report directory
    /// (`models/<name>.safetensors`), if it wrote one.
    pub model: Option<String>,
    /// The architecture of the binary the node ran (`aarch64` under qemu).
    pub arch: String,
    /// The config preset it ran with (`edge`), if any.
    pub profile: Option<String>,
    /// Shard bytes it sent and received (pushes, pulls and the states it
    /// served), from its last `/status`.
    pub bytes_out: Option<u64>,
    pub bytes_in: Option<u64>,
    /// Compute time over step time, from its last `/status`.
    pub utilization: Option<f64>,
    /// Its link's rate each way under `network = "netns"`, in Mbit/s.
    pub link_mbps: Option<f64>,
}

/// Memory of one node process (one life: a restarted node is a new one).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RssGrowth {
    pub node: String,
    pub pid: u32,
    /// Seconds since the testnet started, of the first sample after warm-up.
    pub from_secs: f64,
    pub to_secs: f64,
    /// RSS at the first sample after warm-up.
    pub baseline_bytes: u64,
    /// Highest RSS after warm-up.
    pub peak_bytes: u64,
    /// `peak / baseline - 1`.
    pub growth: f64,
}

/// How long the nodes' views took to agree after one change of membership.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ViewAgreement {
    /// The event (`FaultRecord::action`) and when it ran (seconds since the
    /// testnet started, and since training started).
    pub action: String,
    pub secs: f64,
    pub at_secs: f64,
    /// Seconds from the event to the first poll at which every live node's
    /// placement held the same members, every live node; `None`:
    /// not before the end of the run. Changes that overlap settle
    /// together: an event's agreement is the first one after it, whatever
    /// came in between.
    pub agreed_after_secs: Option<f64>,
    /// The live nodes that placement counted.
    pub live: Option<u64>,
}

/// Whether one poll's samples (every live node, read at once) show agreed
/// views: every node that still elects (not `done`, not `leaving`) has a
/// placement over the same members, and counts every node that is not
/// leaving. The count of the live nodes it agreed on, if it did.
fn agreed(poll: &[&Sample]) -> Option<u64> {
    let members = poll.iter().filter(|s| s.role != "leaving").count() as u64;
    let mut electors = poll.iter().filter(|s| s.role != "leaving" && s.role != "done");
    let first = electors.next()?;
    let hash = first.members.as_ref()?;
    let same = |s: &&&Sample| s.members.as_ref() == Some(hash) && s.live == members;
    (same(&first) && electors.all(|s| same(&s))).then_some(members)
}

/// For each change of membership in `faults`, how long the views took to
/// agree after it ([`agreed`], poll by poll; a poll is the samples that
/// share one `secs`). Pure.
pub fn view_agreements(faults: &[FaultRecord], samples: &[Sample]) -> Vec<ViewAgreement> {
    let mut polls: BTreeMap<u64, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        polls.entry(s.secs.to_bits()).or_default().push(s);
    }
    let mut polls: Vec<(f64, Vec<&Sample>)> = polls.into_values().map(|p| (p[0].secs, p)).collect();
    polls.sort_by(|a, b| a.0.total_cmp(&b.0));
    // When each poll agreed, in order: each change's agreement is the first after it.
    let agreements: Vec<(f64, u64)> = polls.iter().filter_map(|(t, p)| agreed(p).map(|live| (*t, live))).collect();
    faults
        .iter()
        .filter(|f| f.membership)
        .map(|f| {
            // A poll at the event's own time was read before the event ran.
            let found = agreements.iter().find(|(t, _)| *t > f.secs).map(|(t, live)| (t - f.secs, *live));
            ViewAgreement {
                action: f.action.clone(),
                secs: f.secs,
                at_secs: f.at_secs,
                agreed_after_secs: found.map(|x| x.0),
                live: found.map(|x| x.1),
            }
        })
        .collect()
}

/// The verdict on a run, written into `summary.json` as `checks`.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct CheckReport {
    /// Every node process that lived past warm-up for at least two samples.
    pub rss: Vec<RssGrowth>,
    /// Processes too short-lived to judge (fewer than two samples after warm-up).
    pub rss_not_judged: Vec<String>,
    /// The peak resident memory (`VmHWM`) of each node with a
    /// `max_peak_rss_mib`, over all its lives, in bytes.
    pub peak_rss: BTreeMap<String, u64>,
    /// Rounds each node closed at the timeout (over all its lives).
    pub rounds_forced: BTreeMap<String, u64>,
    /// Of those, the rounds forced during a partition or within
    /// [`crate::checks::HEAL_GRACE_SECS`] after it healed: excused (see
    /// [`crate::checks::judge`]).
    pub rounds_forced_after_heal: u64,
    /// And those forced within `kill_grace_secs` after a kill: excused.
    pub rounds_forced_after_kill: u64,
    /// Mean final accuracy of the nodes that trained to the end (not killed,
    /// not left).
    pub survivors_accuracy: Option<f64>,
    pub survivors: Vec<String>,
    /// The same mean in the fault-free run.
    pub fault_free_accuracy: Option<f64>,
    /// Each check that failed, in words. Empty: the run passed.
    pub failures: Vec<String>,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub scenario: String,
    pub run_id: String,
    pub timed_out: bool,
    pub duration_secs: f64,
    /// When every initial node had trained a step (the timeline's zero).
    pub training_started_secs: Option<f64>,
    pub nodes: Vec<NodeOutcome>,
    pub role_changes: Vec<RoleRecord>,
    pub faults: Vec<FaultRecord>,
    /// Every sample, for other tools.
    pub samples: Vec<Sample>,
    /// Each node process's memory and open files over time (process
    /// backend only; empty on docker).
    pub resources: Vec<ResourceSample>,
    /// Each node's peak resident memory (`VmHWM`) over all its lives, in
    /// bytes (process backend only).
    pub peak_rss: BTreeMap<String, u64>,
    /// How long the views took to agree after each change of membership.
    pub view_agreement: Vec<ViewAgreement>,
    /// The verdict on the scenario's `[checks]`, if it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checks: Option<CheckReport>,
}

/// Window for the steps/s around a fault.
const RATE_WINDOW_SECS: f64 = 10.0;

/// Mean over nodes of each node's steps/s within `[from, to]`.
fn steps_per_sec(nodes: &ByNode<'_>, from: f64, to: f64) -> Option<f64> {
    let rates: Vec<f64> = nodes
        .values()
        .filter_map(|s| {
            let w: Vec<&&Sample> = s.iter().filter(|x| x.secs >= from && x.secs <= to).collect();
            let (a, b) = (w.first()?, w.last()?);
            (b.secs > a.secs).then(|| b.step.saturating_sub(a.step) as f64 / (b.secs - a.secs))
        })
        .collect();
    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
}

impl Summary {
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        scenario: &Scenario,
        training_started_secs: Option<f64>,
        duration_secs: f64,
        timed_out: bool,
        nodes: Vec<NodeOutcome>,
        role_changes: Vec<RoleRecord>,
        mut faults: Vec<FaultRecord>,
        samples: Vec<Sample>,
    ) -> Self {
        let grouped = by_node(&samples);
        for f in faults.iter_mut() {
            f.steps_per_sec_before = steps_per_sec(&grouped, f.secs - RATE_WINDOW_SECS, f.secs);
            f.steps_per_sec_after = steps_per_sec(&grouped, f.secs, f.secs + RATE_WINDOW_SECS);
        }
        let view_agreement = view_agreements(&faults, &samples);
        Self {
            scenario: scenario.name.clone(),
            run_id: scenario.run_id.clone(),
            timed_out,
            duration_secs,
            training_started_secs,
            nodes,
            role_changes,
            faults,
            samples,
            resources: Vec::new(),
            peak_rss: BTreeMap::new(),
            view_agreement,
            checks: None,
        }
    }

    /// The resource samples the launcher took.
    pub fn with_resources(mut self, resources: Vec<ResourceSample>) -> Self {
        self.peak_rss.clear();
        for r in &resources {
            let peak = self.peak_rss.entry(r.node.clone()).or_insert(0);
            *peak = (*peak).max(r.peak_rss_bytes).max(r.rss_bytes);
        }
        self.resources = resources;
        self
    }

    /// Write `summary.json` into `dir` (after the checks were added to a
    /// summary whose plot is already drawn).
    pub fn write_json(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join("summary.json");
        std::fs::write(&path, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {}", path.display()))
    }

    /// Write `summary.json` and `plot.png` into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        self.write_json(dir)?;
        let png = dir.join("plot.png");
        plot(self, &png).map_err(|e| anyhow::anyhow!("drawing {}: {e}", png.display()))
    }
}

/// Register a font for labels, if the system has one (Debian:
/// fonts-dejavu-core). Without it the plot is drawn without text.
fn font() -> bool {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        let candidates = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        ];
        candidates.iter().find_map(|p| std::fs::read(p).ok()).is_some_and(|bytes| {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
}

/// A labelled point of [`plot_points`]: its name, x and y.
pub type LabelledPoint = (String, f64, f64);

/// `points` as labelled dots on a log-scaled x axis, written as a PNG (the
/// bytes-against-loss plot of `shoal bench comm --workload llama`). Without
/// a font on the machine, the dots are drawn without their text.
pub fn plot_points(path: &Path, title: &str, axes: (&str, &str), points: &[LabelledPoint]) -> anyhow::Result<()> {
    draw_points(path, title, axes, points).map_err(|e| anyhow::anyhow!("plotting {}: {e}", path.display()))
}

/// `x` with an SI prefix: 1.5 k, 20 M, 3 G.
fn si(x: f64) -> String {
    let (v, unit) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    let v = format!("{v:.3}");
    format!("{} {unit}", v.trim_end_matches('0').trim_end_matches('.')).trim_end().to_string()
}

fn draw_points(
    path: &Path,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    points: &[LabelledPoint],
) -> Result<(), Box<dyn std::error::Error>> {
    let text = font();
    let positive = || points.iter().filter(|p| p.1 > 0.0 && p.1.is_finite() && p.2.is_finite());
    let (x_min, x_max) = positive().fold((f64::MAX, f64::MIN), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
    let (y_min, y_max) = positive().fold((f64::MAX, f64::MIN), |(lo, hi), p| (lo.min(p.2), hi.max(p.2)));
    if x_min > x_max {
        return Err("no point to plot".into());
    }
    let pad = ((y_max - y_min) * 0.1).max(0.01);
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut b = ChartBuilder::on(&root);
    b.margin(20);
    if text {
        b.caption(title, ("sans-serif", 22)).x_label_area_size(40).y_label_area_size(60);
    }
    let mut chart = b.build_cartesian_2d((x_min / 2.0..x_max * 4.0).log_scale(), (y_min - pad)..(y_max + 3.0 * pad))?;
    if text {
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).x_label_formatter(&|x| si(*x)).draw()?;
    }
    // Labels of points at about the same height step up, one line each.
    let mut placed: Vec<(f64, f64)> = Vec::new();
    for (i, (name, x, y)) in positive().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart.draw_series(std::iter::once(Circle::new((*x, *y), 6, color.filled())))?;
        if text {
            let mut at = *y + pad * 0.25;
            // Within a decade to the side, a label may overlap.
            while placed.iter().any(|(py, px)| (py - at).abs() < pad * 0.3 && (px / x).log10().abs() < 1.0) {
                at += pad * 0.35;
            }
            placed.push((at, *x));
            let style = ("sans-serif", 14).into_font().color(&BLACK);
            chart.draw_series(std::iter::once(Text::new(name.clone(), (*x * 1.08, at), style)))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Height of each panel of `plot.png`, in pixels.
const PANEL: u32 = 360;

/// `plot.png`, panels from the top: test accuracy, training loss and
/// steps/s per node over time; which nodes owned shards when; resident
/// memory (process backend). Faults are red vertical lines labelled with
/// their action, role changes blue ticks at the top of the first three.
fn plot(s: &Summary, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let text = font();
    let panels = if s.resources.is_empty() { 4 } else { 5 };
    let root = BitMapBackend::new(path, (1200, PANEL * panels)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((panels as usize, 1));
    let nodes = by_node(&s.samples);
    let t_max = s.samples.iter().map(|x| x.secs).fold(1.0f64, f64::max);
    let loss_max = s.samples.iter().filter_map(|x| x.loss).fold(0.1f64, f64::max);
    // Steps per second of each node between its consecutive samples.
    let rates: BTreeMap<&str, Vec<(f64, f64)>> = nodes
        .iter()
        .map(|(name, pts)| {
            let r = pts
                .windows(2)
                .filter(|w| w[1].secs > w[0].secs && w[1].step >= w[0].step)
                .map(|w| (w[1].secs, (w[1].step - w[0].step) as f64 / (w[1].secs - w[0].secs)))
                .collect();
            (*name, r)
        })
        .collect();
    let rate_max = rates.values().flatten().map(|p| p.1).fold(1.0f64, f64::max) * 1.05;
    let series: [(&str, f64, Box<Reading>); 2] = [
        ("test accuracy (%)", 100.0, Box::new(|_, p| p.accuracy.map(|a| a * 100.0))),
        ("training loss", loss_max * 1.05, Box::new(|_, p| p.loss)),
    ];
    for (i, (label, y_max, value)) in series.iter().enumerate() {
        let lines: Vec<(&str, Vec<(f64, f64)>)> = nodes
            .iter()
            .map(|(name, pts)| (*name, pts.iter().filter_map(|p| value(name, p).map(|v| (p.secs, v))).collect()))
            .collect();
        line_panel(s, &areas[i], label, t_max, *y_max, &lines, text)?;
    }
    let lines: Vec<(&str, Vec<(f64, f64)>)> = rates.into_iter().collect();
    line_panel(s, &areas[2], "steps/s per node", t_max, rate_max, &lines, text)?;
    plot_ownership(s, &areas[3], t_max, text)?;
    if !s.resources.is_empty() {
        plot_memory(s, &areas[4], t_max, text)?;
    }
    root.present()?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// What a line panel reads from a node's sample.
type Reading = dyn Fn(&str, &Sample) -> Option<f64>;

/// One panel of lines per node over time, with the faults and role changes.
fn line_panel(
    s: &Summary,
    area: &Area<'_>,
    label: &str,
    t_max: f64,
    y_max: f64,
    lines: &[(&str, Vec<(f64, f64)>)],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption(format!("{} — {}", s.scenario, label), ("sans-serif", 20))
            .x_label_area_size(30)
            .y_label_area_size(50);
    }
    let mut chart = b.build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
    if text {
        chart.configure_mesh().x_desc("seconds").y_desc(label).draw()?;
    }
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let drawn = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?;
        if text {
            drawn.label(*name).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
    }
    draw_faults(s, &mut chart, y_max, text)?;
    for r in &s.role_changes {
        chart.draw_series(LineSeries::new(vec![(r.secs, y_max * 0.95), (r.secs, y_max)], BLUE.stroke_width(1)))?;
    }
    if text {
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    }
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The faults as red lines, each labelled with its action (the first 28
/// characters), the labels stepped down so that neighbours do not overlap.
fn draw_faults(
    s: &Summary,
    chart: &mut Chart<'_, '_>,
    y_max: f64,
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    for (i, f) in s.faults.iter().enumerate() {
        chart.draw_series(LineSeries::new(vec![(f.secs, 0.0), (f.secs, y_max)], RED.stroke_width(2)))?;
        if text {
            let label: String = f.action.chars().take(28).collect();
            let y = y_max * (0.9 - 0.08 * (i % 4) as f64);
            let style = ("sans-serif", 13).into_font().color(&RED);
            chart.draw_series(std::iter::once(Text::new(label, (f.secs, y), style)))?;
        }
    }
    Ok(())
}

/// One row per node: a bar for each stretch of time it owned shards (from
/// the role changes the launcher saw), labelled with how many.
fn plot_ownership(s: &Summary, area: &Area<'_>, t_max: f64, text: bool) -> Result<(), Box<dyn std::error::Error>> {
    let mut names: Vec<&str> = s.samples.iter().map(|x| x.node.as_str()).collect();
    names.extend(s.role_changes.iter().map(|r| r.node.as_str()));
    names.sort_unstable();
    names.dedup();
    let rows = names.len().max(1) as f64;
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption(format!("{} — shards owned, by node", s.scenario), ("sans-serif", 20))
            .x_label_area_size(30)
            .y_label_area_size(50);
    }
    let mut chart = b.build_cartesian_2d(0.0..t_max, 0.0..rows)?;
    if text {
        chart.configure_mesh().x_desc("seconds").y_labels(0).disable_y_mesh().draw()?;
    }
    for (row, name) in names.iter().enumerate() {
        let changes: Vec<&RoleRecord> = s.role_changes.iter().filter(|r| r.node == *name).collect();
        let y = rows - 1.0 - row as f64;
        if text {
            let style = ("sans-serif", 13).into_font().color(&BLACK);
            chart.draw_series(std::iter::once(Text::new(name.to_string(), (0.0, y + 0.55), style)))?;
        }
        for (k, r) in changes.iter().enumerate() {
            if r.owned.is_empty() {
                continue;
            }
            let to = changes.get(k + 1).map_or(t_max, |n| n.secs);
            let color = Palette99::pick(row).to_rgba();
            chart.draw_series(std::iter::once(Rectangle::new([(r.secs, y + 0.15), (to, y + 0.85)], color.filled())))?;
            if text {
                let style = ("sans-serif", 12).into_font().color(&BLACK);
                chart.draw_series(std::iter::once(Text::new(
                    format!("{}", r.owned.len()),
                    (r.secs, y + 0.8),
                    style,
                )))?;
            }
        }
    }
    draw_faults(s, &mut chart, rows, false)?;
    Ok(())
}

/// Each node's resident memory (MiB) over time, with the faults.
fn plot_memory(s: &Summary, area: &Area<'_>, t_max: f64, text: bool) -> Result<(), Box<dyn std::error::Error>> {
    const MIB: f64 = 1024.0 * 1024.0;
    let y_max = s.resources.iter().map(|r| r.rss_bytes as f64 / MIB).fold(1.0f64, f64::max) * 1.1;
    let mut b = ChartBuilder::on(area);
    b.margin(10);
    if text {
        b.caption(format!("{} — resident memory (MiB)", s.scenario), ("sans-serif", 20))
            .x_label_area_size(30)
            .y_label_area_size(50);
    }
    let mut chart = b.build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
    if text {
        chart.configure_mesh().x_desc("seconds").y_desc("RSS (MiB)").draw()?;
    }
    let mut nodes: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &s.resources {
        nodes.entry(r.node.as_str()).or_default().push((r.secs, r.rss_bytes as f64 / MIB));
    }
    for (i, (_, pts)) in nodes.into_iter().enumerate() {
        chart.draw_series(LineSeries::new(pts, Palette99::pick(i).to_rgba().stroke_width(2)))?;
    }
    draw_faults(s, &mut chart, y_max, false)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(secs: f64, node: &str, step: u64) -> Sample {
        Sample {
            secs,
            node: node.into(),
            step,
            loss: Some(1.0 / (1.0 + secs)),
            accuracy: Some(0.5),
            samples_per_sec: 0.0,
            rounds_forced: 0,
            role: "worker".into(),
            members: None,
            live: 0,
        }
    }

    #[test]
    fn si_prefixes_trim_their_zeros() {
        assert_eq!(super::si(1e6), "1 M");
        assert_eq!(super::si(1.5e9), "1.5 G");
        assert_eq!(super::si(250.0), "250");
    }

    #[test]
    fn rss_is_read_from_proc_status() {
        let status = "Name:\tshoal\nVmPeak:\t  99 kB\nVmRSS:\t   51200 kB\nThreads:\t9\n";
        assert_eq!(vm_rss_bytes(status), Some(51200 * 1024));
        assert_eq!(vm_rss_bytes("Name:\tx\n"), None);
        assert_eq!(vm_rss_bytes("VmRSS:\tlots\n"), None);
    }

    #[test]
    fn steps_per_sec_is_the_mean_node_rate_in_the_window() {
        let s = vec![sample(0.0, "a", 0), sample(10.0, "a", 100), sample(0.0, "b", 0), sample(10.0, "b", 50)];
        assert_eq!(steps_per_sec(&by_node(&s), 0.0, 10.0), Some(7.5));
        assert_eq!(steps_per_sec(&by_node(&s), 20.0, 30.0), None);
    }

    fn change(secs: f64, action: &str) -> FaultRecord {
        FaultRecord {
            secs,
            at_secs: secs,
            at_step: None,
            line: 1,
            action: action.into(),
            outcome: "ok".into(),
            membership: true,
            failure: action.starts_with("kill"),
            steps_per_sec_before: None,
            steps_per_sec_after: None,
        }
    }

    /// One poll of three nodes: each with its (role, members hash, live).
    fn poll(secs: f64, nodes: [(&str, Option<&str>, u64); 3]) -> Vec<Sample> {
        nodes
            .iter()
            .enumerate()
            .map(|(i, (role, members, live))| Sample {
                role: role.to_string(),
                members: members.map(str::to_string),
                live: *live,
                ..sample(secs, &format!("node{i}"), 1)
            })
            .collect()
    }

    /// Views agree at the first poll after a change where every node that
    /// elects holds the same members, every node; a node still joining (no
    /// placement), split members or a count that still holds a dead node
    /// is not agreement; changes that overlap settle together.
    #[test]
    fn views_agree_at_the_first_poll_where_every_node_holds_every_live_node() {
        let w = "worker";
        let samples: Vec<Sample> = [
            poll(1.0, [(w, Some("a"), 3), (w, Some("a"), 3), (w, Some("a"), 3)]),
            // A kill at 1.5 s: the others still count the dead node (4 of 3 polled).
            poll(2.0, [(w, Some("a"), 4), (w, Some("a"), 4), (w, Some("a"), 4)]),
            poll(3.0, [(w, Some("b"), 3), (w, Some("a"), 4), ("joining", None, 0)]),
            poll(4.0, [(w, Some("b"), 3), (w, Some("b"), 3), ("joining", None, 0)]),
            poll(5.0, [(w, Some("c"), 3), ("aggregator", Some("c"), 3), (w, Some("c"), 3)]),
            // A node that finished keeps its last placement and is not judged.
            poll(6.0, [(w, Some("c"), 3), (w, Some("c"), 3), ("done", Some("old"), 2)]),
        ]
        .concat();
        let faults = [
            change(1.5, "kill node3"),
            change(2.5, "add a node"),
            change(5.5, "node9 leaves"),
            change(7.0, "add a node"),
        ];
        let v = view_agreements(&faults, &samples);
        let got: Vec<(Option<f64>, Option<u64>)> = v.iter().map(|v| (v.agreed_after_secs, v.live)).collect();
        assert_eq!(got, vec![(Some(3.5), Some(3)), (Some(2.5), Some(3)), (Some(0.5), Some(3)), (None, None)]);
        // Slow, partitioned and healed are not changes of membership.
        let mut slow = change(1.5, "slow node1");
        slow.membership = false;
        assert!(view_agreements(&[slow], &samples).is_empty());
    }

    #[test]
    fn the_report_is_written_with_a_png() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let sc = Scenario::parse("nodes = 2\n", "t.toml", "t").map_err(|e| anyhow::anyhow!("{e}"))?;
        let samples: Vec<Sample> = (0..20).map(|i| sample(i as f64, if i % 2 == 0 { "a" } else { "b" }, i)).collect();
        let fault = FaultRecord {
            secs: 5.0,
            at_secs: 1.0,
            at_step: None,
            line: 3,
            action: "kill node1".into(),
            outcome: "ok".into(),
            membership: true,
            failure: true,
            steps_per_sec_before: None,
            steps_per_sec_after: None,
        };
        let resources = (0..4)
            .map(|i| ResourceSample {
                secs: 5.0 * i as f64,
                node: "a".into(),
                pid: 7,
                rss_bytes: (40 + i) << 20,
                peak_rss_bytes: (41 + i) << 20,
                open_fds: 30,
            })
            .collect();
        let roles = vec![
            RoleRecord { secs: 1.0, node: "a".into(), role: "aggregator".into(), owned: vec![0, 1] },
            RoleRecord { secs: 1.0, node: "b".into(), role: "aggregator".into(), owned: vec![2, 3] },
            RoleRecord { secs: 6.0, node: "b".into(), role: "worker".into(), owned: vec![] },
            RoleRecord { secs: 6.0, node: "a".into(), role: "aggregator".into(), owned: vec![0, 1, 2, 3] },
        ];
        let summary =
            Summary::build(&sc, Some(1.0), 20.0, false, vec![], roles, vec![fault], samples).with_resources(resources);
        summary.write(dir.path())?;
        let png = std::fs::read(dir.path().join("plot.png"))?;
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16 and 20: five
        // panels (accuracy, loss, steps/s, ownership, memory).
        let height = u32::from_be_bytes([png[20], png[21], png[22], png[23]]);
        assert_eq!(height, 5 * PANEL);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("summary.json"))?)?;
        assert!(json["faults"][0]["steps_per_sec_before"].as_f64().is_some());
        assert_eq!(json["resources"][3]["rss_bytes"].as_u64(), Some(43 << 20));
        Ok(())
    }
}
