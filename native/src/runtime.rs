//! The tokio implementation of the rules' injected clock and sleep.

use std::time::Duration;

use queue::{BoxFuture, Clock, Instant, Runtime};

/// Clock and sleep on tokio.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioRuntime;

impl Clock for TokioRuntime {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

impl Runtime for TokioRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}
