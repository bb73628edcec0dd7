//! A runtime-free cancellation signal ([`CancelToken`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// A cloneable, one-way cancellation flag that wakes its waiters.
///
/// The consumer cancels one token on shutdown; every handler context holds a
/// clone. Handlers either poll [`CancelToken::is_cancelled`] or await
/// [`CancelToken::cancelled`]. Implemented here (not with tokio) because the
/// rules crate must build for wasm32 without an async runtime.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    inner: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    cancelled: bool,
    waiters: Vec<Waker>,
}

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the token and wakes every waiter. Idempotent.
    pub fn cancel(&self) {
        let waiters = {
            let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            state.cancelled = true;
            std::mem::take(&mut state.waiters)
        };
        for waker in waiters {
            waker.wake();
        }
    }

    /// Whether [`cancel`](Self::cancel) has been called.
    pub fn is_cancelled(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cancelled
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
        let mut state = self.token.inner.lock().unwrap_or_else(|e| e.into_inner());
        if state.cancelled {
            return Poll::Ready(());
        }
        if !state.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            state.waiters.push(cx.waker().clone());
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
}
