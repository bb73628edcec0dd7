use std::time::Duration;

use jobrail::{BoxFuture, Clock, Instant, Runtime};

/// Clock and sleep on tokio.
///
/// The clock is tokio's: under paused time (`tokio::time::pause`, a test's
/// `start_paused`) it moves with the virtual clock, so deadlines, breaker
/// cool-downs and sleeps all read the same time.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioRuntime;

impl Clock for TokioRuntime {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

impl Runtime for TokioRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_clock_follows_tokios_paused_time() {
        let runtime = TokioRuntime;
        let before = runtime.now();
        runtime.sleep(Duration::from_secs(3600)).await;
        assert!(runtime.now() - before >= Duration::from_secs(3600));
    }
}
