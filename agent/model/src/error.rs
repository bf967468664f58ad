use std::num::{ParseFloatError, ParseIntError};

/// Why a Service's config (annotations or spec) was rejected. The Service keeps its last good
/// config; the error is reported once (log line, metric, Kubernetes Warning Event).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown skewless.io/mode {value:?}; expected request, connection or observe")]
    UnknownMode { value: String },
    #[error("unknown annotation {key:?}; is it a typo?")]
    UnknownAnnotation { key: String },
    #[error("annotation {annotation}: {value:?} is not a number")]
    InvalidFloat {
        annotation: &'static str,
        value: String,
        #[source]
        source: ParseFloatError,
    },
    #[error("annotation {annotation}: {value:?} is not a whole number")]
    InvalidInteger {
        annotation: &'static str,
        value: String,
        #[source]
        source: ParseIntError,
    },
    #[error("annotation {annotation}: {value:?} is not a duration (like 500ms, 30s, 1m30s)")]
    InvalidDuration {
        annotation: &'static str,
        value: String,
    },
    #[error("annotation {annotation}: {value:?} is outside {range}")]
    OutOfRange {
        annotation: &'static str,
        value: String,
        range: &'static str,
    },
    #[error("retryable method {value:?} is not /package.Service/Method or /package.Service/*")]
    InvalidMethod { value: String },
    #[error("gRPC health service name {value:?} contains whitespace or commas or is too long")]
    InvalidHealthService { value: String },
    #[error(
        "headless Service (clusterIP None) has no virtual IP to balance; remove skewless.io/mode"
    )]
    Headless,
    #[error("Service has no ClusterIP (type ExternalName or not yet allocated)")]
    NoClusterIp,
    #[error("clusterIP {value:?} is not an IP address")]
    InvalidClusterIp { value: String },
    #[error(
        "port {port} uses protocol {protocol}; skewless balances TCP (gRPC) only, move it to another Service"
    )]
    UnsupportedProtocol { port: i32, protocol: String },
    #[error("port {port} is not a valid port number")]
    InvalidPort { port: i32 },
    #[error("Service has no ports")]
    NoPorts,
}

impl ConfigError {
    /// A short CamelCase reason, used as the Kubernetes Event reason and as a metric label
    /// (bounded: one value per variant).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            ConfigError::UnknownMode { .. } => "UnknownMode",
            ConfigError::UnknownAnnotation { .. } => "UnknownAnnotation",
            ConfigError::InvalidFloat { .. } | ConfigError::InvalidInteger { .. } => {
                "InvalidNumber"
            }
            ConfigError::InvalidDuration { .. } => "InvalidDuration",
            ConfigError::OutOfRange { .. } => "OutOfRange",
            ConfigError::InvalidMethod { .. } => "InvalidMethod",
            ConfigError::InvalidHealthService { .. } => "InvalidHealthService",
            ConfigError::Headless => "Headless",
            ConfigError::NoClusterIp | ConfigError::InvalidClusterIp { .. } => "NoClusterIP",
            ConfigError::UnsupportedProtocol { .. } => "UnsupportedProtocol",
            ConfigError::InvalidPort { .. } | ConfigError::NoPorts => "InvalidPort",
        }
    }
}

/// Every problem found in one Service's config, in the order found (the mode, the tuning
/// annotations in key order, then the spec); never empty. Reported whole, in one log line and
/// one Kubernetes Event, so a user with a typo'd key and a bad number fixes both at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    /// The problems; at least one.
    #[must_use]
    pub fn as_slice(&self) -> &[ConfigError] {
        &self.0
    }

    /// The first problem found.
    #[must_use]
    pub fn first(&self) -> &ConfigError {
        // Never empty: every constructor pushes at least one error.
        &self.0[0]
    }

    /// The first problem's [`ConfigError::reason`]: the Event reason and metric label (one
    /// bounded value per rejected config).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        self.first().reason()
    }

    /// How many problems there are.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `first`, then `rest`.
    pub(crate) fn new(first: ConfigError, rest: Vec<ConfigError>) -> Self {
        Self(std::iter::once(first).chain(rest).collect())
    }

    /// `errors` as a [`ConfigErrors`], or `None` when there are none.
    pub(crate) fn from_vec(errors: Vec<ConfigError>) -> Option<Self> {
        (!errors.is_empty()).then_some(Self(errors))
    }
}

impl From<ConfigError> for ConfigErrors {
    fn from(error: ConfigError) -> Self {
        Self(vec![error])
    }
}

impl std::fmt::Display for ConfigErrors {
    /// The problems separated by "; ".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
