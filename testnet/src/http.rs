//! A minimal blocking HTTP/1.1 client for talking to nodes on loopback
//! (`/status`, `/control/...`); every call is bounded by a timeout.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Largest answer read (a node's `/status` is a few KiB).
const MAX_ANSWER: usize = 1 << 20;

/// Send `method path` to `addr`; returns the status code and the body. The
/// whole exchange must finish within `timeout`.
pub fn request(addr: SocketAddr, method: &str, path: &str, timeout: Duration) -> anyhow::Result<(u16, String)> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connecting to {addr}"))?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{addr} did not answer within {} ms", timeout.as_millis());
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut chunk).with_context(|| format!("reading the answer from {addr}"))?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_ANSWER {
            bail!("{addr} sent more than {MAX_ANSWER} bytes");
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let Some((head, body)) = text.split_once("\r\n\r\n") else { bail!("{addr} sent no HTTP head") };
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("{addr} sent a bad status line"))?;
    Ok((code, body.to_string()))
}

/// GET a JSON document.
pub fn get_json(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<serde_json::Value> {
    let (code, body) = request(addr, "GET", path, timeout)?;
    if code != 200 {
        bail!("GET {path} on {addr}: {code} {}", body.trim());
    }
    serde_json::from_str(&body).with_context(|| format!("GET {path} on {addr}: not JSON"))
}

/// POST a control command; any answer but 200 is an error with the node's message.
pub fn post(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<String> {
    let (code, body) = request(addr, "POST", path, timeout)?;
    if code != 200 {
        bail!("POST {path} on {addr}: {code} {}", body.trim());
    }
    Ok(body.trim().to_string())
}

/// Percent-encode a query value.
pub fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
