//! Connection mode's relay between two hostile peers: any bytes from the client (usually after
//! a valid preface) and from the backend, read in small pieces, with a rotation at any point.
//! The relay must never panic and always end (paused time: its timeouts are bounded).
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use skewless_balancer::metrics::RotationReason;
use skewless_balancer::relay::{RelayHandle, RelaySettings, relay};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, duplex};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fuzz_target!(|data: &[u8]| {
    let [flags, split, rotate_at, data @ ..] = data else {
        return;
    };
    let split = data.len() * usize::from(*split) / 256;
    let (client, backend) = data.split_at(split);
    let rotate_at = (flags & 1 == 1).then(|| client.len() * usize::from(*rotate_at) / 256);
    let with_preface = flags & 2 == 0;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Small pipes: the relay meets backpressure.
        let (c, c_relay) = duplex(512);
        let (b, b_relay) = duplex(512);
        let handle = RelayHandle::new();
        let h = handle.clone();
        let task = tokio::spawn(async move {
            relay(c_relay, b_relay, &RelaySettings::default(), h).await
        });
        let (mut c_read, mut c_write) = tokio::io::split(c);
        let (mut b_read, mut b_write) = tokio::io::split(b);
        let client_side = async {
            if with_preface {
                let _ = c_write.write_all(PREFACE).await;
            }
            let cut = rotate_at.unwrap_or(client.len());
            let _ = c_write.write_all(&client[..cut]).await;
            if rotate_at.is_some() {
                handle.rotate(RotationReason::Skew);
            }
            let _ = c_write.write_all(&client[cut..]).await;
            let _ = c_write.shutdown().await;
        };
        let backend_side = async {
            let _ = b_write.write_all(backend).await;
            let _ = b_write.shutdown().await;
        };
        let mut sink_c = Vec::new();
        let mut sink_b = Vec::new();
        let (_, _, _, _, end) = tokio::join!(
            client_side,
            backend_side,
            c_read.read_to_end(&mut sink_c),
            b_read.read_to_end(&mut sink_b),
            tokio::time::timeout(Duration::from_secs(600), task),
        );
        let end = end.expect("the relay always ends");
        end.expect("the relay never panics").ok();
        assert!(
            u64::from(handle.stats().open_streams()) <= handle.stats().requests(),
            "open streams are requests"
        );
    });
});
