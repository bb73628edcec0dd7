//! `jobrail schedules list` and `trigger` against Postgres: the ticks fired
//! read from Postgres claims, a manual tick sent to a Postgres queue.
//!
//! Needs Postgres at `DATABASE_URL` (default
//! postgres://postgres@127.0.0.1:5432/test); skipped, loudly, when it is not
//! reachable and `CI` is not set.

#![cfg(feature = "postgres")]

use std::process::Command;
use std::time::Duration;

use jobrail::{Claim, ClaimStore, SchedulesConfig, SystemTime};
use jobrail_postgres::PgClaims;
use serde_json::Value;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn jobrail(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_jobrail"))
        .args(args)
        .env_remove("JOBRAIL_CONFIG")
        .env_remove("JOBRAIL_BACKEND")
        .output()
        .expect("the jobrail binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.success(), json, format!("{stdout}{stderr}"))
}

#[tokio::test]
async fn list_and_trigger_on_postgres() {
    let url = database_url();
    let unique = format!("{}_{}", std::process::id(), rand_suffix());
    let table = format!("sched_cli_{unique}");
    let claims = match PgClaims::connect_with_table(&url, &table).await {
        Ok(claims) => claims,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("SKIPPED: Postgres not reachable at {url}: {e}");
            return;
        }
        Err(e) => panic!("Postgres not reachable at {url}: {e}"),
    };
    let queue = format!("sched-cli-{unique}");
    let config = format!(
        "[schedules.nightly]\njob = \"nightly-report\"\nqueue = \"{queue}\"\n\
         cron = \"0 0 0 * * *\"\ntime_zone = \"UTC\"\nmissed = \"each:2\"\n\
         payload = {{ kind = \"daily\" }}\n"
    );
    let path = std::env::temp_dir().join(format!("jobrail-schedules-{unique}.toml"));
    std::fs::write(&path, &config).unwrap();
    let path_text = path.to_string_lossy().into_owned();

    // The latest midnight is fired in the store; the one before is not.
    let schedule = SchedulesConfig::from_toml(&config)
        .unwrap()
        .schedules()
        .unwrap()
        .remove(0);
    let latest = schedule.latest_at_or_before(SystemTime::now()).unwrap();
    let key = schedule.tick_key(&latest).unwrap();
    let Claim::Claimed { fence } = claims.claim(&key, Duration::from_secs(30)).await.unwrap()
    else {
        panic!("a fresh key");
    };
    claims.complete(&key, fence).await.unwrap();

    let (ok, json, out) = jobrail(&[
        "--json",
        "--database-url",
        &url,
        "schedules",
        "list",
        "--config",
        &path_text,
        "--claims",
        "postgres",
        "--claims-table",
        &table,
    ]);
    assert!(ok, "{out}");
    let nightly = &json["schedules"][0];
    assert_eq!(nightly["name"], "nightly", "{out}");
    assert_eq!(nightly["missed"], "each:2");
    assert_eq!(nightly["next"].as_array().unwrap().len(), 3);
    assert_eq!(nightly["latest"][0]["tick"], latest.rfc3339(), "{out}");
    assert_eq!(nightly["latest"][0]["state"], "fired", "{out}");
    assert_eq!(nightly["latest"][1]["state"], "not_fired", "{out}");

    // Text output names the same.
    let (ok, _, text) = jobrail(&[
        "--database-url",
        &url,
        "schedules",
        "list",
        "--config",
        &path_text,
        "--claims",
        "postgres",
        "--claims-table",
        &table,
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("{}  fired", latest.rfc3339())),
        "{text}"
    );

    // Trigger through the Postgres queue of a fresh schema.
    let schema = format!("sched_cli_{unique}");
    let (ok, _, out) = jobrail(&[
        "--backend",
        "postgres",
        "--database-url",
        &url,
        "--schema",
        &schema,
        "install",
    ]);
    assert!(ok, "{out}");
    let (ok, json, out) = jobrail(&[
        "--json",
        "--backend",
        "postgres",
        "--database-url",
        &url,
        "--schema",
        &schema,
        "schedules",
        "trigger",
        "nightly",
        "--config",
        &path_text,
    ]);
    assert!(ok, "{out}");
    assert_eq!(json["tick"], "manual", "{out}");
    assert_eq!(json["queue"], queue.as_str());
    let (ok, json, out) = jobrail(&[
        "--json",
        "--backend",
        "postgres",
        "--database-url",
        &url,
        "--schema",
        &schema,
        "depth",
        "--queue",
        &queue,
    ]);
    assert!(ok, "{out}");
    assert_eq!(json["ready"], 1, "{out}");

    // An unknown schedule is not found (exit status 3).
    let status = Command::new(env!("CARGO_BIN_EXE_jobrail"))
        .args([
            "--backend",
            "memory",
            "schedules",
            "trigger",
            "nope",
            "--config",
            &path_text,
        ])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(3));
    let _ = std::fs::remove_file(&path);
    // The test's own tables go with it.
    use jobrail_postgres::tokio_postgres;
    if let Ok((client, connection)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        let task = tokio::spawn(connection);
        let _ = client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; DROP TABLE IF EXISTS {table}"
            ))
            .await;
        drop(client);
        let _ = task.await;
    }
}

fn rand_suffix() -> u32 {
    SystemTime::now()
        .duration_since(jobrail::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}
