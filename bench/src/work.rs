//! The job every benchmark runs, its no-op handler, and the envelope as a
//! hand-written consumer decodes it (the baselines' one typed pass).

use std::collections::BTreeMap;

use jobrail::{JobContext, JobError};
use serde::{Deserialize, Serialize};

/// The payload of every benchmark job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Work {
    /// A sequence number.
    pub id: u64,
    /// A short string, so that decoding does some work.
    pub name: String,
}

/// The facade's handler: a no-op on the decoded payload.
pub async fn handler(_: JobContext, work: Work) -> Result<(), JobError> {
    std::hint::black_box(&work);
    Ok(())
}

/// The envelope as a hand-written consumer decodes it: one pass, the
/// payload typed.
#[derive(Debug, Deserialize)]
pub struct TypedEnvelope {
    /// Format version.
    pub v: u32,
    /// Message id.
    pub id: String,
    /// Job name.
    pub job: String,
    /// The typed payload.
    pub payload: Work,
    /// Dispatch time.
    pub dispatched_at_ms: u64,
    /// Metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// The benchmark job (`work`) on `queue`.
pub fn job(queue: &str) -> jobrail::Job<Work> {
    jobrail::Job::<Work>::builder("work")
        .queue(queue)
        .build()
        .expect("a valid job")
}

/// `n` payloads, numbered from 0.
pub fn payloads(n: u64) -> Vec<Work> {
    (0..n)
        .map(|id| Work {
            id,
            name: "report".into(),
        })
        .collect()
}

/// The envelope as a hand-written producer writes it: a fresh UUID v4 as
/// its id, the typed payload serialized in place, the time. What the
/// dispatch baselines encode inside their clock, as the facade encodes
/// its own. Returns the id and the body.
pub fn encode_by_hand<P: Serialize>(work: &P) -> (String, Vec<u8>) {
    #[derive(Serialize)]
    struct Written<'a, P> {
        v: u32,
        id: &'a str,
        job: &'a str,
        payload: &'a P,
        dispatched_at_ms: u64,
    }
    let id = uuid::Uuid::new_v4().to_string();
    let dispatched_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let body = serde_json::to_vec(&Written {
        v: 1,
        id: &id,
        job: "work",
        payload: work,
        dispatched_at_ms,
    })
    .expect("the envelope serializes");
    (id, body)
}
