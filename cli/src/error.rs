//! The tool's errors: one line each, and the exit status they map to.

use std::fmt;

use jobrail_native::{DriverError, ErrorKind};

/// Why a command failed, and which exit status says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CliError {
    /// The exit status.
    pub(crate) status: u8,
    /// One line for the operator.
    pub(crate) message: String,
}

/// Exit status of an operation that failed.
pub(crate) const FAILED: u8 = 1;
/// Exit status of a command line that cannot be carried out as given.
pub(crate) const USAGE: u8 = 2;
/// Exit status when a record named is not there.
pub(crate) const NOT_FOUND: u8 = 3;

impl CliError {
    /// An operation failed.
    pub(crate) fn failed(message: impl Into<String>) -> Self {
        CliError::new(FAILED, message)
    }

    /// The command line cannot be carried out as given.
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        CliError::new(USAGE, message)
    }

    /// What was named is not there.
    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        CliError::new(NOT_FOUND, message)
    }

    fn new(status: u8, message: impl Into<String>) -> Self {
        CliError {
            status,
            message: one_line(&message.into()),
        }
    }
}

/// `text` on one line: line breaks become `; `.
pub(crate) fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<DriverError> for CliError {
    fn from(e: DriverError) -> Self {
        let status = match e.kind() {
            ErrorKind::NotFound => NOT_FOUND,
            _ => FAILED,
        };
        CliError::new(status, e.to_string())
    }
}

impl From<jobrail::PolicyError> for CliError {
    fn from(e: jobrail::PolicyError) -> Self {
        CliError::usage(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_keep_their_kind_in_the_status() {
        let e = CliError::from(DriverError::new(
            "nats",
            ErrorKind::NotFound,
            "no record `x`",
        ));
        assert_eq!(e.status, NOT_FOUND);
        assert_eq!(e.message, "nats driver: not found: no record `x`");
        let e = CliError::from(DriverError::new("sqs", ErrorKind::Connection, "refused"));
        assert_eq!(e.status, FAILED);
    }

    #[test]
    fn messages_are_one_line() {
        let e = CliError::failed("first\n  second\n\nthird\n");
        assert_eq!(e.message, "first; second; third");
    }
}
