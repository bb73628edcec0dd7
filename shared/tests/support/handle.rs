//! A delivery for tests of the pipeline: a body at an attempt, whose
//! settlements are recorded and answered as the test chooses. Shared by
//! `tests/pipeline.rs` and `support/delivery_oracle.rs` (and through it the
//! property test and the fuzz target), which include this file.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use jobrail::{BoxFuture, DeliveryHandle, ErrorKind, Settlement, SettlementError};

/// How the backend answers a settlement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Answer {
    /// Accepted.
    Accept,
    /// Refused (not accepted).
    Refuse,
    /// Never answered.
    Hang,
}

/// One delivery of `body` on delivery `attempt`; every settlement asked of
/// it is pushed onto `seen`, then answered with `answer`.
pub(crate) struct Handle {
    pub(crate) body: Vec<u8>,
    pub(crate) attempt: u32,
    pub(crate) answer: Answer,
    pub(crate) seen: Arc<Mutex<Vec<Settlement>>>,
}

impl Handle {
    /// `body` on its first delivery, settlements accepted and recorded in
    /// `seen`.
    pub(crate) fn new(body: Vec<u8>, seen: &Arc<Mutex<Vec<Settlement>>>) -> Self {
        Handle {
            body,
            attempt: 1,
            answer: Answer::Accept,
            seen: Arc::clone(seen),
        }
    }

    /// The same on delivery `attempt`.
    pub(crate) fn at(self, attempt: u32) -> Self {
        Handle { attempt, ..self }
    }

    /// The same, its settlements answered with `answer`.
    pub(crate) fn answering(self, answer: Answer) -> Self {
        Handle { answer, ..self }
    }
}

impl DeliveryHandle for Handle {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn settle<'a>(self, settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a,
    {
        self.seen.lock().unwrap().push(settlement.clone());
        match self.answer {
            Answer::Accept => Box::pin(std::future::ready(Ok(()))),
            Answer::Refuse => Box::pin(std::future::ready(Err(SettlementError::new(
                ErrorKind::NotAccepted,
                "the backend said no",
            )))),
            Answer::Hang => Box::pin(std::future::pending()),
        }
    }
}
