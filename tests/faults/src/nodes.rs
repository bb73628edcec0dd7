//! Private brokers for the restart fault, so the shared brokers other tests
//! use are never restarted: a `nats-server` on a free port with its own
//! JetStream directory, and a RabbitMQ node of its own (name, ports, data
//! and log directories, no plugins), and a Postgres server of its own
//! ([`PgServer`]). Plus `rabbitmqctl` helpers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

#[cfg(feature = "postgres-queue")]
pub(crate) use jobrail_conformance::servers::PgServer;
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
