//! Feeds the skewless model from a local YAML file instead of Kubernetes: how the demo and
//! single-machine users run the agent.
//!
//! The file lists Services with their ClusterIPs, ports, mode, tuning annotations and endpoints
//! (see [`File`] and the example in `examples/services.yaml`). It is re-read when inotify
//! reports a change in its directory (so an opt-in reaches the model within milliseconds; the
//! directory, not the file, so an editor or a Kubernetes ConfigMap replacing it by rename and a
//! file created later are seen too), and on every poll as the fallback (no inotify, a symlink
//! into another directory), and applied when its content changed. A file that cannot be read
//! or parsed is reported (log line + `skewless_source_errors_total{source="file"}`) and the
//! last good state stays in effect; per-Service problems (a bad annotation) are handled by the
//! index like Kubernetes ones: that Service keeps its last good config.

#![forbid(unsafe_code)]

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::Duration,
};

use notify::Watcher as _;
use serde::Deserialize;
use skewless_model::{
    EndpointInput, Index, Metrics, PortInput, Rejection, ServiceInput, ServiceKey, SliceInput,
    SliceKey, SlicePortInput, Snapshot, TargetPort, annotations,
};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

/// The file's top level.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    #[serde(default)]
    pub services: Vec<FileService>,
}

/// One Service in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileService {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// IPv4 and/or IPv6 VIPs.
    #[serde(rename = "clusterIPs")]
    pub cluster_ips: Vec<String>,
    /// Shorthand for the `skewless.io/mode` annotation. Absent (and no annotation): the
    /// Service is listed but not handled.
    #[serde(default)]
    pub mode: Option<String>,
    /// `skewless.io/*` annotations, as on a Kubernetes Service.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    pub ports: Vec<FilePort>,
    #[serde(default)]
    pub endpoints: Vec<FileEndpoint>,
}

/// A Service port.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FilePort {
    #[serde(default)]
    pub name: String,
    pub port: i32,
    /// Number or container port name; default: `port`.
    #[serde(default)]
    pub target_port: Option<FileTargetPort>,
    #[serde(default)]
    pub protocol: String,
}

/// `targetPort`: a number or a name.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum FileTargetPort {
    Number(u16),
    Name(String),
}

/// One backend.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileEndpoint {
    pub address: String,
    /// Pod (or process) name, for status and metrics.
    #[serde(default)]
    pub target: Option<String>,
    /// Service port name -> the port this endpoint listens on. Needed for named target ports;
    /// otherwise defaults to the numeric target port.
    #[serde(default)]
    pub ports: BTreeMap<String, u16>,
    #[serde(default)]
    pub ready: Option<bool>,
    #[serde(default)]
    pub serving: Option<bool>,
    #[serde(default)]
    pub terminating: Option<bool>,
}

fn default_namespace() -> String {
    "default".to_owned()
}

/// Why a file was not applied. The previous state stays in effect.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("service {service} is listed twice")]
    DuplicateService { service: ServiceKey },
    #[error(
        "service {service}: endpoint {address} has no port for service port {port_name:?}, whose targetPort is a name; add `ports: {{{port_name}: N}}`"
    )]
    MissingEndpointPort {
        service: ServiceKey,
        address: String,
        port_name: String,
    },
}

/// The model inputs a file describes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    pub services: Vec<ServiceInput>,
    pub slices: Vec<SliceInput>,
}

/// Parses a file's content into model inputs.
///
/// # Errors
/// [`FileError::Parse`] for YAML that does not match the format (unknown fields included), and
/// the consistency errors of [`FileError`].
pub fn parse(path: &Path, text: &str) -> Result<Inputs, FileError> {
    let file: File = serde_yaml::from_str(text).map_err(|source| FileError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let mut seen = BTreeSet::new();
    let mut inputs = Inputs::default();
    for svc in file.services {
        let key = ServiceKey::new(svc.namespace.clone(), svc.name.clone());
        if !seen.insert(key.clone()) {
            return Err(FileError::DuplicateService { service: key });
        }
        inputs.slices.extend(slices(&key, &svc)?);
        let mut annots = svc.annotations;
        if let Some(mode) = svc.mode {
            annots.insert(annotations::MODE.to_owned(), mode);
        }
        inputs.services.push(ServiceInput {
            key,
            annotations: annots,
            cluster_ips: svc.cluster_ips,
            ports: svc
                .ports
                .iter()
                .map(|p| PortInput {
                    name: p.name.clone(),
                    port: p.port,
                    protocol: p.protocol.clone(),
                    target_port: p.target_port.as_ref().map(|t| match t {
                        FileTargetPort::Number(n) => TargetPort::Number(*n),
                        FileTargetPort::Name(n) => TargetPort::Name(n.clone()),
                    }),
                })
                .collect(),
        });
    }
    Ok(inputs)
}

/// One slice per endpoint: endpoints may listen on different numbers for a named port, and a
/// slice carries one number per port name (as the EndpointSlice controller does).
fn slices(key: &ServiceKey, svc: &FileService) -> Result<Vec<SliceInput>, FileError> {
    svc.endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let ports = svc
                .ports
                .iter()
                .map(|p| {
                    let number = match (e.ports.get(&p.name), &p.target_port) {
                        (Some(n), _) => i32::from(*n),
                        (None, Some(FileTargetPort::Number(n))) => i32::from(*n),
                        (None, None) => p.port,
                        (None, Some(FileTargetPort::Name(_))) => {
                            return Err(FileError::MissingEndpointPort {
                                service: key.clone(),
                                address: e.address.clone(),
                                port_name: p.name.clone(),
                            });
                        }
                    };
                    Ok(SlicePortInput {
                        name: p.name.clone(),
                        port: Some(number),
                        protocol: p.protocol.clone(),
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok(SliceInput {
                key: SliceKey {
                    namespace: key.namespace.clone(),
                    name: format!("{}-file-{i}", key.name),
                },
                service_name: Some(key.name.clone()),
                ports,
                endpoints: vec![EndpointInput {
                    addresses: vec![e.address.clone()],
                    target_name: e.target.clone(),
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                }],
            })
        })
        .collect()
}

/// The file source. Build it, take [`FileSource::snapshots`], then spawn [`FileSource::run`].
pub struct FileSource {
    path: PathBuf,
    poll: Duration,
    index: Index,
    /// Content of the last file applied, to skip unchanged polls.
    last_text: Option<String>,
    /// Display of the last error reported, so an unchanged broken file is reported once.
    last_error: Option<Vec<String>>,
    /// Set once a file has been applied: until then the model is empty because nothing was
    /// read, not because the file names no Service.
    synced: watch::Sender<bool>,
}

impl FileSource {
    /// `poll`: how often the file is re-read (1 s is plenty for humans editing it).
    #[must_use]
    pub fn new(path: impl Into<PathBuf>, poll: Duration, metrics: Metrics) -> Self {
        Self {
            path: path.into(),
            poll,
            index: Index::new(metrics),
            last_text: None,
            last_error: None,
            synced: watch::Sender::new(false),
        }
    }

    /// Becomes `true` once the file has been read and applied (a missing or invalid file
    /// keeps it `false`). Gate readiness and redirects on it, as with Kubernetes discovery.
    #[must_use]
    pub fn synced(&self) -> watch::Receiver<bool> {
        self.synced.subscribe()
    }

    /// Per-Service state, as with Kubernetes discovery.
    #[must_use]
    pub fn snapshots(&self) -> watch::Receiver<Snapshot> {
        self.index.subscribe()
    }

    /// Reads the file once and applies it if it changed.
    ///
    /// # Errors
    /// The file could not be read or is invalid; nothing was applied.
    pub fn reload(&mut self) -> Result<Vec<Rejection>, FileError> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| FileError::Read {
            path: self.path.clone(),
            source,
        })?;
        if self.last_text.as_deref() == Some(text.as_str()) {
            return Ok(Vec::new());
        }
        // Remembered only once applied: a broken file is re-parsed (and its error deduplicated
        // by `run`) until it changes.
        let inputs = parse(&self.path, &text)?;
        self.last_text = Some(text);
        debug!(services = inputs.services.len(), "file applied");
        let rejections = self.index.reset(&inputs.services, &inputs.slices);
        self.synced
            .send_if_modified(|s| !std::mem::replace(s, true));
        Ok(rejections)
    }

    /// Follows the file forever: re-reads it a moment after inotify reports a change in its
    /// directory, and on every poll.
    pub async fn run(mut self) {
        info!(path = %self.path.display(), poll = ?self.poll, "watching services file");
        let (changed_tx, mut changed_rx) = mpsc::channel::<()>(1);
        let mut watcher = DirWatcher::new(&self.path, changed_tx);
        let mut tick = tokio::time::interval(self.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // Retried on every poll while the directory does not exist yet.
                    watcher.ensure();
                }
                Some(()) = changed_rx.recv() => {
                    // A writer's burst of events (truncate, write, close) is one change: let it
                    // settle, then read once.
                    tokio::time::sleep(SETTLE).await;
                    while changed_rx.try_recv().is_ok() {}
                }
            }
            self.reload_and_report();
        }
    }

    fn reload_and_report(&mut self) {
        match self.reload() {
            Ok(_) => {
                if self.last_error.take().is_some() {
                    info!(path = %self.path.display(), "services file valid again");
                }
            }
            Err(error) => {
                let causes = causes(&error);
                if self.last_error.as_ref() != Some(&causes) {
                    warn!(
                        error = &error as &dyn std::error::Error,
                        "services file rejected; keeping last good state"
                    );
                    self.index.metrics().source_error("file");
                    self.last_error = Some(causes);
                }
            }
        }
    }
}

/// How long after a change event the file is read: writers produce several events per change.
const SETTLE: Duration = Duration::from_millis(10);

/// An inotify watch on the file's directory that signals `changed` for events that may concern
/// the file: its own name, a Kubernetes ConfigMap's `..data` swap, or an overflow.
struct DirWatcher {
    path: PathBuf,
    changed: mpsc::Sender<()>,
    watcher: Option<notify::RecommendedWatcher>,
    /// The last failure, logged once.
    failed: Option<Vec<String>>,
}

impl DirWatcher {
    fn new(path: &Path, changed: mpsc::Sender<()>) -> Self {
        let mut w = Self {
            path: path.to_owned(),
            changed,
            watcher: None,
            failed: None,
        };
        w.ensure();
        w
    }

    /// Sets the watch up if it is not yet.
    fn ensure(&mut self) {
        if self.watcher.is_some() {
            return;
        }
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = self.path.file_name().map(std::ffi::OsStr::to_owned);
        let changed = self.changed.clone();
        let watched = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let concerns_file = match &event {
                Ok(event) => concerns(event, name.as_deref()),
                // Overflow or a backend error: the file may have changed.
                Err(_) => true,
            };
            if concerns_file {
                // Full means a reload is already due.
                let _ = changed.try_send(());
            }
        })
        .and_then(|mut w| {
            w.watch(&dir, notify::RecursiveMode::NonRecursive)?;
            Ok(w)
        });
        match watched {
            Ok(w) => {
                debug!(dir = %dir.display(), "watching the services file's directory");
                self.watcher = Some(w);
                if self.failed.take().is_some() {
                    info!(dir = %dir.display(), "watching the services file's directory again");
                }
            }
            Err(error) => {
                let causes = causes(&error);
                if self.failed.as_ref() != Some(&causes) {
                    warn!(
                        dir = %dir.display(),
                        error = &error as &dyn std::error::Error,
                        "cannot watch the services file's directory; polling only"
                    );
                    self.failed = Some(causes);
                }
            }
        }
    }
}

/// Whether an event in the directory may concern the file named `name`. Opens and reads (ours
/// included) do not; anything that writes, creates, renames or removes it does.
fn concerns(event: &notify::Event, name: Option<&std::ffi::OsStr>) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    event.paths.is_empty()
        || event.paths.iter().any(|p| match p.file_name() {
            Some(f) => Some(f) == name || f.as_encoded_bytes().starts_with(b".."),
            None => true,
        })
}

/// The error and its sources, to report a failure once until it changes. The log line itself
/// shows the sources through tracing (`error.sources=[..]`).
fn causes(error: &(dyn std::error::Error + 'static)) -> Vec<String> {
    std::iter::successors(Some(error), |e| e.source())
        .map(ToString::to_string)
        .collect()
}
