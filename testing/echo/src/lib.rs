//! The echo backend of skewless's tests, benchmark and demo.
//!
//! It implements `skewless.echo.v1.Echo` (proto/skewless/echo/v1/echo.proto) and names the pod
//! (`--name`) in every reply, so a client can tally where its calls landed. Every call waits for
//! the pod's delay, which is settable at run time through [`EchoControl`] in-process or through
//! the small HTTP/1 admin endpoint in [`admin`] (`PUT /delay/<ms>`), plus the request's own
//! `delay_ms`. `grpc.health.v1` is served with `tonic-health`; [`EchoControl::set_serving`]
//! flips it.
#![forbid(unsafe_code)]

pub mod admin;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::server::HealthReporter;

/// Generated code for `skewless.echo.v1`.
#[expect(clippy::pedantic, missing_docs, reason = "generated code")]
pub mod pb {
    tonic::include_proto!("skewless.echo.v1");
}

use pb::echo_server::{Echo, EchoServer};
use pb::{EchoReply, EchoRequest};

/// Largest message the echo server and the test clients accept: well above gRPC's 4 MiB
/// default so tests can push large messages through the balancer.
pub const MAX_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// Errors of the echo server.
#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    /// Binding or reading the listener's address failed.
    #[error("failed to bind the echo listener")]
    Bind(#[source] std::io::Error),
    /// The gRPC server stopped with an error.
    #[error("echo server failed")]
    Serve(#[source] tonic::transport::Error),
    /// The admin endpoint failed to accept.
    #[error("echo admin endpoint failed")]
    Admin(#[source] std::io::Error),
    /// The server task ended before it handed out its controls.
    #[error("echo server exited before it was ready")]
    Exited,
    /// The server task panicked or was aborted.
    #[error("echo server task failed")]
    Join(#[source] tokio::task::JoinError),
}

/// Run-time controls of one echo server: its delay and its health status.
#[derive(Clone)]
pub struct EchoControl {
    delay_us: Arc<AtomicU64>,
    health: HealthReporter,
}

impl std::fmt::Debug for EchoControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EchoControl")
            .field("delay", &self.delay())
            .finish_non_exhaustive()
    }
}

impl EchoControl {
    /// Sets the delay every call waits before replying (the slow-pod knob).
    pub fn set_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.delay_us.store(us, Ordering::Relaxed);
    }

    /// The current per-call delay.
    #[must_use]
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Ordering::Relaxed))
    }

    /// Sets the `grpc.health.v1` status of the Echo service and of the whole server ("").
    pub async fn set_serving(&self, serving: bool) {
        let status = if serving {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        self.health.set_service_status(SERVICE_NAME, status).await;
        self.health.set_service_status("", status).await;
    }
}

/// Fully qualified name of the echo service, as `grpc.health.v1` knows it.
pub const SERVICE_NAME: &str = "skewless.echo.v1.Echo";

#[derive(Debug, Clone)]
struct EchoImpl {
    name: Arc<str>,
    control: EchoControl,
}

impl EchoImpl {
    async fn wait(&self, extra_ms: u32) {
        let delay = self.control.delay() + Duration::from_millis(u64::from(extra_ms));
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }

    fn reply(&self, req: EchoRequest) -> EchoReply {
        let payload = if req.reply_size > 0 {
            vec![0x5a; req.reply_size as usize]
        } else {
            req.payload
        };
        EchoReply {
            payload,
            pod: self.name.to_string(),
        }
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Echo for EchoImpl {
    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let req = request.into_inner();
        self.wait(req.delay_ms).await;
        Ok(Response::new(self.reply(req)))
    }

    type ServerStreamStream = ReplyStream;

    async fn server_stream(
        &self,
        request: Request<EchoRequest>,
    ) -> Result<Response<Self::ServerStreamStream>, Status> {
        let req = request.into_inner();
        self.wait(req.delay_ms).await;
        // A bounded channel keeps a slow reader from making the server buffer every reply.
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        let interval = Duration::from_millis(u64::from(req.interval_ms));
        tokio::spawn(async move {
            for i in 0..req.count {
                if i > 0 && !interval.is_zero() {
                    tokio::time::sleep(interval).await;
                }
                if tx.send(Ok(this.reply(req.clone()))).await.is_err() {
                    // The client went away (cancelled); stop producing.
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn client_stream(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<EchoReply>, Status> {
        let mut stream = request.into_inner();
        let mut payload = Vec::new();
        let mut delay_ms = 0;
        while let Some(req) = stream.next().await {
            let req = req?;
            payload.extend_from_slice(&req.payload);
            delay_ms = req.delay_ms;
        }
        self.wait(delay_ms).await;
        Ok(Response::new(EchoReply {
            payload,
            pod: self.name.to_string(),
        }))
    }

    type BidiStream = ReplyStream;

    async fn bidi(
        &self,
        request: Request<Streaming<EchoRequest>>,
    ) -> Result<Response<Self::BidiStream>, Status> {
        let mut stream = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            while let Some(req) = stream.next().await {
                let out = match req {
                    Ok(req) => {
                        this.wait(req.delay_ms).await;
                        Ok(this.reply(req))
                    }
                    Err(status) => Err(status),
                };
                if tx.send(out).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the echo service and `grpc.health.v1` on `listener` until `shutdown` resolves, then
/// drains gracefully (GOAWAY, in-flight calls finish).
///
/// # Errors
/// When the gRPC server fails.
pub async fn serve(
    listener: TcpListener,
    name: &str,
    control_tx: oneshot::Sender<EchoControl>,
    initial_delay: Duration,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), EchoError> {
    let options = ServeOptions {
        initial_delay,
        ..ServeOptions::default()
    };
    serve_with(listener, name, options, control_tx, shutdown).await
}

/// How [`serve_with`] serves, beyond the listener and the name.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServeOptions {
    /// The per-call delay at start ([`EchoControl::set_delay`] changes it later).
    pub initial_delay: Duration,
    /// Like a gRPC server's MaxConnectionAge: each client connection gets a graceful GOAWAY
    /// (h2's two-phase GOAWAY with a PING) once it is this old, and its calls finish. `None`:
    /// connections live as long as the client keeps them.
    pub max_connection_age: Option<Duration>,
}

/// [`serve`] with every option.
///
/// # Errors
/// When the gRPC server fails.
pub async fn serve_with(
    listener: TcpListener,
    name: &str,
    options: ServeOptions,
    control_tx: oneshot::Sender<EchoControl>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), EchoError> {
    let ServeOptions {
        initial_delay,
        max_connection_age,
    } = options;
    let (health, health_service) = tonic_health::server::health_reporter();
    let control = EchoControl {
        delay_us: Arc::new(AtomicU64::new(0)),
        health,
    };
    control.set_delay(initial_delay);
    control.set_serving(true).await;
    let echo = EchoImpl {
        name: Arc::from(name),
        control: control.clone(),
    };
    // The caller may have stopped caring about the control handle; serving goes on.
    let _ = control_tx.send(control);
    let service = EchoServer::new(echo)
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE);
    // tonic sets TCP_NODELAY only on listeners it binds itself; gRPC servers set it (grpc-go,
    // grpc-java do), and without it replies wait for the client's delayed ACK (40 ms on Linux).
    let incoming = tokio_stream::StreamExt::map(TcpListenerStream::new(listener), |conn| {
        if let Ok(tcp) = &conn {
            let _ = tcp.set_nodelay(true);
        }
        conn
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(age) = max_connection_age {
        builder = builder.max_connection_age(age);
    }
    builder
        .add_service(health_service)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(EchoError::Serve)
}

/// An echo server running on a spawned task; for tests and the benchmark.
#[derive(Debug)]
pub struct SpawnedEcho {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its name, as it appears in replies.
    pub name: String,
    /// Its run-time controls.
    pub control: EchoControl,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), EchoError>>,
}

impl SpawnedEcho {
    /// Binds `addr` (port 0 picks one) and serves there on a spawned task.
    ///
    /// # Errors
    /// When binding fails.
    pub async fn start(addr: SocketAddr, name: &str) -> Result<Self, EchoError> {
        let listener = TcpListener::bind(addr).await.map_err(EchoError::Bind)?;
        Self::start_on(listener, name).await
    }

    /// Serves on an already bound listener on a spawned task.
    ///
    /// # Errors
    /// When the listener has no local address.
    pub async fn start_on(listener: TcpListener, name: &str) -> Result<Self, EchoError> {
        let addr = listener.local_addr().map_err(EchoError::Bind)?;
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let (control_tx, control_rx) = oneshot::channel();
        let owned = name.to_owned();
        let task = tokio::spawn(async move {
            serve(listener, &owned, control_tx, Duration::ZERO, async {
                let _ = shutdown_rx.await;
            })
            .await
        });
        let control = control_rx.await.map_err(|_| EchoError::Exited)?;
        Ok(Self {
            addr,
            name: name.to_owned(),
            control,
            shutdown: Some(shutdown_tx),
            task,
        })
    }

    /// Starts a graceful shutdown (GOAWAY to every client) and waits until the server stopped.
    ///
    /// # Errors
    /// When the server had failed.
    pub async fn stop(mut self) -> Result<(), EchoError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match (&mut self.task).await {
            Ok(res) => res,
            Err(join) => Err(EchoError::Join(join)),
        }
    }
}

impl Drop for SpawnedEcho {
    fn drop(&mut self) {
        // A dropped handle must not leave a server running in a test process.
        self.task.abort();
    }
}
