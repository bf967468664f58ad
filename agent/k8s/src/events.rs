//! Warning Events for rejected Service configs.
//!
//! Every node's agent sees the same bad annotation at about the same time. kube's `Recorder`
//! names events by timestamp, so a 1000-node cluster would get 1000 Events per mistake. We name
//! the Event after the Service's UID and the error instead: the first agent creates it, the
//! others get `409 AlreadyExists` and stop there. One Event per distinct error, cluster-wide.

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{PostParams, Resource},
};
use skewless_model::{Metrics, Rejection};
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// `reportingController` of our Events.
pub const REPORTING_CONTROLLER: &str = "skewless.io/agent";
/// `action` of our Events: the agent tried to apply the Service's config.
pub const ACTION: &str = "ApplyConfig";

/// A rejected config and the Service it belongs to.
#[derive(Clone, Debug)]
pub(crate) struct Report {
    pub(crate) rejection: Rejection,
    pub(crate) regarding: ObjectReference,
}

/// Reports waiting to be posted. Each distinct error is reported once per Service, so the
/// queue only fills when the API server is slow and many Services go bad at once; it is
/// bounded so that cannot grow the agent's memory without limit.
pub(crate) const QUEUE: usize = 256;

/// The index's end of the queue to the poster: never blocks, drops and counts when full.
#[derive(Debug)]
pub(crate) struct Queue {
    tx: mpsc::Sender<Report>,
    metrics: Metrics,
}

impl Queue {
    /// A queue of `capacity` reports and the poster's end of it.
    pub(crate) fn new(capacity: usize, metrics: Metrics) -> (Self, mpsc::Receiver<Report>) {
        let (tx, rx) = mpsc::channel(capacity);
        (Self { tx, metrics }, rx)
    }

    /// Queues a report, or drops and counts it when the poster is that far behind. The
    /// rejection itself is already counted and logged by the index; only its Event is lost.
    pub(crate) fn push(&self, report: Report) {
        match self.tx.try_send(report) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(report)) => {
                self.metrics.warning_event_dropped();
                debug!(service = %report.rejection.service, "warning event queue full; event dropped");
            }
            // The poster lives as long as the discovery loop; closed only at shutdown.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

/// Posts Events; owned by one task so that a slow API server never delays the index.
pub(crate) struct EventPoster {
    client: Client,
    instance: String,
}

impl EventPoster {
    pub(crate) fn new(client: Client, instance: String) -> Self {
        Self { client, instance }
    }

    pub(crate) async fn post(&self, report: &Report) {
        let Report {
            rejection,
            regarding,
        } = report;
        let event = build_event(rejection, regarding, &self.instance);
        let ns = rejection.service.namespace.as_str();
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        match api.create(&PostParams::default(), &event).await {
            Ok(_) => {
                debug!(service = %rejection.service, reason = rejection.error.reason(), "warning event posted")
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                debug!(service = %rejection.service, "warning event already posted by another node");
            }
            Err(error) => {
                warn!(service = %rejection.service, %error, "posting warning event failed");
            }
        }
    }
}

/// The Event for a rejection, named deterministically (see the module docs).
pub(crate) fn build_event(
    rejection: &Rejection,
    regarding: &ObjectReference,
    instance: &str,
) -> Event {
    let outcome = if rejection.kept_last_good {
        "keeping the last good skewless config"
    } else {
        "skewless does not handle this Service"
    };
    let note = note(&rejection.error.to_string(), outcome);
    let uid = regarding.uid.as_deref().unwrap_or_default();
    let name = format!(
        "{}.skewless.{:016x}",
        rejection.service.name,
        fnv1a(&[uid.as_bytes(), note.as_bytes()])
    );
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(rejection.service.namespace.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        type_: Some("Warning".to_owned()),
        reason: Some(rejection.error.reason().to_owned()),
        action: Some(ACTION.to_owned()),
        note: Some(note),
        regarding: Some(regarding.clone()),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        reporting_instance: Some(instance.chars().take(128).collect()),
        ..Event::default()
    }
}

/// The API server's limit on an Event's note, in bytes.
pub const NOTE_LIMIT: usize = 1024;

/// "`problems`; `outcome`", cut to [`NOTE_LIMIT`] bytes: every problem of the config is listed,
/// but a user-supplied value (an annotation can hold 256 KiB) must not make the API server
/// refuse the Event. The outcome always stays; what is cut from the problems ends in "...".
fn note(problems: &str, outcome: &str) -> String {
    let full = format!("{problems}; {outcome}");
    if full.len() <= NOTE_LIMIT {
        return full;
    }
    let room = NOTE_LIMIT - outcome.len() - "...; ".len();
    let mut cut = room.min(problems.len());
    while !problems.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...; {outcome}", &problems[..cut])
}

/// Reference to the Service an Event is about.
pub(crate) fn service_ref(svc: &crate::ServiceObject) -> ObjectReference {
    svc.object_ref(&())
}

/// FNV-1a, 64 bit: a stable hash (unlike `DefaultHasher`) so all agents pick the same name.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in *part {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use skewless_model::{ConfigError, ServiceKey};

    use super::*;

    fn mk_rejection(error: ConfigError) -> Rejection {
        Rejection {
            service: ServiceKey::new("ns", "web"),
            error: error.into(),
            kept_last_good: true,
        }
    }

    fn mk_ref(uid: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            name: Some("web".into()),
            namespace: Some("ns".into()),
            uid: Some(uid.into()),
            ..ObjectReference::default()
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_growing() {
        let metrics = Metrics::default();
        let (queue, mut rx) = Queue::new(2, metrics.clone());
        for value in ["a", "b", "c", "d", "e"] {
            queue.push(Report {
                rejection: mk_rejection(ConfigError::UnknownMode {
                    value: value.into(),
                }),
                regarding: mk_ref("u1"),
            });
        }
        assert_eq!(
            metrics.warning_events_dropped_total(),
            3,
            "three did not fit"
        );
        let first = rx.try_recv().expect("the first report is kept");
        assert!(
            matches!(first.rejection.error.first(), ConfigError::UnknownMode { value } if value == "a"),
            "the oldest reports are kept, the newest dropped"
        );
        assert!(rx.try_recv().is_ok());
        assert!(rx.try_recv().is_err(), "only two were queued");
    }

    #[test]
    fn same_error_on_two_nodes_gets_the_same_event_name() {
        let r = mk_rejection(ConfigError::UnknownMode { value: "x".into() });
        let a = build_event(&r, &mk_ref("u1"), "node-a");
        let b = build_event(&r, &mk_ref("u1"), "node-b");
        assert_eq!(a.metadata.name, b.metadata.name);
        assert_eq!(a.type_.as_deref(), Some("Warning"));
        assert_eq!(a.reason.as_deref(), Some("UnknownMode"));
    }

    #[test]
    fn different_error_or_service_gets_a_new_event_name() {
        let r1 = mk_rejection(ConfigError::UnknownMode { value: "x".into() });
        let r2 = mk_rejection(ConfigError::UnknownMode { value: "y".into() });
        let n = |r: &Rejection, uid: &str| build_event(r, &mk_ref(uid), "n").metadata.name;
        assert_ne!(n(&r1, "u1"), n(&r2, "u1"));
        assert_ne!(
            n(&r1, "u1"),
            n(&r1, "u2"),
            "a recreated Service must be told again"
        );
    }

    #[test]
    fn every_problem_of_a_config_goes_into_one_event() {
        let mut svc = skewless_model::ServiceInput {
            key: ServiceKey::new("ns", "web"),
            annotations: [
                ("skewless.io/mode", "request"),
                ("skewless.io/hold_time", "1s"),
                ("skewless.io/skew-threshold", "lots"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            cluster_ips: vec!["10.96.0.10".into()],
            ports: Vec::new(),
        };
        svc.ports.push(skewless_model::PortInput {
            name: "grpc".into(),
            port: 80,
            protocol: "TCP".into(),
            target_port: None,
        });
        let error = svc.config().expect_err("two bad annotations");
        let r = Rejection {
            service: svc.key.clone(),
            error,
            kept_last_good: false,
        };
        let event = build_event(&r, &mk_ref("u1"), "n");
        let note = event.note.expect("a note");
        assert!(
            note.contains("skewless.io/hold_time") && note.contains("\"lots\""),
            "both problems in one Event: {note}"
        );
        assert!(
            note.ends_with("skewless does not handle this Service"),
            "{note}"
        );
        assert_eq!(event.reason.as_deref(), Some("UnknownAnnotation"));
    }

    #[test]
    fn a_huge_value_cannot_push_the_note_past_the_api_limit() {
        let r = mk_rejection(ConfigError::UnknownMode {
            value: "é".repeat(100_000),
        });
        let note = build_event(&r, &mk_ref("u1"), "n").note.expect("a note");
        assert!(note.len() <= NOTE_LIMIT, "{} bytes", note.len());
        assert!(
            note.ends_with("...; keeping the last good skewless config"),
            "cut in the problems, never in the outcome: {}",
            &note[note.len() - 60..]
        );
    }
}
