//! Request mode's retry policy, apart from the I/O that obeys it (the call's loop in `proxy`).
//!
//! A failed attempt is retried, on another endpoint, only when it is safe: the upstream
//! provably did not process it (REFUSED_STREAM, or above a graceful GOAWAY's last stream id),
//! or its method is configured as retryable (idempotent); never beyond `max_attempts`, never
//! when its body was not kept for a replay, never when its backoff would end past the caller's
//! deadline, and only with a token of the retry budget (which the loop withdraws). A request
//! the upstream did not process goes again at once; one it was processing waits a jittered,
//! doubling backoff first.

use std::time::Duration;

use h2::Reason;
use tokio::time::Instant;

use crate::request::config::Config;
use crate::request::picker::Outcome;

/// Whether `path` (`/pkg.Service/Method`) is configured as retryable: named, or its service
/// named as `/pkg.Service/`.
pub(super) fn retryable_method(config: &Config, path: &str) -> bool {
    config
        .retryable_methods
        .iter()
        .any(|m| path == m.as_str() || (m.ends_with('/') && path.starts_with(m.as_str())))
}

/// What is known of a failed attempt when its retry is decided.
#[derive(Debug, Clone, Copy)]
pub(super) struct Failed {
    /// Attempts that reached an upstream so far, this one included.
    pub(super) attempts: u32,
    /// The most attempts per request (at least 1).
    pub(super) max_attempts: u32,
    /// The method is configured as retryable.
    pub(super) retryable_method: bool,
    /// The upstream provably did not process it ([`not_processed`]).
    pub(super) not_processed: bool,
    /// Its request body so far is kept, so it can be sent again.
    pub(super) replayable: bool,
}

/// The decision the call's loop obeys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// Retry on another endpoint if the retry budget has a token (else the call fails, the
    /// refusal counted): at once, or after `pause`.
    Retry { pause: Option<Duration> },
    /// Fail the call with the upstream's error.
    Fail(NoRetry),
}

/// Why a failed attempt is not retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoRetry {
    /// `max_attempts` reached.
    Attempts,
    /// The upstream may have processed it and its method is not retryable.
    NotSafe,
    /// Its body was not kept (too large, or a response had started).
    NotReplayable,
    /// Its backoff would end past the caller's deadline.
    PastDeadline,
}

/// Decides whether the attempt `failed` is retried, at `now` with the caller's `deadline`.
/// `unit` (uniform in [0, 1), the pool's RNG) is drawn only for a backoff, so a decision that
/// needs none leaves the picker's random sequence as it was.
pub(super) fn decide(
    failed: &Failed,
    config: &Config,
    now: Instant,
    deadline: Option<Instant>,
    unit: impl FnOnce() -> f64,
) -> Decision {
    if failed.attempts >= failed.max_attempts {
        return Decision::Fail(NoRetry::Attempts);
    }
    if !(failed.retryable_method || failed.not_processed) {
        return Decision::Fail(NoRetry::NotSafe);
    }
    if !failed.replayable {
        return Decision::Fail(NoRetry::NotReplayable);
    }
    let pause = (!failed.not_processed).then(|| retry_pause(config, failed.attempts, unit()));
    if let (Some(pause), Some(deadline)) = (pause, deadline)
        && now + pause >= deadline
    {
        return Decision::Fail(NoRetry::PastDeadline);
    }
    Decision::Retry { pause }
}

/// The pause before retry number `attempts` (1 for the first retry) of a request an upstream
/// was processing: uniform in [1/2, 1] x `retry_backoff x 2^(attempts-1)`; `unit` is uniform
/// in [0, 1).
fn retry_pause(config: &Config, attempts: u32, unit: f64) -> Duration {
    let ceiling = config
        .retry_backoff
        .saturating_mul(1 << attempts.saturating_sub(1).min(16));
    ceiling.mul_f64(0.5 + unit / 2.0)
}

/// What a retried attempt says about its endpoint. A graceful GOAWAY (the server rotating or
/// shutting down its connection) says nothing: the endpoint stays as it was. Anything else, a
/// REFUSED_STREAM included, is a failure of the endpoint: otherwise an endpoint that refuses
/// every stream would look cheap (it answers at once and holds nothing in flight), attract
/// every first attempt and drain the retry budget, until calls fail; counted as failures, it
/// is ejected after `failure_threshold` of them like any failing endpoint.
pub(super) fn retried_outcome(error: &h2::Error) -> Outcome {
    if graceful_go_away(error) {
        Outcome::Cancelled
    } else {
        Outcome::Failure
    }
}

/// The stream was cut by the upstream's graceful GOAWAY (NO_ERROR).
fn graceful_go_away(h2: &h2::Error) -> bool {
    h2.is_go_away() && h2.is_remote() && h2.reason() == Some(Reason::NO_ERROR)
}

/// Whether the upstream provably did not process the request: it refused the stream
/// (REFUSED_STREAM), or the stream was cut by a graceful GOAWAY (NO_ERROR). h2 fails a stream
/// with a remote NO_ERROR GOAWAY when its id is above the GOAWAY's last-stream-id (or it was
/// still queued, never sent); a graceful server finishes every stream at or below it.
pub(super) fn not_processed(error: &h2::Error) -> bool {
    error.reason() == Some(Reason::REFUSED_STREAM) || graceful_go_away(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            retry_backoff: Duration::from_millis(20),
            max_attempts: 3,
            retryable_methods: vec!["/pkg.Idem/Get".into(), "/pkg.All/".into()],
            ..Config::default()
        }
    }

    /// The first attempt of a non-retryable method failed after it was sent.
    fn failed() -> Failed {
        Failed {
            attempts: 1,
            max_attempts: 3,
            retryable_method: false,
            not_processed: false,
            replayable: true,
        }
    }

    fn no_unit() -> f64 {
        panic!("no backoff was due: the picker's RNG must not be drawn")
    }

    #[test]
    fn retryable_methods_are_named_or_their_whole_service() {
        let c = config();
        assert!(retryable_method(&c, "/pkg.Idem/Get"));
        assert!(!retryable_method(&c, "/pkg.Idem/Put"));
        assert!(
            !retryable_method(&c, "/pkg.Idem/GetMore"),
            "a whole name, not a prefix"
        );
        assert!(retryable_method(&c, "/pkg.All/Anything"));
        assert!(!retryable_method(&c, "/pkg.Allx/Anything"));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn what_the_upstream_did_not_process_is_retried_at_once_whatever_the_method() {
        let now = Instant::now();
        let f = Failed {
            not_processed: true,
            ..failed()
        };
        let soon = Some(now + Duration::from_millis(1));
        assert_eq!(
            decide(&f, &config(), now, soon, no_unit),
            Decision::Retry { pause: None },
            "no backoff, so no deadline to miss"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn what_the_upstream_may_have_processed_is_retried_only_for_retryable_methods() {
        let now = Instant::now();
        assert_eq!(
            decide(&failed(), &config(), now, None, no_unit),
            Decision::Fail(NoRetry::NotSafe)
        );
        let idempotent = Failed {
            retryable_method: true,
            attempts: 2,
            ..failed()
        };
        assert_eq!(
            decide(&idempotent, &config(), now, None, || 0.5),
            Decision::Retry {
                pause: Some(Duration::from_millis(30))
            },
            "the second retry: 3/4 of 2 x 20 ms"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn no_retry_past_the_attempts_an_unkept_body_or_the_deadline() {
        let now = Instant::now();
        let c = config();
        let last = Failed {
            attempts: 3,
            not_processed: true,
            ..failed()
        };
        assert_eq!(
            decide(&last, &c, now, None, no_unit),
            Decision::Fail(NoRetry::Attempts)
        );
        let unkept = Failed {
            not_processed: true,
            replayable: false,
            ..failed()
        };
        assert_eq!(
            decide(&unkept, &c, now, None, no_unit),
            Decision::Fail(NoRetry::NotReplayable)
        );
        let idempotent = Failed {
            retryable_method: true,
            ..failed()
        };
        // The first retry waits 10-20 ms: 15 ms with this unit.
        let at = |ms| Some(now + Duration::from_millis(ms));
        assert_eq!(
            decide(&idempotent, &c, now, at(15), || 0.5),
            Decision::Fail(NoRetry::PastDeadline),
            "a pause ending at the deadline is too late"
        );
        assert_eq!(
            decide(&idempotent, &c, now, at(16), || 0.5),
            Decision::Retry {
                pause: Some(Duration::from_millis(15))
            }
        );
    }

    #[test]
    fn retry_pauses_double_per_retry_with_jitter_in_the_upper_half() {
        let config = config();
        let ms = |attempts, unit| retry_pause(&config, attempts, unit).as_secs_f64() * 1e3;
        assert!(
            (ms(1, 0.0) - 10.0).abs() < 1e-6,
            "first retry: at least half of 20 ms"
        );
        assert!(ms(1, 0.999) < 20.0, "first retry: under 20 ms");
        assert!(
            (ms(2, 0.0) - 20.0).abs() < 1e-6,
            "second retry: half of 40 ms"
        );
        assert!(
            (ms(3, 0.5) - 60.0).abs() < 1e-6,
            "third retry: 3/4 of 80 ms"
        );
        assert!(
            retry_pause(&config, u32::MAX, 0.999) < Duration::from_secs(24 * 3600),
            "the exponent is capped"
        );
    }

    #[test]
    fn a_refused_stream_is_not_processed_and_a_failure_of_its_endpoint() {
        let refused = h2::Error::from(Reason::REFUSED_STREAM);
        assert!(not_processed(&refused));
        assert_eq!(retried_outcome(&refused), Outcome::Failure);
        let reset = h2::Error::from(Reason::INTERNAL_ERROR);
        assert!(!not_processed(&reset));
    }
}
