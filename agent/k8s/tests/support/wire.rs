//! The fake API server's HTTP side: JSON responses and `Status` errors, query strings, and
//! label and field selectors.

use std::collections::BTreeMap;

use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use serde_json::{Value, json};

use super::{Body, Obj};

pub(super) fn full(status: StatusCode, v: &Value) -> Response<Body> {
    bytes_response(status, Bytes::from(v.to_string()))
}

pub(super) fn bytes_response(status: StatusCode, body: Bytes) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(body).map_err(|never| match never {}).boxed())
        .expect("response")
}

pub(super) fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

pub(super) fn error(code: u16, reason: &str, message: &str) -> Response<Body> {
    full(
        StatusCode::from_u16(code).expect("status code"),
        &status(code, reason, message),
    )
}

/// `%XX` and `+` decoding of one query component.
pub(super) fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn query(req: &http::Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

/// A parsed `labelSelector` or `fieldSelector`.
pub(super) struct Selector {
    labels: Vec<(String, Op)>,
    name: Option<String>,
}

pub(super) enum Op {
    Eq(String),
    Ne(String),
    Exists,
    Absent,
}

impl Selector {
    pub(super) fn parse(q: &BTreeMap<String, String>) -> Self {
        let labels = q
            .get("labelSelector")
            .map(|sel| {
                sel.split(',')
                    .filter(|t| !t.is_empty())
                    .map(|t| {
                        if let Some((k, v)) = t.split_once("!=") {
                            (k.to_owned(), Op::Ne(v.to_owned()))
                        } else if let Some((k, v)) = t.split_once("==") {
                            (k.to_owned(), Op::Eq(v.to_owned()))
                        } else if let Some((k, v)) = t.split_once('=') {
                            (k.to_owned(), Op::Eq(v.to_owned()))
                        } else if let Some(k) = t.strip_prefix('!') {
                            (k.to_owned(), Op::Absent)
                        } else {
                            (t.to_owned(), Op::Exists)
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let name = q
            .get("fieldSelector")
            .and_then(|s| s.strip_prefix("metadata.name="))
            .map(str::to_owned);
        Self { labels, name }
    }

    pub(super) fn matches(&self, ns: Option<&str>, obj: &Obj) -> bool {
        if ns.is_some_and(|ns| ns != obj.namespace) {
            return false;
        }
        if self.name.as_ref().is_some_and(|n| *n != obj.name) {
            return false;
        }
        self.labels.iter().all(|(k, op)| {
            let v = obj.labels.get(k);
            match op {
                Op::Eq(want) => v == Some(want),
                Op::Ne(want) => v != Some(want),
                Op::Exists => v.is_some(),
                Op::Absent => v.is_none(),
            }
        })
    }
}
