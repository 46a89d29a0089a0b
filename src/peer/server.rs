//! The node's peer endpoint: other nodes' drivers read the seals and the
//! file ranges of models this node holds sealed, over TLS with the
//! certificate this node's Lease pins (`tls`). Nothing else is served, and
//! nothing without the cluster's peer token (401, no byte).
//!
//! - `GET /v1/models/<sid>/seal`: the seal (files, sha256s, chunk tables).
//! - `GET /v1/models/<sid>/file?path=<path>` with `Range: bytes=a-b`: bytes
//!   of a file the seal lists, read from the immutable sealed copy.
//!
//! Uploads are capped in number (more get 503 at once, so the asker turns
//! to another peer or the origin instead of queueing) and in bandwidth,
//! shared by every upload, so serving peers never starves the node's pods.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::{CHUNK_DIGEST, REFUSED, SLOT_WAIT, Tokens, WAIT_FOR_CHUNK};
use crate::cache::manifest::CHUNK_BYTES;
use crate::cache::store::SealedView;
use crate::cache::{self, Root, Seal, SourceId};

type Body = BoxBody<Bytes, Infallible>;

/// Bytes read and sent at a time.
const PIECE: usize = 1 << 20;

pub struct PeerServer {
    roots: Vec<Root>,
    tokens: Arc<Tokens>,
    uploads: Arc<Semaphore>,
    /// Requests waiting for a pull announced here to start (`wait=1`).
    waiters: Arc<Semaphore>,
    pacer: Pacer,
    seals: Arc<Seals>,
    /// Read-only views of sealed models being served (an image's mount).
    views: Mutex<Views>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// Open views by (root index, model), each with when it was last asked for.
type Views = HashMap<(usize, SourceId), (Arc<SealedView>, Instant)>;

/// A view nobody asked for this long is closed (an image unmounted).
const VIEW_IDLE: Duration = Duration::from_secs(30);

/// Connections the endpoint serves at once, in all and from one address
/// (a node's driver needs a few per pull); more wait their turn, and
/// beyond `OPEN` in all are closed at once, so that slow or idle clients
/// cannot take every slot or the driver's memory.
const MAX_CONNECTIONS: usize = 512;
const PER_SOURCE: usize = 64;
const OPEN: usize = 4096;
/// A request head arrives within this, whole, at most `MAX_HEAD` bytes.
const HEAD_WITHIN: Duration = Duration::from_secs(5);
const MAX_HEAD: usize = 16 << 10;
/// A connection whose bytes stop moving for this long is closed: a reader
/// that stopped reading holds no upload slot for ever.
const STALLED: Duration = Duration::from_secs(30);
/// A pull here that moved less than 1 MiB in this long is stalled, and a
/// request waiting on it for a chunk is answered "not yet". A pull that
/// relays chunks takes each one whole from its leader before it writes a
/// byte of it: a chunk of 8 MiB among 16 on a 25 MB/s link takes 5 s.
const PULL_STALLED: Duration = Duration::from_secs(10);
/// Requests that wait here at once for a pull to start (each looks again
/// every 100 ms, on the blocking pool).
const MAX_WAITERS: usize = 32;

impl PeerServer {
    pub fn new(
        roots: Vec<Root>,
        tokens: Arc<Tokens>,
        max_uploads: usize,
        upload_bytes_per_sec: u64,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> PeerServer {
        PeerServer {
            roots,
            tokens,
            uploads: Arc::new(Semaphore::new(max_uploads.max(1))),
            waiters: Arc::new(Semaphore::new(MAX_WAITERS)),
            pacer: Pacer::new(upload_bytes_per_sec),
            seals: Arc::default(),
            views: Mutex::default(),
            metrics,
        }
    }

    /// Serves peers on `listener`, over TLS with `acceptor`'s certificate
    /// (the one this node's Lease pins).
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        acceptor: tokio_rustls::TlsAcceptor,
    ) {
        tokio::spawn(self.clone().close_idle_views());
        let admission = Arc::new(crate::conns::Admission::new(
            MAX_CONNECTIONS,
            PER_SOURCE,
            OPEN,
            HEAD_WITHIN * 6,
        ));
        loop {
            let (stream, from) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "peer endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(opened) = admission.open(from.ip()) else {
                debug!(%from, "peer endpoint: too many connections open; closed");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (me, admission, acceptor) = (self.clone(), admission.clone(), acceptor.clone());
            tokio::spawn(async move {
                // The handshake comes before the wait for a serving slot:
                // it is the connection's opening, which the client bounds
                // by its connect timeout, while a wait for a slot is
                // answered within the request's. A client that stops in it
                // holds its open connection no longer than one that stops
                // in a request line.
                let io = crate::conns::Stalls::new(stream, STALLED);
                let io = match tokio::time::timeout(HEAD_WITHIN, acceptor.accept(io)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        debug!(%from, error = %e, "peer endpoint: TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(%from, "peer endpoint: TLS handshake not done in time");
                        return;
                    }
                };
                let Some(_slot) = admission.admit(opened).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| {
                    let me = me.clone();
                    async move { Ok::<_, Infallible>(me.handle(req).await) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEAD_WITHIN)
                    .max_header_size(MAX_HEAD)
                    .serve_connection(TokioIo::new(io), service)
                    .await
                {
                    debug!(error = %e, "peer connection ended");
                }
            });
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        match self.clone().answer(&req).await {
            Ok(r) => r,
            Err((reason, status, msg)) => {
                self.metrics
                    .peer_refused
                    .get_or_create(&crate::metrics::Reason {
                        reason: reason.into(),
                    })
                    .inc();
                let mut r = text(status, msg);
                r.headers_mut()
                    .insert(REFUSED, header::HeaderValue::from_static(reason));
                r
            }
        }
    }

    /// Checks who asks and for what, then answers from a sealed model or
    /// a pull still running here.
    async fn answer(self: Arc<Self>, req: &Request<Incoming>) -> Result<Response<Body>, Refusal> {
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if token.is_empty() || !self.tokens.accepts(token) {
            return Err((
                "unauthorized",
                StatusCode::UNAUTHORIZED,
                "peers serve only drivers holding the cluster's peer token".into(),
            ));
        }
        if req.method() != Method::GET {
            return Err((
                "bad_request",
                StatusCode::METHOD_NOT_ALLOWED,
                "GET only".into(),
            ));
        }
        let no_such = || {
            (
                "bad_request",
                StatusCode::NOT_FOUND,
                "no such endpoint".into(),
            )
        };
        let (sid, what) = req
            .uri()
            .path()
            .strip_prefix("/v1/models/")
            .and_then(|r| r.split_once('/'))
            .ok_or_else(no_such)?;
        let Some(sid) = SourceId::parse_model(sid) else {
            return Err((
                "bad_request",
                StatusCode::NOT_FOUND,
                "not a model id".into(),
            ));
        };
        let what = what.to_string();
        let found = match self.clone().find_sealed(req, &sid, what == "file").await? {
            Looked::Sealed(found) => found,
            Looked::Arriving(r) => return Ok(r),
        };
        let Some((i, root, seal, served)) = found else {
            return Err((
                "not_held",
                StatusCode::NOT_FOUND,
                format!("model {sid} is not sealed here"),
            ));
        };
        match what.as_str() {
            "seal" => Ok(Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(served).boxed())
                .expect("static response")),
            "file" => self.sealed_file(req, i, &root, &sid, &seal).await,
            _ => Err(no_such()),
        }
    }

    /// The model's seal here, or, for a file, the answer of its pull still
    /// running here. A pull announced here may not have opened its area
    /// yet, or may be sealing right now: an asker that waits looks again a
    /// moment. Askers that wait are bounded in number: past that, one asks
    /// another peer or the origin at once.
    async fn find_sealed(
        self: Arc<Self>,
        req: &Request<Incoming>,
        sid: &SourceId,
        file: bool,
    ) -> Result<Looked, Refusal> {
        let waiting = match req.uri().query().is_some_and(|q| q.contains("wait=1")) {
            true => match self.waiters.clone().try_acquire_owned() {
                Ok(w) => Some(w),
                Err(_) => {
                    return Err((
                        "busy",
                        StatusCode::SERVICE_UNAVAILABLE,
                        "too many requests are waiting here".into(),
                    ));
                }
            },
            false => None,
        };
        let until = tokio::time::Instant::now() + WAIT_FOR_CHUNK;
        loop {
            let (roots, s, seals) = (self.roots.clone(), sid.clone(), self.seals.clone());
            let found = crate::offload::blocking(move || seals.find(&roots, &s)).await;
            if matches!(found, Ok(Some(_))) || !file {
                return Ok(Looked::Sealed(found.ok().flatten()));
            }
            if let Some(view) = self.roots.iter().find_map(|r| r.pulls.get(sid)) {
                // A wait on a pull under way is woken by the pull, not by
                // looking again: it holds no place among `MAX_WAITERS`
                // (every follower waits here for the chunks this node
                // relays).
                drop(waiting);
                return self.clone().partial(view, req).await.map(Looked::Arriving);
            }
            if waiting.is_none() || tokio::time::Instant::now() >= until {
                return Ok(Looked::Sealed(found.ok().flatten()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A file of the sealed model `sid`, found in root `i`: whole, or the
    /// range asked for.
    async fn sealed_file(
        self: &Arc<Self>,
        req: &Request<Incoming>,
        i: usize,
        root: &Root,
        sid: &SourceId,
        seal: &Seal,
    ) -> Result<Response<Body>, Refusal> {
        let path = req.uri().query().and_then(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .find(|(k, _)| k == "path")
                .map(|(_, v)| v.into_owned())
        });
        let entry = path
            .and_then(|p| seal.files.iter().find(|f| f.path == p).cloned())
            .ok_or_else(|| {
                (
                    "bad_request",
                    StatusCode::NOT_FOUND,
                    "the seal lists no such file".to_string(),
                )
            })?;
        let range = req
            .headers()
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .map(|r| parse_range(r, entry.size));
        let (start, end) = match range {
            None => (0, entry.size),
            Some(Some(r)) => r,
            Some(None) => {
                return Err((
                    "bad_request",
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    format!("file is {} bytes", entry.size),
                ));
            }
        };
        let Some(slot) = self.slot().await else {
            return Err((
                "busy",
                StatusCode::SERVICE_UNAVAILABLE,
                "every upload slot is taken".into(),
            ));
        };
        let unreadable = |what: &str| ("not_held", StatusCode::NOT_FOUND, what.to_string());
        let view = self.view(i, root, sid).await.map_err(|e| {
            warn!(error = %e, "could not open a sealed model to serve a peer");
            unreadable("the sealed model is not readable here")
        })?;
        let at = view.path().join(&entry.path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&at)
            .ok()
            .filter(|f| {
                f.metadata()
                    .is_ok_and(|m| m.is_file() && m.len() == entry.size)
            })
            .ok_or_else(|| unreadable("the sealed file is not readable here"))?;
        let body = self.stream(file, start, end, (slot, view));
        let mut resp = Response::builder()
            .header(header::CONTENT_LENGTH, end - start)
            .header(header::CONTENT_TYPE, "application/octet-stream");
        // A whole chunk carries its digest, as from a pull still
        // running: a node that began filling from this one's pull
        // goes on reading the same way once it is sealed.
        let idx = start / CHUNK_BYTES;
        let whole_chunk = start % CHUNK_BYTES == 0 && end == (start + CHUNK_BYTES).min(entry.size);
        if whole_chunk && let Some(d) = entry.chunks.get(idx as usize) {
            resp = resp.header(CHUNK_DIGEST, d.as_str());
        }
        resp = if range.is_some() {
            resp.status(StatusCode::PARTIAL_CONTENT).header(
                header::CONTENT_RANGE,
                format!("bytes {start}-{}/{}", end.saturating_sub(1), entry.size),
            )
        } else {
            resp.status(StatusCode::OK)
        };
        Ok(resp.body(body).expect("valid response"))
    }

    /// An upload slot, waiting a moment for one: an asker turned away
    /// tries other peers, then comes back.
    async fn slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slot_within(SLOT_WAIT).await
    }

    async fn slot_within(&self, wait: Duration) -> Option<tokio::sync::OwnedSemaphorePermit> {
        tokio::time::timeout(wait, self.uploads.clone().acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// One chunk of a model this node is still pulling, once its hasher
    /// has passed it (waiting for it while the pull moves, when asked to),
    /// with the chunk's digest in a header.
    async fn partial(
        self: Arc<Self>,
        view: Arc<cache::partial::Partial>,
        req: &Request<Incoming>,
    ) -> Result<Response<Body>, Refusal> {
        let bad = |m: &str| ("bad_request", StatusCode::BAD_REQUEST, m.to_string());
        let until = tokio::time::Instant::now() + WAIT_FOR_CHUNK;
        let mut path = None;
        let mut wait = false;
        for (k, v) in url::form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes()) {
            match &*k {
                "path" => path = Some(v.into_owned()),
                "wait" => wait = v == "1",
                _ => {}
            }
        }
        let path = path.ok_or_else(|| bad("no path"))?;
        let (start, end) = req
            .headers()
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .and_then(|r| parse_range(r, u64::MAX))
            .ok_or_else(|| bad("a model still arriving is served one chunk at a time, by Range"))?;
        let idx = start / CHUNK_BYTES;
        // Hashed: its digest is known, or (a pull hashing for the sha256
        // alone, `FileHasher::whole_only`) its bytes are final and the
        // digest is computed here.
        let ready = |f: &cache::partial::FileView| {
            f.has_chunk(idx) || f.hashed >= f.chunk_range(idx).1.max(1)
        };
        let f = match view.file(&path).filter(ready) {
            Some(f) => f,
            None if wait => view
                .wait_for(
                    &path,
                    ready,
                    1 << 20,
                    PULL_STALLED,
                    until.saturating_duration_since(tokio::time::Instant::now()),
                )
                .await
                .ok_or((
                    "not_yet",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not yet: the pull here has not reached that chunk".to_string(),
                ))?,
            None => {
                return Err(("not_yet", StatusCode::SERVICE_UNAVAILABLE, "not yet".into()));
            }
        };
        if (start, end) != f.chunk_range(idx) {
            return Err(bad("the range must be one whole chunk"));
        }
        // An asker that waits (this is the pull it follows) queues for a
        // slot within the same bound as for the chunk, first come first
        // served: turned away after a second, it would join the back of
        // the queue again and again while later askers got through, and
        // under load some chunk would end up costing the origin.
        let wait_slot = if wait {
            until.saturating_duration_since(tokio::time::Instant::now())
        } else {
            Duration::ZERO
        };
        let slot = self.slot_within(wait_slot.max(SLOT_WAIT)).await.ok_or((
            "busy",
            StatusCode::SERVICE_UNAVAILABLE,
            "every upload slot is taken".to_string(),
        ))?;
        // The partial file may have just been renamed into place.
        let file = open_regular(&f.at)
            .or_else(|| view.file(&path).and_then(|g| open_regular(&g.at)))
            .ok_or((
                "busy",
                StatusCode::SERVICE_UNAVAILABLE,
                "the file is moving into place; ask again".to_string(),
            ))?;
        let digest = match f.chunks.get(idx as usize) {
            Some(d) => d.clone(),
            None => chunk_digest(&file, &f.at, start, end)
                .await
                .map_err(|e| ("io", StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
        };
        let body = self.stream(file, start, end, slot);
        Ok(Response::builder()
            .status(StatusCode::PARTIAL_CONTENT)
            .header(header::CONTENT_LENGTH, end - start)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(CHUNK_DIGEST, digest)
            .header(
                header::CONTENT_RANGE,
                format!("bytes {start}-{}/{}", end - 1, f.size),
            )
            .body(body)
            .expect("valid response"))
    }

    /// Streams `[start, end)` of `file`, paced, holding the upload slot
    /// until the last byte is sent or the asker goes away.
    /// The open view of `sid` in root `i`, opened now if none is (an
    /// image mounted once, then shared by every request until idle).
    async fn view(
        &self,
        i: usize,
        root: &Root,
        sid: &SourceId,
    ) -> crate::error::Result<Arc<SealedView>> {
        let key = (i, sid.clone());
        if let Some((v, at)) = self
            .views
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&key)
        {
            *at = Instant::now();
            return Ok(v.clone());
        }
        let (r, s) = (root.clone(), sid.clone());
        let opened =
            crate::offload::blocking(move || r.backend.store().open_sealed(&r, &s).map(Arc::new))
                .await?;
        // Two requests may open it at once: the first kept wins, and the
        // other view is closed off the runtime (closing unmounts).
        let (kept, spare) = {
            let mut views = self.views.lock().unwrap_or_else(|p| p.into_inner());
            match views.get_mut(&key) {
                Some((v, at)) => {
                    *at = Instant::now();
                    (v.clone(), Some(opened))
                }
                None => {
                    views.insert(key, (opened.clone(), Instant::now()));
                    (opened, None)
                }
            }
        };
        close(spare.into_iter().collect()).await;
        Ok(kept)
    }

    /// Closes views idle for `VIEW_IDLE` that nobody reads now, off the
    /// runtime (an unmount blocks).
    async fn close_idle_views(self: Arc<Self>) {
        loop {
            tokio::time::sleep(VIEW_IDLE / 3).await;
            let idle: Vec<Arc<SealedView>> = {
                let mut views = self.views.lock().unwrap_or_else(|p| p.into_inner());
                let keys: Vec<(usize, SourceId)> = views
                    .iter()
                    .filter(|(_, (v, at))| at.elapsed() >= VIEW_IDLE && Arc::strong_count(v) == 1)
                    .map(|(k, _)| k.clone())
                    .collect();
                keys.iter()
                    .filter_map(|k| views.remove(k))
                    .map(|(v, _)| v)
                    .collect()
            };
            close(idle).await;
        }
    }

    fn stream(
        self: &Arc<Self>,
        file: File,
        start: u64,
        end: u64,
        held: impl Send + 'static,
    ) -> Body {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(2);
        let me = self.clone();
        let file = Arc::new(file);
        tokio::spawn(async move {
            // The upload slot, and the view the file is on, stay taken
            // while the file is read.
            let _held = held;
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
                me.metrics.peer_served_bytes.inc_by(n as u64);
                pos += n as u64;
            }
        });
        StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
    }
}

fn open_regular(at: &std::path::Path) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(at)
        .ok()
        .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))
}

/// Closes `views` off the runtime: the last reference to an image's view
/// unmounts it, which blocks.
async fn close(views: Vec<Arc<SealedView>>) {
    if views.is_empty() {
        return;
    }
    let _ = crate::offload::blocking(move || {
        drop(views);
        Ok(())
    })
    .await;
}

/// Seals already parsed, each with the stat of its `seal.json` when read.
/// A chunk request would otherwise parse the whole seal (about a megabyte
/// of chunk digests for a 140 GB model) for 8 MiB of data; a stat tells
/// whether the file is still the one parsed (a seal is written once by
/// rename, and a model evicted and sealed again has a new file).
#[derive(Default)]
struct Seals(Mutex<HashMap<SourceId, Kept>>);

/// A parsed seal: which root (its index) and which `seal.json` it came
/// from, and its bytes as served.
type Kept = (usize, Stamp, Arc<Seal>, Bytes);

/// A model found sealed: its root (index, and the root), its seal, and the
/// seal's bytes as served.
type Found = (usize, Root, Arc<Seal>, Bytes);

/// A request refused: the reason counted and sent back, its status, and
/// why in words.
type Refusal = (&'static str, StatusCode, String);

/// What a look for a model found: its seal (None: not sealed here), or,
/// for a file of a pull still running here, that pull's answer.
enum Looked {
    Sealed(Option<Found>),
    Arriving(Response<Body>),
}

/// What identifies one `seal.json` file's content without reading it.
type Stamp = (u64, u64, i64, i64, u64);

/// Seals kept parsed, by their files' bytes in all (each kept twice:
/// parsed, and as served): the models being served at once, with room.
const SEALS_KEPT_BYTES: u64 = 128 << 20;

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

impl Seals {
    /// The root holding `sid` sealed, and its seal.
    fn find(&self, roots: &[Root], sid: &SourceId) -> crate::error::Result<Option<Found>> {
        for (i, r) in roots.iter().enumerate() {
            let Some(now) = stamp(&r.source(sid).seal()) else {
                continue;
            };
            let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((root, at, seal, served)) = kept.get(sid)
                && *root == i
                && *at == now
            {
                return Ok(Some((i, r.clone(), seal.clone(), served.clone())));
            }
            drop(kept);
            // A seal no pull of this driver writes (MAX_SEAL_BYTES) is not
            // served: a peer would refuse it anyway.
            if now.4 > cache::manifest::MAX_SEAL_BYTES {
                warn!(
                    model = %sid,
                    bytes = now.4,
                    "a seal over the bound is not served to peers"
                );
                continue;
            }
            if let Some(seal) = cache::read_seal(r, sid)? {
                let served = Bytes::from(serde_json::to_vec(&seal).map_err(|e| {
                    crate::error::Error::Internal(format!("encode the seal of {sid}: {e}"))
                })?);
                let seal = Arc::new(seal);
                let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
                let held: u64 = kept.values().map(|k| k.1.4).sum();
                if held.saturating_add(now.4) > SEALS_KEPT_BYTES {
                    kept.clear();
                }
                kept.insert(sid.clone(), (i, now, seal.clone(), served.clone()));
                return Ok(Some((i, r.clone(), seal, served)));
            }
        }
        Ok(None)
    }
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

/// The digest of `[start, end)` of `file` (at `at`), read now: a chunk
/// whose bytes are final but whose digest the pull did not keep.
async fn chunk_digest(
    file: &File,
    at: &Path,
    start: u64,
    end: u64,
) -> crate::error::Result<String> {
    let file = file
        .try_clone()
        .map_err(|e| crate::error::Error::io("reopen", at, e))?;
    let at = at.to_path_buf();
    crate::offload::blocking(move || {
        let mut buf = vec![0u8; (end - start) as usize];
        file.read_exact_at(&mut buf, start)
            .map_err(|e| crate::error::Error::io("read a chunk of", &at, e))?;
        Ok(cache::manifest::chunk_digest(&buf))
    })
    .await
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn listening() -> (std::net::SocketAddr, super::super::tls::Pin) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Arc::new(PeerServer::new(
            Vec::new(),
            Arc::new(Tokens::fixed(&["a-peer-token-0123456789"])),
            4,
            0,
            Arc::default(),
        ));
        let id = super::super::tls::Identity::generate().unwrap();
        let pin = super::super::tls::parse_pin(&id.pin_hex()).unwrap();
        tokio::spawn(server.serve(listener, id.acceptor().clone()));
        (addr, pin)
    }

    /// What the server says to `sent` over TLS, until it closes the
    /// connection (or 20 s pass: it never did).
    async fn answer_to(
        (addr, pin): (std::net::SocketAddr, super::super::tls::Pin),
        sent: &[u8],
    ) -> String {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let connector =
            tokio_rustls::TlsConnector::from(Arc::new(super::super::tls::client_config(pin)));
        let name = rustls::pki_types::ServerName::try_from("peer").unwrap();
        let mut c = connector.connect(name, tcp).await.unwrap();
        let _ = c.write_all(sent).await;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut got)).await;
        let head = String::from_utf8_lossy(&sent[..sent.len().min(40)]).into_owned();
        assert!(read.is_ok(), "the connection was held open after {head:?}");
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A client that opens a connection and never finishes the handshake
    /// is cut off after `HEAD_WITHIN`, like one that never ends its head;
    /// one that speaks plain HTTP gets no answer at all.
    #[tokio::test]
    async fn unfinished_handshakes_and_plain_http_are_cut_off() {
        let (addr, _) = listening().await;
        let started = std::time::Instant::now();
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut got)).await;
        assert!(read.is_ok(), "a silent client held its connection");
        assert!(started.elapsed() >= HEAD_WITHIN, "{:?}", started.elapsed());
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /v1/models/x/seal HTTP/1.1\r\nauthorization: Bearer a-peer-token-0123456789\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut got)).await;
        assert!(
            !String::from_utf8_lossy(&got).contains("HTTP/1.1"),
            "answered in the clear"
        );
    }

    /// A head larger than the bound is refused, and one that never ends is
    /// cut off after `HEAD_WITHIN`: no connection holds memory or a slot
    /// for ever before the token is even read. Before, hyper buffered
    /// ~400 KiB per head and waited for it without a bound.
    #[tokio::test]
    async fn oversized_and_unfinished_heads_are_cut_off() {
        let addr = listening().await;
        let mut big = b"GET /v1/models/x/seal HTTP/1.1\r\nx-pad: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 64 << 10));
        big.extend(b"\r\n\r\n");
        let answer = answer_to(addr, &big).await;
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
            "{answer}"
        );
        let started = std::time::Instant::now();
        answer_to(addr, b"GET /v1/models/x/seal HTTP/1.1\r\nx-slow: ").await;
        assert!(started.elapsed() >= HEAD_WITHIN, "{:?}", started.elapsed());
        // A whole head is still answered (no token: 401).
        let answer = answer_to(
            addr,
            b"GET /v1/models/x/seal HTTP/1.1\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }

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
