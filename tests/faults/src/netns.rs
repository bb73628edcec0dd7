//! Hosts of the partition faults: network namespaces joined to the host by
//! veth pairs, and a forwarder of ours on the host side of each pair.
//!
//! Each [`Link`] is a namespace (`jrf-<pid>-<k>`) with one end of a veth
//! pair (`10.<net>.<k>.2/30`); the other end (`10.<net>.<k>.1/30`) stays on
//! the host. A process started with [`Link::command`] runs inside the
//! namespace: the only address it can reach besides its own loopback is the
//! host end of its pair, where the forwarder listens on the port of each
//! server (RabbitMQ, NATS, the SQS emulator, Postgres) and relays to the
//! server on the host's loopback. So every byte between a worker and its
//! servers crosses its own veth pair and the forwarder:
//!
//! - a clean partition sets the host end down ([`Net::cut`]): packets are
//!   dropped with no reset, and every connection through the link hangs;
//! - a slow link ([`Link::delay`]) holds each chunk for a set time before
//!   the forwarder writes it on, in both directions;
//! - a half-open connection ([`Link::half_open`]) stops forwarding from the
//!   server to the client on every connection open at that moment, while
//!   the client's bytes still reach the server (the kernel has no `netem`,
//!   so latency and one-way loss are the forwarder's).
//!
//! The namespaces are deleted when the [`Net`] is dropped (deleting a
//! namespace deletes its veth pair), and namespaces left by a suite that
//! was killed (their pid is gone) are deleted when the next one starts.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The prefix of every namespace the suite makes.
const PREFIX: &str = "jrf-";

/// Runs `ip` with `args`; an error names the command.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What the forwarder does on one link; shared with its connections.
pub(crate) struct LinkState {
    /// Each chunk's delay, in ms (0: none).
    delay_ms: AtomicU64,
    /// Connections numbered below this forward nothing from the server.
    half_open_below: AtomicU64,
    /// The next connection's number.
    next: AtomicU64,
    /// When the latest connection was accepted, in ms since `epoch`.
    last_accept_ms: AtomicU64,
    /// When the link was made.
    epoch: Instant,
}

impl LinkState {
    fn new() -> LinkState {
        LinkState {
            delay_ms: AtomicU64::new(0),
            half_open_below: AtomicU64::new(0),
            next: AtomicU64::new(0),
            last_accept_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// One namespace and its veth pair.
pub(crate) struct Link {
    /// The namespace's name.
    pub(crate) ns: String,
    /// The host end's interface.
    host_if: String,
    /// The host end's address (where the forwarder listens).
    pub(crate) host_ip: Ipv4Addr,
    state: Arc<LinkState>,
}

impl Link {
    /// A command that runs `program` inside the namespace.
    pub(crate) fn command(&self, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).arg(program);
        cmd
    }

    /// Delays every chunk by `delay` from now on (zero: no delay).
    pub(crate) fn delay(&self, delay: Duration) {
        self.state
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Stops forwarding from the servers to the namespace on every
    /// connection open now; connections made later pass both ways.
    pub(crate) fn half_open(&self) {
        let next = self.state.next.load(Ordering::SeqCst);
        self.state.half_open_below.store(next, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub(crate) fn connections(&self) -> u64 {
        self.state.next.load(Ordering::SeqCst)
    }

    /// When the latest connection was accepted (the link's making if none
    /// was).
    pub(crate) fn last_accept(&self) -> Instant {
        let ms = self.state.last_accept_ms.load(Ordering::SeqCst);
        self.state.epoch + Duration::from_millis(ms)
    }

    /// `url` with loopback replaced by this link's host end (what a process
    /// in the namespace connects to).
    pub(crate) fn rewrite(&self, url: &str) -> String {
        url.replace("127.0.0.1", &self.host_ip.to_string())
            .replace("localhost", &self.host_ip.to_string())
    }
}

/// The namespaces of one fault and their forwarders.
pub(crate) struct Net {
    /// The links, in the order asked for.
    pub(crate) links: Vec<Link>,
    forwarders: Vec<JoinHandle<()>>,
}

impl Net {
    /// Whether this machine lets the suite make namespaces (root, `ip`).
    pub(crate) fn available() -> Result<(), String> {
        let name = format!("{PREFIX}{}-probe", std::process::id());
        ip(&["netns", "add", &name]).map_err(|e| {
            format!("cannot create a network namespace (root and iproute2 are needed): {e}")
        })?;
        ip(&["netns", "del", &name])
    }

    /// Deletes the namespaces of suites that are no longer running.
    fn sweep() {
        let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
            return;
        };
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(name) = line.split_whitespace().next() else {
                continue;
            };
            let Some(rest) = name.strip_prefix(PREFIX) else {
                continue;
            };
            let pid = rest.split('-').next().unwrap_or_default();
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }

    /// A free second octet for `10.<net>.0.0/16`: none of the machine's
    /// addresses may be in it.
    fn free_net() -> Result<u8, String> {
        let out = Command::new("ip")
            .args(["-o", "-4", "addr", "show"])
            .output()
            .map_err(|e| format!("cannot run ip: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let start = (std::process::id() % 60) as u8;
        (0..60u8)
            .map(|i| 190 + (start + i) % 60)
            .find(|net| !text.contains(&format!(" 10.{net}.")))
            .ok_or_else(|| "no free 10.x.0.0/16 for the namespaces".to_string())
    }

    /// `n` namespaces, each joined to the host by a veth pair, with a
    /// forwarder on each host end for every port of `ports` (to the same
    /// port on the host's loopback).
    pub(crate) async fn create(n: usize, ports: &[u16]) -> Result<Net, String> {
        Self::sweep();
        let pid = std::process::id();
        let net = Self::free_net()?;
        let mut built = Net {
            links: vec![],
            forwarders: vec![],
        };
        for k in 0..n {
            let ns = format!("{PREFIX}{pid}-{k}");
            let host_if = format!("jrf{pid}h{k}");
            let peer_if = format!("jrf{pid}n{k}");
            let host_ip = Ipv4Addr::new(10, net, k as u8, 1);
            let ns_ip = Ipv4Addr::new(10, net, k as u8, 2);
            ip(&["netns", "add", &ns])?;
            // Pushed at once, so that Drop deletes it whatever fails next.
            built.links.push(Link {
                ns: ns.clone(),
                host_if: host_if.clone(),
                host_ip,
                state: Arc::new(LinkState::new()),
            });
            ip(&[
                "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
            ])?;
            ip(&["link", "set", &peer_if, "netns", &ns])?;
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])?;
            ip(&["link", "set", &host_if, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ns_ip}/30"),
                "dev",
                &peer_if,
            ])?;
            ip(&["-n", &ns, "link", "set", &peer_if, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        for link in &built.links {
            for &port in ports {
                let listener = TcpListener::bind((link.host_ip, port)).await.map_err(|e| {
                    format!(
                        "the forwarder cannot listen on {}:{port}: {e}",
                        link.host_ip
                    )
                })?;
                built
                    .forwarders
                    .push(tokio::spawn(forward(listener, port, link.state.clone())));
            }
        }
        Ok(built)
    }

    /// A clean partition of link `k`: its host end goes down; packets are
    /// dropped, nothing is reset.
    pub(crate) fn cut(&self, k: usize) -> Result<(), String> {
        ip(&["link", "set", &self.links[k].host_if, "down"])
    }

    /// Heals link `k` (its host end up again, its address routed again).
    pub(crate) fn heal(&self, k: usize) -> Result<(), String> {
        ip(&["link", "set", &self.links[k].host_if, "up"])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for forwarder in &self.forwarders {
            forwarder.abort();
        }
        for link in &self.links {
            let _ = ip(&["netns", "del", &link.ns]);
            // Normally gone with the namespace; not if the pair was made
            // but not yet moved into it.
            let _ = Command::new("ip")
                .args(["link", "del", &link.host_if])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Accepts connections on `listener` and relays each to loopback `port`.
async fn forward(listener: TcpListener, port: u16, state: Arc<LinkState>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let number = state.next.fetch_add(1, Ordering::SeqCst);
        state.last_accept_ms.store(state.now_ms(), Ordering::SeqCst);
        let state = state.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let up = pump(client_read, server_write, state.clone(), None);
            let down = pump(server_read, client_write, state, Some(number));
            // Either direction ending (end of stream, an error) closes both.
            tokio::select! {
                _ = up => {}
                _ = down => {}
            }
        });
    }
}

/// Copies `from` to `to`, each chunk held for the link's delay; with
/// `number` (the server-to-client direction of that connection), stops
/// forwarding once the link makes that connection half-open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<LinkState>,
    number: Option<u64>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let half_open = |state: &LinkState| {
        number.is_some_and(|n| n < state.half_open_below.load(Ordering::SeqCst))
    };
    let writer_state = state.clone();
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if half_open(&writer_state) {
                // One direction dead for good: hold the connection open,
                // forward nothing more.
                std::future::pending::<()>().await;
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let delay = Duration::from_millis(state.delay_ms.load(Ordering::SeqCst));
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    // The writer drains what the reader queued after the reader ends.
    let (_, ()) = tokio::join!(reader, writer);
}
