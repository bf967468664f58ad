//! Any text as a services file: `parse` returns model inputs or a typed error, never panics,
//! and whatever it accepts the model's index takes (rejections are values, not panics).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use skewless_model::{Index, Metrics};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(inputs) = skewless_services_file::parse(Path::new("fuzz.yaml"), text) else {
        return;
    };
    let mut index = Index::new(Metrics::default());
    let rejections = index.reset(&inputs.services, &inputs.slices);
    assert!(
        rejections.len() <= inputs.services.len(),
        "at most one rejection per Service"
    );
    let snapshot = index.subscribe().borrow().clone();
    for svc in snapshot.iter() {
        assert!(
            inputs.services.iter().any(|s| s.key == svc.key),
            "the model holds a Service the file does not name: {}",
            svc.key
        );
    }
});
