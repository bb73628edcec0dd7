//! Time, injected ([`Runtime`], [`Clock`], [`VirtualRuntime`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use web_time::Instant;
pub use web_time::{SystemTime, UNIX_EPOCH};

use crate::model::maybe_send::{BoxFuture, MaybeSend, MaybeSync};

/// A monotonic clock.
pub trait Clock: MaybeSend + MaybeSync {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// A clock plus the ability to sleep.
///
/// The rules never read a clock or sleep on their own: the native worker
/// passes a tokio-backed [`Runtime`], the edge a Workers timer, and tests a
/// [`VirtualRuntime`] whose sleeps advance a virtual clock instantly. This is
/// what lets the same executor run on wasm32 (where `std::time::Instant::now`
/// panics and tokio's timer is unavailable) and be tested without sleeping.
pub trait Runtime: Clock {
    /// A future that completes after `duration`.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

/// The platform clock (`web_time::Instant`, which also works on wasm32).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A runtime whose clock only moves when something sleeps or [`advance`] is
/// called. Sleeping completes at once after moving the clock forward, so
/// tests of backoff and deadlines run instantly and deterministically.
///
/// [`advance`]: VirtualRuntime::advance
#[derive(Debug, Clone)]
pub struct VirtualRuntime {
    base: Instant,
    state: Arc<Mutex<VirtualState>>,
}

#[derive(Debug, Default)]
struct VirtualState {
    elapsed: Duration,
    sleeps: Vec<Duration>,
}

impl Default for VirtualRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl VirtualRuntime {
    /// A virtual clock starting now.
    pub fn new() -> Self {
        VirtualRuntime {
            base: Instant::now(),
            state: Arc::default(),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.elapsed = state.elapsed.saturating_add(by);
    }

    /// Virtual time elapsed since creation.
    pub fn elapsed(&self) -> Duration {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).elapsed
    }

    /// Every sleep requested so far, in order.
    pub fn sleeps(&self) -> Vec<Duration> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sleeps
            .clone()
    }
}

impl Clock for VirtualRuntime {
    fn now(&self) -> Instant {
        let elapsed = self.elapsed();
        self.base.checked_add(elapsed).unwrap_or(self.base)
    }
}

impl Runtime for VirtualRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.elapsed = state.elapsed.saturating_add(duration);
            state.sleeps.push(duration);
        }
        Box::pin(std::future::ready(()))
    }
}
