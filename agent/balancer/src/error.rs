//! Errors of the balancer's public API. Each error adds one level of context with a
//! `#[source]`; request mode's errors of one call live with the call (`request::proxy`, whose
//! single "rescue" maps them to gRPC statuses), an upstream connect's with [`crate::upstream`].

/// Errors of [`crate::Balancer::serve`].
#[derive(Debug, thiserror::Error)]
pub enum BalancerError {
    /// Accepting a client connection failed.
    #[error("failed to accept a client connection")]
    Accept(#[source] std::io::Error),
}
