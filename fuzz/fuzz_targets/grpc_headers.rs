//! Any bytes as the gRPC headers a peer sends: `grpc-timeout` parses to a bounded duration or
//! nothing, `grpc-status` to a code or nothing, and re-encoding a parsed timeout gives a value
//! that parses back no shorter (no panic anywhere).
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use skewless_balancer::grpc;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    if let Some(timeout) = grpc::parse_timeout(&value) {
        let again = grpc::parse_timeout(&grpc::encode_timeout(timeout));
        // What the balancer forwards upstream is never a shorter budget than it was given.
        assert!(
            again.is_some_and(|t| t >= timeout),
            "{timeout:?} re-encoded as {again:?}"
        );
    }
    let mut headers = HeaderMap::new();
    headers.insert("grpc-status", value.clone());
    headers.insert("content-type", value);
    let _ = grpc::status_of(&headers);
    let _ = grpc::is_grpc(&headers);
});
