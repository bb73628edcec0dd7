//! Schedules fired by Cron Triggers, in the native harness: the Worker's
//! `scheduled` handler as `CloudflareQueues::trigger` runs it (the same
//! `EdgeScheduler`, the same firing rule, claims on the virtual clock), the
//! jobs through the same consumer.

#![cfg(not(target_arch = "wasm32"))]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{
    Claim, ClaimState, ClaimStore, Job, JobContext, JobError, Missed, Registry, RegistryError,
    Schedule, SystemTime, TickOutcome, TICK_METADATA, UNIX_EPOCH,
};
use jobrail_edge::testing::{CloudflareQueues, MessageState};
use jobrail_edge::Options;

const WRANGLER: &str = r#"
[triggers]
crons = ["* * * * *", "0 3 * * *"]

[[d1_databases]]
binding = "CLAIMS_DB"
database_name = "claims"
database_id = "claims"

[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.consumers]]
queue = "jobs"
max_batch_size = 4
max_batch_timeout = 1
max_retries = 10
dead_letter_queue = "jobs-dlq"
"#;

fn job() -> Job<String> {
    Job::<String>::builder("report")
        .queue("jobs")
        .max_deliveries(3)
        .build()
        .unwrap()
}

/// What the jobs of one harness ran: (schedule, tick) per execution, the
/// tick read from the job's metadata.
#[derive(Clone, Default)]
struct Ran(Arc<Mutex<Vec<(String, String)>>>);

impl Ran {
    fn of(&self, schedule: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| s == schedule)
            .map(|(_, tick)| tick.clone())
            .collect()
    }

    fn jobs(&self) -> impl Fn() -> Result<Registry, RegistryError> + 'static {
        let ran = self.clone();
        move || {
            let mut registry = Registry::new();
            let ran = ran.clone();
            registry.register(&job(), move |ctx: JobContext, schedule: String| {
                let ran = ran.clone();
                async move {
                    let tick = ctx
                        .metadata()
                        .get(TICK_METADATA)
                        .cloned()
                        .unwrap_or_default();
                    ran.0.lock().unwrap().push((schedule, tick));
                    Ok::<(), JobError>(())
                }
            })?;
            Ok(registry)
        }
    }
}

/// The schedules: each sends its own name as the payload.
fn schedules() -> Result<Vec<Schedule>, String> {
    let build = |name: &str, cron: &str, zone: &str, missed: Missed| {
        Schedule::builder(name, &job(), cron)
            .time_zone(zone)
            .missed(missed)
            .payload(name.to_string())
            .build()
            .map_err(|e| e.to_string())
    };
    Ok(vec![
        build("every-minute", "* * * * *", "UTC", Missed::Latest)?,
        build("paris-five", "*/5 * * * *", "Europe/Paris", Missed::Latest)?,
        build(
            "paris-five-skip",
            "*/5 * * * *",
            "Europe/Paris",
            Missed::Skip,
        )?,
        build("nightly", "0 3 * * *", "UTC", Missed::Latest)?,
    ])
}

const OPTIONS: Options = Options {
    schedules: Some(schedules),
    log_settlements: false,
    ..Options::DEFAULT
};

/// A minute boundary ahead of the harness's wall clock, at `hh:mm` past a
/// whole hour (UTC; the hour is a multiple of 5 minutes in Paris too).
fn harness_at(minute_of_hour: u64) -> (CloudflareQueues, u64, Ran) {
    let ran = Ran::default();
    let mut cf =
        CloudflareQueues::new(WRANGLER, ran.jobs(), OPTIONS).expect("the configuration fits");
    let now_s = cf.unix_now_ms() / 1000;
    let hour = (now_s / 3600 + 1) * 3600;
    let at = hour + 60 * minute_of_hour;
    cf.advance_to(at * 1000);
    (cf, at, ran)
}

fn time(unix_s: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix_s)
}

fn label(unix_s: u64) -> String {
    jobrail::Tick::from_unix_seconds(unix_s as i64).rfc3339()
}

fn sent_by(fired: &[jobrail_edge::ScheduleFired], schedule: &str) -> usize {
    fired
        .iter()
        .filter(|f| f.schedule == schedule)
        .map(|f| f.sent())
        .sum()
}

#[test]
fn a_trigger_delivered_twice_for_the_same_tick_dispatches_once() {
    let (mut cf, m, ran) = harness_at(0);
    let first = cf.trigger("* * * * *");
    assert_eq!(sent_by(&first, "every-minute"), 1);
    // The same trigger again, later in the same minute (a duplicate
    // delivery, or a retry of the invocation).
    cf.advance(Duration::from_secs(20));
    let second = cf.trigger_at("* * * * *", time(m));
    assert_eq!(sent_by(&second, "every-minute"), 0);
    let outcomes: Vec<String> = second
        .iter()
        .filter(|f| f.schedule == "every-minute")
        .flat_map(|f| f.outcomes().map(|(_, o)| format!("{o:?}")))
        .collect();
    assert_eq!(outcomes, ["AlreadyFired"], "{outcomes:?}");
    cf.run_until_idle();
    assert_eq!(ran.of("every-minute"), [label(m)], "one run, for the tick");
    let key = format!("schedule:every-minute:{}", label(m));
    assert_eq!(
        cf.claims().state(&key).now_or_panic().unwrap(),
        ClaimState::Done,
        "the tick is recorded as fired"
    );
    let runs: Vec<_> = cf
        .messages()
        .iter()
        .filter(|m| m.state == MessageState::Acked)
        .collect();
    assert!(runs.iter().all(|m| m.attempts() == [1]));
}

#[test]
fn a_dropped_minute_fires_late_with_latest_and_never_with_skip() {
    let (mut cf, m0, ran) = harness_at(10);
    // 10:00 fires both five-minute schedules, 10:01 to 10:04 fire nothing
    // new, the platform drops the trigger of 10:05, 10:06 and 10:07 run.
    let mut late_trigger = Duration::ZERO;
    for minute in [0, 1, 2, 3, 4, 6, 7] {
        cf.advance_to((m0 + 60 * minute) * 1000);
        if minute == 6 {
            late_trigger = cf.now();
        }
        let fired = cf.trigger("* * * * *");
        let expected = usize::from(minute == 0);
        assert_eq!(
            sent_by(&fired, "paris-five-skip"),
            expected,
            "minute {minute}"
        );
        let latest = usize::from(minute == 0 || minute == 6);
        assert_eq!(sent_by(&fired, "paris-five"), latest, "minute {minute}");
        cf.run_until_idle();
    }
    let tick_10_05 = label(m0 + 300);
    assert_eq!(ran.of("paris-five"), [label(m0), tick_10_05.clone()]);
    assert_eq!(
        ran.of("paris-five-skip"),
        [label(m0)],
        "skip never fires a missed tick"
    );
    // Late by one minute: it ran after the 10:06 trigger.
    let late = cf
        .messages()
        .iter()
        .find(|m| {
            String::from_utf8_lossy(&m.body).contains(&tick_10_05)
                && String::from_utf8_lossy(&m.body).contains("\"paris-five\"")
        })
        .expect("the late tick's job");
    assert_eq!(late.sent_at, late_trigger, "sent by the 10:06 trigger");
    assert_eq!(late.attempts(), [1]);
}

#[test]
fn a_utc_schedule_fires_from_its_own_trigger_only() {
    let (mut cf, _, ran) = harness_at(0);
    let now_s = cf.unix_now_ms() / 1000;
    let day = (now_s / 86_400 + 1) * 86_400;
    let three = day + 3 * 3600;
    cf.advance_to(three * 1000);
    let every_minute = cf.trigger("* * * * *");
    assert_eq!(sent_by(&every_minute, "nightly"), 0, "not from * * * * *");
    assert!(every_minute.iter().all(|f| f.schedule != "nightly"));
    let own = cf.trigger("0 3 * * *");
    assert_eq!(own.len(), 1);
    assert_eq!(sent_by(&own, "nightly"), 1);
    cf.run_until_idle();
    assert_eq!(ran.of("nightly"), [label(three)]);
}

#[test]
fn a_tick_held_by_an_invocation_that_died_is_fired_after_its_lease() {
    let (mut cf, m, ran) = harness_at(20);
    // First trigger ever of the schedule: it is known from now on.
    cf.trigger("* * * * *");
    cf.run_until_idle();
    let next = m + 60;
    cf.advance_to(next * 1000);
    // Another invocation claimed the next tick and died before sending.
    let key = format!("schedule:every-minute:{}", label(next));
    assert!(matches!(
        cf.claims()
            .claim(&key, Duration::from_secs(30))
            .now_or_panic(),
        Ok(Claim::Claimed { .. })
    ));
    let fired = cf.trigger("* * * * *");
    let mine: Vec<_> = fired
        .iter()
        .filter(|f| f.schedule == "every-minute")
        .collect();
    assert_eq!(
        mine[0].passes.len(),
        2,
        "waited for the lease, then went back"
    );
    let outcomes: Vec<String> = mine[0].outcomes().map(|(_, o)| format!("{o:?}")).collect();
    assert!(outcomes[0].starts_with("Held"), "{outcomes:?}");
    assert!(
        matches!(
            mine[0].outcomes().last().map(|(_, o)| o),
            Some(TickOutcome::Fired {
                taken_over: true,
                ..
            })
        ),
        "{outcomes:?}"
    );
    cf.run_until_idle();
    assert_eq!(
        ran.of("every-minute")
            .iter()
            .filter(|t| **t == label(next))
            .count(),
        1
    );
}

#[test]
fn a_failed_send_is_sent_again_once() {
    let (mut cf, m, ran) = harness_at(30);
    cf.trigger("* * * * *");
    cf.run_until_idle();
    let next = m + 60;
    cf.advance_to(next * 1000);
    // Every schedule of the trigger sends through JOBS: the first fails.
    cf.fail_sends("JOBS", 1);
    let fired = cf.trigger("* * * * *");
    let mine = fired.iter().find(|f| f.schedule == "every-minute").unwrap();
    let sends: usize = fired.iter().map(|f| f.sent()).sum();
    assert_eq!(mine.sent(), 1, "{mine:?}");
    assert!(sends >= 1);
    cf.run_until_idle();
    assert_eq!(
        ran.of("every-minute")
            .iter()
            .filter(|t| **t == label(next))
            .count(),
        1
    );
}

#[test]
fn the_check_refuses_triggers_that_do_not_fit_the_schedules() {
    // The every-minute trigger missing: the Paris schedules have none.
    let text = WRANGLER.replace(
        "crons = [\"* * * * *\", \"0 3 * * *\"]",
        "crons = [\"0 3 * * *\", \"5 4 * * *\"]",
    );
    let jobs = Ran::default().jobs();
    let err = CloudflareQueues::new(&text, Ran::default().jobs(), OPTIONS).unwrap_err();
    assert!(
        err.contains("schedule `paris-five`") && err.contains("\"* * * * *\""),
        "{err}"
    );
    assert!(
        err.contains("\"5 4 * * *\", which fires no declared schedule"),
        "{err}"
    );
    // No D1 database for the claims.
    let text = WRANGLER.replace("binding = \"CLAIMS_DB\"", "binding = \"OTHER_DB\"");
    let err = CloudflareQueues::new(&text, jobs, OPTIONS).unwrap_err();
    assert!(
        err.contains("CLAIMS_DB") && err.contains("[[d1_databases]]"),
        "{err}"
    );
}

/// Polls a future that needs no executor (the memory store answers at once).
trait NowOrPanic: std::future::Future + Sized {
    fn now_or_panic(self) -> Self::Output {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut fut = std::pin::pin!(self);
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => panic!("the store did not answer at once"),
        }
    }
}

impl<F: std::future::Future> NowOrPanic for F {}
