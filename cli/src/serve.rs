//! `jobrail serve`: the dashboard (jobrail-web) on its own.

use jobrail::{Job, JobContext, Registry};
use jobrail_web::{Dashboard, Role, Source};
use serde_json::{json, Value};

use crate::args::{Connection, ServeArgs};
use crate::commands::Output;
use crate::error::CliError;

/// One user of a users file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UserLine {
    pub(crate) name: String,
    pub(crate) role: Role,
    /// The password, or `sha256:HEX`.
    pub(crate) secret: String,
}

/// Reads a users file: `NAME ROLE PASSWORD` or `NAME ROLE sha256:HEX` per
/// line, `#` comments, blank lines.
pub(crate) fn parse_users(text: &str, path: &str) -> Result<Vec<UserLine>, CliError> {
    let mut users = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.splitn(3, char::is_whitespace);
        let (Some(name), Some(role), Some(secret)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(CliError::usage(format!(
                "{path}:{}: a user is `NAME ROLE PASSWORD` (or `NAME ROLE sha256:HEX`)",
                i + 1
            )));
        };
        let role = Role::parse(role).ok_or_else(|| {
            CliError::usage(format!(
                "{path}:{}: `{role}` is not a role: operator or read-only",
                i + 1
            ))
        })?;
        users.push(UserLine {
            name: name.to_string(),
            role,
            secret: secret.trim().to_string(),
        });
    }
    if users.is_empty() {
        return Err(CliError::usage(format!(
            "{path} names no user: the dashboard serves no page without credentials"
        )));
    }
    Ok(users)
}

/// The edge keepers `--edge NAME=URL` names, with their tokens.
fn edges(edges: &[String]) -> Result<Vec<(String, String, String)>, CliError> {
    let mut out = Vec::new();
    for edge in edges {
        let Some((name, url)) = edge.split_once('=') else {
            return Err(CliError::usage(format!("--edge {edge}: give NAME=URL")));
        };
        let specific = format!(
            "JOBRAIL_EDGE_TOKEN_{}",
            name.to_ascii_uppercase()
                .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        );
        let token = std::env::var(&specific)
            .or_else(|_| std::env::var("JOBRAIL_EDGE_TOKEN"))
            .map_err(|_| {
                CliError::usage(format!(
                    "--edge {name}: set {specific} or JOBRAIL_EDGE_TOKEN to the keeper's FAILURES_TOKEN"
                ))
            })?;
        out.push((name.to_string(), url.to_string(), token));
    }
    Ok(out)
}

pub(crate) async fn serve(
    connection: &Connection,
    settings: ServeArgs,
) -> Result<Output, CliError> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,jobrail_web::audit=info".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let path = settings.users.display().to_string();
    let text = std::fs::read_to_string(&settings.users)
        .map_err(|e| CliError::usage(format!("cannot read the users file {path}: {e}")))?;
    let users = parse_users(&text, &path)?;
    let edges = edges(&settings.edges)?;
    let mut builder = Dashboard::builder()
        .show_payloads(settings.show_payloads)
        .base_path(settings.base_path.clone());
    for u in users {
        builder = match u.secret.strip_prefix("sha256:") {
            Some(hex) => builder.user_sha256(u.name, hex, u.role),
            None => builder.user(u.name, u.secret, u.role),
        };
    }
    let mut driver = None;
    if connection.backend.is_some() {
        let connected = crate::backend::connect(connection).await?;
        let mut source = Source::native(connected.name(), connected.clone());
        // The jobs the configuration file names: their policies and budgets.
        let overrides = jobrail_native::overrides_from_env()?;
        let mut registry = Registry::new();
        for name in overrides.named_jobs() {
            let job = Job::<Value>::builder(name.to_string()).build()?;
            registry
                .register(&job, |_: JobContext, _: Value| async { Ok(()) })
                .map_err(|e| CliError::usage(e.to_string()))?;
        }
        registry.apply_overrides(&overrides)?;
        source = source.jobs(registry.specs().cloned());
        for q in &settings.queues {
            source = source.queue(q.clone());
        }
        if settings.source.config.is_some() {
            let schedules = crate::schedules::load(&settings.source)?;
            let claims = crate::schedules::claims(&settings.source, connection).await?;
            for s in &schedules {
                source = source.queue(s.queue().to_string());
            }
            source = source.schedules(schedules, Some(claims));
        }
        builder = builder.source(source);
        driver = Some(connected);
    } else if settings.queues.is_empty() && edges.is_empty() {
        return Err(CliError::usage(
            "nothing to show: give --backend (and --queue), or --edge NAME=URL",
        ));
    }
    for (name, url, token) in edges {
        builder = builder.source(Source::edge(name, url, token));
    }
    let dashboard = builder
        .build()
        .map_err(|e| CliError::usage(e.to_string()))?;
    let listener = tokio::net::TcpListener::bind(&settings.listen)
        .await
        .map_err(|e| CliError::failed(format!("cannot listen on {}: {e}", settings.listen)))?;
    let at = listener
        .local_addr()
        .map_err(|e| CliError::failed(e.to_string()))?;
    eprintln!(
        "jobrail: the dashboard is at http://{at}{}/",
        settings.base_path
    );
    let router = if settings.base_path.is_empty() {
        dashboard.router()
    } else {
        axum::Router::new().nest(&settings.base_path, dashboard.router())
    };
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(jobrail_native::shutdown_signal())
        .await;
    if let Some(driver) = driver {
        let _ = driver.stop().await;
    }
    served.map_err(|e| CliError::failed(format!("the dashboard stopped: {e}")))?;
    Ok(Output {
        text: "the dashboard stopped\n".into(),
        json: json!({"stopped": true, "address": at.to_string()}),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_file_reads_and_refuses_clearly() {
        let users = parse_users(
            "# who may sign in\nalice operator s3cret with spaces\n\nbob read-only sha256:ab\n",
            "users",
        )
        .unwrap();
        assert_eq!(users.len(), 2);
        assert_eq!(users[0].secret, "s3cret with spaces");
        assert_eq!(users[1].role, Role::ReadOnly);
        let e = parse_users("carol admin pw\n", "users").unwrap_err();
        assert!(
            e.to_string().contains("users:1: `admin` is not a role"),
            "{e}"
        );
        let e = parse_users("dave operator\n", "users").unwrap_err();
        assert!(e.to_string().contains("NAME ROLE PASSWORD"), "{e}");
        let e = parse_users("# nobody\n", "users").unwrap_err();
        assert!(
            e.to_string().contains("no page is served") || e.to_string().contains("names no user"),
            "{e}"
        );
    }
}
