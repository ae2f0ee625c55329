//! `shoal top`: a terminal view of the cluster, reached through any one
//! node's HTTP endpoint (its `/status` lists the peers it hears). One row
//! per node; keys sort and select. It draws with ratatui on the terminal it
//! runs in, so it works over SSH.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Borders, Paragraph, Row as TableRow, Table, TableState};
use serde_json::Value;

use crate::cmd::cli::TopArgs;

/// One node as a row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub name: String,
    pub peer_id: String,
    pub role: String,
    pub shards: Vec<u32>,
    pub step: u64,
    /// The node's own throughput; for a peer, the compute rate its
    /// heartbeat gossips.
    pub samples_per_sec: f64,
    /// The node asked has its training loss; peers gossip none.
    pub loss: Option<f64>,
    /// Bytes per second of its exchanges (as measured for the link rate).
    pub link_bytes_per_sec: Option<f64>,
    /// Milliseconds since its last heartbeat (0 for the node asked).
    pub last_seen_ms: u64,
    /// The node `shoal top` reads.
    pub asked: bool,
}

/// The rows of one `/status` document: the node asked, then its peers.
pub fn rows(status: &Value) -> Vec<Row> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let shards = |v: &Value| v.as_array().map(|a| a.iter().filter_map(|s| s.as_u64()).map(|s| s as u32).collect());
    let link = match (status["link_bytes"].as_f64(), status["link_secs"].as_f64()) {
        (Some(b), Some(s)) if s > 0.0 => Some(b / s),
        _ => None,
    };
    let mut out = vec![Row {
        name: text(&status["name"]),
        peer_id: text(&status["peer_id"]),
        role: text(&status["role"]),
        shards: shards(&status["owned_shards"]).unwrap_or_default(),
        step: status["step"].as_u64().unwrap_or(0),
        samples_per_sec: status["samples_per_sec"].as_f64().unwrap_or(0.0),
        loss: status["last_loss"].as_f64(),
        link_bytes_per_sec: link,
        last_seen_ms: 0,
        asked: true,
    }];
    for p in status["peers"].as_array().into_iter().flatten() {
        let id = text(&p["peer_id"]);
        let rate = p["net_bytes_per_sec"].as_f64().filter(|r| *r > 0.0);
        out.push(Row {
            // Peers are named as logs name them (the node's own name
            // defaults to the same).
            name: id.parse().map(|p| crate::ops::logging::short(&p)).unwrap_or_else(|_| id.clone()),
            peer_id: id,
            role: text(&p["role"]),
            shards: shards(&p["owned_shards"]).unwrap_or_default(),
            step: p["step"].as_u64().unwrap_or(0),
            samples_per_sec: p["compute_samples_per_sec"].as_f64().unwrap_or(0.0),
            loss: None,
            link_bytes_per_sec: rate,
            last_seen_ms: p["last_seen_ms_ago"].as_u64().unwrap_or(0),
            asked: false,
        });
    }
    out
}

/// The column the rows are sorted by (`s` cycles through them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    Node,
    Role,
    Step,
    Speed,
}

impl SortKey {
    pub fn next(self) -> Self {
        match self {
            SortKey::Node => SortKey::Role,
            SortKey::Role => SortKey::Step,
            SortKey::Step => SortKey::Speed,
            SortKey::Speed => SortKey::Node,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SortKey::Node => "node",
            SortKey::Role => "role",
            SortKey::Step => "step",
            SortKey::Speed => "samples/s",
        }
    }
}

/// Sort rows by `key` (ties by name), descending when `reverse`.
pub fn sort(rows: &mut [Row], key: SortKey, reverse: bool) {
    rows.sort_by(|a, b| {
        let o = match key {
            SortKey::Node => a.name.cmp(&b.name),
            SortKey::Role => a.role.cmp(&b.role),
            SortKey::Step => a.step.cmp(&b.step),
            SortKey::Speed => a.samples_per_sec.total_cmp(&b.samples_per_sec),
        };
        o.then_with(|| a.name.cmp(&b.name))
    });
    if reverse {
        rows.reverse();
    }
}

/// What the view shows, between two reads.
struct View {
    rows: Vec<Row>,
    sort: SortKey,
    reverse: bool,
    table: TableState,
    error: Option<String>,
}

fn rate(bytes_per_sec: Option<f64>) -> String {
    bytes_per_sec.map_or("-".into(), |r| format!("{:.2} MB/s", r / 1e6))
}

fn draw(frame: &mut ratatui::Frame, view: &mut View, node: SocketAddr) {
    let [top, detail, foot] =
        Layout::vertical([Constraint::Min(5), Constraint::Length(5), Constraint::Length(1)]).areas(frame.area());
    let header = TableRow::new(["node", "role", "shards", "step", "samples/s", "loss", "link", "seen"])
        .style(Style::new().add_modifier(Modifier::BOLD));
    let body = view.rows.iter().map(|r| {
        let shards = r.shards.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        TableRow::new([
            if r.asked { format!("{}*", r.name) } else { r.name.clone() },
            r.role.clone(),
            if shards.is_empty() { "-".into() } else { shards },
            r.step.to_string(),
            format!("{:.0}", r.samples_per_sec),
            r.loss.map_or("-".into(), |l| format!("{l:.4}")),
            rate(r.link_bytes_per_sec),
            format!("{} ms", r.last_seen_ms),
        ])
    });
    let widths = [8, 11, 18, 8, 10, 8, 12, 9].map(Constraint::Length);
    let title = format!(" shoal top: {} nodes through {node} (* the node asked) ", view.rows.len());
    let table = Table::new(body, widths)
        .header(header)
        .block(Block::default().borders(Borders::ALL).title(title))
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
    frame.render_stateful_widget(table, top, &mut view.table);
    let chosen = view.table.selected().and_then(|i| view.rows.get(i));
    let text = chosen.map_or("select a node with the arrow keys".into(), |r| {
        format!(
            "peer {}\nrole {}, shards {:?}, step {}\nsamples/s {:.1}, link {}",
            r.peer_id,
            r.role,
            r.shards,
            r.step,
            r.samples_per_sec,
            rate(r.link_bytes_per_sec)
        )
    });
    frame.render_widget(Paragraph::new(text).block(Block::default().borders(Borders::ALL).title(" selected ")), detail);
    let keys = format!(
        "s sort: {}{}  r reverse  up/down select  q quit{}",
        view.sort.name(),
        if view.reverse { " (descending)" } else { "" },
        view.error.as_ref().map(|e| format!("  | {e}")).unwrap_or_default()
    );
    frame.render_widget(Paragraph::new(keys), foot);
}

/// Read the node's `/status` into the view (an error is shown, not fatal:
/// the node may come back).
fn refresh(view: &mut View, node: SocketAddr) {
    match shoal_testnet::http::get_json(node, "/status", Duration::from_secs(2)) {
        Ok(status) => {
            let chosen = view.table.selected().and_then(|i| view.rows.get(i)).map(|r| r.peer_id.clone());
            view.rows = rows(&status);
            sort(&mut view.rows, view.sort, view.reverse);
            // Keep the same node selected across a re-sort.
            if let Some(id) = chosen {
                view.table.select(view.rows.iter().position(|r| r.peer_id == id));
            }
            view.error = None;
        }
        Err(e) => view.error = Some(format!("{node} unreachable: {e:#}")),
    }
}

pub fn run(args: TopArgs) -> anyhow::Result<()> {
    let node: SocketAddr = args.node.parse().with_context(|| {
        format!("--node {}: give the HTTP address a node printed (`status on http://HOST:PORT/`)", args.node)
    })?;
    anyhow::ensure!(args.interval_ms >= 100, "--interval-ms {}: at least 100", args.interval_ms);
    let mut view =
        View { rows: Vec::new(), sort: SortKey::Node, reverse: false, table: TableState::default(), error: None };
    refresh(&mut view, node);
    if view.rows.is_empty() {
        anyhow::bail!("{}", view.error.unwrap_or_else(|| format!("{node} answered no status")));
    }
    let mut terminal = ratatui::try_init().context("opening the terminal")?;
    let result = (|| -> anyhow::Result<()> {
        let interval = Duration::from_millis(args.interval_ms);
        let mut last = Instant::now();
        loop {
            terminal.draw(|f| draw(f, &mut view, node))?;
            let wait = interval.saturating_sub(last.elapsed());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()? {
                    if k.kind != KeyEventKind::Press {
                        continue;
                    }
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                        KeyCode::Char('s') => view.sort = view.sort.next(),
                        KeyCode::Char('r') => view.reverse = !view.reverse,
                        KeyCode::Down => view.table.select_next(),
                        KeyCode::Up => view.table.select_previous(),
                        _ => continue,
                    }
                    sort(&mut view.rows, view.sort, view.reverse);
                }
            }
            if last.elapsed() >= interval {
                refresh(&mut view, node);
                last = Instant::now();
            }
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_document_becomes_one_row_per_node_and_sorts() {
        let status = serde_json::json!({
            "name": "node0", "peer_id": "12D3KooWAAAAAAnode00", "role": "aggregator", "owned_shards": [0, 1],
            "step": 40, "samples_per_sec": 900.0, "last_loss": 0.5, "link_bytes": 2e6, "link_secs": 2.0,
            "peers": [
                {"peer_id": "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", "role": "worker", "step": 42, "owned_shards": [],
                 "last_seen_ms_ago": 120, "compute_samples_per_sec": 1500.0, "net_bytes_per_sec": 0.0},
                {"peer_id": "12D3KooWCCCCCCpeer02", "role": "aggregator", "step": 39, "owned_shards": [2],
                 "last_seen_ms_ago": 80, "compute_samples_per_sec": 300.0, "net_bytes_per_sec": 5e5}
            ]
        });
        let mut r = rows(&status);
        assert_eq!(r.len(), 3);
        assert!(r[0].asked && r[0].loss == Some(0.5) && r[0].link_bytes_per_sec == Some(1e6));
        assert_eq!((r[1].name.as_str(), r[1].link_bytes_per_sec), ("x6nXTN", None));
        assert_eq!(r[2].shards, [2]);
        sort(&mut r, SortKey::Speed, true);
        assert_eq!(r.iter().map(|x| x.step).collect::<Vec<_>>(), [42, 40, 39]);
        sort(&mut r, SortKey::Role, false);
        assert_eq!(r.iter().map(|x| x.role.as_str()).collect::<Vec<_>>(), ["aggregator", "aggregator", "worker"]);
        assert_eq!(SortKey::Speed.next(), SortKey::Node);
    }
}
