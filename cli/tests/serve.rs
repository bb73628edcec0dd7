//! `jobrail serve` as a user starts it: a users file, a backend, a queue;
//! pages refused without credentials, served with them, a mutation refused
//! to the read-only user; a users file that names no one, refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

/// The server, and its standard error kept open (a closed pipe would fail
/// its log lines).
struct Serve {
    child: Child,
    _stderr: BufReader<std::process::ChildStderr>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn users_file(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "jobrail-serve-users-{}-{}",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

/// One HTTP/1.1 request; the status and the body.
fn request(addr: &str, method: &str, path: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let auth = auth.map_or(String::new(), |a| format!("Authorization: Basic {a}\r\n"));
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer.split(' ').nth(1).unwrap().parse().unwrap();
    (status, answer)
}

/// `jobrail --backend memory serve` with `users`, on a free port: the
/// process and its address.
fn start(users: &std::path::Path) -> (Serve, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_jobrail"))
        .args([
            "--backend",
            "memory",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--queue",
            "reports",
            "--users",
        ])
        .arg(users)
        .env_remove("JOBRAIL_CONFIG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let serve = Serve {
        child,
        _stderr: stderr,
    };
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim()
        .trim_end_matches('/')
        .to_string();
    (serve, addr)
}

#[test]
fn the_dashboard_serves_its_users_only() {
    // alice:pw-alice and bob:pw-bob, in base64.
    let alice = "YWxpY2U6cHctYWxpY2U=";
    let bob = "Ym9iOnB3LWJvYg==";
    let users = users_file("# the dashboard's users\nalice operator pw-alice\nbob read-only sha256:f3c9b4d4a0f8a3c0d3b1a8a53a7b0b4c3e0f0b4e9ac4e8e1f3a2b3c4d5e6f7a8\n");
    // bob's digest above is not pw-bob's: he cannot sign in with it.
    let (serve, addr) = start(&users);
    let (status, _) = request(&addr, "GET", "/", None, "");
    assert_eq!(status, 401);
    let (status, page) = request(&addr, "GET", "/", Some(alice), "");
    assert_eq!(status, 200);
    assert!(page.contains("reports"), "{page}");
    let (status, page) = request(&addr, "GET", "/failures?queue=reports", Some(alice), "");
    assert_eq!(status, 200);
    assert!(page.contains("No failure records"), "{page}");
    let (status, _) = request(&addr, "GET", "/", Some(bob), "");
    assert_eq!(status, 401, "a digest that is not the password's");
    drop(serve);

    let users = users_file("alice operator pw-alice\nbob read-only pw-bob\n");
    let (_serve, addr) = start(&users);
    let (status, page) = request(&addr, "GET", "/failures", Some(bob), "");
    assert_eq!(status, 200);
    assert!(
        !page.contains("data-mutation"),
        "no mutation form for the read-only role"
    );
    let (status, _) = request(
        &addr,
        "POST",
        "/failures/action",
        Some(bob),
        "do=purge-matching&queue=reports&confirm=yes",
    );
    assert_eq!(status, 403);
}

#[test]
fn a_users_file_without_users_is_refused() {
    let users = users_file("# nobody yet\n");
    let out = Command::new(env!("CARGO_BIN_EXE_jobrail"))
        .args([
            "--backend",
            "memory",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--users",
        ])
        .arg(&users)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("names no user"), "{stderr}");
}
