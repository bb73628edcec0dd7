//! A runtime-free cancellation signal ([`CancelToken`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// A cloneable, one-way cancellation flag that wakes its waiters.
///
/// The consumer cancels one token on shutdown; every handler context holds a
/// clone. Handlers either poll [`CancelToken::is_cancelled`] or await
/// [`CancelToken::cancelled`]. Implemented here (not with tokio) because the
/// rules crate must build for wasm32 without an async runtime.
///
/// Reading the flag is one atomic load (every delivery reads it, from every
/// worker thread); only waiting and cancelling take the lock.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Set once, under the lock, before the waiters are woken.
    cancelled: AtomicBool,
    waiters: Mutex<Vec<Waker>>,
}

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the token and wakes every waiter. Idempotent.
    pub fn cancel(&self) {
        let waiters = {
            let mut waiters = self.inner.waiters.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.cancelled.store(true, Ordering::Release);
            std::mem::take(&mut *waiters)
        };
        for waker in waiters {
            waker.wake();
        }
    }

    /// Whether [`cancel`](Self::cancel) has been called.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancelled.load(Ordering::Acquire)
    }

    /// A future that completes once the token is cancelled.
    pub fn cancelled(&self) -> Cancellation {
        Cancellation {
            token: self.clone(),
        }
    }
}

/// Future returned by [`CancelToken::cancelled`].
#[derive(Debug)]
pub struct Cancellation {
    token: CancelToken,
}

impl Future for Cancellation {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.token.is_cancelled() {
            return Poll::Ready(());
        }
        let inner = &self.token.inner;
        let mut waiters = inner.waiters.lock().unwrap_or_else(|e| e.into_inner());
        // Again under the lock: `cancel` sets the flag while holding it, so
        // a waker pushed here is one `cancel` will find.
        if inner.cancelled.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        if !waiters.iter().any(|w| w.will_wake(cx.waker())) {
            waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn cancellation_completes_waiters() {
        let token = CancelToken::new();
        let mut waiting = token.cancelled();
        assert!((&mut waiting).now_or_never().is_none());
        token.cancel();
        assert!(waiting.now_or_never().is_some());
        assert!(token.is_cancelled());
    }

    /// A waiter on another thread is woken, however the cancel and its wait
    /// interleave (no wake-up lost between the flag and the lock).
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn waiters_on_other_threads_are_woken() {
        for _ in 0..200 {
            let token = CancelToken::new();
            let waiter = {
                let token = token.clone();
                std::thread::spawn(move || futures_executor::block_on(token.cancelled()))
            };
            token.cancel();
            waiter.join().unwrap();
            assert!(token.clone().is_cancelled());
        }
    }
}
