//! The `skewless.io/*` annotations a Service opts in and tunes itself with.
//!
//! Every value is validated here, before anything reaches the datapath or the balancer: a bad
//! value is a [`ConfigError`], and the index keeps the Service's last good config (see
//! [`crate::Index`]). Unknown keys under `skewless.io/` are errors too, so a typo such as
//! `skewless.io/hold_time` is reported instead of silently meaning "default".

use std::{collections::BTreeMap, fmt, str::FromStr, time::Duration};

use crate::{ConfigError, ConfigErrors};

/// Opts a Service in: `request`, `connection` or `observe`. Without it the Service is ignored.
pub const MODE: &str = "skewless.io/mode";
/// How far above its fair share (1/N of the ready backends) the busiest backend may be before
/// the Service counts as skewed: a ratio, `1.5` = 50 % over fair share. Default 1.5, range
/// (1, 100].
pub const SKEW_THRESHOLD: &str = "skewless.io/skew-threshold";
/// How long skew must stay above the threshold before `connection` mode rotates connections,
/// so a short burst does not cause churn. Default `30s`, range 0s..=1h.
pub const HOLD_TIME: &str = "skewless.io/hold-time";
/// Upper bound on GOAWAY rotations per Service per minute on this node; `0` disables rotation.
/// Default 6, range 0..=600.
pub const MAX_ROTATIONS_PER_MINUTE: &str = "skewless.io/max-rotations-per-minute";
/// Connections older than this are rotated (gracefully) even without skew; `0s` or absent means
/// no limit. Range 1s..=24h when set.
pub const MAX_CONNECTION_AGE: &str = "skewless.io/max-connection-age";
/// gRPC health service name to watch with `grpc.health.v1.Health/Watch` on every backend. Absent
/// means no active health checking (EndpointSlice conditions only); an empty value asks for the
/// whole server's health, as the gRPC health protocol defines.
pub const GRPC_HEALTH_SERVICE: &str = "skewless.io/grpc-health-service";
/// Comma-separated gRPC methods that are safe to retry on another endpoint, as
/// `/package.Service/Method` or `/package.Service/*`. Default: none (only the always-safe
/// retries of DESIGN.md happen).
pub const RETRYABLE_METHODS: &str = "skewless.io/retryable-methods";

const PREFIX: &str = "skewless.io/";
const KNOWN: [&str; 7] = [
    MODE,
    SKEW_THRESHOLD,
    HOLD_TIME,
    MAX_ROTATIONS_PER_MINUTE,
    MAX_CONNECTION_AGE,
    GRPC_HEALTH_SERVICE,
    RETRYABLE_METHODS,
];

/// What skewless does for a Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Redirect new connections to the node balancer, which balances every request.
    Request,
    /// Redirect and relay each connection to one backend; rotate connections on skew.
    Connection,
    /// No redirect: observe which backend each connection is pinned to and report skew.
    Observe,
}

impl Mode {
    /// The annotation value for this mode.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Request => "request",
            Mode::Connection => "connection",
            Mode::Observe => "observe",
        }
    }

    /// Whether connections to the Service's VIP are redirected to the node balancer.
    #[must_use]
    pub fn redirects(self) -> bool {
        matches!(self, Mode::Request | Mode::Connection)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value.trim() {
            "request" => Ok(Mode::Request),
            "connection" => Ok(Mode::Connection),
            "observe" => Ok(Mode::Observe),
            _ => Err(ConfigError::UnknownMode {
                value: value.to_owned(),
            }),
        }
    }
}

/// Per-Service tuning, from the optional annotations. [`Tuning::default`] documents the defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// See [`SKEW_THRESHOLD`].
    pub skew_threshold: f64,
    /// See [`HOLD_TIME`].
    pub hold_time: Duration,
    /// See [`MAX_ROTATIONS_PER_MINUTE`].
    pub max_rotations_per_minute: u32,
    /// See [`MAX_CONNECTION_AGE`]; `None` = no limit.
    pub max_connection_age: Option<Duration>,
    /// See [`GRPC_HEALTH_SERVICE`]; `None` = no active health checks.
    pub grpc_health_service: Option<String>,
    /// See [`RETRYABLE_METHODS`].
    pub retryable_methods: Vec<MethodPattern>,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            skew_threshold: 1.5,
            hold_time: Duration::from_secs(30),
            max_rotations_per_minute: 6,
            max_connection_age: None,
            grpc_health_service: None,
            retryable_methods: Vec::new(),
        }
    }
}

/// A gRPC method, or all methods of a gRPC service, that may be retried.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MethodPattern {
    /// Fully qualified service, e.g. `echo.v1.Echo`.
    pub service: String,
    /// Method name, or `None` for every method of the service (`/echo.v1.Echo/*`).
    pub method: Option<String>,
}

impl MethodPattern {
    /// Whether a request path (`/echo.v1.Echo/Say`) matches.
    #[must_use]
    pub fn matches(&self, path: &str) -> bool {
        let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
            return false;
        };
        service == self.service && self.method.as_deref().is_none_or(|m| m == method)
    }
}

impl fmt::Display for MethodPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "/{}/{}",
            self.service,
            self.method.as_deref().unwrap_or("*")
        )
    }
}

impl FromStr for MethodPattern {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = || ConfigError::InvalidMethod {
            value: value.to_owned(),
        };
        let (service, method) = value
            .strip_prefix('/')
            .and_then(|p| p.split_once('/'))
            .ok_or_else(invalid)?;
        let valid_part = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        };
        if !valid_part(service) || !(method == "*" || valid_part(method)) {
            return Err(invalid());
        }
        Ok(Self {
            service: service.to_owned(),
            method: (method != "*").then(|| method.to_owned()),
        })
    }
}

/// Reads the mode annotation: `None` when the Service has not opted in.
///
/// # Errors
/// [`ConfigError::UnknownMode`] for a value that is not one of the three modes.
pub fn mode(annotations: &BTreeMap<String, String>) -> Result<Option<Mode>, ConfigError> {
    annotations.get(MODE).map(|v| v.parse()).transpose()
}

/// Parses and validates the tuning annotations, starting from [`Tuning::default`].
///
/// # Errors
/// Every invalid or unknown `skewless.io/` annotation, in key order.
pub fn tuning(annotations: &BTreeMap<String, String>) -> Result<Tuning, ConfigErrors> {
    let mut errors = Vec::new();
    let t = tuning_into(annotations, &mut errors);
    ConfigErrors::from_vec(errors).map_or(Ok(t), Err)
}

/// [`tuning`], with the problems pushed to `errors` (the bad annotations keep their defaults).
pub(crate) fn tuning_into(
    annotations: &BTreeMap<String, String>,
    errors: &mut Vec<ConfigError>,
) -> Tuning {
    let mut t = Tuning::default();
    for (key, value) in annotations.iter().filter(|(k, _)| k.starts_with(PREFIX)) {
        if let Err(error) = apply(&mut t, key, value.trim()) {
            errors.extend(error);
        }
    }
    t
}

/// Applies one `skewless.io/` annotation to `t`, or says why it is wrong (a retryable-methods
/// list may hold several bad patterns).
fn apply(t: &mut Tuning, key: &str, value: &str) -> Result<(), Vec<ConfigError>> {
    match key {
        MODE => {}
        SKEW_THRESHOLD => {
            let v: f64 = value.parse().map_err(|source| {
                vec![ConfigError::InvalidFloat {
                    annotation: SKEW_THRESHOLD,
                    value: value.to_owned(),
                    source,
                }]
            })?;
            if !(v.is_finite() && v > 1.0 && v <= 100.0) {
                return Err(vec![out_of_range(SKEW_THRESHOLD, value, "(1, 100]")]);
            }
            t.skew_threshold = v;
        }
        HOLD_TIME => {
            let d = parse_duration(HOLD_TIME, value).map_err(|e| vec![e])?;
            if d > Duration::from_secs(3600) {
                return Err(vec![out_of_range(HOLD_TIME, value, "0s..=1h")]);
            }
            t.hold_time = d;
        }
        MAX_ROTATIONS_PER_MINUTE => {
            let v: u32 = value.parse().map_err(|source| {
                vec![ConfigError::InvalidInteger {
                    annotation: MAX_ROTATIONS_PER_MINUTE,
                    value: value.to_owned(),
                    source,
                }]
            })?;
            if v > 600 {
                return Err(vec![out_of_range(
                    MAX_ROTATIONS_PER_MINUTE,
                    value,
                    "0..=600",
                )]);
            }
            t.max_rotations_per_minute = v;
        }
        MAX_CONNECTION_AGE => {
            let d = parse_duration(MAX_CONNECTION_AGE, value).map_err(|e| vec![e])?;
            if d.is_zero() {
                t.max_connection_age = None;
            } else if d < Duration::from_secs(1) || d > Duration::from_secs(86_400) {
                return Err(vec![out_of_range(
                    MAX_CONNECTION_AGE,
                    value,
                    "0s or 1s..=24h",
                )]);
            } else {
                t.max_connection_age = Some(d);
            }
        }
        GRPC_HEALTH_SERVICE => {
            if value.len() > 256 || value.chars().any(|c| c.is_whitespace() || c == ',') {
                return Err(vec![ConfigError::InvalidHealthService {
                    value: value.to_owned(),
                }]);
            }
            t.grpc_health_service = Some(value.to_owned());
        }
        RETRYABLE_METHODS => {
            let (methods, bad): (Vec<_>, Vec<_>) = value
                .split(',')
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::parse::<MethodPattern>)
                .partition(Result::is_ok);
            if !bad.is_empty() {
                return Err(bad.into_iter().filter_map(Result::err).collect());
            }
            t.retryable_methods = methods.into_iter().filter_map(Result::ok).collect();
        }
        _ => {
            debug_assert!(!KNOWN.contains(&key));
            return Err(vec![ConfigError::UnknownAnnotation {
                key: key.to_owned(),
            }]);
        }
    }
    Ok(())
}

fn out_of_range(annotation: &'static str, value: &str, range: &'static str) -> ConfigError {
    ConfigError::OutOfRange {
        annotation,
        value: value.to_owned(),
        range,
    }
}

/// Parses a Go-style duration (`500ms`, `30s`, `5m`, `1h`, `1m30s`; a bare `0` is zero), the
/// format Kubernetes users already write in probes and flags.
///
/// # Errors
/// [`ConfigError::InvalidDuration`] naming the annotation.
pub fn parse_duration(annotation: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let invalid = || ConfigError::InvalidDuration {
        annotation,
        value: value.to_owned(),
    };
    if value == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = value;
    let mut total = Duration::ZERO;
    if rest.is_empty() {
        return Err(invalid());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(invalid)?;
        if digits == 0 {
            return Err(invalid());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(invalid)?),
            "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(invalid)?),
            _ => return Err(invalid()),
        };
        total = total.checked_add(part).ok_or_else(invalid)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mk_annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn absent_mode_means_not_opted_in() {
        let a = mk_annotations(&[("other.io/x", "y")]);
        assert_eq!(mode(&a).expect("no mode is not an error"), None);
    }

    #[test]
    fn all_three_modes_parse() {
        for (v, m) in [
            ("request", Mode::Request),
            ("connection", Mode::Connection),
            (" observe ", Mode::Observe),
        ] {
            assert_eq!(mode(&mk_annotations(&[(MODE, v)])).expect("valid"), Some(m));
        }
    }

    #[test]
    fn unknown_mode_is_rejected_with_its_value() {
        let err = mode(&mk_annotations(&[(MODE, "fast")])).expect_err("fast is not a mode");
        assert_eq!(
            err,
            ConfigError::UnknownMode {
                value: "fast".into()
            }
        );
        assert_eq!(err.reason(), "UnknownMode");
    }

    #[test]
    fn no_tuning_annotations_give_documented_defaults() {
        let t = tuning(&mk_annotations(&[(MODE, "request")])).expect("defaults are valid");
        assert_eq!(t, Tuning::default());
        assert!((t.skew_threshold - 1.5).abs() < f64::EPSILON);
        assert_eq!(t.hold_time, Duration::from_secs(30));
        assert_eq!(t.max_rotations_per_minute, 6);
    }

    #[test]
    fn every_tuning_annotation_is_applied() {
        let t = tuning(&mk_annotations(&[
            (SKEW_THRESHOLD, "2.5"),
            (HOLD_TIME, "1m30s"),
            (MAX_ROTATIONS_PER_MINUTE, "0"),
            (MAX_CONNECTION_AGE, "10m"),
            (GRPC_HEALTH_SERVICE, "echo.v1.Echo"),
            (RETRYABLE_METHODS, "/echo.v1.Echo/Say, /echo.v1.Admin/*"),
        ]))
        .expect("all values are valid");
        assert!((t.skew_threshold - 2.5).abs() < f64::EPSILON);
        assert_eq!(t.hold_time, Duration::from_secs(90));
        assert_eq!(t.max_rotations_per_minute, 0);
        assert_eq!(t.max_connection_age, Some(Duration::from_secs(600)));
        assert_eq!(t.grpc_health_service.as_deref(), Some("echo.v1.Echo"));
        assert_eq!(t.retryable_methods.len(), 2);
        assert!(t.retryable_methods[0].matches("/echo.v1.Echo/Say"));
        assert!(!t.retryable_methods[0].matches("/echo.v1.Echo/Other"));
        assert!(t.retryable_methods[1].matches("/echo.v1.Admin/Anything"));
    }

    #[test]
    fn invalid_number_names_the_annotation() {
        let err = tuning(&mk_annotations(&[(SKEW_THRESHOLD, "lots")])).expect_err("not a number");
        assert!(
            matches!(
                err.as_slice(),
                [ConfigError::InvalidFloat {
                    annotation: SKEW_THRESHOLD,
                    ..
                }]
            ),
            "got {err:?}"
        );
        let err = tuning(&mk_annotations(&[(MAX_ROTATIONS_PER_MINUTE, "-1")]))
            .expect_err("negative count");
        assert!(
            matches!(err.as_slice(), [ConfigError::InvalidInteger { .. }]),
            "got {err:?}"
        );
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        for (k, v) in [
            (SKEW_THRESHOLD, "1.0"),
            (SKEW_THRESHOLD, "NaN"),
            (HOLD_TIME, "2h"),
            (MAX_ROTATIONS_PER_MINUTE, "601"),
            (MAX_CONNECTION_AGE, "10ms"),
        ] {
            let err = tuning(&mk_annotations(&[(k, v)])).expect_err("out of range");
            assert!(
                matches!(err.as_slice(), [ConfigError::OutOfRange { .. }]),
                "{k}={v}: {err:?}"
            );
        }
    }

    #[test]
    fn durations_parse_go_style_and_reject_garbage() {
        let d = |v| parse_duration(HOLD_TIME, v);
        assert_eq!(d("500ms").expect("ms"), Duration::from_millis(500));
        assert_eq!(d("1h2m3s").expect("compound"), Duration::from_secs(3723));
        assert_eq!(d("0").expect("bare zero"), Duration::ZERO);
        for bad in ["", "30", "s", "1.5s", "10 s", "3d", "-1s"] {
            assert!(
                matches!(d(bad), Err(ConfigError::InvalidDuration { .. })),
                "{bad:?} must be rejected"
            );
        }
    }

    #[test]
    fn unknown_skewless_annotation_is_reported_as_typo() {
        let err = tuning(&mk_annotations(&[("skewless.io/hold_time", "1s")]))
            .expect_err("typo must not be ignored");
        assert_eq!(
            err,
            ConfigError::UnknownAnnotation {
                key: "skewless.io/hold_time".into()
            }
            .into()
        );
    }

    #[test]
    fn bad_method_patterns_are_rejected() {
        for bad in ["echo.v1.Echo/Say", "/echo.v1.Echo", "/echo v1/Say", "/*/*"] {
            let err =
                tuning(&mk_annotations(&[(RETRYABLE_METHODS, bad)])).expect_err("bad pattern");
            assert!(
                matches!(err.as_slice(), [ConfigError::InvalidMethod { .. }]),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn every_bad_annotation_is_reported_not_only_the_first() {
        let err = tuning(&mk_annotations(&[
            ("skewless.io/hold_time", "1s"),
            (SKEW_THRESHOLD, "lots"),
            (RETRYABLE_METHODS, "/a.B/C, nope, /*/*"),
        ]))
        .expect_err("three bad annotations");
        let reasons: Vec<&str> = err.as_slice().iter().map(ConfigError::reason).collect();
        assert_eq!(
            reasons,
            [
                "UnknownAnnotation",
                "InvalidMethod",
                "InvalidMethod",
                "InvalidNumber"
            ],
            "every problem, annotations in key order: {err}"
        );
        let shown = err.to_string();
        for part in ["skewless.io/hold_time", "\"nope\"", "\"/*/*\"", "\"lots\""] {
            assert!(shown.contains(part), "{part} missing from {shown:?}");
        }
    }
}
