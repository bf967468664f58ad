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
