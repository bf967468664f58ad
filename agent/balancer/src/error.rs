//! Errors of the balancer. Each adds one level of context; the proxy's single "rescue" in
//! `proxy` maps them to gRPC statuses.

/// Errors of [`crate::Balancer::serve`].
#[derive(Debug, thiserror::Error)]
pub enum BalancerError {
    /// Accepting a client connection failed.
    #[error("failed to accept a client connection")]
    Accept(#[source] std::io::Error),
}

/// Why a request could not be forwarded; becomes a gRPC status for the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    /// The Service has no endpoints at all.
    #[error("no endpoints")]
    NoEndpoints,
    /// There are endpoints but none became ready in time.
    #[error("no endpoint is ready")]
    NoReadyEndpoint,
    /// The caller's budget ran out before the upstream answered.
    #[error("deadline exceeded in the balancer")]
    DeadlineExceeded,
    /// The upstream failed the request after it was sent.
    #[error("upstream request failed")]
    Upstream(#[source] h2::Error),
    /// The client reset its stream (or its connection broke) before the reply: nobody to
    /// answer.
    #[error("client went away")]
    ClientGone,
}

/// Errors of one connection attempt to an endpoint.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// TCP connect failed.
    #[error("tcp connect failed")]
    Tcp(#[source] std::io::Error),
    /// TCP connect or the handshake took longer than the connect timeout.
    #[error("connect timed out")]
    Timeout,
    /// The connection closed before the server sent anything (nobody serves the listener).
    #[error("server closed the connection without speaking HTTP/2")]
    Silent,
    /// The HTTP/2 handshake failed.
    #[error("http/2 handshake failed")]
    Handshake(#[source] h2::Error),
}
