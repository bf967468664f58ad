//! Any annotation values (and some made-up keys): `mode` and `tuning` accept or reject them
//! with a typed error, never panic, and what they accept is inside the documented ranges.
#![no_main]

use std::{collections::BTreeMap, time::Duration};

use libfuzzer_sys::fuzz_target;
use skewless_model::annotations::{
    self, GRPC_HEALTH_SERVICE, HOLD_TIME, MAX_CONNECTION_AGE, MAX_ROTATIONS_PER_MINUTE, MODE,
    RETRYABLE_METHODS, SKEW_THRESHOLD,
};

const KEYS: [&str; 9] = [
    MODE,
    SKEW_THRESHOLD,
    HOLD_TIME,
    MAX_ROTATIONS_PER_MINUTE,
    MAX_CONNECTION_AGE,
    GRPC_HEALTH_SERVICE,
    RETRYABLE_METHODS,
    "skewless.io/hold_time",
    "example.com/other",
];

fuzz_target!(|data: &[u8]| {
    // Records separated by 0xff: the first byte picks the key, the rest is the value.
    let mut map = BTreeMap::new();
    for record in data.split(|b| *b == 0xff) {
        let Some((&key, value)) = record.split_first() else {
            continue;
        };
        let key = KEYS[usize::from(key) % KEYS.len()];
        map.insert(key.to_owned(), String::from_utf8_lossy(value).into_owned());
    }
    let _ = annotations::mode(&map);
    let Ok(t) = annotations::tuning(&map) else { return };
    assert!(t.skew_threshold > 1.0 && t.skew_threshold <= 100.0, "{t:?}");
    assert!(t.hold_time <= Duration::from_secs(3600), "{t:?}");
    assert!(t.max_rotations_per_minute <= 600, "{t:?}");
    if let Some(age) = t.max_connection_age {
        assert!(
            age >= Duration::from_secs(1) && age <= Duration::from_secs(86_400),
            "{t:?}"
        );
    }
    if let Some(name) = &t.grpc_health_service {
        assert!(name.len() <= 256, "{t:?}");
    }
    for m in &t.retryable_methods {
        // An accepted pattern matches its own path.
        let path = match &m.method {
            Some(method) => format!("/{}/{}", m.service, method),
            None => format!("/{}/Any", m.service),
        };
        assert!(m.matches(&path), "{m:?} must match {path}");
    }
});
