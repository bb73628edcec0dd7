//! Turning a handler panic into an ordinary error.
//!
//! Why: one bad message must not take the worker (or, on the edge, the whole
//! wasm instance) down with it. A panic is caught wherever the handler
//! raises it: in the call that builds its future (the synchronous part of a
//! closure, before its `async` block) and around each poll of that future.
//! It becomes a [`Panicked`] error carrying the panic message and a
//! backtrace of where it happened. The backtrace is captured by
//! a panic hook (installed once, chaining to the previous hook for panics
//! outside handlers), because by the time `catch_unwind` returns the stack
//! of the panic is gone.
//!
//! On targets built with `panic = "abort"` (wasm32-unknown-unknown) nothing
//! can be caught; the edge binding settles messages so that an abort costs a
//! retry, not a loss.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::model::error::{JobError, Panicked};
use crate::model::maybe_send::BoxFuture;

/// Calls `start` and runs the future it returns, converting a panic in
/// either into `Err(Panicked)`. `start` is called on the first poll, inside
/// the same guard as every poll.
pub(crate) fn catch_panics<F>(start: F) -> impl Future<Output = Result<(), JobError>>
where
    F: FnOnce() -> BoxFuture<'static, Result<(), JobError>> + Unpin,
{
    CatchPanic::Start(Some(start))
}

enum CatchPanic<F> {
    Start(Option<F>),
    Running(BoxFuture<'static, Result<(), JobError>>),
}

impl<F> CatchPanic<F>
where
    F: FnOnce() -> BoxFuture<'static, Result<(), JobError>> + Unpin,
{
    fn step(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), JobError>> {
        if let CatchPanic::Start(start) = self {
            let start = start.take().expect("a started handler is Running");
            *self = CatchPanic::Running(start());
        }
        match self {
            CatchPanic::Running(fut) => fut.as_mut().poll(cx),
            CatchPanic::Start(_) => unreachable!("replaced above"),
        }
    }
}

impl<F> Future for CatchPanic<F>
where
    F: FnOnce() -> BoxFuture<'static, Result<(), JobError>> + Unpin,
{
    type Output = Result<(), JobError>;

    #[cfg(panic = "unwind")]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match guard(|| this.step(cx)) {
            Ok(poll) => poll,
            Err(panicked) => Poll::Ready(Err(panicked.into())),
        }
    }

    #[cfg(not(panic = "unwind"))]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let _ = Panicked::new;
        self.get_mut().step(cx)
    }
}

/// Runs `f`, turning a panic into [`Panicked`] (message, location and
/// backtrace). On targets that abort on panic, simply runs `f`.
pub(crate) fn guard<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    #[cfg(panic = "unwind")]
    {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        hook::install();
        hook::enter();
        let result = catch_unwind(AssertUnwindSafe(f));
        hook::leave();
        result.map_err(|payload| {
            let message = payload_text(payload.as_ref());
            let (location, backtrace) = hook::take();
            let message = match location {
                Some(location) => format!("{message} (at {location})"),
                None => message,
            };
            Panicked::new(message, backtrace)
        })
    }
    #[cfg(not(panic = "unwind"))]
    {
        Ok(f())
    }
}

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a
/// `String`; anything else is named as such).
#[cfg(panic = "unwind")]
pub(crate) fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string())
}

#[cfg(panic = "unwind")]
mod hook {
    use std::cell::{Cell, RefCell};
    use std::sync::Once;

    thread_local! {
        static DEPTH: Cell<u32> = const { Cell::new(0) };
        static LAST: RefCell<Option<(String, String)>> = const { RefCell::new(None) };
    }

    static INSTALL: Once = Once::new();

    pub(super) fn install() {
        INSTALL.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if DEPTH.with(Cell::get) > 0 {
                    let location = info.location().map(|l| l.to_string()).unwrap_or_default();
                    let backtrace = std::backtrace::Backtrace::force_capture().to_string();
                    LAST.with(|last| *last.borrow_mut() = Some((location, backtrace)));
                } else {
                    previous(info);
                }
            }));
        });
    }

    pub(super) fn enter() {
        DEPTH.with(|d| d.set(d.get() + 1));
    }

    pub(super) fn leave() {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }

    pub(super) fn take() -> (Option<String>, String) {
        match LAST.with(|last| last.borrow_mut().take()) {
            Some((location, backtrace)) => (Some(location), backtrace),
            None => (None, String::new()),
        }
    }
}
