use std::time::Duration;

use jobrail::{BoxFuture, Clock, Instant, Runtime};

/// Clock and sleep on tokio.
///
/// The clock is tokio's: under paused time (`tokio::time::pause`, a test's
/// `start_paused`) it moves with the virtual clock, so deadlines, breaker
/// cool-downs and sleeps all read the same time.
///
/// A sleep reads the clock when it is made (its deadline is fixed then) but
/// becomes a tokio timer only when it is first polled: the settlement budget
/// races each settlement against a sleep, and a settlement that is ready at
/// once (the memory driver settles synchronously) never polls it, so it
/// costs no timer.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioRuntime;

impl Clock for TokioRuntime {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

impl Runtime for TokioRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let deadline = tokio::time::Instant::now() + duration;
        // The timer is made inside the future, so on its first poll.
        Box::pin(async move { tokio::time::sleep_until(deadline).await })
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

    #[tokio::test(start_paused = true)]
    async fn a_sleep_counts_from_when_it_was_made_not_first_polled() {
        let runtime = TokioRuntime;
        let before = runtime.now();
        let sleep = runtime.sleep(Duration::from_secs(10));
        tokio::time::advance(Duration::from_secs(4)).await;
        sleep.await;
        assert_eq!(runtime.now() - before, Duration::from_secs(10));
    }
}
