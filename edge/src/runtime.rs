//! The rules' injected clock and sleep, on the Workers timer.

use std::time::Duration;

use jobrail::{BoxFuture, Clock, Instant, Runtime};

/// `performance.now()` for the clock, `setTimeout` for sleeping.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkersRuntime;

impl Clock for WorkersRuntime {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

impl Runtime for WorkersRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(worker::Delay::from(duration))
    }
}
