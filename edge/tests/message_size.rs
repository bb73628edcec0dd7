//! Cloudflare Queues refuses a message above 128 KB (128,000 bytes): the
//! producer side refuses it first, with an error naming the limit and the
//! size, and sends nothing. The native harness runs the same check as the
//! Worker's `EdgeProducer`.

#![cfg(not(target_arch = "wasm32"))]

use jobrail::{Envelope, Job, JobContext, JobError, Registry, RegistryError};
use jobrail_edge::testing::{CloudflareQueues, MessageState};
use jobrail_edge::{EdgeErrorKind, Options, MAX_MESSAGE_BYTES};

const WRANGLER: &str = r#"
[[queues.producers]]
queue = "blobs"
binding = "BLOBS"

[[queues.consumers]]
queue = "blobs"
max_batch_size = 1
max_retries = 10
dead_letter_queue = "blobs-dlq"
"#;

fn job() -> Job<String> {
    Job::<String>::builder("store-blob")
        .queue("blobs")
        .max_deliveries(3)
        .build()
        .expect("a valid job")
}

async fn store(_ctx: JobContext, blob: String) -> Result<(), JobError> {
    if blob.is_empty() {
        return Err(JobError::permanent("empty blob"));
    }
    Ok(())
}

fn harness() -> CloudflareQueues {
    let jobs = || -> Result<Registry, RegistryError> {
        let mut registry = Registry::new();
        registry.register(&job(), store)?;
        Ok(registry)
    };
    CloudflareQueues::new(WRANGLER, jobs, Options::DEFAULT).expect("the configuration fits")
}

/// A payload whose envelope, as the producer sends it, is exactly `size`
/// bytes. Every envelope of this job has the same overhead: a UUID, a
/// 13-digit millisecond time and the job name.
fn payload_for_message_of(size: usize) -> String {
    let overhead = Envelope::new(job().name(), serde_json::json!(""))
        .encode()
        .len();
    "b".repeat(size - overhead)
}

#[test]
fn a_message_of_exactly_the_limit_is_sent_and_runs() {
    let mut cf = harness();
    let id = cf
        .try_send(&job(), &payload_for_message_of(MAX_MESSAGE_BYTES))
        .expect("a message of exactly 128,000 bytes is accepted");
    assert_eq!(cf.queued("blobs")[0].body.len(), MAX_MESSAGE_BYTES);
    assert_eq!(cf.run_until_idle(), 1);
    assert_eq!(cf.state(&id), &MessageState::Acked);
}

#[test]
fn a_message_above_the_limit_is_refused_before_anything_is_sent() {
    let mut cf = harness();
    for size in [MAX_MESSAGE_BYTES + 1, 4 * MAX_MESSAGE_BYTES] {
        let err = cf
            .try_send(&job(), &payload_for_message_of(size))
            .expect_err("above 128,000 bytes the platform would refuse it");
        assert_eq!(err.kind, EdgeErrorKind::Unsupported);
        let text = err.to_string();
        assert!(
            text.contains(&format!("{size} bytes")),
            "names the size: {text}"
        );
        assert!(text.contains("128000 bytes"), "names the limit: {text}");
        assert!(!text.contains("bbbb"), "keeps the payload out: {text}");
    }
    assert!(cf.queued("blobs").is_empty(), "nothing was queued");
    assert!(cf.messages().is_empty(), "nothing was queued");
    assert_eq!(cf.run_until_idle(), 0);
}

#[test]
#[should_panic(expected = "limit of 128000 bytes")]
fn send_panics_on_a_message_above_the_limit() {
    harness().send(&job(), &payload_for_message_of(MAX_MESSAGE_BYTES + 1));
}
