//! Private brokers for the restart fault, so the shared brokers other tests
//! use are never restarted: a `nats-server` on a free port with its own
//! JetStream directory, and a RabbitMQ node of its own (name, ports, data
//! and log directories, no plugins), and a Postgres server of its own
//! ([`PgServer`]). Plus `rabbitmqctl` helpers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

pub(crate) use jobrail_conformance::servers::{free_port, port_open, wait_port, NatsServer};

/// Runs `rabbitmqctl` (on `node` if given), its output kept out of the
/// logs (it may echo what it was given). Errors name the command, not its
/// arguments.
pub(crate) fn rabbitmqctl(node: Option<&str>, args: &[&str]) -> Result<(), String> {
    let mut cmd = Command::new("rabbitmqctl");
    if let Some(node) = node {
        cmd.args(["-n", node]);
    }
    let out = cmd
        .arg("-q")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run rabbitmqctl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "rabbitmqctl {} failed ({})",
            args.first().copied().unwrap_or_default(),
            out.status
        ))
    }
}

/// A RabbitMQ user for the run, with a random password.
pub(crate) struct RabbitUser {
    /// Its name.
    pub(crate) name: String,
    /// Its password.
    pub(crate) password: String,
    node: Option<String>,
}

impl RabbitUser {
    /// Creates `name` on `node` (the default node if `None`) with full
    /// permissions on `/`.
    pub(crate) fn create(node: Option<&str>, name: &str, password: &str) -> Result<Self, String> {
        rabbitmqctl(node, &["add_user", name, password])?;
        rabbitmqctl(
            node,
            &["set_permissions", "-p", "/", name, ".*", ".*", ".*"],
        )?;
        Ok(RabbitUser {
            name: name.into(),
            password: password.into(),
            node: node.map(str::to_string),
        })
    }

    /// An AMQP URL with this user's credentials on `port`.
    pub(crate) fn url(&self, port: u16) -> String {
        format!(
            "amqp://{}:{}@127.0.0.1:{port}/%2f",
            self.name, self.password
        )
    }
}

impl Drop for RabbitUser {
    fn drop(&mut self) {
        let _ = rabbitmqctl(self.node.as_deref(), &["delete_user", &self.name]);
    }
}

/// A private RabbitMQ node.
pub(crate) struct RabbitNode {
    /// Its node name (`faults-<run>@localhost`).
    pub(crate) name: String,
    /// Its AMQP port.
    pub(crate) port: u16,
    running: bool,
}

impl RabbitNode {
    /// Starts a node of its own under `dir`; waits up to 30 s for it.
    pub(crate) async fn start(run: &str, dir: &Path) -> Result<Self, String> {
        let name = format!("faults-{run}@localhost");
        let port = free_port();
        let mut dist = free_port();
        while dist == port {
            dist = free_port();
        }
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let plugins = dir.join("enabled_plugins");
        std::fs::write(&plugins, "").map_err(|e| e.to_string())?;
        let conf = dir.join("rabbitmq.conf");
        // The machine's rabbitmq.conf names the shared node's listener: a
        // config file of its own replaces it.
        std::fs::write(&conf, format!("listeners.tcp.local = 127.0.0.1:{port}\n"))
            .map_err(|e| e.to_string())?;
        // The server drops to the rabbitmq user: it must be able to write here.
        let _ = Command::new("chmod")
            .arg("-R")
            .arg("a+rwX")
            .arg(dir)
            .status();
        let status = Command::new("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &name)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_CONFIG_FILE", &conf)
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", &plugins)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("cannot run rabbitmq-server: {e}"))?;
        if !status.success() {
            return Err(format!("rabbitmq-server -detached failed ({status})"));
        }
        let node = RabbitNode {
            name,
            port,
            running: true,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if rabbitmqctl(Some(&node.name), &["await_startup", "-t", "1"]).is_ok()
                && port_open(port)
            {
                return Ok(node);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Err(format!(
            "the private RabbitMQ node {} did not start within 30 s (see its log under {})",
            node.name,
            dir.display()
        ))
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        if self.running {
            let _ = rabbitmqctl(Some(&self.name), &["stop"]);
            self.running = false;
        }
    }
}

/// A private Postgres server for the restart fault (the shared one on 5432
/// is never restarted): `initdb` into a directory of its own (trust
/// authentication, fsync off), a free port, its socket in that directory.
/// Run as the `postgres` user when the suite runs as root (`runuser`).
#[cfg(feature = "postgres-queue")]
pub(crate) struct PgServer {
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    /// Its port on 127.0.0.1.
    pub(crate) port: u16,
    as_postgres: bool,
    running: bool,
}

#[cfg(feature = "postgres-queue")]
impl PgServer {
    /// The directory of the server's binaries: the newest
    /// `/usr/lib/postgresql/*/bin` with `initdb`, else `pg_config --bindir`.
    pub(crate) fn bin_dir() -> Option<std::path::PathBuf> {
        let mut found: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
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
        let bin = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        bin.join("initdb").exists().then_some(bin)
    }

    /// Creates the cluster under `dir` (removed first) and starts it.
    pub(crate) async fn start(dir: &Path) -> Result<Self, String> {
        let bin = Self::bin_dir().ok_or(
            "no Postgres server binaries (initdb) under /usr/lib/postgresql/*/bin or pg_config --bindir",
        )?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // Root cannot run the server: then it runs as `postgres`.
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
        server.up().await?;
        Ok(server)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The server's log file.
    pub(crate) fn log(&self) -> std::path::PathBuf {
        self.dir.join("server.log")
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

    /// Starts the server and waits (30 s at most) until it accepts
    /// connections.
    pub(crate) async fn up(&mut self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100",
            self.port,
            self.dir.display()
        );
        let (data, log) = (self.data(), self.log().display().to_string());
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-w", "-t", "30", "-o", &options, "start",
            ],
        )?;
        self.running = true;
        if wait_port(self.port, Duration::from_secs(30)).await {
            Ok(())
        } else {
            Err("the private Postgres server did not listen".into())
        }
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: no checkpoint,
    /// every connection cut; the next start recovers from the WAL).
    pub(crate) async fn down(&mut self) -> Result<(), String> {
        let data = self.data();
        self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])?;
        self.running = false;
        Ok(())
    }
}

#[cfg(feature = "postgres-queue")]
impl Drop for PgServer {
    fn drop(&mut self) {
        if self.running {
            let data = self.data();
            let _ = self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
