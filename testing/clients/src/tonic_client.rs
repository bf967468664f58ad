//! The tonic echo client: the same load and the same [`ClientResult`] as the grpcio and
//! grpc-js clients, with tonic's defaults (one `Channel` = one HTTP/2 connection that tonic
//! reconnects on failure; the `tonic/<version>` user-agent).

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use skewless_echo::pb::{EchoRequest, echo_client::EchoClient};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::{CallTally, ClientResult, ClientSpec, StreamResult, result::Failure};

/// tonic's version as this binary links it (tonic does not export it; keep it with Cargo.lock).
pub const TONIC_VERSION: &str = "0.14.9";

/// Replies and requests of the long-lived streams are this far apart.
pub const STREAM_INTERVAL: Duration = Duration::from_millis(50);

const MAX_MESSAGE: usize = 64 * 1024 * 1024;
const MAX_LISTED_FAILURES: usize = 20;

/// Errors before any call is made.
#[derive(Debug, thiserror::Error)]
pub enum TonicClientError {
    #[error("invalid target {0:?}")]
    Target(String, #[source] tonic::transport::Error),
}

/// The gRPC name of a status code, as grpcio and grpc-js print it.
#[must_use]
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "CANCELLED",
        C::Unknown => "UNKNOWN",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::DeadlineExceeded => "DEADLINE_EXCEEDED",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::PermissionDenied => "PERMISSION_DENIED",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Aborted => "ABORTED",
        C::OutOfRange => "OUT_OF_RANGE",
        C::Unimplemented => "UNIMPLEMENTED",
        C::Internal => "INTERNAL",
        C::Unavailable => "UNAVAILABLE",
        C::DataLoss => "DATA_LOSS",
        C::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Builds a [`CallTally`] from concurrent calls.
#[derive(Debug)]
pub struct Recorder {
    t0: Instant,
    inner: Mutex<(CallTally, Vec<f64>)>,
}

impl Recorder {
    #[must_use]
    pub fn new(t0: Instant) -> Self {
        Self {
            t0,
            inner: Mutex::new((CallTally::default(), Vec::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (CallTally, Vec<f64>)> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An OK call served by `pod`, `latency` after it started.
    pub fn success(&self, pod: &str, latency: Duration) {
        let now = self.t0.elapsed().as_secs_f64();
        let mut guard = self.lock();
        let (t, lat) = &mut *guard;
        t.ok += 1;
        *t.pods.entry(pod.to_owned()).or_default() += 1;
        t.first_seen_s
            .entry(pod.to_owned())
            .or_insert((now * 1000.0).round() / 1000.0);
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "seconds of a bounded run"
        )]
        let sec = now as usize;
        if t.per_second.len() <= sec {
            t.per_second.resize_with(sec + 1, BTreeMap::new);
        }
        *t.per_second[sec].entry(pod.to_owned()).or_default() += 1;
        lat.push(latency.as_secs_f64() * 1000.0);
    }

    /// A failed call.
    pub fn failure(&self, code: &str, message: &str) {
        let now = self.t0.elapsed().as_secs_f64();
        let mut guard = self.lock();
        let t = &mut guard.0;
        *t.failed.entry(code.to_owned()).or_default() += 1;
        if t.failures.len() < MAX_LISTED_FAILURES {
            t.failures.push(Failure {
                at_s: (now * 1000.0).round() / 1000.0,
                code: code.to_owned(),
                message: message.to_owned(),
            });
        }
    }

    /// The tally, with the latency percentiles.
    #[must_use]
    pub fn finish(&self) -> CallTally {
        let mut guard = self.lock();
        let (t, lat) = &mut *guard;
        lat.sort_by(f64::total_cmp);
        let pct = |p: f64| -> Option<f64> {
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "an index into a bounded list"
            )]
            let i = ((p * lat.len() as f64) as usize).min(lat.len().checked_sub(1)?);
            Some((lat[i] * 1000.0).round() / 1000.0)
        };
        let mut out = t.clone();
        out.p50_ms = pct(0.50);
        out.p99_ms = pct(0.99);
        out
    }
}

fn request_timeout<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

/// Runs the load `spec` describes and returns what happened.
///
/// # Errors
/// When the target is not a valid address.
pub async fn run(spec: &ClientSpec) -> Result<ClientResult, TonicClientError> {
    let t0 = Instant::now();
    let start_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut clients = Vec::new();
    for _ in 0..spec.channels.max(1) {
        let mut endpoint = Endpoint::from_shared(format!("http://{}", spec.target))
            .map_err(|e| TonicClientError::Target(spec.target.clone(), e))?;
        if let Some(k) = spec.keepalive {
            endpoint = endpoint
                .http2_keep_alive_interval(k)
                .keep_alive_timeout(Duration::from_secs(20))
                .keep_alive_while_idle(true);
        }
        let channel: Channel = endpoint.connect_lazy();
        clients.push(
            EchoClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        );
    }
    let expired = move |deadline: Option<Instant>| deadline.is_some_and(|d| Instant::now() >= d);
    let deadline = spec.duration.map(|d| t0 + d);
    let unary = Arc::new(Recorder::new(t0));
    let large = Arc::new(Recorder::new(t0));
    let issued = Arc::new(AtomicU64::new(0));

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..spec.concurrency.max(1) {
        let (clients, unary, issued) = (clients.clone(), unary.clone(), issued.clone());
        let (calls, timeout, payload) = (spec.calls, spec.timeout, spec.payload as usize);
        let delay_ms = spec
            .call_delay
            .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
        tasks.spawn(async move {
            loop {
                let i = issued.fetch_add(1, Ordering::Relaxed);
                if i >= calls || expired(deadline) {
                    return;
                }
                let mut client = clients[usize::try_from(i).unwrap_or(0) % clients.len()].clone();
                let req = EchoRequest {
                    payload: vec![b'h'; payload],
                    delay_ms,
                    ..EchoRequest::default()
                };
                let start = Instant::now();
                match client.echo(request_timeout(req, timeout)).await {
                    Ok(reply) => unary.success(&reply.into_inner().pod, start.elapsed()),
                    Err(status) => unary.failure(code_name(status.code()), status.message()),
                }
            }
        });
    }
    if spec.large_calls > 0 {
        let (clients, large) = (clients.clone(), large.clone());
        let (n, bytes) = (spec.large_calls, spec.large_bytes as usize);
        let timeout = spec.timeout.max(Duration::from_secs(30));
        tasks.spawn(async move {
            for i in 0..n {
                if i > 0 && expired(deadline) {
                    return;
                }
                let mut client = clients[i as usize % clients.len()].clone();
                let req = EchoRequest {
                    payload: vec![b'L'; bytes],
                    reply_size: u32::try_from(bytes).unwrap_or(u32::MAX),
                    ..EchoRequest::default()
                };
                let start = Instant::now();
                match client.echo(request_timeout(req, timeout)).await {
                    Ok(reply) => {
                        let reply = reply.into_inner();
                        if reply.payload.len() == bytes {
                            large.success(&reply.pod, start.elapsed());
                        } else {
                            large.failure("SHORT_REPLY", &format!("{} bytes", reply.payload.len()));
                        }
                    }
                    Err(status) => large.failure(code_name(status.code()), status.message()),
                }
            }
        });
    }
    let server_stream = spec
        .stream
        .map(|d| tokio::spawn(server_stream(clients[0].clone(), d)));
    let bidi = spec.bidi.map(|d| tokio::spawn(bidi(clients[0].clone(), d)));
    while tasks.join_next().await.is_some() {}
    let server_stream = match server_stream {
        Some(h) => h.await.ok(),
        None => None,
    };
    let bidi = match bidi {
        Some(h) => h.await.ok(),
        None => None,
    };
    Ok(ClientResult {
        client: "tonic".into(),
        version: TONIC_VERSION.into(),
        start_unix_s,
        elapsed_s: (t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
        unary: unary.finish(),
        large: large.finish(),
        server_stream,
        bidi,
    })
}

fn stream_count(d: Duration) -> u32 {
    u32::try_from(d.as_millis() / STREAM_INTERVAL.as_millis())
        .unwrap_or(u32::MAX)
        .max(1)
}

async fn server_stream(mut client: EchoClient<Channel>, d: Duration) -> StreamResult {
    let count = stream_count(d);
    let mut res = StreamResult {
        expected: u64::from(count),
        messages: 0,
        pods: BTreeMap::new(),
        code: "OK".into(),
        message: String::new(),
    };
    let req = EchoRequest {
        payload: b"s".to_vec(),
        count,
        interval_ms: u32::try_from(STREAM_INTERVAL.as_millis()).unwrap_or(50),
        ..EchoRequest::default()
    };
    let mut fail = |status: &tonic::Status| {
        code_name(status.code()).clone_into(&mut res.code);
        status.message().clone_into(&mut res.message);
    };
    match client
        .server_stream(request_timeout(req, d + Duration::from_secs(30)))
        .await
    {
        Err(status) => fail(&status),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(reply)) => {
                        res.messages += 1;
                        *res.pods.entry(reply.pod).or_default() += 1;
                    }
                    Ok(None) => break,
                    Err(status) => {
                        fail(&status);
                        break;
                    }
                }
            }
        }
    }
    res
}

/// Time-bounded, not count-bounded: a busy client sends fewer messages, never a longer
/// stream. `expected` is what was sent.
async fn bidi(mut client: EchoClient<Channel>, d: Duration) -> StreamResult {
    let mut res = StreamResult {
        expected: 0,
        messages: 0,
        pods: BTreeMap::new(),
        code: "OK".into(),
        message: String::new(),
    };
    let sent = Arc::new(AtomicU64::new(0));
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let sender = {
        let sent = sent.clone();
        tokio::spawn(async move {
            let end = Instant::now() + d;
            loop {
                let msg = EchoRequest {
                    payload: b"b".to_vec(),
                    ..EchoRequest::default()
                };
                if tx.send(msg).await.is_err() {
                    return;
                }
                sent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(STREAM_INTERVAL).await;
                if Instant::now() >= end {
                    return;
                }
            }
        })
    };
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut fail = |status: &tonic::Status| {
        code_name(status.code()).clone_into(&mut res.code);
        status.message().clone_into(&mut res.message);
    };
    match client
        .bidi(request_timeout(outbound, d + Duration::from_secs(30)))
        .await
    {
        Err(status) => fail(&status),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(reply)) => {
                        res.messages += 1;
                        *res.pods.entry(reply.pod).or_default() += 1;
                    }
                    Ok(None) => break,
                    Err(status) => {
                        fail(&status);
                        break;
                    }
                }
            }
        }
    }
    sender.abort();
    res.expected = sent.load(Ordering::Relaxed);
    res
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_reported_tonic_version_is_the_locked_one() {
        let lock =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.lock"))
                .expect("the workspace's Cargo.lock");
        let locked = lock
            .split("[[package]]")
            .find(|p| p.contains("\nname = \"tonic\"\n"))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
            .map(|v| v.trim_matches('"').to_owned());
        assert_eq!(
            locked.as_deref(),
            Some(super::TONIC_VERSION),
            "TONIC_VERSION must follow Cargo.lock"
        );
    }
}
