//! Placeholder: filled by the throughput work.
fn main() {}
