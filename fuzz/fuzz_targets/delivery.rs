//! Any bytes as a message body, through the pipeline a host uses
//! (`Registry::deliver`): no panic, one settlement, and one terminal failure
//! keeping the body unless the bytes are a valid envelope. The rule and its
//! check are the property test's (`shared/tests/support/delivery_oracle.rs`).

#![no_main]

#[allow(dead_code)]
#[path = "../../shared/tests/support/delivery_oracle.rs"]
mod oracle;

use libfuzzer_sys::fuzz_target;

thread_local! {
    static PIPELINE: oracle::Pipeline = oracle::Pipeline::new();
}

fuzz_target!(|body: &[u8]| {
    PIPELINE.with(|pipeline| {
        pipeline.check(body);
    });
});
