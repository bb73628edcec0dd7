//! The conformance suite against the in-memory driver, and generated cases
//! for the failure store's pages.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{FailureKind, FailureRecord};
use jobrail_conformance::failures::{check_pages, walk_pages};
use jobrail_conformance::{conformance_suite, Backend, Hooks};
use jobrail_native::{Driver, DriverError, Failures, MemoryConfig, MemoryDriver, Page, Purge};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseResult, TestRunner};

struct Memory {
    driver: MemoryDriver,
}

impl Memory {
    fn new() -> Self {
        // A maximum delay lets the suite provoke a refused settlement.
        let config = MemoryConfig {
            max_retry_delay: Some(Duration::from_secs(3600)),
            // Short, so the suite sees a refused settlement's message again.
            refused_hold: Duration::from_millis(500),
            // Short, so the suite's longer delays are carried in steps.
            max_dispatch_delay: Some(Duration::from_secs(1)),
        };
        Memory {
            driver: MemoryDriver::new(config),
        }
    }
}

#[async_trait]
impl Backend for Memory {
    async fn connect(&self) -> Arc<dyn Driver> {
        Arc::new(self.driver.clone())
    }

    fn hooks(&self) -> Hooks {
        Hooks {
            inject_failure_body: true,
            inject_body: true,
            ..Hooks::default()
        }
    }

    async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        self.driver.inject_failure_body(queue, body).await
    }

    /// The memory driver checks no size: its own send takes the body.
    async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let outgoing = jobrail_native::Outgoing {
            id: format!("injected-{}", body.len()),
            body,
            delay: None,
        };
        self.driver.send(queue, outgoing).await
    }
}

/// A record of message `n` that failed at `failed_at_ms`.
fn record(n: usize, failed_at_ms: u64) -> FailureRecord {
    FailureRecord {
        v: 1,
        id: format!("record-{n:03}"),
        queue: "pages".into(),
        message_id: Some(format!("message-{n:03}")),
        job: Some("job".into()),
        kind: FailureKind::Permanent,
        reason: "generated".into(),
        attempt: 1,
        executions: 1,
        failed_at_ms,
        envelope: None,
        raw_body: None,
        truncated: None,
    }
}

/// A store of `times.len()` entries (records failed at those times, in
/// that order; times repeat, as records of one millisecond do), plus
/// `foreign` entries that are not records.
async fn store(times: &[u64], foreign: usize) -> Failures {
    let driver = MemoryDriver::default();
    for (n, at) in times.iter().enumerate() {
        driver
            .inject_failure_body("pages", record(n, *at).encode())
            .await
            .unwrap();
    }
    for n in 0..foreign {
        driver
            .inject_failure_body("pages", format!("not a record {n}").into_bytes())
            .await
            .unwrap();
    }
    Failures::new(Arc::new(driver))
}

/// Runs `cases` generated from `strategy`, each on the test's runtime.
fn generated<S: Strategy>(strategy: S, case: impl Fn(S::Value) -> TestCaseResult) {
    tokio::task::block_in_place(|| {
        let mut runner = TestRunner::new(Config {
            cases: 128,
            failure_persistence: None,
            ..Config::default()
        });
        if let Err(e) = runner.run(&strategy, case) {
            panic!("{e}");
        }
    });
}

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Handle::current().block_on(future)
}

/// Any number of entries (records of repeating times, entries that are
/// not records), any fixed page size: the pages are oldest first and hold
/// every entry once, each page full but the last; reading twice gives the
/// same pages.
async fn failure_pages_at_any_size_hold_every_entry_once() {
    let strategy = (
        proptest::collection::vec(0u64..4, 0..20),
        0usize..3,
        1usize..25,
    );
    generated(strategy, |(times, foreign, limit)| {
        block_on(async {
            let failures = store(&times, foreign).await;
            let all = failures.all("pages").await.unwrap();
            prop_assert_eq!(all.len(), times.len() + foreign);
            prop_assert!(all
                .windows(2)
                .all(|w| w[0].failed_at_ms() <= w[1].failed_at_ms()));
            let pages = walk_pages(&failures, "pages", limit).await;
            check_pages(&pages, &all, limit);
            prop_assert_eq!(walk_pages(&failures, "pages", limit).await, pages);
            Ok(())
        })
    });
}

/// Pages of changing sizes, and the entry a cursor names purged before the
/// next page is read: every entry is listed once, none skipped, even among
/// records of one millisecond.
async fn failure_pages_continue_after_a_purged_cursor_entry() {
    let strategy = (
        proptest::collection::vec(0u64..3, 1..16),
        proptest::collection::vec(1usize..5, 1..6),
        proptest::collection::vec(any::<bool>(), 1..6),
    );
    generated(strategy, |(times, limits, purge_cursor)| {
        block_on(async {
            let failures = store(&times, 0).await;
            let before = failures.all("pages").await.unwrap();
            let mut listed = Vec::new();
            let mut purged = Vec::new();
            let mut after = None;
            for i in 0.. {
                let limit = limits[i % limits.len()];
                let page = failures
                    .list("pages", &Page { after, limit })
                    .await
                    .unwrap();
                prop_assert!(page.entries.len() <= limit);
                listed.extend(page.entries.iter().map(|e| e.id.clone()));
                after = page.next.clone();
                if after.is_none() {
                    break;
                }
                if purge_cursor[i % purge_cursor.len()] {
                    let last = page.entries.last().unwrap().id.clone();
                    let went = failures
                        .purge("pages", &Purge::One(last.clone()))
                        .await
                        .unwrap();
                    prop_assert_eq!(went, 1);
                    purged.push(last);
                }
                prop_assert!(i < 100, "the cursors do not come to an end");
            }
            let want: Vec<String> = before.iter().map(|e| e.id.clone()).collect();
            prop_assert_eq!(&listed, &want, "purged on the way: {:?}", purged);
            Ok(())
        })
    });
}

conformance_suite!(
    Memory::new();
    extra: failure_pages_at_any_size_hold_every_entry_once,
    failure_pages_continue_after_a_purged_cursor_entry,
);
