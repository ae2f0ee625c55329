//! The node's HTTP endpoint: a status page, `/status` (JSON), `/metrics`
//! (Prometheus text format) and, when `http.control` is set, the control
//! endpoint testnets use to inject faults.
//!
//! One small HTTP/1.1 server, one task per connection, `Connection: close`,
//! bounded request size and read time. Routes:
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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use shoal_protocol::libp2p::{Multiaddr, PeerId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::handles::leave::LeaveSwitch;
use crate::handles::membership::MembershipHandle;
use crate::handles::net::NetworkHandle;
use crate::handles::status::{StatusHandle, StatusSnapshot};
use crate::ops::faults::Faults;

/// Largest request head accepted.
const MAX_REQUEST: usize = 16 * 1024;
/// Longest a client may take to send its request, and to take the answer.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;

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
}

/// One peer as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PeerDoc {
    pub peer_id: String,
    pub role: String,
    pub step: u64,
    pub owned_shards: Vec<u32>,
    pub last_seen_ms_ago: u64,
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

/// Bind and serve until the process ends. Returns the bound address.
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
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            // Take a slot before accepting: at most MAX_CONNECTIONS at once.
            let Ok(slot) = slots.clone().acquire_owned().await else { break };
            match listener.accept().await {
                Ok((stream, _)) => {
                    let state = state.clone();
                    tokio::spawn(async move {
                        if let Err(e) = handle(stream, &state).await {
                            debug!(error = %format!("{e:#}"), "http request failed");
                        }
                        drop(slot);
                    });
                }
                Err(e) => {
                    warn!(error = %e, "http accept failed");
                    // Out of file descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(local)
}

/// A parsed request line.
#[derive(Debug, PartialEq)]
struct Request {
    method: String,
    path: String,
    query: Vec<(String, String)>,
}

fn parse_request(head: &str) -> Option<Request> {
    let line = head.lines().next()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?;
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let (path, q) = target.split_once('?').unwrap_or((target, ""));
    let query = q
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    Some(Request { method, path: path.to_string(), query })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Response {
    code: u16,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Response {
    fn text(code: u16, body: impl Into<String>) -> Self {
        Self { code, content_type: "text/plain; charset=utf-8", body: body.into().into_bytes() }
    }
}

async fn handle(mut stream: TcpStream, state: &HttpState) -> anyhow::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let head = tokio::time::timeout(READ_TIMEOUT, async {
        let mut chunk = [0u8; 1024];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > MAX_REQUEST {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    let resp = match head {
        Err(_) => Response::text(408, "request timeout\n"),
        Ok(Err(e)) => return Err(e.into()),
        Ok(Ok(())) if buf.len() > MAX_REQUEST => Response::text(431, "request too large\n"),
        Ok(Ok(())) => match parse_request(&String::from_utf8_lossy(&buf)) {
            None => Response::text(400, "bad request\n"),
            Some(req) => route(&req, state).await,
        },
    };
    let reason = match resp.code {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        resp.code,
        resp.content_type,
        resp.body.len()
    );
    tokio::time::timeout(READ_TIMEOUT, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&resp.body).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| anyhow::anyhow!("client did not take the answer within {} s", READ_TIMEOUT.as_secs()))??;
    Ok(())
}

async fn route(req: &Request, state: &HttpState) -> Response {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/") => {
            Response { code: 200, content_type: "text/html; charset=utf-8", body: PAGE.as_bytes().to_vec() }
        }
        ("GET", "/status") => match status_doc(state).await {
            Some(doc) => match serde_json::to_vec_pretty(&doc) {
                Ok(body) => Response { code: 200, content_type: "application/json", body },
                Err(e) => Response::text(503, format!("encoding status: {e}\n")),
            },
            None => Response::text(503, "status actor stopped\n"),
        },
        ("GET", "/metrics") => match state.status.snapshot().await {
            Some(s) => Response {
                code: 200,
                content_type: crate::ops::metrics::CONTENT_TYPE,
                body: crate::ops::metrics::metrics_text(&s, state.faults.as_ref()).into_bytes(),
            },
            None => Response::text(503, "status actor stopped\n"),
        },
        ("POST", p) if p.starts_with("/control/") => {
            if !state.control {
                return Response::text(403, "control endpoint disabled (start the node with --control)\n");
            }
            match control(p, &req.query, state).await {
                Ok(msg) => {
                    info!(path = p, query = ?req.query, "control: {msg}");
                    Response::text(200, format!("{msg}\n"))
                }
                Err(e) => Response::text(400, format!("{e:#}\n")),
            }
        }
        (_, "/" | "/status" | "/metrics") => Response::text(405, "use GET\n"),
        _ => Response::text(404, "not found: try /, /status or /metrics\n"),
    }
}

fn param<'a>(query: &'a [(String, String)], key: &str) -> Option<&'a str> {
    query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

async fn control(path: &str, query: &[(String, String)], state: &HttpState) -> anyhow::Result<String> {
    let peer = || -> anyhow::Result<PeerId> {
        let p = param(query, "peer").context("missing ?peer=<peer id>")?;
        p.parse().with_context(|| format!("`{p}` is not a peer id"))
    };
    match path {
        "/control/fault" => {
            let mut done = Vec::new();
            if let Some(v) = param(query, "serve_delay_ms") {
                let ms: u64 = v.parse().with_context(|| format!("serve_delay_ms `{v}` is not a whole number"))?;
                state.faults.set_serve_delay_ms(ms);
                done.push(format!("serve delay {ms} ms"));
            }
            if let Some(v) = param(query, "slowdown") {
                let f: f64 = v.parse().with_context(|| format!("slowdown `{v}` is not a number"))?;
                state.faults.set_slowdown(f).map_err(|e| anyhow::anyhow!(e))?;
                done.push(format!("slowdown {f}x"));
            }
            anyhow::ensure!(!done.is_empty(), "give serve_delay_ms and/or slowdown");
            Ok(done.join(", "))
        }
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
                tokio::spawn(async move {
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

/// The status page: plain HTML and a little JavaScript, no external assets.
const PAGE: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shoal node</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.3em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.err{color:#b00}progress{width:20em}
</style></head><body>
<h1>shoal node <span id="name"></span></h1>
<p><progress id="bar" max="1" value="0"></progress> <span id="steps"></span></p>
<table id="me"></table>
<h2>Peers</h2><table id="peers"></table>
<p id="err" class="err"></p>
<script>
function row(k,v){return '<tr><th>'+k+'</th><td>'+v+'</td></tr>'}
function fmt(x,d){return x==null?'-':(typeof x=='number'?x.toFixed(d):x)}
async function tick(){
 try{
  const s=await (await fetch('/status',{cache:'no-store'})).json();
  document.getElementById('name').textContent=s.name+' ('+s.peer_id.slice(-6)+')';
  document.getElementById('bar').max=s.total_steps;document.getElementById('bar').value=s.step;
  document.getElementById('steps').textContent='step '+s.step+' / '+s.total_steps;
  document.getElementById('me').innerHTML=
   row('role',s.role)+row('owned shards',s.owned_shards.join(', ')||'-')+
   row('model version',s.model_version)+row('samples/s',fmt(s.samples_per_sec,1))+
   row('loss',fmt(s.last_loss,4))+row('test accuracy',s.last_accuracy==null?'-':(100*s.last_accuracy).toFixed(2)+'%')+(s.last_bits_per_byte==null?'':row('bits/byte',s.last_bits_per_byte.toFixed(3)))+
   row('push / pull latency (ms)',fmt(s.push_latency_ms,2)+' / '+fmt(s.pull_latency_ms,2))+
   row('bytes out / in',s.bytes_out+' / '+s.bytes_in)+
   row('handoffs out / in',s.handoffs_out+' / '+s.handoffs_in)+
   row('aggregators in the placement',s.aggregators)+
   row('faults','serve delay '+s.serve_delay_ms+' ms, slowdown '+s.slowdown+'x')+
   row('memory (now / peak)',s.rss_bytes==null?'-':(s.rss_bytes/1048576).toFixed(1)+' / '+(s.peak_rss_bytes/1048576).toFixed(1)+' MiB')+
   row('compression (push / pull)',(s.compress_push||'-')+' / '+(s.compress_pull||'-')+', residuals '+s.residual_bytes+' B')+
   row('suspects (named by)',Object.entries(s.suspected_by).map(([p,by])=>p.slice(-6)+' ('+by.map(b=>b.slice(-6)).join(', ')+')').join('<br>')||'-')+
   row('listen',s.listen.join('<br>'));
  document.getElementById('peers').innerHTML='<tr><th>peer</th><th>role</th><th>step</th><th>shards</th><th>last seen</th></tr>'+
   s.peers.map(p=>'<tr><td>'+p.peer_id.slice(-6)+'</td><td>'+p.role+'</td><td>'+p.step+'</td><td>'+
   (p.owned_shards.join(', ')||'-')+'</td><td>'+p.last_seen_ms_ago+' ms ago</td></tr>').join('');
  document.getElementById('err').textContent='';
 }catch(e){document.getElementById('err').textContent='node unreachable: '+e}
}
tick();setInterval(tick,1000);
</script></body></html>
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_parse_and_bad_ones_are_refused() {
        let r = parse_request("POST /control/unblock?peer=12D3&addr=%2Fip4%2F127.0.0.1%2Ftcp%2F1 HTTP/1.1\r\n\r\n");
        let Some(r) = r else { panic!("did not parse") };
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/control/unblock"));
        assert_eq!(param(&r.query, "addr"), Some("/ip4/127.0.0.1/tcp/1"));
        assert_eq!(param(&r.query, "peer"), Some("12D3"));
        assert_eq!(parse_request("GET /\r\n"), None);
        assert_eq!(parse_request(""), None);
        assert_eq!(percent_decode("a%2"), "a%2", "a truncated escape is kept as is");
    }
}
