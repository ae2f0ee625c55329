//! The node's HTTP endpoint: a status page, `/status` (JSON), `/metrics`
//! (Prometheus text format) and, when `http.control` is set, the control
//! endpoint testnets use to inject faults.
//!
//! An axum router served over HTTP/1.1 with `Connection: close`: at most
//! [`MAX_CONNECTIONS`] connections at once (more wait in the listen
//! backlog), request bodies refused over [`MAX_REQUEST`] bytes, every
//! request read within [`REQUEST_TIMEOUT`] of its connection (a client that
//! connects and sends nothing, or a byte at a time, loses the connection
//! and its slot) and every answer within [`ANSWER_TIMEOUT`]. The server is one of the node's tasks:
//! when the node stops it stops accepting, lets the requests in hand
//! finish (at most [`SHUTDOWN_GRACE`]) and closes its port. Routes:
//!
//! | method | path | answer |
//! | --- | --- | --- |
//! | GET | `/` | self-contained HTML page that refreshes `/status` every second |
//! | GET | `/status` | [`StatusDoc`] as JSON |
//! | GET | `/metrics` | counters and gauges in Prometheus text format |
//! | POST | `/control/fault?serve_delay_ms=N&slowdown=F` | set fault injection |
//! | POST | `/control/block?peer=ID` | refuse and close connections to a peer |
//! | POST | `/control/unblock?peer=ID[&addr=MULTIADDR]` | lift a block, then dial `addr` |
//! | POST | `/control/leave` | leave the run cleanly |
//!
//! Another method on `/`, `/status` or `/metrics` is answered 405, any
//! other path 404, a control request with the endpoint off 403, and a bad
//! control parameter 400 with what was wrong; each as one line of text.

use std::collections::BTreeMap;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use shoal_protocol::libp2p::{Multiaddr, PeerId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{info, warn};

use crate::handles::leave::LeaveSwitch;
use crate::handles::membership::MembershipHandle;
use crate::handles::net::NetworkHandle;
use crate::handles::status::{StatusHandle, StatusSnapshot};
use crate::ops::faults::Faults;
use crate::ops::tasks::NodeTasks;

/// Largest request body accepted (no route reads one).
pub const MAX_REQUEST: usize = 16 * 1024;
/// Longest a connection may take to send its request (hyper's own header
/// timeout needs a timer that `axum::serve` does not set). Without it, 64
/// clients that connect and send nothing held every slot for as long as
/// they liked, and the endpoint answered no one.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the node may take to answer a request.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;
/// Longest the requests in hand may take to finish once the node stops.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What the endpoint reads and controls.
#[derive(Debug, Clone)]
pub struct HttpState {
    pub status: StatusHandle,
    pub membership: MembershipHandle,
    pub net: NetworkHandle,
    pub faults: Arc<Faults>,
    pub leave: LeaveSwitch,
    pub listen: Vec<Multiaddr>,
    pub control: bool,
    pub failure_timeout_ms: u64,
    /// The node's tasks: the server is one, and so is a redial after
    /// `/control/unblock`.
    pub tasks: NodeTasks,
}

/// One peer as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PeerDoc {
    pub peer_id: String,
    pub role: String,
    pub step: u64,
    pub owned_shards: Vec<u32>,
    pub last_seen_ms_ago: u64,
    /// Its measured rates, as its heartbeat gossips them: samples/s of
    /// compute, and bytes/s of its exchanges.
    pub compute_samples_per_sec: f64,
    pub net_bytes_per_sec: f64,
}

/// The `/status` document.
#[derive(Debug, Clone, Serialize)]
pub struct StatusDoc {
    #[serde(flatten)]
    pub status: StatusSnapshot,
    pub listen: Vec<String>,
    /// Peers with this node's config heard from within the failure timeout.
    pub peers: Vec<PeerDoc>,
    /// Each suspect, with the peers whose heartbeats name it (this node
    /// included when its own aggregator does): claims, not verdicts.
    pub suspected_by: BTreeMap<String, Vec<String>>,
    pub serve_delay_ms: u64,
    pub slowdown: f64,
}

/// Bind, and serve as one of the node's tasks until the node stops.
/// Returns the bound address.
pub async fn serve(addr: SocketAddr, state: HttpState) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("binding the HTTP endpoint on {addr}"))?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() {
        warn!(%local, "HTTP endpoint is reachable from other machines");
    }
    if state.control {
        warn!(%local, "control endpoint enabled: anyone who reaches it can inject faults");
    }
    info!(%local, "status on http://{local}/");
    let tasks = state.tasks.clone();
    let listener = Bounded { listener, slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)) };
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(tasks.stopping());
    let stopping = tasks.stopping();
    tasks.spawn_graceful(async move {
        let grace = async {
            stopping.await;
            // Bounds the wait on a client that holds its connection open.
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        tokio::select! {
            r = server.into_future() => {
                if let Err(e) = r {
                    warn!(error = %e, "the HTTP endpoint failed");
                }
            }
            () = grace => warn!(%local, "HTTP requests still in hand {} s after the node stopped: dropped",
                SHUTDOWN_GRACE.as_secs()),
        }
    });
    Ok(local)
}

/// The routes, and the limits every request passes through.
fn router(state: HttpState) -> Router {
    Router::new()
        .route("/", get(page).fallback(use_get))
        .route("/status", get(status).fallback(use_get))
        .route("/metrics", get(metrics).fallback(use_get))
        .route("/history", get(history).fallback(use_get))
        .route("/control/", post(control).fallback(not_found))
        .route("/control/{*action}", post(control).fallback(not_found))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_REQUEST))
        .layer(middleware::from_fn(answer_within))
        .with_state(Arc::new(state))
}

/// One line of plain text.
fn text(code: StatusCode, body: impl Into<String>) -> Response {
    (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body.into()).into_response()
}

/// Every answer: within [`ANSWER_TIMEOUT`], never cached, and the
/// connection closed after it.
async fn answer_within(req: Request, next: Next) -> Response {
    let mut resp = match tokio::time::timeout(ANSWER_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the node did not answer within {} s\n", ANSWER_TIMEOUT.as_secs()),
        ),
    };
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

async fn status(State(state): State<Arc<HttpState>>) -> Response {
    let Some(doc) = status_doc(&state).await else {
        return text(StatusCode::SERVICE_UNAVAILABLE, "status actor stopped\n");
    };
    match serde_json::to_vec_pretty(&doc) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("encoding status: {e}\n")),
    }
}

async fn metrics(State(state): State<Arc<HttpState>>) -> Response {
    match state.status.snapshot().await {
        Some(s) => {
            let body = crate::ops::metrics::metrics_text(&s, state.faults.as_ref());
            ([(header::CONTENT_TYPE, crate::ops::metrics::CONTENT_TYPE)], body).into_response()
        }
        None => text(StatusCode::SERVICE_UNAVAILABLE, "status actor stopped\n"),
    }
}

async fn history(State(state): State<Arc<HttpState>>) -> Response {
    let Some(doc) = state.status.history().await else {
        return text(StatusCode::SERVICE_UNAVAILABLE, "status actor stopped\n");
    };
    match serde_json::to_vec(&doc) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("encoding history: {e}\n")),
    }
}

async fn use_get() -> Response {
    text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n")
}

async fn not_found() -> Response {
    text(StatusCode::NOT_FOUND, "not found: try /, /status, /history or /metrics\n")
}

/// `POST /control/...`: 403 while the endpoint is off, 400 with the
/// reason for a bad command or parameter.
async fn control(State(state): State<Arc<HttpState>>, uri: Uri) -> Response {
    if !state.control {
        return text(StatusCode::FORBIDDEN, "control endpoint disabled (start the node with --control)\n");
    }
    let query = match Query::<Vec<(String, String)>>::try_from_uri(&uri) {
        Ok(Query(q)) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("{}\n", e.body_text())),
    };
    let path = uri.path();
    match command(path, &query, &state).await {
        Ok(msg) => {
            info!(path, query = ?query, "control: {msg}");
            text(StatusCode::OK, format!("{msg}\n"))
        }
        Err(e) => text(StatusCode::BAD_REQUEST, format!("{e:#}\n")),
    }
}

fn param<'a>(query: &'a [(String, String)], key: &str) -> Option<&'a str> {
    query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

async fn command(path: &str, query: &[(String, String)], state: &HttpState) -> anyhow::Result<String> {
    let peer = || -> anyhow::Result<PeerId> {
        let p = param(query, "peer").context("missing ?peer=<peer id>")?;
        p.parse().with_context(|| format!("`{p}` is not a peer id"))
    };
    match path {
        "/control/fault" => fault(query, &state.faults),
        "/control/block" => {
            let p = peer()?;
            state.net.block(p).await.map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(format!("blocked {p}"))
        }
        "/control/unblock" => {
            let p = peer()?;
            state.net.unblock(p).await.map_err(|e| anyhow::anyhow!("{e}"))?;
            if let Some(a) = param(query, "addr") {
                let addr: Multiaddr = a.parse().with_context(|| format!("`{a}` is not a multiaddr"))?;
                // Reconnect in the background: the answer does not wait on the dial.
                let net = state.net.clone();
                state.tasks.spawn(async move {
                    if let Err(e) = net.dial(addr.clone()).await {
                        warn!(%addr, error = %e, "redial after unblock failed");
                    }
                });
            }
            Ok(format!("unblocked {p}"))
        }
        "/control/leave" => {
            state.leave.leave();
            Ok("leaving".into())
        }
        other => anyhow::bail!("unknown control `{other}`: fault, block, unblock or leave"),
    }
}

/// `/control/fault`: set the serve delay and/or the slowdown.
fn fault(query: &[(String, String)], faults: &Faults) -> anyhow::Result<String> {
    let mut done = Vec::new();
    if let Some(v) = param(query, "serve_delay_ms") {
        let ms: u64 = v.parse().with_context(|| format!("serve_delay_ms `{v}` is not a whole number"))?;
        faults.set_serve_delay_ms(ms);
        done.push(format!("serve delay {ms} ms"));
    }
    if let Some(v) = param(query, "slowdown") {
        let f: f64 = v.parse().with_context(|| format!("slowdown `{v}` is not a number"))?;
        faults.set_slowdown(f).map_err(|e| anyhow::anyhow!(e))?;
        done.push(format!("slowdown {f}x"));
    }
    anyhow::ensure!(!done.is_empty(), "give serve_delay_ms and/or slowdown");
    Ok(done.join(", "))
}

/// The TCP listener, with at most [`MAX_CONNECTIONS`] connections open: a
/// slot is taken before accepting and held by the connection.
struct Bounded {
    listener: TcpListener,
    slots: Arc<Semaphore>,
}

impl axum::serve::Listener for Bounded {
    type Io = Slotted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Slotted, SocketAddr) {
        // The semaphore is never closed: `None` cannot happen, and would
        // only lift the bound.
        let slot = self.slots.clone().acquire_owned().await.ok();
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let read_by = Box::pin(tokio::time::sleep(REQUEST_TIMEOUT));
                    return (Slotted { stream, _slot: slot, read_by }, addr);
                }
                Err(e) => {
                    warn!(error = %e, "http accept failed");
                    // Out of file descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A connection holding its slot until it is dropped. Reads fail once
/// [`REQUEST_TIMEOUT`] has passed since it was accepted: the server then
/// drops it. (One request per connection, `Connection: close`: a request
/// read in time is answered within [`ANSWER_TIMEOUT`].)
struct Slotted {
    stream: TcpStream,
    _slot: Option<OwnedSemaphorePermit>,
    read_by: Pin<Box<tokio::time::Sleep>>,
}

impl AsyncRead for Slotted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        // Polled first, so that its timer wakes a read that waits for
        // bytes that never come.
        if self.read_by.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no request within {} s of connecting", REQUEST_TIMEOUT.as_secs()),
            )));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Slotted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

async fn status_doc(state: &HttpState) -> Option<StatusDoc> {
    let status = state.status.snapshot().await?;
    let snap = state.membership.snapshot();
    let peers = snap
        .view
        .live(snap.now_ms, state.failure_timeout_ms)
        .iter()
        .map(|p| PeerDoc {
            peer_id: p.heartbeat.peer.to_string(),
            role: format!("{:?}", p.heartbeat.role).to_lowercase(),
            step: p.heartbeat.step,
            owned_shards: p.heartbeat.owned_shards.clone(),
            last_seen_ms_ago: snap.now_ms.saturating_sub(p.last_seen_ms),
            compute_samples_per_sec: f64::from(p.heartbeat.capabilities.compute_samples_per_sec),
            net_bytes_per_sec: f64::from(p.heartbeat.capabilities.net_bytes_per_sec),
        })
        .collect();
    let mine: Vec<PeerId> = status.suspects.iter().filter_map(|s| s.parse().ok()).collect();
    let suspected_by = snap
        .view
        .suspected_by(&mine)
        .into_iter()
        .map(|(s, by)| (s.to_string(), by.iter().map(ToString::to_string).collect()))
        .collect();
    Some(StatusDoc {
        status,
        listen: state.listen.iter().map(|a| a.to_string()).collect(),
        peers,
        suspected_by,
        serve_delay_ms: state.faults.serve_delay().as_millis() as u64,
        slowdown: state.faults.slowdown(),
    })
}

/// The status page: plain HTML, inline SVG charts and a little JavaScript,
/// built into the binary (no external assets, no network at run time).
const PAGE: &str = include_str!("page.html");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_parameters_are_percent_decoded() -> anyhow::Result<()> {
        let uri: Uri = "/control/unblock?peer=12D3&addr=%2Fip4%2F127.0.0.1%2Ftcp%2F1&x=a%2".parse()?;
        let Query(q) = Query::<Vec<(String, String)>>::try_from_uri(&uri)?;
        assert_eq!(param(&q, "addr"), Some("/ip4/127.0.0.1/tcp/1"));
        assert_eq!(param(&q, "peer"), Some("12D3"));
        assert_eq!(param(&q, "x"), Some("a%2"), "a truncated escape is kept as is");
        Ok(())
    }

    #[test]
    fn bad_fault_parameters_are_refused_with_the_reason() {
        let faults = Faults::default();
        let q = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let err = |q: Vec<(String, String)>| fault(&q, &faults).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert_eq!(
            err(q("serve_delay_ms", "abc")),
            "serve_delay_ms `abc` is not a whole number: invalid digit found in string"
        );
        assert_eq!(err(q("slowdown", "x")), "slowdown `x` is not a number: invalid float literal");
        assert_eq!(err(Vec::new()), "give serve_delay_ms and/or slowdown");
        assert_eq!(fault(&q("serve_delay_ms", "7"), &faults).ok().as_deref(), Some("serve delay 7 ms"));
    }
}
