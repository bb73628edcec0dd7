//! The one-pass pure path: a successful delivery decodes its payload once,
//! a tier-one retry decodes it again from the raw payload, and what the
//! context borrows from the envelope (metadata, message id) is whole again
//! in the event and the failure record, whether or not the handler kept
//! its context.

#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use futures_executor::block_on;
use jobrail::{
    CancelToken, Envelope, EventKind, Incoming, Job, JobContext, JobError, Registry, Resolution,
    Runtime, Settlement, VirtualRuntime,
};
use serde::{Deserialize, Deserializer};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// A payload that counts how many times it is decoded.
#[derive(Debug, PartialEq)]
struct Counted(u64);

static DECODES: AtomicU32 = AtomicU32::new(0);

impl<'de> Deserialize<'de> for Counted {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        DECODES.fetch_add(1, Ordering::SeqCst);
        u64::deserialize(d).map(Counted)
    }
}

fn envelope(job: &str) -> Envelope {
    let mut envelope = Envelope::new(job, serde_json::json!(41));
    envelope.metadata.insert("tenant".into(), "a\"b".into());
    envelope
}

fn process(registry: &Registry, body: &[u8]) -> jobrail::Processed {
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let delivery = Incoming {
        queue: "default",
        body,
        attempt: 1,
        shutdown_returns: None,
        deadline: None,
    };
    block_on(registry.process(delivery, &runtime, &CancelToken::new()))
}

/// One test for the decode counts (the counter is global to this binary).
#[test]
fn success_decodes_once_and_a_tier_one_retry_decodes_again() {
    let validated = Arc::new(AtomicU32::new(0));
    let seen = validated.clone();
    let job = Job::<Counted>::builder("counted")
        .tier_one(3)
        .validate(move |p: &Counted| {
            seen.fetch_add(1, Ordering::SeqCst);
            assert_eq!(p, &Counted(41));
            Ok(())
        })
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let contexts = Arc::new(Mutex::new(Vec::new()));
    let (c, kept) = (calls.clone(), contexts.clone());
    let mut registry = Registry::new();
    registry
        .register(&job, move |ctx: JobContext, p: Counted| {
            let (c, kept) = (c.clone(), kept.clone());
            async move {
                assert_eq!(p, Counted(41));
                assert_eq!(ctx.metadata()["tenant"], "a\"b");
                assert_eq!(ctx.job(), "counted");
                assert_eq!(ctx.queue(), "default");
                kept.lock().unwrap().push(ctx.clone());
                // Fails until the third execution of each delivery.
                if c.fetch_add(1, Ordering::SeqCst) % 3 < 2 {
                    return Err(JobError::new("flaky"));
                }
                Ok(())
            }
        })
        .unwrap();

    // Three executions: one decode when prepared (for validation and the
    // first execution), one more for each tier-one retry.
    let env = envelope("counted");
    DECODES.store(0, Ordering::SeqCst);
    let processed = process(&registry, &env.encode());
    assert_eq!(processed.settlement, Settlement::Ack);
    assert_eq!(processed.executions(), 3);
    assert_eq!(DECODES.load(Ordering::SeqCst), 3);
    assert_eq!(validated.load(Ordering::SeqCst), 1);
    assert_eq!(
        processed.event.kind,
        EventKind::Succeeded {
            resolution: Resolution::TierOne { attempt: 3, of: 3 }
        }
    );
    assert_eq!(processed.event.message_id, env.id, "kept contexts: a copy");
    let kept = contexts.lock().unwrap();
    assert_eq!(kept.len(), 3);
    assert_eq!(kept[0].message_id(), env.id);
    assert_eq!(
        (kept[0].in_process_attempt(), kept[2].in_process_attempt()),
        (1, 3)
    );
    drop(kept);

    // A first execution that succeeds decodes once.
    let single = Job::<Counted>::builder("single").build().unwrap();
    registry
        .register(&single, |_: JobContext, p: Counted| async move {
            assert_eq!(p, Counted(41));
            Ok(())
        })
        .unwrap();
    DECODES.store(0, Ordering::SeqCst);
    let env = envelope("single");
    let processed = process(&registry, &env.encode());
    assert_eq!(processed.settlement, Settlement::Ack);
    assert_eq!(DECODES.load(Ordering::SeqCst), 1, "one typed decode");
    assert_eq!(processed.event.message_id, env.id);
    assert_eq!(&*processed.event.job, "single");
    assert_eq!(&*processed.event.queue, "default");
    assert_eq!(
        registry.stats().job("single").first_attempt,
        0,
        "not settled"
    );
    registry.settled(&processed, Ok(()));
    assert_eq!(registry.stats().job("single").first_attempt, 1);
    assert_eq!(registry.stats().job("single").executions, 1);
}

/// A terminal failure's record holds the whole envelope, metadata included,
/// whether the handler dropped its context or kept a clone of it.
#[test]
fn the_failure_record_keeps_the_metadata_the_context_borrowed() {
    for keep in [false, true] {
        let job = Job::<u64>::builder("fails").build().unwrap();
        let contexts = Arc::new(Mutex::new(Vec::new()));
        let kept = contexts.clone();
        let mut registry = Registry::new();
        registry
            .register(&job, move |ctx: JobContext, _: u64| {
                if keep {
                    kept.lock().unwrap().push(ctx);
                }
                async { Err(JobError::permanent("no")) }
            })
            .unwrap();
        registry.events_include_payload(true);
        let env = envelope("fails");
        let processed = process(&registry, &env.encode());
        let Settlement::Fail(record) = &processed.settlement else {
            panic!("{:?}", processed.settlement);
        };
        assert_eq!(record.envelope.as_ref(), Some(&env), "keep: {keep}");
        assert_eq!(record.message_id.as_deref(), Some(env.id.as_str()));
        assert_eq!(processed.event.message_id, env.id);
        assert_eq!(processed.event.payload, Some(env.payload.clone()));
        assert_eq!(contexts.lock().unwrap().len(), usize::from(keep));
    }
}
