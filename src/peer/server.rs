//! The node's peer endpoint: other nodes' drivers read the seals and the
//! file ranges of models this node holds sealed. Nothing else is served,
//! and nothing without the cluster's peer token (401, no byte).
//!
//! - `GET /v1/models/<sid>/seal`: the seal (files, sha256s, chunk tables).
//! - `GET /v1/models/<sid>/file?path=<path>` with `Range: bytes=a-b`: bytes
//!   of a file the seal lists, read from the immutable sealed copy.
//!
//! Uploads are capped in number (more get 503 at once, so the asker turns
//! to another peer or the origin instead of queueing) and in bandwidth,
//! shared by every upload, so serving peers never starves the node's pods.

use std::convert::Infallible;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::Tokens;
use crate::cache::{self, Root, Seal};

type Body = BoxBody<Bytes, Infallible>;

/// Bytes read and sent at a time.
const PIECE: usize = 1 << 20;

pub struct PeerServer {
    roots: Vec<Root>,
    tokens: Arc<Tokens>,
    uploads: Arc<Semaphore>,
    pacer: Pacer,
}

impl PeerServer {
    pub fn new(
        roots: Vec<Root>,
        tokens: Arc<Tokens>,
        max_uploads: usize,
        upload_bytes_per_sec: u64,
    ) -> PeerServer {
        PeerServer {
            roots,
            tokens,
            uploads: Arc::new(Semaphore::new(max_uploads.max(1))),
            pacer: Pacer::new(upload_bytes_per_sec),
        }
    }

    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "peer endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let me = self.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let me = me.clone();
                    async move { Ok::<_, Infallible>(me.handle(req).await) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(error = %e, "peer connection ended");
                }
            });
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let refused = |reason: &str, status: StatusCode, msg: String| {
            crate::metrics::global()
                .peer_refused
                .get_or_create(&crate::metrics::Reason {
                    reason: reason.into(),
                })
                .inc();
            text(status, msg)
        };
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if token.is_empty() || !self.tokens.accepts(token) {
            return refused(
                "unauthorized",
                StatusCode::UNAUTHORIZED,
                "peers serve only drivers holding the cluster's peer token".into(),
            );
        }
        if req.method() != Method::GET {
            return refused(
                "bad_request",
                StatusCode::METHOD_NOT_ALLOWED,
                "GET only".into(),
            );
        }
        let Some((sid, what)) = req
            .uri()
            .path()
            .strip_prefix("/v1/models/")
            .and_then(|r| r.split_once('/'))
        else {
            return refused(
                "bad_request",
                StatusCode::NOT_FOUND,
                "no such endpoint".into(),
            );
        };
        if !super::is_model(sid) {
            return refused(
                "bad_request",
                StatusCode::NOT_FOUND,
                "not a model id".into(),
            );
        }
        let (sid, what) = (sid.to_string(), what.to_string());
        let roots = self.roots.clone();
        let s = sid.clone();
        let found = crate::offload::blocking(move || find(&roots, &s)).await;
        let Ok(Some((root, seal))) = found else {
            return refused(
                "not_held",
                StatusCode::NOT_FOUND,
                format!("model {sid} is not sealed here"),
            );
        };
        match what.as_str() {
            "seal" => match serde_json::to_vec(&seal) {
                Ok(b) => Response::builder()
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(b)).boxed())
                    .expect("static response"),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            },
            "file" => {
                let path = req.uri().query().and_then(|q| {
                    url::form_urlencoded::parse(q.as_bytes())
                        .find(|(k, _)| k == "path")
                        .map(|(_, v)| v.into_owned())
                });
                let Some(entry) =
                    path.and_then(|p| seal.files.iter().find(|f| f.path == p).cloned())
                else {
                    return refused(
                        "bad_request",
                        StatusCode::NOT_FOUND,
                        "the seal lists no such file".into(),
                    );
                };
                let range = req
                    .headers()
                    .get(header::RANGE)
                    .and_then(|v| v.to_str().ok())
                    .map(|r| parse_range(r, entry.size));
                let (start, end) = match range {
                    None => (0, entry.size),
                    Some(Some(r)) => r,
                    Some(None) => {
                        return refused(
                            "bad_request",
                            StatusCode::RANGE_NOT_SATISFIABLE,
                            format!("file is {} bytes", entry.size),
                        );
                    }
                };
                let Ok(slot) = self.uploads.clone().try_acquire_owned() else {
                    return refused(
                        "busy",
                        StatusCode::SERVICE_UNAVAILABLE,
                        "every upload slot is taken".into(),
                    );
                };
                let at = root.source(&sid).data().join(&entry.path);
                let file = match std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&at)
                {
                    Ok(f)
                        if f.metadata()
                            .is_ok_and(|m| m.is_file() && m.len() == entry.size) =>
                    {
                        f
                    }
                    _ => {
                        return refused(
                            "not_held",
                            StatusCode::NOT_FOUND,
                            "the sealed file is not readable here".into(),
                        );
                    }
                };
                let body = self.stream(file, start, end, slot);
                let mut resp = Response::builder()
                    .header(header::CONTENT_LENGTH, end - start)
                    .header(header::CONTENT_TYPE, "application/octet-stream");
                resp = if range.is_some() {
                    resp.status(StatusCode::PARTIAL_CONTENT).header(
                        header::CONTENT_RANGE,
                        format!("bytes {start}-{}/{}", end.saturating_sub(1), entry.size),
                    )
                } else {
                    resp.status(StatusCode::OK)
                };
                resp.body(body).expect("valid response")
            }
            _ => refused(
                "bad_request",
                StatusCode::NOT_FOUND,
                "no such endpoint".into(),
            ),
        }
    }

    /// Streams `[start, end)` of `file`, paced, holding the upload slot
    /// until the last byte is sent or the asker goes away.
    fn stream(
        self: &Arc<Self>,
        file: File,
        start: u64,
        end: u64,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Body {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(2);
        let me = self.clone();
        let file = Arc::new(file);
        tokio::spawn(async move {
            let _slot = slot;
            let mut pos = start;
            while pos < end {
                let n = ((end - pos) as usize).min(PIECE);
                let f = file.clone();
                let read = crate::offload::blocking(move || {
                    let mut buf = vec![0u8; n];
                    f.read_exact_at(&mut buf, pos)
                        .map_err(|e| crate::error::Error::Internal(format!("read: {e}")))?;
                    Ok(buf)
                })
                .await;
                let Ok(buf) = read else {
                    // The asker sees a short body and turns elsewhere.
                    return;
                };
                me.pacer.take(n as u64).await;
                if tx.send(Ok(Frame::data(Bytes::from(buf)))).await.is_err() {
                    return;
                }
                crate::metrics::global().peer_served_bytes.inc_by(n as u64);
                pos += n as u64;
            }
        });
        StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
    }
}

/// The root holding `sid` sealed, and its seal.
fn find(roots: &[Root], sid: &str) -> crate::error::Result<Option<(Root, Seal)>> {
    for r in roots {
        if let Some(seal) = cache::read_seal(r, sid)? {
            return Ok(Some((r.clone(), seal)));
        }
    }
    Ok(None)
}

/// `bytes=a-b` (b inclusive, optional) within a file of `size`: the
/// half-open range, None when it is not one range inside the file.
fn parse_range(v: &str, size: u64) -> Option<(u64, u64)> {
    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
    let start: u64 = a.trim().parse().ok()?;
    let end = match b.trim() {
        "" => size,
        b => b.parse::<u64>().ok()?.checked_add(1)?.min(size),
    };
    (start < end).then_some((start, end))
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Full::new(Bytes::from(msg)).boxed())
        .expect("static response")
}

/// One bandwidth bound shared by every upload: each piece books its time
/// on a common schedule.
struct Pacer {
    bytes_per_sec: u64,
    next: Mutex<Instant>,
}

impl Pacer {
    fn new(bytes_per_sec: u64) -> Pacer {
        Pacer {
            bytes_per_sec,
            next: Mutex::new(Instant::now()),
        }
    }

    async fn take(&self, n: u64) {
        if self.bytes_per_sec == 0 {
            return;
        }
        let at = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(n as f64 / self.bytes_per_sec as f64);
            start
        };
        tokio::time::sleep_until(at.into()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_stay_inside_the_file() {
        assert_eq!(parse_range("bytes=0-9", 100), Some((0, 10)));
        assert_eq!(parse_range("bytes=90-", 100), Some((90, 100)));
        assert_eq!(parse_range("bytes=90-500", 100), Some((90, 100)));
        assert_eq!(parse_range("bytes=100-", 100), None);
        assert_eq!(parse_range("bytes=5-2", 100), None);
        assert_eq!(parse_range("bytes=0-1,4-5", 100), None);
        assert_eq!(parse_range("items=0-1", 100), None);
    }
}
