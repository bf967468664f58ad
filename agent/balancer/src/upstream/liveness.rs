//! Whether an upstream HTTP/2 connection is still alive, for a backend that dies silently (a
//! lost node, a partition: no RST, no FIN). One monitor per connection, a timer with no
//! per-request work: while requests are outstanding and the server has sent no HEADERS or
//! DATA for [`LivenessConfig::ping_after`], it sends a PING (one in flight at a time);
//! unanswered, the connection is first *suspect* ([`LivenessConfig::suspect_after`]: no new
//! requests), then *dead* ([`LivenessConfig::ping_timeout`]: the pool closes it and ejects the
//! endpoint). Idle connections are PINGed at [`LivenessConfig::idle_ping_interval`].
//!
//! Guarantees: at most [`MAX_PINGS_WITHOUT_DATA`] PINGs between two HEADERS/DATA frames from
//! the server (gRPC servers close a connection at the third PING "strike"); every upstream
//! socket has TCP keepalive and `TCP_USER_TIMEOUT` as the backstop (`set_tcp_options`).
//! Timings and measurements: docs/balancer.md, "Silently dead backends".

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use h2::{Ping, PingPong};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Most PINGs sent between two HEADERS or DATA frames from the server (see the module docs).
pub const MAX_PINGS_WITHOUT_DATA: u32 = 2;

/// Tuning of upstream liveness checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LivenessConfig {
    /// Silence from the server (no HEADERS or DATA) while requests are outstanding before a
    /// PING is sent. The monitor looks twice per period, so a PING goes out between 1 and 1.5
    /// times this after the server's last frame.
    pub ping_after: Duration,
    /// An unanswered PING this old makes the connection suspect: it takes no new requests
    /// until the PING is answered.
    pub suspect_after: Duration,
    /// An unanswered PING this old (and no HEADERS or DATA meanwhile): the connection is dead.
    /// It is closed, its requests end with UNAVAILABLE, and the endpoint is ejected.
    pub ping_timeout: Duration,
    /// PING interval on a connection without outstanding requests.
    pub idle_ping_interval: Duration,
    /// Silence after which the kernel sends TCP keepalive probes (then one per second).
    pub tcp_keepalive: Duration,
    /// `TCP_USER_TIMEOUT`: sent data or keepalive probes unacknowledged this long close the
    /// socket.
    pub tcp_user_timeout: Duration,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        Self {
            ping_after: Duration::from_millis(200),
            suspect_after: Duration::from_millis(300),
            ping_timeout: Duration::from_secs(1),
            idle_ping_interval: Duration::from_secs(30),
            tcp_keepalive: Duration::from_secs(2),
            tcp_user_timeout: Duration::from_secs(5),
        }
    }
}

/// What one connection's monitor reads, shared with the connection's reader and the pool's
/// leases. Updating it costs a relaxed atomic add per read of the socket and per request.
#[derive(Debug, Default)]
pub(crate) struct Signals {
    /// Reads of the socket that carried HEADERS or DATA from the server.
    heard: AtomicU64,
    /// Requests outstanding on the connection (the pool's leases; h2 counts only the streams it
    /// has sent, not the ones queued behind the server's MAX_CONCURRENT_STREAMS).
    streams: AtomicU32,
    /// The monitor sleeps until a request starts (no request was outstanding).
    sleeping: AtomicBool,
    wake: Notify,
}

impl Signals {
    /// The server sent HEADERS or DATA.
    pub(crate) fn heard(&self) {
        self.heard.fetch_add(1, Ordering::Relaxed);
    }

    /// A request starts on the connection; returns how many are outstanding now. The first one
    /// wakes a sleeping monitor.
    pub(crate) fn stream_opened(&self) -> u32 {
        // SeqCst pairs with the monitor's store of `sleeping` then load of `streams`: one of
        // the two sides sees the other's write, so no wake-up is lost (on x86 both are the
        // same instructions as relaxed ones).
        let open = self.streams.fetch_add(1, Ordering::SeqCst) + 1;
        if open == 1
            && self.sleeping.load(Ordering::SeqCst)
            && self.sleeping.swap(false, Ordering::SeqCst)
        {
            self.wake.notify_one();
        }
        open
    }

    /// A request is over.
    pub(crate) fn stream_closed(&self) {
        self.streams.fetch_sub(1, Ordering::Relaxed);
    }

    /// Requests outstanding now.
    pub(crate) fn streams(&self) -> u32 {
        self.streams.load(Ordering::Relaxed)
    }

    fn heard_count(&self) -> u64 {
        self.heard.load(Ordering::Relaxed)
    }
}

/// The connection was closed: no PING can be sent or answered on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Closed;

/// One connection's PINGs, as the monitor sends them: one in flight at a time.
pub(crate) trait Pings {
    /// Sends a PING.
    fn send_ping(&mut self) -> Result<(), Closed>;
    /// Ready once the PING sent last is answered.
    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Closed>>;
}

/// h2's: its connection task sends the PING and matches the answer.
impl Pings for PingPong {
    fn send_ping(&mut self) -> Result<(), Closed> {
        PingPong::send_ping(self, Ping::opaque()).map_err(|_| Closed)
    }

    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Closed>> {
        PingPong::poll_pong(self, cx).map(|pong| pong.map(drop).map_err(|_| Closed))
    }
}

/// What the monitor tells its owner while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Report {
    /// A PING is overdue (`true`: take no new requests) or was answered after all (`false`).
    Suspect(bool),
    /// A PING was answered: the server was alive a moment ago.
    Answered,
}

/// Why the monitor stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A PING went unanswered for the ping timeout: close the connection.
    Dead,
    /// The connection ended by itself (its PINGs report it closed).
    Closed,
    /// A probe was asked for, but the PINGs allowed without data are spent: only a new
    /// connection (whose first PING is free) can answer it.
    ProbeNeedsNewConnection,
}

/// How one PING ended.
enum Pong {
    Answered,
    Timeout,
    Closed,
}

/// Watches one connection until it is dead or closed. `pings_sent` is the number of PINGs
/// already sent on it without a HEADERS/DATA frame from the server since (the connect's own);
/// `probe`, when notified, asks for a PING now (an ejected endpoint proving it answers).
pub(crate) async fn monitor(
    mut pings: impl Pings,
    signals: &Signals,
    config: &LivenessConfig,
    pings_sent: u32,
    probe: Option<&Notify>,
    mut report: impl FnMut(Report),
) -> Verdict {
    let probe_asked = || async {
        match probe {
            Some(probe) => probe.notified().await,
            None => std::future::pending().await,
        }
    };
    let look = config.ping_after / 2;
    let mut heard = signals.heard_count();
    let mut pings_without_data = pings_sent;
    // When the monitor last saw the server speak (or answer a PING).
    let mut quiet_since = Instant::now();
    let mut probe_wanted = false;
    loop {
        let now = Instant::now();
        let h = signals.heard_count();
        if h != heard {
            heard = h;
            quiet_since = now;
            pings_without_data = 0;
        }
        let busy = signals.streams() > 0;
        let may_ping = pings_without_data < MAX_PINGS_WITHOUT_DATA;
        let due = if busy {
            quiet_since + config.ping_after
        } else {
            quiet_since + config.idle_ping_interval
        };
        if probe_wanted && !may_ping {
            return Verdict::ProbeNeedsNewConnection;
        }
        if may_ping && (probe_wanted || due <= now) {
            probe_wanted = false;
            pings_without_data += 1;
            tracing::trace!(busy, pings_without_data, "ping");
            match ping(&mut pings, signals, config, &mut report).await {
                Pong::Answered => {
                    report(Report::Answered);
                    quiet_since = Instant::now();
                    continue;
                }
                Pong::Timeout => return Verdict::Dead,
                Pong::Closed => return Verdict::Closed,
            }
        }
        if busy {
            // Look again soon: whether the server spoke meanwhile is only seen by looking.
            tokio::select! {
                () = tokio::time::sleep_until(now + look) => {}
                () = probe_asked() => probe_wanted = true,
            }
            continue;
        }
        // Idle: sleep until the idle PING is due or a request starts.
        signals.sleeping.store(true, Ordering::SeqCst);
        if signals.streams.load(Ordering::SeqCst) == 0 {
            let idle_ping = async {
                if may_ping {
                    tokio::time::sleep_until(due).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = idle_ping => {}
                () = signals.wake.notified() => {}
                () = probe_asked() => probe_wanted = true,
            }
        }
        signals.sleeping.store(false, Ordering::SeqCst);
    }
}

/// Sends one PING and waits for its answer, reporting the connection suspect if the answer is
/// late. HEADERS or DATA arriving meanwhile prove the server alive too: the deadlines then
/// start over (the PONG may be queued behind a large response).
async fn ping(
    pings: &mut impl Pings,
    signals: &Signals,
    config: &LivenessConfig,
    report: &mut impl FnMut(Report),
) -> Pong {
    if pings.send_ping().is_err() {
        return Pong::Closed;
    }
    let mut sent = Instant::now();
    let mut heard = signals.heard_count();
    let mut suspect = false;
    let answered = loop {
        let suspect_at = sent + config.suspect_after;
        let dead_at = sent + config.ping_timeout;
        tokio::select! {
            biased;
            pong = poll_fn(|cx| pings.poll_pong(cx)) => break pong.is_ok(),
            () = tokio::time::sleep_until(suspect_at), if !suspect => {}
            () = tokio::time::sleep_until(dead_at) => {}
        }
        let now = Instant::now();
        if signals.heard_count() != heard {
            // The server spoke: alive. Wait for the PONG with fresh deadlines.
            heard = signals.heard_count();
            sent = now;
            if std::mem::take(&mut suspect) {
                report(Report::Suspect(false));
            }
        } else if now >= dead_at {
            tracing::info!(
                timeout_ms = config.ping_timeout.as_millis(),
                "ping unanswered, connection dead"
            );
            return Pong::Timeout;
        } else if !suspect {
            tracing::debug!(
                late_ms = config.suspect_after.as_millis(),
                "ping unanswered, connection suspect"
            );
            suspect = true;
            report(Report::Suspect(true));
        }
    };
    if suspect {
        tracing::debug!("late ping answered, connection no longer suspect");
        report(Report::Suspect(false));
    }
    if answered {
        Pong::Answered
    } else {
        Pong::Closed
    }
}

/// Sets the TCP backstop on an upstream socket: keepalive probes after `tcp_keepalive` of
/// silence, one per second, and `TCP_USER_TIMEOUT`.
pub(crate) fn set_tcp_options(
    tcp: &tokio::net::TcpStream,
    config: &LivenessConfig,
) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(tcp);
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(config.tcp_keepalive)
            .with_interval(Duration::from_secs(1)),
    )?;
    socket.set_tcp_user_timeout(Some(config.tcp_user_timeout))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::pin::pin;

    use bytes::Bytes;
    use tokio::sync::watch;

    use super::*;

    /// A client connection's PINGs to a real h2 server over an in-memory pipe. The server
    /// answers PINGs (h2 does while its connection is polled) except while `frozen` holds
    /// true: then it reads and answers nothing, as a blackholed backend.
    struct Pair {
        pings: Option<PingPong>,
        _sender: h2::client::SendRequest<Bytes>,
        frozen: watch::Sender<bool>,
    }

    async fn pair() -> Pair {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (frozen, mut rx) = watch::channel(false);
        tokio::spawn(async move {
            let mut conn = h2::server::handshake(server)
                .await
                .expect("server handshake");
            loop {
                let _ = rx.wait_for(|frozen| !*frozen).await;
                tokio::select! {
                    accepted = conn.accept() => if accepted.is_none() { return },
                    _ = rx.changed() => {}
                }
            }
        });
        let (sender, mut conn) = h2::client::handshake(client)
            .await
            .expect("client handshake");
        let pings = conn.ping_pong().expect("ping_pong is taken once");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Pair {
            pings: Some(pings),
            _sender: sender,
            frozen,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_silent_server_with_requests_outstanding_is_suspect_then_dead_within_1_3_s() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        signals.stream_opened();
        p.frozen.send_replace(true);
        let t0 = Instant::now();
        let mut reports = Vec::new();
        let verdict = monitor(p.pings.take().unwrap(), &signals, &config, 0, None, |r| {
            reports.push((r, t0.elapsed()));
        })
        .await;
        let dead_at = t0.elapsed();
        assert_eq!(verdict, Verdict::Dead);
        // The PING goes out between 1 and 1.5 x ping_after after the server's last frame.
        let (first, last) = (config.ping_after, config.ping_after * 3 / 2);
        assert!(
            dead_at >= first + config.ping_timeout && dead_at <= last + config.ping_timeout,
            "dead {dead_at:?} after the server went silent"
        );
        assert!(dead_at <= ms(1300), "found dead within ~1 s: {dead_at:?}");
        let [(Report::Suspect(true), suspect_at)] = reports[..] else {
            panic!("one suspect report before the verdict: {reports:?}");
        };
        assert!(
            suspect_at >= first + config.suspect_after && suspect_at <= last + config.suspect_after,
            "suspect {suspect_at:?} after the server went silent"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn at_most_two_pings_go_out_between_two_frames_of_server_data() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        signals.stream_opened();
        let answered = RefCell::new(0);
        let mut m = pin!(monitor(
            p.pings.take().unwrap(),
            &signals,
            &config,
            0,
            None,
            |r| {
                assert_eq!(r, Report::Answered, "the server answers at once");
                *answered.borrow_mut() += 1;
            }
        ));
        // A long call, the server silent but alive: gRPC servers count each PING as a strike
        // and GOAWAY at the third.
        tokio::select! {
            v = &mut m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
        assert_eq!(*answered.borrow(), 2, "two PINGs without server data");
        // The server sends DATA: its strikes are forgotten, two more are allowed.
        signals.heard();
        tokio::select! {
            v = &mut m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
        assert_eq!(*answered.borrow(), 4, "two more after server data");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_connects_own_ping_counts_against_the_allowance() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        signals.stream_opened();
        let answered = RefCell::new(0);
        let m = monitor(p.pings.take().unwrap(), &signals, &config, 1, None, |_| {
            *answered.borrow_mut() += 1;
        });
        tokio::select! {
            v = m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
        assert_eq!(*answered.borrow(), 1, "one PING after the connect's");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_idle_connection_is_not_pinged_until_a_request_starts() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        p.frozen.send_replace(true);
        let reports = RefCell::new(Vec::new());
        let mut m = pin!(monitor(
            p.pings.take().unwrap(),
            &signals,
            &config,
            0,
            None,
            |r| reports.borrow_mut().push(r)
        ));
        tokio::select! {
            v = &mut m => panic!("an idle connection was judged: {v:?}"),
            () = tokio::time::sleep(config.idle_ping_interval / 3) => {}
        }
        let t0 = Instant::now();
        signals.stream_opened();
        assert_eq!(m.await, Verdict::Dead, "a request wakes the monitor");
        assert!(
            t0.elapsed() <= config.ping_after * 3 / 2 + config.ping_timeout,
            "dead {:?} after the request started",
            t0.elapsed()
        );
        assert_eq!(*reports.borrow(), [Report::Suspect(true)]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_idle_connection_is_pinged_at_the_idle_interval_and_found_dead() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        p.frozen.send_replace(true);
        let t0 = Instant::now();
        let verdict = monitor(p.pings.take().unwrap(), &signals, &config, 0, None, |_| {}).await;
        assert_eq!(verdict, Verdict::Dead);
        assert_eq!(
            t0.elapsed(),
            config.idle_ping_interval + config.ping_timeout
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_late_answer_clears_the_suspicion_and_the_connection_lives() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        signals.stream_opened();
        p.frozen.send_replace(true);
        let reports = RefCell::new(Vec::new());
        let mut m = pin!(monitor(
            p.pings.take().unwrap(),
            &signals,
            &config,
            0,
            None,
            |r| reports.borrow_mut().push(r)
        ));
        tokio::select! {
            v = &mut m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(ms(800)) => {}
        }
        assert_eq!(*reports.borrow(), [Report::Suspect(true)]);
        // The server was only slow: it answers before the PING timeout.
        p.frozen.send_replace(false);
        tokio::select! {
            v = &mut m => panic!("a slow server was judged: {v:?}"),
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
        assert_eq!(
            reports.borrow()[..3],
            [
                Report::Suspect(true),
                Report::Suspect(false),
                Report::Answered
            ]
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn server_data_while_a_ping_is_unanswered_restarts_its_deadline() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        signals.stream_opened();
        p.frozen.send_replace(true);
        let t0 = Instant::now();
        let mut m = pin!(monitor(
            p.pings.take().unwrap(),
            &signals,
            &config,
            0,
            None,
            |_| {}
        ));
        tokio::select! {
            v = &mut m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(ms(1100)) => {}
        }
        // The PING answer may be queued behind a large response the server is sending.
        signals.heard();
        assert_eq!(m.await, Verdict::Dead);
        assert!(
            t0.elapsed() >= ms(1100) + config.ping_timeout,
            "dead {:?}: the data restarted the deadline",
            t0.elapsed()
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_probe_pings_at_once_or_asks_for_a_new_connection_when_pings_are_spent() {
        let config = LivenessConfig::default();
        let mut p = pair().await;
        let signals = Signals::default();
        let probe = Notify::new();
        let answered = RefCell::new(0);
        let mut m = pin!(monitor(
            p.pings.take().unwrap(),
            &signals,
            &config,
            1,
            Some(&probe),
            |r| {
                assert_eq!(r, Report::Answered);
                *answered.borrow_mut() += 1;
            }
        ));
        probe.notify_one();
        tokio::select! {
            v = &mut m => panic!("monitor ended: {v:?}"),
            () = tokio::time::sleep(ms(10)) => {}
        }
        assert_eq!(*answered.borrow(), 1, "the probe PING was answered at once");
        probe.notify_one();
        assert_eq!(
            tokio::time::timeout(ms(10), m).await,
            Ok(Verdict::ProbeNeedsNewConnection),
            "two PINGs without data: a third could cost the connection"
        );
    }
}
