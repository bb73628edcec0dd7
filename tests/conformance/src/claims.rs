//! The conformance suite for claim stores ([`jobrail::ClaimStore`]): one set
//! of scenarios every store must pass, memory, Postgres, Redis and the
//! edge's D1 alike.
//!
//! A store is given as a [`ClaimFixture`]: it opens handles on one store
//! (each a new connection where the store has connections), so a scenario
//! can play several workers, kill one (drop its handle mid-work, as a dead
//! process drops its connection), and look at the store again "after a
//! crash" through a handle that shares nothing with the one that wrote.
//! Every scenario uses keys of its own (the fixture's prefix plus a random
//! part), so runs and scenarios never see each other's claims.
//!
//! [`claim_store_suite!`](crate::claim_store_suite) expands to a test
//! binary's `main` running every scenario on a fixture:
//!
//! ```ignore
//! struct MyStore;
//! #[async_trait::async_trait]
//! impl jobrail_conformance::claims::ClaimFixture for MyStore { /* open */ }
//! jobrail_conformance::claim_store_suite!(MyStore);
//! ```

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use jobrail::{run_once, Claim, ClaimError, ClaimHeld, ClaimStore, JobError, Once, Outcome};

/// A claim store under test.
#[async_trait]
pub trait ClaimFixture: Send + Sync + 'static {
    /// A new handle on the store: a new connection where the store has
    /// connections; for an in-process store, a handle on the same claims.
    async fn open(&self) -> Arc<dyn ClaimStore>;

    /// How much the store's clock and the test's may disagree about when a
    /// lease ends (a network round trip, a server's clock): scenarios wait
    /// this much beyond a lease before expecting it ended, and accept a
    /// remaining time this much above the lease.
    fn slack(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// A key no other run or scenario uses.
pub fn unique_key(scenario: &str) -> String {
    format!("conformance:{scenario}:{}", jobrail::new_message_id())
}

/// One scenario: its name and the test.
pub type ClaimScenario = (
    &'static str,
    fn(Arc<dyn ClaimFixture>) -> crate::runner::TestFuture,
);

macro_rules! scenario {
    ($name:ident) => {
        (stringify!($name), |f| Box::pin($name(f)))
    };
}

/// Every scenario of the suite.
pub fn scenarios() -> Vec<ClaimScenario> {
    vec![
        scenario!(first_claim_holds_the_key),
        scenario!(two_workers_racing_on_one_key),
        scenario!(many_workers_racing_on_many_keys),
        scenario!(completion_is_visible_after_a_crash),
        scenario!(holder_killed_mid_work),
        scenario!(lease_expiry_frees_the_key),
        scenario!(completion_after_the_lease_is_lost),
        scenario!(release_frees_the_key_at_once),
        scenario!(extend_keeps_the_key),
        scenario!(operations_of_a_stale_fence_are_lost),
        scenario!(invalid_claims_are_refused),
        scenario!(run_once_runs_the_effect_once_across_racing_workers),
        scenario!(run_once_releases_after_a_failed_effect),
    ]
}

/// Runs every scenario on the fixture `make` builds (a fresh fixture per
/// scenario), with libtest's command line and report, and exits: 0 when
/// every scenario passed, 101 otherwise.
pub fn run<F, Fut, C>(make: F) -> !
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = C> + 'static,
    C: ClaimFixture,
{
    run_trials(make, None)
}

/// [`run`], but when the environment variable `var` is not set every
/// scenario is listed as ignored (its reason printed once): for stores
/// that need a server the test command starts (`--ignored` then fails them
/// for want of it, as it should).
pub fn run_unless_missing<F, Fut, C>(var: &'static str, make: F) -> !
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = C> + 'static,
    C: ClaimFixture,
{
    let missing = std::env::var_os(var).is_none();
    if missing {
        println!("{var} is not set: the claim-store scenarios of this store are ignored");
    }
    run_trials(make, missing.then_some(var))
}

fn run_trials<F, Fut, C>(make: F, ignored_for: Option<&'static str>) -> !
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = C> + 'static,
    C: ClaimFixture,
{
    let make = Arc::new(make);
    let trials = scenarios()
        .into_iter()
        .map(|(name, scenario)| {
            let make = make.clone();
            crate::runner::trial(name, move || async move {
                let fixture: Arc<dyn ClaimFixture> = Arc::new(make().await);
                scenario(fixture).await;
            })
            .with_ignored_flag(ignored_for.is_some())
        })
        .collect();
    crate::runner::run_trials(trials)
}

async fn claim(store: &dyn ClaimStore, key: &str, lease: Duration) -> Claim {
    store
        .claim(key, lease)
        .await
        .unwrap_or_else(|e| panic!("claim `{key}`: {e}"))
}

fn fence(claim: Claim) -> u64 {
    match claim {
        Claim::Claimed { fence } => fence,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_held(claim: Claim, lease: Duration, slack: Duration) -> Duration {
    match claim {
        Claim::Held { remaining } => {
            assert!(
                remaining <= lease + slack,
                "remaining {remaining:?} is more than the lease {lease:?}"
            );
            remaining
        }
        other => panic!("expected Held, got {other:?}"),
    }
}

fn assert_lost(result: Result<(), ClaimError>, what: &str) {
    assert!(
        matches!(result, Err(ClaimError::Lost { .. })),
        "{what}: expected ClaimError::Lost, got {result:?}"
    );
}

/// The first claim of a key holds it; a second claimant sees it held, with
/// no more than the lease remaining.
async fn first_claim_holds_the_key(fixture: Arc<dyn ClaimFixture>) {
    let (a, b) = (fixture.open().await, fixture.open().await);
    let key = unique_key("first");
    let lease = Duration::from_secs(30);
    let first = fence(claim(&*a, &key, lease).await);
    assert!(first >= 1, "fences start above zero");
    let remaining = assert_held(claim(&*b, &key, lease).await, lease, fixture.slack());
    assert!(
        remaining > Duration::from_secs(20),
        "a 30 s lease taken just now has {remaining:?} left"
    );
    // The holder itself claiming again is no different: held.
    assert_held(claim(&*a, &key, lease).await, lease, fixture.slack());
}

/// Two workers claim one key at the same instant, many times over: exactly
/// one wins each key.
async fn two_workers_racing_on_one_key(fixture: Arc<dyn ClaimFixture>) {
    let (a, b) = (fixture.open().await, fixture.open().await);
    let lease = Duration::from_secs(30);
    for round in 0..25 {
        let key = unique_key(&format!("race-{round}"));
        let (x, y) = tokio::join!(a.claim(&key, lease), b.claim(&key, lease));
        let (x, y) = (x.unwrap(), y.unwrap());
        let wins = [x, y]
            .iter()
            .filter(|c| matches!(c, Claim::Claimed { .. }))
            .count();
        assert_eq!(wins, 1, "round {round}: both or neither won: {x:?} {y:?}");
        assert!(
            [x, y].iter().any(|c| matches!(c, Claim::Held { .. })),
            "round {round}: the loser must see the key held: {x:?} {y:?}"
        );
    }
}

/// Eight workers (each its own handle) race on ten keys at once: one winner
/// per key, and every key's winner can complete.
async fn many_workers_racing_on_many_keys(fixture: Arc<dyn ClaimFixture>) {
    let lease = Duration::from_secs(30);
    let keys: Arc<Vec<String>> =
        Arc::new((0..10).map(|i| unique_key(&format!("many-{i}"))).collect());
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = fixture.open().await;
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            let mut won = Vec::new();
            for key in keys.iter() {
                if let Claim::Claimed { fence } = store.claim(key, lease).await.unwrap() {
                    won.push((key.clone(), fence));
                }
            }
            for (key, fence) in &won {
                store.complete(key, *fence).await.unwrap();
            }
            won.len()
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    assert_eq!(total, keys.len(), "one winner per key");
    let check = fixture.open().await;
    for key in keys.iter() {
        assert_eq!(claim(&*check, key, lease).await, Claim::Done);
    }
}

/// A completed claim is seen as done through a handle that shares nothing
/// with the one that completed it, after that one is gone.
async fn completion_is_visible_after_a_crash(fixture: Arc<dyn ClaimFixture>) {
    let key = unique_key("crash");
    let lease = Duration::from_secs(30);
    {
        let writer = fixture.open().await;
        let f = fence(claim(&*writer, &key, lease).await);
        writer.complete(&key, f).await.unwrap();
        drop(writer);
    }
    let after = fixture.open().await;
    assert_eq!(claim(&*after, &key, lease).await, Claim::Done);
    assert_eq!(
        claim(&*after, &key, Duration::from_millis(1)).await,
        Claim::Done
    );
}

/// A holder dies mid-work (its handle dropped without completing): others
/// see the key held until its lease ends, then one claims it with a higher
/// fence, and the dead holder's late completion is refused.
async fn holder_killed_mid_work(fixture: Arc<dyn ClaimFixture>) {
    let key = unique_key("killed");
    let lease = Duration::from_millis(1500);
    let slack = fixture.slack();
    let doomed = fixture.open().await;
    let started = Instant::now();
    let old = fence(claim(&*doomed, &key, lease).await);
    drop(doomed);
    let other = fixture.open().await;
    let remaining = assert_held(claim(&*other, &key, lease).await, lease, slack);
    assert!(remaining > Duration::ZERO || started.elapsed() >= lease - slack);
    tokio::time::sleep(lease.saturating_sub(started.elapsed()) + slack).await;
    let new = fence(claim(&*other, &key, lease).await);
    assert!(
        new > old,
        "the new fence {new} is not above the dead holder's {old}"
    );
    // The dead holder's work, finished late (say by a paused process), is lost.
    let ghost = fixture.open().await;
    assert_lost(
        ghost.complete(&key, old).await,
        "complete with the dead holder's fence",
    );
    other.complete(&key, new).await.unwrap();
    assert_eq!(claim(&*ghost, &key, lease).await, Claim::Done);
}

/// A lease's remaining time shrinks, and the key is free when it ends.
async fn lease_expiry_frees_the_key(fixture: Arc<dyn ClaimFixture>) {
    let (a, b) = (fixture.open().await, fixture.open().await);
    let key = unique_key("expiry");
    let lease = Duration::from_millis(1200);
    let slack = fixture.slack();
    let first = fence(claim(&*a, &key, lease).await);
    let early = assert_held(claim(&*b, &key, lease).await, lease, slack);
    tokio::time::sleep(Duration::from_millis(500)).await;
    match claim(&*b, &key, lease).await {
        Claim::Held { remaining } => assert!(
            remaining < early,
            "the remaining time did not shrink: {early:?} then {remaining:?}"
        ),
        Claim::Claimed { .. } => panic!("claimed 500 ms into a 1.2 s lease"),
        Claim::Done => panic!("done without a completion"),
    }
    tokio::time::sleep(lease + slack).await;
    let second = fence(claim(&*b, &key, lease).await);
    assert!(second > first);
}

/// A completion after the lease ended is refused even if nobody claimed the
/// key meanwhile; the key is then free for a new claim.
async fn completion_after_the_lease_is_lost(fixture: Arc<dyn ClaimFixture>) {
    let store = fixture.open().await;
    let key = unique_key("late");
    let lease = Duration::from_millis(300);
    let f = fence(claim(&*store, &key, lease).await);
    tokio::time::sleep(lease + fixture.slack()).await;
    assert_lost(store.complete(&key, f).await, "complete after the lease");
    let again = fence(claim(&*store, &key, lease).await);
    assert!(again > f);
}

/// A released claim (the effect did not happen) frees the key at once.
async fn release_frees_the_key_at_once(fixture: Arc<dyn ClaimFixture>) {
    let (a, b) = (fixture.open().await, fixture.open().await);
    let key = unique_key("release");
    let lease = Duration::from_secs(30);
    let f = fence(claim(&*a, &key, lease).await);
    a.release(&key, f).await.unwrap();
    let g = fence(claim(&*b, &key, lease).await);
    assert!(g > f);
    assert_lost(a.release(&key, f).await, "release of a released claim");
    assert_held(claim(&*a, &key, lease).await, lease, fixture.slack());
}

/// Extending a live claim keeps the key past its first lease, and the
/// completion is accepted then.
async fn extend_keeps_the_key(fixture: Arc<dyn ClaimFixture>) {
    let (a, b) = (fixture.open().await, fixture.open().await);
    let key = unique_key("extend");
    let lease = Duration::from_millis(600);
    let f = fence(claim(&*a, &key, lease).await);
    a.extend(&key, f, Duration::from_secs(30)).await.unwrap();
    tokio::time::sleep(lease + fixture.slack()).await;
    let remaining = assert_held(
        claim(&*b, &key, Duration::from_secs(30)).await,
        Duration::from_secs(30),
        fixture.slack(),
    );
    assert!(
        remaining > Duration::from_secs(20),
        "extended lease has {remaining:?} left"
    );
    a.complete(&key, f).await.unwrap();
    assert_eq!(claim(&*b, &key, lease).await, Claim::Done);
    assert_lost(
        a.extend(&key, f, lease).await,
        "extend of a completed claim",
    );
}

/// Complete, release and extend with a fence that is not the key's latest,
/// or on a key never claimed, change nothing and say so.
async fn operations_of_a_stale_fence_are_lost(fixture: Arc<dyn ClaimFixture>) {
    let store = fixture.open().await;
    let key = unique_key("stale");
    let lease = Duration::from_secs(30);
    let never = unique_key("never");
    assert_lost(
        store.complete(&never, 1).await,
        "complete of a key never claimed",
    );
    assert_lost(
        store.release(&never, 1).await,
        "release of a key never claimed",
    );
    assert_lost(
        store.extend(&never, 1, lease).await,
        "extend of a key never claimed",
    );
    let f = fence(claim(&*store, &key, lease).await);
    assert_lost(
        store.complete(&key, f + 1).await,
        "complete with a future fence",
    );
    assert_lost(
        store.complete(&key, f.wrapping_sub(1)).await,
        "complete with an old fence",
    );
    assert_lost(
        store.release(&key, f + 7).await,
        "release with another fence",
    );
    // Still held by `f`.
    store.complete(&key, f).await.unwrap();
    assert_eq!(claim(&*store, &key, lease).await, Claim::Done);
}

/// Bad keys and leases are refused before anything is stored.
async fn invalid_claims_are_refused(fixture: Arc<dyn ClaimFixture>) {
    let store = fixture.open().await;
    let long = "k".repeat(jobrail::MAX_CLAIM_KEY_BYTES + 1);
    let ok = unique_key("invalid");
    for (key, lease, what) in [
        ("", Duration::from_secs(1), "an empty key"),
        (
            long.as_str(),
            Duration::from_secs(1),
            "a key over the limit",
        ),
        (ok.as_str(), Duration::ZERO, "a zero lease"),
        (
            ok.as_str(),
            jobrail::MAX_CLAIM_LEASE + Duration::from_secs(1),
            "a lease over the limit",
        ),
    ] {
        let result = store.claim(key, lease).await;
        assert!(
            matches!(result, Err(ClaimError::Invalid(_))),
            "{what}: expected ClaimError::Invalid, got {result:?}"
        );
    }
    // Nothing was stored for the valid key.
    fence(claim(&*store, &ok, Duration::from_secs(1)).await);
    // Keys are taken as bytes: any text is a key of its own.
    let odd = format!("{}:ünïcode 'quoted' \"key\" %_\\", unique_key("odd"));
    let f = fence(claim(&*store, &odd, Duration::from_secs(30)).await);
    store.complete(&odd, f).await.unwrap();
    let prefix = &odd[..odd.len() - 1];
    fence(claim(&*store, prefix, Duration::from_secs(30)).await);
}

/// Six workers run one effect through `run_once`, retrying as the claim
/// asks: the effect runs once, the others end `AlreadyDone`, and a held key
/// asks for a retry through `RetryAfter`.
async fn run_once_runs_the_effect_once_across_racing_workers(fixture: Arc<dyn ClaimFixture>) {
    let key = Arc::new(unique_key("run-once"));
    let effects = Arc::new(AtomicU32::new(0));
    let lease = Duration::from_secs(30);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let store = fixture.open().await;
        let (key, effects) = (key.clone(), effects.clone());
        tasks.push(tokio::spawn(async move {
            let mut retries = 0;
            loop {
                let result = run_once(&*store, &key, lease, |_fence| async {
                    effects.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Ok::<_, JobError>(())
                })
                .await;
                match result {
                    Ok(once) => return (once, retries),
                    Err(e) => {
                        let Outcome::RetryAfter(delay) = e.outcome() else {
                            panic!("unexpected error {e}")
                        };
                        assert!(e.find::<ClaimHeld>().is_some(), "{e}");
                        assert!(delay <= lease + Duration::from_secs(1));
                        retries += 1;
                        // The holder finishes in 300 ms; poll faster than the lease.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    let mut ran = 0;
    let mut retried = 0;
    for task in tasks {
        let (once, retries) = task.await.unwrap();
        ran += usize::from(once.ran());
        retried += retries;
    }
    assert_eq!(ran, 1, "exactly one worker ran the effect");
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect ran once");
    assert!(retried > 0, "the racing workers saw the key held");
    let check = fixture.open().await;
    assert_eq!(
        run_once(&*check, &key, lease, |_| async { Ok::<_, JobError>(()) })
            .await
            .unwrap(),
        Once::AlreadyDone
    );
}

/// A failed effect releases its claim: the next attempt runs the effect at
/// once, with a higher fence, and the error keeps its outcome.
async fn run_once_releases_after_a_failed_effect(fixture: Arc<dyn ClaimFixture>) {
    let store = fixture.open().await;
    let key = unique_key("failed");
    let lease = Duration::from_secs(30);
    let mut fences = Vec::new();
    let failed = run_once(&*store, &key, lease, |f| {
        fences.push(f);
        async { Err::<(), _>(JobError::permanent("card declined")) }
    })
    .await
    .unwrap_err();
    assert_eq!(failed.outcome(), Outcome::Permanent);
    let again = run_once(&*store, &key, lease, |f| {
        fences.push(f);
        async { Ok::<_, JobError>(7) }
    })
    .await
    .unwrap();
    assert_eq!(again, Once::Ran(7));
    assert!(fences[1] > fences[0], "fences {fences:?}");
}
