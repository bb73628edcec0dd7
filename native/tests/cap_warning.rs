//! The start-up warning for a job whose delivery cap was never chosen, read
//! from the consumer's log.
//!
//! This test has a binary of its own: `tracing` caches each call site's
//! interest process-wide, and a consumer started by a test on another
//! thread, before this test's subscriber exists, can leave the warning's
//! call site cached as uninteresting, so the line would never reach the
//! subscriber and the test would fail by chance.
#![cfg(feature = "memory")]

use std::sync::{Arc, Mutex};

use jobrail::{Job, JobContext, Registry};
use jobrail_native::{Consumer, MemoryDriver};

/// A job whose delivery cap was never chosen is named in a warning when the
/// consumer starts; one that chose `.uncapped()` or a cap is not.
#[tokio::test]
async fn an_unchosen_cap_is_logged_when_the_consumer_starts() {
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = Buffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let mut registry = Registry::new();
    for job in [
        Job::<u32>::builder("forgotten").queue("q").build().unwrap(),
        Job::<u32>::builder("endless")
            .queue("q")
            .uncapped()
            .build()
            .unwrap(),
        Job::<u32>::builder("capped")
            .queue("q")
            .max_deliveries(3)
            .build()
            .unwrap(),
    ] {
        registry
            .register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
    }
    let driver = Arc::new(MemoryDriver::default());
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    tokio::task::yield_now().await;
    consumer.shutdown().await.unwrap();

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("has no delivery cap"))
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains("`forgotten`"),
        "{text}"
    );
}
