//! A node's shutdown: however it ends (it finishes, leaves, is killed, or
//! fails to start), none of its tasks is left running and its ports are
//! free. Each scenario runs one real node (loopback TCP, real training on
//! the embedded digits data set) in a runtime of its own, so the runtime's
//! count of live tasks is the node's alone. The runtime has one thread: a
//! task that has ended is released before the task waiting on it runs
//! again, so the count is exact the moment the node's task has returned.

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::Context;
use shoal_models::OptimizerKind;
use shoal_node::cluster::ClusterSpec;
use shoal_node::config::NodeConfig;
use shoal_node::node::{start, NodeReport, RunningNode};
use shoal_node::policy::sync::SyncPolicy;
use shoal_protocol::libp2p::identity::Keypair;
use shoal_protocol::libp2p::multiaddr::Protocol;
use shoal_protocol::libp2p::Multiaddr;
use shoal_tests::digits_config;

/// The longest any one wait may take before the test fails.
const BOUND: Duration = Duration::from_secs(120);

/// One node alone (it is its own roster): digits, BSP, loopback TCP on a
/// free port, the HTTP endpoint on a free port with control on.
fn one_node(run: &str, steps: u64) -> anyhow::Result<NodeConfig> {
    let mut c =
        ClusterSpec::new(1, digits_config(run, steps, SyncPolicy::Bsp, OptimizerKind::Sgd, 0.1)).node_config(0)?;
    c.http.control = true;
    Ok(c)
}

/// Run `scenario` in a runtime of its own, one thread, as a node's process would.
fn in_own_runtime<F: Future<Output = anyhow::Result<()>>>(scenario: F) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(scenario)
}

fn live_tasks() -> usize {
    tokio::runtime::Handle::current().metrics().num_alive_tasks()
}

/// The node's libp2p TCP address as a socket address.
fn tcp_addr(a: &Multiaddr) -> anyhow::Result<SocketAddr> {
    let (mut ip, mut port) = (None, None);
    for p in a.iter() {
        match p {
            Protocol::Ip4(v) => ip = Some(std::net::IpAddr::V4(v)),
            Protocol::Tcp(v) => port = Some(v),
            _ => {}
        }
    }
    Ok(SocketAddr::new(ip.context("no ip4")?, port.context("no tcp port")?))
}

/// The node's ports: its libp2p TCP listener and its HTTP endpoint.
fn ports(node: &RunningNode) -> anyhow::Result<[SocketAddr; 2]> {
    let tcp = tcp_addr(node.listen.first().context("no listen address")?)?;
    Ok([tcp, node.http.context("no HTTP endpoint")?])
}

/// What must hold once a node is gone: the runtime holds no more tasks
/// than before it started, and each of its ports can be bound again.
fn assert_gone(before: usize, ports: &[SocketAddr]) -> anyhow::Result<()> {
    let left = live_tasks().saturating_sub(before);
    anyhow::ensure!(left == 0, "{left} of the node's tasks are still running after it stopped");
    for addr in ports {
        TcpListener::bind(addr).with_context(|| format!("the node's port {addr} is still taken"))?;
    }
    Ok(())
}

/// Wait for the node's task, bounded.
async fn join(node: RunningNode) -> anyhow::Result<NodeReport> {
    tokio::time::timeout(BOUND, node.task).await.context("the node did not end in time")?.context("node panicked")?
}

/// An HTTP request on a blocking thread (the node serves on this runtime's
/// only thread): the status code and the body.
async fn http(addr: SocketAddr, method: &'static str, path: &'static str) -> anyhow::Result<(u16, String)> {
    tokio::task::spawn_blocking(move || shoal_testnet::http::request(addr, method, path, Duration::from_secs(30)))
        .await?
}

/// Wait until the node has trained `step` steps.
async fn until_step(node: &mut RunningNode, step: u64) -> anyhow::Result<()> {
    tokio::time::timeout(BOUND, node.progress.wait_for(|s| s.step >= step))
        .await
        .context("the node did not train in time")?
        .context("the node's progress stopped")?;
    Ok(())
}

#[test]
fn a_finished_node_leaves_no_task_and_frees_its_ports() -> anyhow::Result<()> {
    in_own_runtime(async {
        let before = live_tasks();
        let node = start(one_node("shutdown-finish", 5)?, Keypair::generate_ed25519()).await?;
        let ports = ports(&node)?;
        let report = join(node).await?;
        assert_eq!((report.steps, report.left), (5, false));
        assert_gone(before, &ports)
    })
}

#[test]
fn a_node_that_leaves_early_leaves_no_task_and_frees_its_ports() -> anyhow::Result<()> {
    in_own_runtime(async {
        let before = live_tasks();
        let mut node = start(one_node("shutdown-leave", 10_000)?, Keypair::generate_ed25519()).await?;
        let ports = ports(&node)?;
        until_step(&mut node, 2).await?;
        // The endpoint answers while the node runs. (These probes once ran
        // against a node of 5 steps: it could finish, and close its
        // endpoint, between two of them.)
        let (code, body) = http(ports[1], "GET", "/status").await?;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("\"total_steps\": 10000"), "{body}");
        let (code, body) = http(ports[1], "GET", "/metrics").await?;
        assert_eq!(code, 200, "{body}");
        assert_eq!(http(ports[1], "POST", "/status").await?, (405, "use GET\n".into()));
        assert_eq!(
            http(ports[1], "GET", "/nope").await?,
            (404, "not found: try /, /status, /history or /metrics\n".into())
        );
        assert_eq!(
            http(ports[1], "POST", "/control/fault?serve_delay_ms=abc").await?,
            (400, "serve_delay_ms `abc` is not a whole number: invalid digit found in string\n".into())
        );
        assert_eq!(
            http(ports[1], "POST", "/control/fault?serve_delay_ms=0").await?,
            (200, "serve delay 0 ms\n".into())
        );
        node.leave();
        let report = join(node).await?;
        assert!(report.left && report.steps < 10_000, "left at step {}", report.steps);
        assert_gone(before, &ports)
    })
}

/// Clients that connect and send nothing take every connection slot: each
/// loses its connection within `REQUEST_TIMEOUT` of connecting, and a
/// request that waited behind them is answered. (Before the timeout it
/// waited for as long as they held their connections: its 30 s client
/// timeout failed the test.)
#[test]
fn clients_that_send_nothing_lose_their_connections_and_the_endpoint_answers() -> anyhow::Result<()> {
    use shoal_node::ops::http::{MAX_CONNECTIONS, REQUEST_TIMEOUT};
    use std::io::Read;
    in_own_runtime(async {
        let node = start(one_node("http-idle", 100_000)?, Keypair::generate_ed25519()).await?;
        let addr = ports(&node)?[1];
        let idle = tokio::task::spawn_blocking(move || {
            (0..MAX_CONNECTIONS).map(|_| std::net::TcpStream::connect(addr)).collect::<std::io::Result<Vec<_>>>()
        })
        .await??;
        let asked = std::time::Instant::now();
        let (code, body) = http(addr, "GET", "/status").await?;
        let waited = asked.elapsed();
        assert_eq!(code, 200, "{body}");
        eprintln!("answered {waited:?} after every slot was taken by a silent client");
        // Each silent client finds its connection closed by the node: end
        // of stream or a reset, not bytes and not its own read timeout.
        let closed = tokio::task::spawn_blocking(move || -> anyhow::Result<usize> {
            let mut closed = 0;
            for mut s in idle {
                s.set_read_timeout(Some(REQUEST_TIMEOUT * 3))?;
                let mut byte = [0u8; 1];
                match s.read(&mut byte) {
                    Ok(0) => closed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
                    Ok(_) => anyhow::bail!("a silent client was sent bytes"),
                    Err(e) => anyhow::bail!("a silent client's connection stayed open: {e}"),
                }
            }
            Ok(closed)
        })
        .await??;
        assert_eq!(closed, MAX_CONNECTIONS);
        node.leave();
        join(node).await?;
        Ok(())
    })
}

/// `GET /history` of a running node: its points grow as it trains, in
/// step order, and its events hold the role it took at the start.
#[test]
fn the_history_grows_while_a_node_trains() -> anyhow::Result<()> {
    in_own_runtime(async {
        let mut node = start(one_node("history", 10_000)?, Keypair::generate_ed25519()).await?;
        let ports = ports(&node)?;
        let read = |body: String| -> anyhow::Result<serde_json::Value> { Ok(serde_json::from_str(&body)?) };
        let steps = |doc: &serde_json::Value| -> Vec<u64> {
            doc["points"].as_array().map(|p| p.iter().filter_map(|p| p["step"].as_u64()).collect()).unwrap_or_default()
        };
        until_step(&mut node, 20).await?;
        let (code, body) = http(ports[1], "GET", "/history").await?;
        assert_eq!(code, 200, "{body}");
        let first = read(body)?;
        until_step(&mut node, 80).await?;
        let (code, body) = http(ports[1], "GET", "/history").await?;
        assert_eq!(code, 200, "{body}");
        let second = read(body)?;
        node.leave();
        join(node).await?;
        let (a, b) = (steps(&first), steps(&second));
        eprintln!("history: {} points to step {:?}, then {} to step {:?}", a.len(), a.last(), b.len(), b.last());
        assert!(a.len() >= 15, "{} points after 20 steps", a.len());
        assert!(b.len() > a.len() && b.last() > a.last(), "the history did not grow: {a:?} then {b:?}");
        assert!(b.windows(2).all(|w| w[0] < w[1]), "points out of step order: {b:?}");
        let point = &second["points"][0];
        for key in ["t", "step", "loss", "samples_per_sec", "bytes_out", "bytes_in", "owned_shards", "role"] {
            assert!(point.get(key).is_some(), "a point has no `{key}`: {point}");
        }
        let kinds: Vec<&str> =
            second["events"].as_array().into_iter().flatten().filter_map(|e| e["kind"].as_str()).collect();
        assert!(kinds.iter().any(|k| ["role", "promoted"].contains(k)), "no role event: {}", second["events"]);
        // The ownership timeline: a lone node owns every shard, from its
        // first placement on, and names itself.
        let me = second["peer_id"].as_str().context("no peer_id")?;
        assert_eq!(second["peers"], serde_json::json!([me]), "the timeline's peers: {}", second["peers"]);
        let marks = second["ownership"].as_array().context("no ownership timeline")?;
        assert_eq!(marks.len(), 1, "a lone node's owners never change: {marks:?}");
        let owners = marks[0]["owners"].as_array().context("no owners")?;
        assert_eq!(owners.len(), 8, "one owner per shard: {owners:?}");
        assert!(owners.iter().all(|o| o == 0), "every shard is this node's: {owners:?}");
        Ok(())
    })
}

/// Chromium for the page test: `SHOAL_CHROMIUM`, or `chromium`,
/// `chromium-browser` or `google-chrome` on the PATH.
fn chromium() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("SHOAL_CHROMIUM") {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| ["chromium", "chromium-browser", "google-chrome"].map(|b| d.join(b)))
        .find(|p| p.is_file())
}

/// Run headless Chromium on the page at `url` with `args` (bounded by
/// [`BOUND`]); returns its stdout. Its profile goes in `profile`.
async fn headless(
    bin: &std::path::Path,
    profile: &std::path::Path,
    url: &str,
    args: &[&str],
) -> anyhow::Result<String> {
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        // A container's /dev/shm may be 64 MiB: Chromium then crashes without this.
        .arg("--disable-dev-shm-usage")
        // Nothing leaves the machine: every host name but loopback fails to
        // resolve (the page is on 127.0.0.1 and loads nothing else).
        .args([
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--no-pings",
            "--disable-domain-reliability",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--window-size=1200,1400", "--virtual-time-budget=5000"])
        .args(args)
        .arg(url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    match tokio::time::timeout(BOUND, tokio::task::spawn_blocking(move || child.wait_with_output())).await {
        Ok(out) => {
            let out = out??;
            anyhow::ensure!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        }
        Err(_) => {
            let _ = std::process::Command::new("kill").arg("-9").arg(pid.to_string()).status();
            anyhow::bail!("chromium did not finish within {BOUND:?}")
        }
    }
}

/// The `d` of the loss chart's line in a dumped page.
fn loss_line(dom: &str) -> Option<String> {
    let chart = dom.split_once("id=\"chart-loss\"")?.1.split("</svg>").next()?;
    let d = chart.split_once("class=\"line\" d=\"")?.1.split('"').next()?;
    Some(d.to_string())
}

/// The status page in headless Chromium: its charts are drawn from
/// `/history`, they change as the node trains, and the screenshot is not
/// blank. Skips without Chromium unless `SHOAL_REQUIRE_CHROMIUM=1` (CI).
#[test]
fn the_status_page_draws_its_charts_in_headless_chromium() -> anyhow::Result<()> {
    let Some(bin) = chromium() else {
        anyhow::ensure!(
            std::env::var_os("SHOAL_REQUIRE_CHROMIUM").is_none(),
            "SHOAL_REQUIRE_CHROMIUM is set and no chromium was found"
        );
        eprintln!("skipped: no chromium (apt-get install chromium, or set SHOAL_CHROMIUM)");
        return Ok(());
    };
    in_own_runtime(async {
        let dir = tempfile::tempdir()?;
        let mut node = start(one_node("page", 100_000)?, Keypair::generate_ed25519()).await?;
        let url = format!("http://{}/", ports(&node)?[1]);
        until_step(&mut node, 20).await?;
        let first = headless(&bin, dir.path(), &url, &["--dump-dom"]).await?;
        until_step(&mut node, 200).await?;
        let second = headless(&bin, dir.path(), &url, &["--dump-dom"]).await?;
        let shot = dir.path().join("page.png");
        headless(&bin, dir.path(), &url, &[&format!("--screenshot={}", shot.display())]).await?;
        node.leave();
        join(node).await?;
        for id in ["chart-loss", "chart-throughput", "chart-bytes", "chart-shards"] {
            assert!(second.contains(&format!("id=\"{id}\"")), "no {id} in the page");
        }
        let (a, b) = (loss_line(&first), loss_line(&second));
        eprintln!(
            "page: loss line of {} then {} characters",
            a.as_ref().map_or(0, String::len),
            b.as_ref().map_or(0, String::len)
        );
        let (a, b) = (a.context("the first load drew no loss line")?, b.context("the second load drew no loss line")?);
        assert!(a.starts_with('M') && a.contains('L'), "not a line: {a}");
        assert_ne!(a, b, "the loss chart did not change between two loads");
        assert!(
            second.contains("class=\"owned mine\""),
            "the shard timeline has no bar of this node's (a lone node owns every shard)"
        );
        assert!(second.contains("(this node)"), "the shard timeline's legend does not name this node");
        // The screenshot: a page with charts, not a blank one.
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot)?));
        let mut reader = decoder.read_info()?;
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf)?;
        let px = info.color_type.samples();
        let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(px).collect();
        let ink = pixels.iter().filter(|p| p.iter().take(3).any(|&c| c < 200)).count();
        let colours: std::collections::BTreeSet<[u8; 3]> = pixels.iter().map(|p| [p[0], p[1], p[2]]).collect();
        eprintln!(
            "page: {}x{}, {ink} of {} pixels inked, {} colours",
            info.width,
            info.height,
            pixels.len(),
            colours.len()
        );
        assert!(ink * 100 > pixels.len(), "the screenshot is nearly blank: {ink} of {} pixels inked", pixels.len());
        assert!(colours.len() >= 8, "the screenshot has {} colours", colours.len());
        Ok(())
    })
}

#[test]
fn a_killed_node_leaves_no_task_and_frees_its_ports() -> anyhow::Result<()> {
    in_own_runtime(async {
        let before = live_tasks();
        let mut node = start(one_node("shutdown-kill", 10_000)?, Keypair::generate_ed25519()).await?;
        let ports = ports(&node)?;
        until_step(&mut node, 2).await?;
        tokio::time::timeout(BOUND, node.kill()).await.context("the kill did not end in time")?;
        assert_gone(before, &ports)
    })
}

#[test]
fn a_node_that_fails_to_start_leaves_no_task_and_frees_its_ports() -> anyhow::Result<()> {
    in_own_runtime(async {
        // Its HTTP port is taken: the start fails at the last thing it
        // builds, with every actor already running.
        let taken = TcpListener::bind("127.0.0.1:0")?;
        let tcp = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut c = one_node("shutdown-fail", 5)?;
        c.network.listen = vec![format!("/ip4/127.0.0.1/tcp/{}", tcp.port()).parse()?];
        c.http.listen = taken.local_addr()?.to_string();
        let before = live_tasks();
        let started = tokio::time::timeout(BOUND, start(c, Keypair::generate_ed25519())).await?;
        let Err(e) = started else { anyhow::bail!("the node started on a port already taken") };
        assert!(format!("{e:#}").contains("binding the HTTP endpoint"), "{e:#}");
        assert_gone(before, &[tcp])
    })
}
