//! A private Postgres server for a bench, so that its figures come from a
//! server with the stock configuration (autovacuum on, fsync on) rather
//! than the machine's shared one (whose CI configuration turns autovacuum
//! off), and so that nothing else runs on it: `initdb` into a directory of
//! its own (trust authentication), `pg_ctl start` on a free port of
//! 127.0.0.1 with its socket in that directory and no setting changed. As
//! the `postgres` user (`runuser`) when the bench runs as root. Dropping it
//! stops the server (`pg_ctl stop -m fast`) and removes the directory.
//!
//! The same approach as the fault suite's `PgServer`
//! (`tests/faults/src/nodes.rs`), without its restarts or `fsync=off`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A running private server.
pub struct PgServer {
    dir: PathBuf,
    bin: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
    as_postgres: bool,
    running: bool,
}

/// A port nothing listens on now (the kernel's pick for port 0).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
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

    /// Creates a cluster in a fresh directory under the system's temporary
    /// directory and starts it with its defaults; waits (60 s at most) until
    /// it accepts connections.
    pub fn start(name: &str) -> Result<Self, String> {
        let bin = Self::bin_dir().ok_or(
            "no Postgres server binaries (initdb) under /usr/lib/postgresql/*/bin or pg_config --bindir",
        )?;
        let dir = std::env::temp_dir().join(format!("{name}-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // Root cannot run the server: then it runs as `postgres`.
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let as_postgres = uid == "0";
        let mut server = PgServer {
            dir,
            bin,
            port: free_port(),
            as_postgres,
            running: false,
        };
        if as_postgres {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&server.dir)
                .status()
                .map_err(|e| format!("cannot run chown: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "chown postgres {} failed ({status})",
                    server.dir.display()
                ));
            }
        }
        let data = server.data();
        // `--no-sync` only skips initdb's own final fsync of the new files;
        // the server then runs with fsync on, as configured by default.
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
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            server.port,
            server.dir.display()
        );
        let log = server.log().display().to_string();
        server.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-w", "-t", "60", "-o", &options, "start",
            ],
        )?;
        server.running = true;
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!(
                    "the private Postgres server did not listen on {} (see {})",
                    server.port,
                    server.log().display()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The server's log file.
    pub fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// Runs one of the server's programs (as `postgres` if root).
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

    /// Stops the server (`pg_ctl stop -m fast`) and removes its directory.
    pub fn stop(mut self) -> Result<(), String> {
        self.shut_down()
    }

    fn shut_down(&mut self) -> Result<(), String> {
        let result = if self.running {
            let data = self.data();
            self.running = false;
            self.run("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"])
        } else {
            Ok(())
        };
        let _ = std::fs::remove_dir_all(&self.dir);
        result
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.shut_down();
    }
}
