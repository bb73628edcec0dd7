//! Handler outcomes as errors ([`JobError`] and its markers).

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// A boxed, thread-safe error: the cause carried by outcomes.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The error a handler returns.
///
/// Any error type converts into it with `?`. Use [`JobError::permanent`],
/// [`JobError::retry_after`] and [`JobError::reject`] to ask for a specific
/// outcome.
///
/// A handler returns `Result<(), JobError>`. `Ok(())` asks for acknowledgement;
/// an error asks for a retry, unless it carries one of the outcome markers
/// [`Permanent`], [`RetryAfter`] or [`Reject`]. The markers are ordinary error
/// types, and they are found anywhere in the source chain: an application
/// may wrap a `Permanent` in its own error type and the consumer still sees a
/// permanent failure. This mirrors how `errors.Is`/`errors.As` work in Go and
/// keeps the cause of every failure matchable.
///
/// Each marker may be built without a cause and keeps its outcome: a
/// `Permanent` with no cause is still a terminal failure, never a success.
///
/// # Wrappers
///
/// The search follows `source()`, and also looks inside a
/// [`std::io::Error`] (whose `source()` skips the error it wraps) and the
/// crate's own [`BreakerError`](crate::BreakerError). A foreign wrapper that
/// forwards `source()` past the error it holds (thiserror's
/// `#[error(transparent)]`) hides a marker inside it: wrap with `#[source]`
/// or `#[from]` instead, or return the marker outermost.
///
/// # When markers nest
///
/// The outermost marker wins: it is the decision taken last, closest to the
/// handler's return. `retry_after(permanent(e), 5s)` retries after 5 s (the
/// handler overrode a library's verdict); `permanent(retry_after(e, 5s))`
/// fails for good. The shutdown rule applies when the outermost marker is
/// the consumer's cancellation.
///
/// # Example
///
/// ```
/// use jobrail::{JobError, Outcome};
///
/// let err = JobError::permanent("report source was deleted");
/// assert_eq!(err.outcome(), Outcome::Permanent);
///
/// let parse: Result<u32, _> = "x".parse::<u32>();
/// let err = JobError::from(parse.unwrap_err());
/// assert_eq!(err.outcome(), Outcome::Ordinary);
/// ```
pub struct JobError {
    inner: BoxError,
}

/// What a handler error asks for, read from its source chain.
///
/// Non-exhaustive: a new marker may add an outcome, so a `match` outside this
/// crate needs a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Retry after the job's backoff; terminal failure at the attempt cap.
    Ordinary,
    /// Retry after this delay instead of the backoff, still subject to the cap.
    RetryAfter(Duration),
    /// Terminal failure now, whatever attempts remain.
    Permanent,
    /// No facade retry: the backend's own rejection policy decides.
    Reject,
    /// The consumer is shutting down and the handler gave up because of it.
    Cancelled,
    /// A circuit breaker refused the call: skip in-process retries.
    BreakerOpen,
}

impl JobError {
    /// Wraps any error as an ordinary (retryable) failure.
    pub fn new(err: impl Into<BoxError>) -> Self {
        JobError { inner: err.into() }
    }

    /// A terminal failure with `cause`, regardless of remaining attempts.
    pub fn permanent(cause: impl Into<BoxError>) -> Self {
        Permanent::new(cause).into()
    }

    /// A retry after `delay` instead of the job's backoff, still subject to the cap.
    pub fn retry_after(cause: impl Into<BoxError>, delay: Duration) -> Self {
        RetryAfter::new(cause, delay).into()
    }

    /// A rejection: no facade retry; the backend's own policy decides.
    pub fn reject(cause: impl Into<BoxError>) -> Self {
        Reject::new(cause).into()
    }

    /// The outcome this error asks for: the first (outermost) marker found
    /// in its source chain.
    pub fn outcome(&self) -> Outcome {
        let mut current: Option<&(dyn StdError + 'static)> = Some(self.inner.as_ref());
        while let Some(err) = current {
            if err.is::<Permanent>() {
                return Outcome::Permanent;
            }
            if let Some(r) = err.downcast_ref::<RetryAfter>() {
                return Outcome::RetryAfter(r.delay);
            }
            if err.is::<Reject>() {
                return Outcome::Reject;
            }
            if err.is::<Cancelled>() {
                return Outcome::Cancelled;
            }
            if err.is::<BreakerOpen>() {
                return Outcome::BreakerOpen;
            }
            current = next_in_chain(err);
        }
        Outcome::Ordinary
    }

    /// Whether any error in the chain is of type `E`.
    pub fn is<E: StdError + 'static>(&self) -> bool {
        self.find::<E>().is_some()
    }

    /// The first error of type `E` in the chain.
    pub fn find<E: StdError + 'static>(&self) -> Option<&E> {
        let mut current: Option<&(dyn StdError + 'static)> = Some(self.inner.as_ref());
        while let Some(err) = current {
            if let Some(found) = err.downcast_ref::<E>() {
                return Some(found);
            }
            current = next_in_chain(err);
        }
        None
    }

    /// The wrapped error.
    pub fn get_ref(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.inner.as_ref()
    }

    /// Unwraps into the boxed error.
    pub fn into_inner(self) -> BoxError {
        self.inner
    }

    /// The error and its causes, joined by `": "`.
    pub fn chain_text(&self) -> String {
        let mut text = self.inner.to_string();
        let mut current = self.inner.source();
        while let Some(err) = current {
            let next = err.to_string();
            if !text.ends_with(&next) {
                text.push_str(": ");
                text.push_str(&next);
            }
            current = err.source();
        }
        text
    }
}

/// The error `err` wraps: its `source()`, or for a [`std::io::Error`] (whose
/// `source()` skips it) the error it holds.
fn next_in_chain<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a (dyn StdError + 'static)> {
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        if let Some(inner) = io.get_ref() {
            return Some(inner);
        }
    }
    err.source()
}

impl<E: Into<BoxError>> From<E> for JobError {
    fn from(err: E) -> Self {
        JobError { inner: err.into() }
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)
    }
}

fn fmt_marker(f: &mut fmt::Formatter<'_>, label: &str, cause: &Option<BoxError>) -> fmt::Result {
    match cause {
        Some(cause) => write!(f, "{label}: {cause}"),
        None => f.write_str(label),
    }
}

/// Marker: terminal failure regardless of remaining attempts.
#[derive(Debug)]
pub struct Permanent {
    cause: Option<BoxError>,
}

impl Permanent {
    /// A permanent failure caused by `cause`.
    pub fn new(cause: impl Into<BoxError>) -> Self {
        Permanent {
            cause: Some(cause.into()),
        }
    }
    /// A permanent failure with no cause. Still a failure, never a success.
    pub fn without_cause() -> Self {
        Permanent { cause: None }
    }
    /// The cause, if any.
    pub fn cause(&self) -> Option<&(dyn StdError + Send + Sync + 'static)> {
        self.cause.as_deref()
    }
}

impl fmt::Display for Permanent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_marker(f, "permanent failure", &self.cause)
    }
}

impl StdError for Permanent {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Marker: retry after `delay` instead of the backoff, still subject to the cap.
///
/// The delay is a lower bound: a driver may round it up or refuse it, never
/// shorten it. A zero delay selects the driver's own timing.
#[derive(Debug)]
pub struct RetryAfter {
    delay: Duration,
    cause: Option<BoxError>,
}

impl RetryAfter {
    /// Retry after `delay`, caused by `cause`.
    pub fn new(cause: impl Into<BoxError>, delay: Duration) -> Self {
        RetryAfter {
            delay,
            cause: Some(cause.into()),
        }
    }
    /// Retry after `delay`, with no cause.
    pub fn without_cause(delay: Duration) -> Self {
        RetryAfter { delay, cause: None }
    }
    /// The requested delay.
    pub fn delay(&self) -> Duration {
        self.delay
    }
}

impl fmt::Display for RetryAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = format!("retry after {:?}", self.delay);
        fmt_marker(f, &label, &self.cause)
    }
}

impl StdError for RetryAfter {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Marker: reject without a facade retry; the backend's policy decides.
#[derive(Debug)]
pub struct Reject {
    cause: Option<BoxError>,
}

impl Reject {
    /// A rejection caused by `cause`.
    pub fn new(cause: impl Into<BoxError>) -> Self {
        Reject {
            cause: Some(cause.into()),
        }
    }
    /// A rejection with no cause.
    pub fn without_cause() -> Self {
        Reject { cause: None }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_marker(f, "rejected", &self.cause)
    }
}

impl StdError for Reject {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// The consumer was cancelled (shutdown). Returned by
/// [`JobContext::check_cancelled`](crate::JobContext::check_cancelled) and
/// [`JobContext::cancelled`](crate::JobContext::cancelled).
///
/// A handler error that is, or wraps, this error while the consumer is
/// shutting down settles as a zero-delay retry that skips the attempt cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    _private: (),
}

impl Cancelled {
    pub(crate) fn new() -> Self {
        Cancelled { _private: () }
    }
}

impl fmt::Display for Cancelled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("consumer cancelled")
    }
}

impl StdError for Cancelled {}

/// A handler panicked. Treated as an ordinary error; the text carries the
/// panic message and, where the target can capture one, a backtrace.
#[derive(Debug)]
pub struct Panicked {
    message: String,
    backtrace: String,
}

impl Panicked {
    pub(crate) fn new(message: String, backtrace: String) -> Self {
        Panicked { message, backtrace }
    }
    /// The panic message.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The captured backtrace (may be empty where none can be captured).
    pub fn backtrace(&self) -> &str {
        &self.backtrace
    }
}

impl fmt::Display for Panicked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handler panicked: {}", self.message)?;
        if !self.backtrace.is_empty() {
            write!(f, "\nbacktrace:\n{}", self.backtrace)?;
        }
        Ok(())
    }
}

impl StdError for Panicked {}

/// The error a call gets while the breaker is open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerOpen {
    name: String,
}

impl BreakerOpen {
    /// The error of the breaker named `name`.
    pub(crate) fn new(name: String) -> Self {
        BreakerOpen { name }
    }

    /// The breaker's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for BreakerOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "circuit breaker `{}` is open", self.name)
    }
}

impl StdError for BreakerOpen {}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[derive(Debug)]
    struct Wrapper(BoxError);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("while building report")
        }
    }
    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(self.0.as_ref())
        }
    }

    #[test]
    fn markers_are_found_through_the_source_chain() {
        let wrapped = JobError::new(Wrapper(Box::new(Permanent::new("gone"))));
        assert_eq!(wrapped.outcome(), Outcome::Permanent);
        assert!(wrapped.is::<Permanent>());
        let wrapped = JobError::new(Wrapper(Box::new(RetryAfter::without_cause(
            Duration::from_secs(3),
        ))));
        assert_eq!(
            wrapped.outcome(),
            Outcome::RetryAfter(Duration::from_secs(3))
        );
    }

    #[test]
    fn markers_without_cause_keep_their_outcome() {
        assert_eq!(
            JobError::from(Permanent::without_cause()).outcome(),
            Outcome::Permanent
        );
        assert_eq!(
            JobError::from(Reject::without_cause()).outcome(),
            Outcome::Reject
        );
        assert_eq!(
            JobError::from(RetryAfter::without_cause(Duration::ZERO)).outcome(),
            Outcome::RetryAfter(Duration::ZERO)
        );
        assert_eq!(Permanent::without_cause().to_string(), "permanent failure");
    }

    #[test]
    fn cause_is_preserved_and_matchable() {
        #[derive(Debug, PartialEq)]
        struct NotFound;
        impl fmt::Display for NotFound {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("not found")
            }
        }
        impl StdError for NotFound {}
        let err = JobError::permanent(NotFound);
        assert_eq!(err.find::<NotFound>(), Some(&NotFound));
        assert_eq!(err.chain_text(), "permanent failure: not found");
    }

    #[test]
    fn plain_errors_are_ordinary() {
        assert_eq!(JobError::from("boom").outcome(), Outcome::Ordinary);
        assert_eq!(
            JobError::from(std::io::Error::other("io")).outcome(),
            Outcome::Ordinary
        );
    }
}
