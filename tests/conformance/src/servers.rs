//! Private servers for tests that stop and restart a broker, so the shared
//! brokers other tests use are never touched: a `nats-server` with
//! JetStream on a free port and a directory of its own, a Postgres server
//! (`initdb` into a directory of its own), plus the process and port
//! helpers around them.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a loopback port")
}

/// Whether something accepts connections on loopback `port`.
pub fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
        .is_ok()
}

/// Waits up to `bound` for loopback `port` to accept connections.
pub async fn wait_port(port: u16, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if port_open(port) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Sends SIGTERM to every child, waits up to `grace` for them to exit, then
/// SIGKILLs the ones still running and reaps them all.
pub async fn terminate(children: &mut [Child], grace: Duration) {
    for child in children.iter() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }
    let deadline = Instant::now() + grace;
    for child in children.iter_mut() {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A private `nats-server` with JetStream, on a free loopback port, storing
/// under a directory of the caller's. It can be stopped and started again on
/// the same port and store; dropping it kills the process.
pub struct NatsServer {
    /// Its client port.
    pub port: u16,
    binary: PathBuf,
    dir: PathBuf,
    log: Option<PathBuf>,
    child: Option<Child>,
}

impl NatsServer {
    /// The `nats-server` binary: `NATS_SERVER`, else the first on `PATH`,
    /// else `/usr/sbin/nats-server` (where Debian installs it); `None` if
    /// none exists.
    pub fn binary() -> Option<PathBuf> {
        if let Some(path) = std::env::var_os("NATS_SERVER") {
            return Some(PathBuf::from(path));
        }
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("nats-server"))
                .find(|candidate| candidate.is_file())
        });
        on_path.or_else(|| {
            let fallback = Path::new("/usr/sbin/nats-server");
            fallback.is_file().then(|| fallback.to_path_buf())
        })
    }

    /// Starts one storing under `dir`, its output appended to `log` (or
    /// discarded), and waits until it accepts connections.
    pub async fn start(dir: &Path, log: Option<&Path>) -> Result<Self, String> {
        let binary =
            Self::binary().ok_or("nats-server is not installed (not on PATH nor in /usr/sbin)")?;
        let mut server = NatsServer {
            port: free_port(),
            binary,
            dir: dir.to_path_buf(),
            log: log.map(Path::to_path_buf),
            child: None,
        };
        server.up().await?;
        Ok(server)
    }

    /// Its client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the process on the same port and store and waits until
    /// it accepts connections.
    pub async fn up(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
        let output = match &self.log {
            Some(log) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .map_err(|e| e.to_string())?,
            ),
            None => Stdio::null(),
        };
        let child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(output)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        if wait_port(self.port, Duration::from_secs(15)).await {
            Ok(())
        } else {
            Err(format!(
                "the private nats-server did not listen on port {} within 15 s",
                self.port
            ))
        }
    }

    /// Stops the process (SIGTERM, SIGKILL after 5 s) and waits until the
    /// port is closed.
    pub async fn down(&mut self) {
        if let Some(child) = self.child.take() {
            terminate(&mut [child], Duration::from_secs(5)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while port_open(self.port) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the process (SIGKILL: no clean shutdown) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP relay from a loopback port of its own to `upstream`
/// (`host:port`): a broker as a client sees it, whose connections can be
/// cut and which can go away and come back on the same port, without
/// touching the broker other tests share. Dropped, it closes everything.
pub struct Relay {
    upstream: String,
    port: u16,
    cut: tokio::sync::watch::Sender<u64>,
    listening: Option<tokio::task::JoinHandle<()>>,
}

impl Relay {
    /// Starts relaying to `upstream`.
    pub async fn start(upstream: impl Into<String>) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("a bound address").port();
        let mut relay = Relay {
            upstream: upstream.into(),
            port,
            cut: tokio::sync::watch::channel(0).0,
            listening: None,
        };
        relay.listen(listener);
        relay
    }

    /// The `host:port` of `url` (`scheme://[credentials@]host:port[/path]`).
    pub fn address_of(url: &str) -> String {
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let rest = rest.rsplit('@').next().unwrap_or(rest);
        rest.split('/').next().unwrap_or(rest).to_string()
    }

    /// `url` with its host and port replaced by the relay's (scheme,
    /// credentials and path kept).
    pub fn url_for(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let (credentials, rest) = match rest.rsplit_once('@') {
            Some((credentials, rest)) => (format!("{credentials}@"), rest),
            None => (String::new(), rest),
        };
        let path = rest.find('/').map_or("", |i| &rest[i..]);
        let scheme = if scheme.is_empty() {
            String::new()
        } else {
            format!("{scheme}://")
        };
        format!("{scheme}{credentials}127.0.0.1:{}{path}", self.port)
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn listen(&mut self, listener: tokio::net::TcpListener) {
        let cuts = self.cut.clone();
        let upstream = self.upstream.clone();
        self.listening = Some(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cut = cuts.subscribe();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        }));
    }

    /// Drops every connection made so far; new ones are accepted.
    pub fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    /// Stops listening and drops every connection: nothing answers on the
    /// port until [`come_back`](Self::come_back).
    pub async fn go_down(&mut self) {
        if let Some(listening) = self.listening.take() {
            listening.abort();
            let _ = listening.await;
        }
        self.cut();
    }

    /// Listens on the same port again.
    pub async fn come_back(&mut self) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("bind the relay's port again");
        self.listen(listener);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(listening) = self.listening.take() {
            listening.abort();
        }
        self.cut();
    }
}

/// A private Postgres server: `initdb` into a directory of its own (trust
/// authentication), `pg_ctl start` on a free port of 127.0.0.1 with its
/// socket in that directory and the settings the caller gives (none: the
/// stock configuration). Its programs run as the `postgres` user
/// (`runuser`) when the caller is root, who cannot run the server.
/// Dropping it stops the server (`pg_ctl stop -m fast`) and removes the
/// directory. The fault suite restarts one; the history benchmark measures
/// on one with autovacuum on, whatever the shared server's configuration.
pub struct PgServer {
    dir: PathBuf,
    bin: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    settings: Vec<String>,
    as_postgres: bool,
    running: bool,
}

impl PgServer {
    /// The directory of the server's binaries: the newest
    /// `/usr/lib/postgresql/*/bin` with `initdb`, else `pg_config --bindir`.
    pub fn bin_dir() -> Option<PathBuf> {
        let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let version = e.file_name().to_string_lossy().parse().ok()?;
                let bin = e.path().join("bin");
                bin.join("initdb").exists().then_some((version, bin))
            })
            .collect();
        found.sort();
        if let Some((_, bin)) = found.pop() {
            return Some(bin);
        }
        let out = Command::new("pg_config").arg("--bindir").output().ok()?;
        let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        bin.join("initdb").exists().then_some(bin)
    }

    /// Creates a cluster under `dir` (removed first) and starts it with
    /// `settings` (`name=value`, each passed as `-c`), waiting until it
    /// accepts connections. `initdb --no-sync` only skips initdb's own final
    /// flush of the new files; the server's `fsync` is as configured.
    pub fn start(dir: &Path, settings: &[&str]) -> Result<Self, String> {
        let bin = Self::bin_dir().ok_or(
            "no Postgres server binaries (initdb) under /usr/lib/postgresql/*/bin or pg_config --bindir",
        )?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let as_postgres = uid == "0";
        if as_postgres {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir)
                .status()
                .map_err(|e| format!("cannot run chown: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "chown postgres {} failed ({status})",
                    dir.display()
                ));
            }
        }
        let mut server = PgServer {
            dir: dir.to_path_buf(),
            bin,
            port: free_port(),
            settings: settings.iter().map(|s| s.to_string()).collect(),
            as_postgres,
            running: false,
        };
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        )?;
        server.up()?;
        Ok(server)
    }

    /// A URL for its `postgres` database as the `postgres` user.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Its directory (data, socket and log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server's log file.
    pub fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// Runs one of the server's programs (as `postgres` if root), its
    /// output kept apart.
    fn run(&self, program: &str, args: &[&str]) -> Result<(), String> {
        let exe = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&exe);
            cmd
        } else {
            Command::new(&exe)
        };
        let out = cmd
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {program}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{program} {} failed ({}): {}",
                args.first().copied().unwrap_or_default(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Starts the server and waits (`pg_ctl -w`, 30 s at most) until it
    /// accepts connections.
    pub fn up(&mut self) -> Result<(), String> {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.dir.display()
        );
        for setting in &self.settings {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        let (data, log) = (self.data(), self.log().display().to_string());
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-w", "-t", "30", "-o", &options, "start",
            ],
        )?;
        self.running = true;
        if port_open(self.port) {
            Ok(())
        } else {
            Err(format!(
                "the private Postgres server did not listen on {} (see {})",
                self.port,
                self.log().display()
            ))
        }
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: no checkpoint,
    /// every connection cut; the next start recovers from the WAL).
    pub fn down(&mut self) -> Result<(), String> {
        self.stop_with("immediate")
    }

    /// Stops the server (`pg_ctl stop -m fast`) and removes its directory.
    pub fn stop(mut self) -> Result<(), String> {
        let result = self.stop_with("fast");
        let _ = std::fs::remove_dir_all(&self.dir);
        result
    }

    fn stop_with(&mut self, mode: &str) -> Result<(), String> {
        if !self.running {
            return Ok(());
        }
        let data = self.data();
        self.running = false;
        self.run("pg_ctl", &["-D", &data, "-m", mode, "-w", "stop"])
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.stop_with("fast");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
