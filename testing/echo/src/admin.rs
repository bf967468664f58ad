//! A tiny HTTP/1 admin endpoint to change an echo server's behaviour at run time, so a benchmark
//! or demo can slow a pod down (and heal it) without restarting it:
//!
//! - `GET /delay` -> the current delay in milliseconds;
//! - `PUT /delay/<ms>` -> sets the delay every call waits (204);
//! - `PUT /health/serving`, `PUT /health/not-serving` -> flips `grpc.health.v1` (204).
//!
//! e.g. `curl -X PUT http://127.0.0.1:9001/delay/50`.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::{EchoControl, EchoError};

/// Serves the admin endpoint on `listener` until `shutdown` resolves.
///
/// # Errors
/// When accepting connections fails.
pub async fn serve(
    listener: TcpListener,
    control: EchoControl,
    shutdown: impl Future<Output = ()>,
) -> Result<(), EchoError> {
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => accepted.map_err(EchoError::Admin)?,
        };
        let control = control.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let control = control.clone();
                async move { Ok::<_, Infallible>(handle(&control, &req).await) }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, %error, "admin connection failed");
            }
        });
    }
}

async fn handle(control: &EchoControl, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let (status, body) = match (req.method(), path) {
        (&Method::GET, "/delay") => (StatusCode::OK, format!("{}\n", control.delay().as_millis())),
        (&Method::PUT, "/health/serving") => {
            control.set_serving(true).await;
            (StatusCode::NO_CONTENT, String::new())
        }
        (&Method::PUT, "/health/not-serving") => {
            control.set_serving(false).await;
            (StatusCode::NO_CONTENT, String::new())
        }
        (&Method::PUT, p) if p.starts_with("/delay/") => {
            match p["/delay/".len()..].parse::<u64>() {
                Ok(ms) => {
                    control.set_delay(Duration::from_millis(ms));
                    tracing::info!(delay_ms = ms, "delay set");
                    (StatusCode::NO_CONTENT, String::new())
                }
                Err(_) => (
                    StatusCode::BAD_REQUEST,
                    "delay must be whole milliseconds\n".to_owned(),
                ),
            }
        }
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}
