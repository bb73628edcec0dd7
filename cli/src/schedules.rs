//! `jobrail schedules list | trigger`: the schedules of the configuration
//! file, their next ticks, the ticks fired as the claim store has them, and
//! a manual trigger.

use std::sync::Arc;

use jobrail::{ClaimState, ClaimStore, Schedule, SchedulesConfig, SystemTime, Tick};
use jobrail_native::{Driver, Producer};
use serde_json::{json, Value};

use crate::args::{ClaimsKind, Connection, ScheduleSource};
use crate::commands::Output;
use crate::error::CliError;

/// The schedules the configuration file declares.
pub(crate) fn load(source: &ScheduleSource) -> Result<Vec<Schedule>, CliError> {
    let Some(path) = &source.config else {
        return Err(CliError::usage(
            "no configuration file: pass --config or set JOBRAIL_CONFIG to the file with the [schedules.<name>] tables",
        ));
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage(format!("cannot read {}: {e}", path.display())))?;
    let config = SchedulesConfig::from_toml(&text).map_err(|e| CliError::usage(e.to_string()))?;
    config
        .schedules()
        .map_err(|e| CliError::usage(e.to_string()))
}

/// The claim store `source` names.
pub(crate) async fn claims(
    source: &ScheduleSource,
    connection: &Connection,
) -> Result<Arc<dyn ClaimStore>, CliError> {
    match source.claims {
        ClaimsKind::Memory => Ok(Arc::new(jobrail::MemoryClaims::new())),
        ClaimsKind::Postgres => postgres(source, connection).await,
        ClaimsKind::Redis => {
            let store = jobrail_redis::RedisClaims::connect(&source.redis_url)
                .await
                .map_err(|e| CliError::failed(format!("cannot connect to Redis: {e}")))?
                .with_prefix(source.redis_prefix.clone());
            Ok(Arc::new(store))
        }
    }
}

#[cfg(feature = "postgres")]
async fn postgres(
    source: &ScheduleSource,
    connection: &Connection,
) -> Result<Arc<dyn ClaimStore>, CliError> {
    let store = jobrail_postgres::PgClaims::connect_with_table(
        &connection.database_url,
        &source.claims_table,
    )
    .await
    .map_err(|e| CliError::failed(format!("cannot open the Postgres claims: {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_: &ScheduleSource, _: &Connection) -> Result<Arc<dyn ClaimStore>, CliError> {
    Err(CliError::usage(
        "this jobrail was built without the `postgres` feature",
    ))
}

fn state_name(state: &Result<ClaimState, jobrail::ClaimError>) -> String {
    match state {
        Ok(ClaimState::Done) => "fired".into(),
        Ok(ClaimState::Held { remaining }) => {
            format!("firing (claim held {} ms more)", remaining.as_millis())
        }
        Ok(ClaimState::Free) => "not fired".into(),
        Err(e) => format!("unknown ({e})"),
    }
}

/// `jobrail schedules list`.
pub(crate) async fn list(
    schedules: &[Schedule],
    claims: &dyn ClaimStore,
    now: SystemTime,
    next: usize,
    last: usize,
) -> Output {
    let mut text = String::new();
    let mut items = Vec::new();
    if schedules.is_empty() {
        text.push_str("no schedules in the configuration file\n");
    }
    for s in schedules {
        let upcoming: Vec<Tick> = s.ticks_after(now).take(next).collect();
        let mut fired = Vec::new();
        for tick in s.last_ticks(now, last).into_iter().rev() {
            let key = s.tick_key(&tick).unwrap_or_default();
            let state = claims.state(&key).await;
            fired.push((tick, state));
        }
        text.push_str(&format!(
            "{}: job {} on queue {}\n  cron {:?} in {}, missed {}, overlap {}{}\n",
            s.name(),
            s.job(),
            s.queue(),
            s.cron(),
            s.time_zone(),
            s.missed(),
            s.overlap(),
            if s.enabled() { "" } else { ", disabled" }
        ));
        text.push_str("  next:");
        if upcoming.is_empty() {
            text.push_str(" none");
        }
        for t in &upcoming {
            text.push_str(&format!(" {t}"));
        }
        text.push('\n');
        text.push_str("  latest due ticks:\n");
        if fired.is_empty() {
            text.push_str("    none\n");
        }
        for (tick, state) in &fired {
            text.push_str(&format!("    {tick}  {}\n", state_name(state)));
        }
        items.push(json!({
            "name": s.name(),
            "job": s.job(),
            "queue": s.queue(),
            "cron": s.cron(),
            "time_zone": s.time_zone(),
            "missed": s.missed().to_string(),
            "overlap": s.overlap().to_string(),
            "enabled": s.enabled(),
            "next": upcoming.iter().map(Tick::rfc3339).collect::<Vec<_>>(),
            "latest": fired.iter().map(|(tick, state)| {
                let (state, remaining_ms, error) = match state {
                    Ok(ClaimState::Done) => ("fired", None, None),
                    Ok(ClaimState::Held { remaining }) => ("held", Some(remaining.as_millis() as u64), None),
                    Ok(ClaimState::Free) => ("not_fired", None, None),
                    Err(e) => ("unknown", None, Some(e.to_string())),
                };
                json!({"tick": tick.rfc3339(), "state": state, "remaining_ms": remaining_ms, "error": error})
            }).collect::<Vec<Value>>(),
        }));
    }
    Output {
        text,
        json: json!({ "schedules": items }),
    }
}

/// `jobrail schedules trigger <name>`: sends the job now as a `manual` tick.
pub(crate) async fn trigger(
    schedules: &[Schedule],
    name: &str,
    driver: Arc<dyn Driver>,
    now: SystemTime,
) -> Result<Output, CliError> {
    let Some(schedule) = schedules.iter().find(|s| s.name() == name) else {
        let known: Vec<&str> = schedules.iter().map(Schedule::name).collect();
        return Err(CliError::not_found(format!(
            "no schedule `{name}` in the configuration file (it has: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        )));
    };
    let tick = Tick::manual(now);
    let dispatch = schedule
        .dispatch(&tick)
        .map_err(|e| CliError::failed(e.to_string()))?;
    let envelope = dispatch.envelope();
    let id = envelope.id.clone();
    Producer::new(driver.clone())
        .send_raw(&dispatch.queue, id.clone(), envelope.encode(), None)
        .await?;
    Ok(Output {
        text: format!(
            "triggered {name}: job {} sent to queue {} on {} as message {id} (tick manual, at {})\n",
            schedule.job(),
            schedule.queue(),
            driver.name(),
            tick.rfc3339()
        ),
        json: json!({
            "schedule": name,
            "job": schedule.job(),
            "queue": schedule.queue(),
            "backend": driver.name(),
            "message_id": id,
            "tick": "manual",
            "triggered_at": tick.rfc3339(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail_native::MemoryDriver;

    fn schedules() -> Vec<Schedule> {
        SchedulesConfig::from_toml(
            "[schedules.purge]\njob = \"purge\"\nqueue = \"q\"\ncron = \"0 * * * *\"\npayload = { days = 3 }\n",
        )
        .unwrap()
        .schedules()
        .unwrap()
    }

    #[tokio::test]
    async fn list_shows_next_ticks_and_fired_ones() {
        let claims = jobrail::MemoryClaims::new();
        let s = schedules();
        let now = Tick::parse("2026-01-01T10:30:00Z").unwrap().time();
        let fired = Tick::parse("2026-01-01T10:00:00Z").unwrap();
        let key = s[0].tick_key(&fired).unwrap();
        let jobrail::Claim::Claimed { fence } = claims
            .claim(&key, std::time::Duration::from_secs(5))
            .await
            .unwrap()
        else {
            panic!("fresh");
        };
        claims.complete(&key, fence).await.unwrap();
        let out = list(&s, &claims, now, 3, 2).await;
        assert!(
            out.text
                .contains("next: 2026-01-01T11:00:00Z 2026-01-01T12:00:00Z 2026-01-01T13:00:00Z"),
            "{}",
            out.text
        );
        assert!(
            out.text.contains("2026-01-01T10:00:00Z  fired"),
            "{}",
            out.text
        );
        assert!(
            out.text.contains("2026-01-01T09:00:00Z  not fired"),
            "{}",
            out.text
        );
        assert_eq!(out.json["schedules"][0]["latest"][0]["state"], "fired");
        assert_eq!(out.json["schedules"][0]["missed"], "latest");
    }

    #[tokio::test]
    async fn trigger_sends_a_manual_tick() {
        let driver = Arc::new(MemoryDriver::default());
        let now = Tick::parse("2026-01-01T10:30:00Z").unwrap().time();
        let out = trigger(&schedules(), "purge", driver.clone(), now)
            .await
            .unwrap();
        assert_eq!(out.json["tick"], "manual");
        assert_eq!(driver.ready("q"), 1);
        let missing = trigger(&schedules(), "nope", driver, now)
            .await
            .unwrap_err();
        assert_eq!(missing.status, crate::error::NOT_FOUND);
    }
}
