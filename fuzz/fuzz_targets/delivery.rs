//! Any bytes as a message body, through the pipeline a host uses
//! (`Registry::deliver`): no panic, one settlement, and one terminal failure
//! keeping the body unless the bytes are a valid envelope; and the crash
//! report of the same body (`Registry::settle_crashed`, on a delivery the
//! first byte chooses) settles it as delivering it would when no handler can
//! run it. The rules and their checks are the property test's
//! (`shared/tests/support/delivery_oracle.rs`).

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
        let attempt = body.first().map_or(1, |b| u32::from(b % 13));
        pipeline.check_crashed(body, attempt);
    });
});
