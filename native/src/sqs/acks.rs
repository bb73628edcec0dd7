//! Acks coalesced into `DeleteMessageBatch` calls.
//!
//! Each subscription has one [`Acker`], shared by its deliveries (which
//! stay settleable after the subscription is gone). An ack hands its
//! receipt to the acker and waits for the answer about its own entry; the
//! acker sends what waits as one `DeleteMessageBatch` call (at most
//! [`BATCH_ENTRIES`] entries, the calls in flight together), as soon as:
//!
//! - ten entries wait; or
//! - no other delivery of the subscription could join: none handed out
//!   unsettled, none buffered (so a lone ack, at concurrency 1 say, waits
//!   for nothing); or
//! - the entries waiting and in flight fill the subscription's prefetch (the
//!   consumer's every slot is held by a settlement waiting here, so no
//!   other delivery can be handed out to join them); or
//! - [`ACK_LINGER`] has passed since the first of them arrived.
//!
//! Each ack's result is its own entry's: listed as deleted, `Ok`; listed as
//! failed (an expired or unknown receipt...), [`ErrorKind::NotAccepted`],
//! as a single `DeleteMessage` that SQS refused; named in neither list,
//! [`ErrorKind::Uncertain`]. A call that failed whole gives every entry its
//! error, kind chosen as for `DeleteMessage` (refused or certainly not
//! sent: not accepted; outcome unknown: uncertain), the SDK's error shared
//! as the cause. So one entry SQS refuses fails only its own settlement.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use tokio::sync::oneshot;

use super::connection::bounded;
use super::errors::{error, fan_out, sdk_error};
use super::publish::BATCH_ENTRIES;
use super::SqsDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

/// The longest an ack waits for others to share its `DeleteMessageBatch`
/// call while more deliveries of its subscription are in hand.
pub(super) const ACK_LINGER: Duration = Duration::from_millis(2);

/// One subscription's pending acks and what it has in hand.
pub(super) struct Acker {
    driver: SqsDriver,
    queue: Arc<str>,
    url: Arc<str>,
    prefetch: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Acks not yet in a call.
    waiting: Vec<Waiting>,
    /// Deliveries handed out and not yet settling.
    out: usize,
    /// Deliveries received and not yet handed out.
    buffered: usize,
    /// Acks in calls not yet answered.
    in_flight: usize,
    /// A linger timer is armed.
    timer: bool,
}

struct Waiting {
    receipt: String,
    done: oneshot::Sender<Result<(), DriverError>>,
}

impl Acker {
    pub(super) fn new(driver: SqsDriver, queue: Arc<str>, url: Arc<str>, prefetch: usize) -> Self {
        Acker {
            driver,
            queue,
            url,
            prefetch: prefetch.max(1),
            state: Mutex::default(),
        }
    }

    /// Deliveries handed out and not yet settling.
    pub(super) fn out(&self) -> usize {
        lock(&self.state).out
    }

    /// The subscription now buffers `n` deliveries.
    pub(super) fn set_buffered(self: &Arc<Self>, n: usize) {
        let mut state = lock(&self.state);
        state.buffered = n;
        self.check(&mut state);
    }

    /// A delivery was handed out.
    pub(super) fn handed_out(&self) {
        lock(&self.state).out += 1;
    }

    /// A delivery handed out is settling otherwise than by ack, or was
    /// dropped.
    pub(super) fn left(self: &Arc<Self>) {
        let mut state = lock(&self.state);
        state.out = state.out.saturating_sub(1);
        self.check(&mut state);
    }

    /// Deletes the message of `receipt` in the next `DeleteMessageBatch`
    /// call; `was_out`: the delivery was counted as handed out.
    pub(super) async fn ack(
        self: &Arc<Self>,
        receipt: String,
        was_out: bool,
    ) -> Result<(), DriverError> {
        let (done, answer) = oneshot::channel();
        {
            let mut state = lock(&self.state);
            if was_out {
                state.out = state.out.saturating_sub(1);
            }
            state.waiting.push(Waiting { receipt, done });
            self.check(&mut state);
        }
        answer.await.unwrap_or_else(|_| {
            Err(error(
                ErrorKind::Uncertain,
                format!(
                    "DeleteMessageBatch on `{}`: the call ended without an answer",
                    self.queue
                ),
            ))
        })
    }

    /// Sends what waits if it is time (see the module docs), or arms the
    /// linger timer.
    fn check(self: &Arc<Self>, state: &mut State) {
        while state.waiting.len() >= BATCH_ENTRIES {
            self.flush(state);
        }
        if state.waiting.is_empty() {
            return;
        }
        let alone = state.out == 0 && state.buffered == 0;
        let blocked = state.waiting.len() + state.in_flight >= self.prefetch;
        if alone || blocked {
            self.flush(state);
        } else if !state.timer {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                self.flush(state);
                return;
            };
            state.timer = true;
            let acker = self.clone();
            runtime.spawn(async move {
                tokio::time::sleep(ACK_LINGER).await;
                let mut state = lock(&acker.state);
                state.timer = false;
                if !state.waiting.is_empty() {
                    acker.flush(&mut state);
                }
            });
        }
    }

    /// Starts one call for up to ten waiting acks.
    fn flush(self: &Arc<Self>, state: &mut State) {
        let take = state.waiting.len().min(BATCH_ENTRIES);
        let batch: Vec<Waiting> = state.waiting.drain(..take).collect();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to run the call: the waiters are gone too,
            // and the messages return when their visibility ends.
            return;
        };
        state.in_flight += batch.len();
        let acker = self.clone();
        runtime.spawn(async move {
            let n = batch.len();
            let (receipts, done): (Vec<String>, Vec<_>) =
                batch.into_iter().map(|w| (w.receipt, w.done)).unzip();
            let results = delete_batch(&acker.driver, &acker.url, &acker.queue, receipts).await;
            lock(&acker.state).in_flight -= n;
            for (done, result) in done.into_iter().zip(results) {
                let _ = done.send(result);
            }
        });
    }
}

/// One `DeleteMessageBatch` call for `receipts` (at most ten) on `url`:
/// one result per receipt, in order (see the module docs).
pub(super) async fn delete_batch(
    driver: &SqsDriver,
    url: &str,
    queue: &str,
    receipts: Vec<String>,
) -> Vec<Result<(), DriverError>> {
    let n = receipts.len();
    let what = format!("DeleteMessageBatch on `{queue}`");
    let entries = receipts
        .into_iter()
        .enumerate()
        .map(|(i, receipt)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(receipt)
                .build()
        })
        .collect::<Result<Vec<_>, _>>();
    let entries = match entries {
        Ok(entries) => entries,
        Err(e) => {
            let e = error(ErrorKind::NotAccepted, format!("{what}: {e}"));
            return fan_out(e, n).into_iter().map(Err).collect();
        }
    };
    let limit = driver.inner.config.operation_timeout;
    let request = driver
        .inner
        .client
        .delete_message_batch()
        .queue_url(url)
        .set_entries(Some(entries));
    let answer = match bounded(limit, &what, ErrorKind::Uncertain, request.send()).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            let e = sdk_error(&what, e, ErrorKind::NotAccepted, ErrorKind::Uncertain);
            return fan_out(e, n).into_iter().map(Err).collect();
        }
        Err(e) => return fan_out(e, n).into_iter().map(Err).collect(),
    };
    (0..n)
        .map(|i| {
            let id = i.to_string();
            if answer.successful().iter().any(|s| s.id() == id) {
                Ok(())
            } else if let Some(refused) = answer.failed().iter().find(|f| f.id() == id) {
                Err(error(
                    ErrorKind::NotAccepted,
                    format!(
                        "{what}: entry refused: {}: {}",
                        refused.code(),
                        refused.message().unwrap_or_default()
                    ),
                ))
            } else {
                Err(error(
                    ErrorKind::Uncertain,
                    format!(
                        "{what}: SQS's answer names neither success nor failure for this entry"
                    ),
                ))
            }
        })
        .collect()
}
