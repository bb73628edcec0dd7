//! Being built.

fn main() {}
