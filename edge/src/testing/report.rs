//! What [`CloudflareQueues`](super::CloudflareQueues) reports: each
//! message's life, each delivery, each invocation.

use std::time::Duration;

use jobrail::{Event, Failure, FailureRecord};

use crate::batch::BatchSummary;

/// An explicit call the consumer made on a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `message.ack()`.
    Ack,
    /// `message.retry({ delaySeconds })`.
    Retry {
        /// The delay asked for, in whole seconds (rounded up from the rules'
        /// delay, as the platform takes it); `None`: the consumer's
        /// `retry_delay`.
        delay_seconds: Option<u32>,
    },
}

/// An outcome event the consumer reported for a message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    /// The platform id of the message it concerns (empty if the event came
    /// from outside any message's work, which the batch loop never does).
    pub message: String,
    /// When, on the virtual clock (time since the harness was created).
    pub at: Duration,
    /// The event.
    pub event: Event,
    /// `None` when the platform accepted the settlement (the event is an
    /// outcome); `Some(error)` when it refused it (the event is what would
    /// have been reported, and the message was kept for redelivery).
    pub refused: Option<String>,
}

/// One delivery of a message: the batch it came in and what became of it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryReport {
    /// The message's `attempts` on this delivery (first = 1).
    pub attempt: u32,
    /// The invocation, an index into [`CloudflareQueues::batches`](super::CloudflareQueues::batches).
    pub batch: usize,
    /// When the batch was delivered, on the virtual clock.
    pub delivered_at: Duration,
    /// The events reported during this delivery, in order.
    pub events: Vec<EventRecord>,
    /// The explicit call that decided the delivery (`None`: no call; the
    /// message was acknowledged when the invocation returned).
    pub call: Option<Call>,
    /// When the call was made, on the virtual clock.
    pub called_at: Option<Duration>,
}

impl DeliveryReport {
    /// Handler executions during this delivery (0 for a message handed back
    /// without running, or failed before any handler ran).
    pub fn executions(&self) -> u32 {
        self.events.iter().map(|e| e.event.executions).sum()
    }

    /// The outcome the platform accepted for this delivery, if any.
    pub fn outcome(&self) -> Option<&Event> {
        self.events
            .iter()
            .rev()
            .find(|e| e.refused.is_none())
            .map(|e| &e.event)
    }
}

/// Where a message stands.
#[derive(Debug, Clone, PartialEq)]
pub enum MessageState {
    /// On its queue, waiting for a delivery (or, on a queue the harness does
    /// not consume, waiting to be read).
    Pending,
    /// Acknowledged after its work was done (explicitly, or with no call
    /// when the invocation returned without a rejection).
    Acked,
    /// Rejected by its handler: no call was made, and the platform
    /// acknowledged it when the invocation returned. No failure record.
    Rejected,
    /// Failed terminally and acknowledged.
    Failed {
        /// Why.
        failure: Failure,
        /// The record sent to the failure queue; `None` when the worker has
        /// no failure queue (the record was only logged).
        record: Option<Box<FailureRecord>>,
    },
    /// The platform gave up after `max_retries` and moved it to the
    /// consumer's dead-letter queue.
    DeadLettered {
        /// The dead-letter queue.
        queue: String,
        /// The id of the copy there.
        id: String,
    },
    /// The platform gave up after `max_retries` and deleted it (the
    /// consumer has no dead-letter queue).
    Dropped,
    /// Not due yet (a dispatch delay beyond 24 hours): acknowledged without
    /// running once a copy of it (the same body) was sent to its queue,
    /// delayed by the next leg. A step, not an attempt: the copy starts at
    /// attempt 1. [`CloudflareQueues::legs`](super::CloudflareQueues::legs) follows the copies.
    SentOn {
        /// The platform id of the copy.
        copy: String,
    },
}

/// The life of one message.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageReport {
    /// The platform id (for [`CloudflareQueues::send`](super::CloudflareQueues::send), the envelope's id).
    pub id: String,
    /// The queue it was sent to.
    pub queue: String,
    /// Its body.
    pub body: Vec<u8>,
    /// When it was sent, on the virtual clock.
    pub sent_at: Duration,
    /// Its deliveries, in order.
    pub deliveries: Vec<DeliveryReport>,
    /// Where it stands now.
    pub state: MessageState,
}

impl MessageReport {
    /// The `attempts` of each delivery, in order (`[1, 2, 3]` for a message
    /// delivered three times).
    pub fn attempts(&self) -> Vec<u32> {
        self.deliveries.iter().map(|d| d.attempt).collect()
    }

    /// Handler executions over all deliveries.
    pub fn executions(&self) -> u32 {
        self.deliveries.iter().map(DeliveryReport::executions).sum()
    }

    /// The delay of each retry call, in order, in whole seconds (`None`: the
    /// consumer's `retry_delay`).
    pub fn retry_delays(&self) -> Vec<Option<u32>> {
        self.deliveries
            .iter()
            .filter_map(|d| match d.call {
                Some(Call::Retry { delay_seconds }) => Some(delay_seconds),
                _ => None,
            })
            .collect()
    }

    /// Every event reported for it, accepted or refused, in order.
    pub fn events(&self) -> impl Iterator<Item = &EventRecord> {
        self.deliveries.iter().flat_map(|d| d.events.iter())
    }

    /// The failure record sent for it, if it failed with one.
    pub fn failure_record(&self) -> Option<&FailureRecord> {
        match &self.state {
            MessageState::Failed {
                record: Some(record),
                ..
            } => Some(record),
            _ => None,
        }
    }
}

/// A message waiting on a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    /// The platform id.
    pub id: String,
    /// The body.
    pub body: Vec<u8>,
    /// Deliveries so far.
    pub attempts: u32,
    /// When it is (or became) visible, on the virtual clock.
    pub visible_at: Duration,
}

/// One invocation of the consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRun {
    /// Its index in [`CloudflareQueues::batches`](super::CloudflareQueues::batches).
    pub index: usize,
    /// The queue.
    pub queue: String,
    /// When the batch was delivered, on the virtual clock.
    pub started: Duration,
    /// When the invocation returned.
    pub finished: Duration,
    /// The platform ids of its messages, in batch order.
    pub messages: Vec<String>,
    /// What the batch loop reported.
    pub summary: BatchSummary,
}
