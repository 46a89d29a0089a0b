//! Test fixtures: small HTTP/1.1 servers on 127.0.0.1 (ephemeral ports)
//! standing in for the remote ends of the http(s)://, hf:// and
//! model-registry:// sources. They are fixtures, not reimplementations:
//! each serves exactly what the sources call, plus knobs to inject faults.
//!
//! - [`FileServer`]: a static file server over a directory: HEAD, Range,
//!   ETag and Last-Modified, per-path request counters; faults: 404, 503
//!   with Retry-After N times (any request, or GETs only), a body cut
//!   mid-way, a body that stalls (always, or for the next N GETs).
//! - [`HubServer`]: the Hugging Face Hub endpoints `hf.rs` uses, serving a
//!   directory as repo `org/minilm` at the fixed commit [`HUB_SHA`].
//! - [`RegistryServer`]: the Kubeflow Model Registry v1alpha3 endpoints
//!   `registry.rs` uses, with artifact URIs given at construction.
//!
//! One request per connection (`Connection: close`), no TLS. A server and
//! its connections stop when it is dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

// ---------------------------------------------------------------- helpers

/// The real all-MiniLM-L6-v2 model directory (fetched once by `tests/scripts/deps/model.sh`).
pub fn model_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/model.sh");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .expect("run tests/scripts/deps/model.sh");
        assert!(out.status.success(), "tests/scripts/deps/model.sh failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// Every regular file under `dir`: ('/'-separated relative path, size), sorted.
pub fn tree_files(dir: &Path) -> Vec<(String, u64)> {
    fn walk(root: &Path, rel: &Path, out: &mut Vec<(String, u64)>) {
        for e in fs::read_dir(root.join(rel)).unwrap() {
            let e = e.unwrap();
            let rel = rel.join(e.file_name());
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                walk(root, &rel, out);
            } else if meta.is_file() {
                let p = rel.to_str().unwrap().replace('\\', "/");
                out.push((p, meta.len()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, Path::new(""), &mut out);
    out.sort();
    out
}

/// Lowercase hex sha256 of a file.
/// `n` bytes of an xorshift stream from `seed`: incompressible, and the
/// same for the same seed.
pub fn pseudo_random(mut seed: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// The bytes that GET requests in `reqs` asked of files under `dir`: the
/// whole file, or the range asked for.
pub fn requested_bytes(reqs: &[Request], dir: &Path) -> u64 {
    reqs.iter()
        .filter(|r| r.method == "GET")
        .filter_map(|r| {
            let size = fs::metadata(dir.join(r.segments.join("/"))).ok()?.len();
            let Some(range) = r.header("range").and_then(|v| v.strip_prefix("bytes=")) else {
                return Some(size);
            };
            let (a, b) = range.split_once('-')?;
            let a: u64 = a.parse().ok()?;
            let b: u64 = b.parse::<u64>().map_or(size, |b| (b + 1).min(size));
            Some(b.saturating_sub(a))
        })
        .sum()
}

pub fn sha256_file(path: &Path) -> String {
    let mut f = fs::File::open(path).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    hex::encode(h.finalize())
}

/// A manifest document (`{"files": [...]}`) for every file under `dir`,
/// with relative URLs, sizes, and sha256 when `with_sha256`.
pub fn manifest_for(dir: &Path, with_sha256: bool) -> Vec<u8> {
    let files: Vec<Value> = tree_files(dir)
        .into_iter()
        .map(|(path, size)| {
            let mut e = json!({"path": path, "url": path, "size": size});
            if with_sha256 {
                e["sha256"] = json!(sha256_file(&dir.join(&path)));
            }
            e
        })
        .collect();
    serde_json::to_vec_pretty(&json!({ "files": files })).unwrap()
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
pub fn http_date(t: SystemTime) -> String {
    httpdate::fmt_http_date(t)
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// A relative path with no `..`, no root.
fn safe_rel(p: &str) -> Option<PathBuf> {
    let path = PathBuf::from(p);
    path.components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then_some(path)
}

// ---------------------------------------------------------------- the HTTP core

/// A parsed request head.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// The path as sent, percent-encoded, without the query.
    pub raw_path: String,
    /// The path's segments, each percent-decoded (so an encoded '/' stays inside one).
    pub segments: Vec<String>,
    pub query: Vec<(String, String)>,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The decoded path without the leading '/'.
    pub fn path(&self) -> String {
        self.segments.join("/")
    }
}

enum Payload {
    Empty,
    Bytes(Arc<Vec<u8>>, u64, u64),
    File(PathBuf, u64, u64),
}

/// How the body is (mis)delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// Close the connection after this many body bytes.
    TruncateAfter(u64),
    /// Send this many body bytes, then hold the connection open, silent.
    StallAfter(u64),
    /// Send the body at this many bytes per second.
    Throttle(u64),
    /// Send the body one byte at a time, this long apart.
    Trickle(Duration),
    /// Answer only after this long (an origin far away).
    Late(Duration),
}

/// A response to send.
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    payload: Payload,
    fault: Fault,
    /// Sent instead of the body's real length (a lying server).
    content_length: Option<u64>,
}

impl Reply {
    pub fn new(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            payload: Payload::Empty,
            fault: Fault::None,
            content_length: None,
        }
    }

    pub fn header(mut self, k: &str, v: impl Into<String>) -> Reply {
        self.headers.push((k.to_string(), v.into()));
        self
    }

    /// `body` as the payload.
    pub fn body(mut self, body: Vec<u8>) -> Reply {
        let len = body.len() as u64;
        self.payload = Payload::Bytes(Arc::new(body), 0, len);
        self
    }

    /// `len` bytes of the file at `path` from `start` (a sparse file
    /// serves gigabytes without holding them anywhere).
    pub fn file(mut self, path: impl Into<PathBuf>, start: u64, len: u64) -> Reply {
        self.payload = Payload::File(path.into(), start, len);
        self
    }

    fn json(status: u16, v: &Value) -> Reply {
        let body = serde_json::to_vec(v).unwrap();
        let len = body.len() as u64;
        let mut r = Reply::new(status).header("Content-Type", "application/json");
        r.payload = Payload::Bytes(Arc::new(body), 0, len);
        r
    }

    fn len(&self) -> u64 {
        match self.payload {
            Payload::Empty => 0,
            Payload::Bytes(_, _, n) | Payload::File(_, _, n) => n,
        }
    }
}

/// Content to serve with HEAD and Range support.
enum Content {
    Bytes(Arc<Vec<u8>>),
    File(PathBuf, fs::Metadata),
}

/// 200, 206 or 416 for `content`, honouring `Range: bytes=a-b | a- | -n`
/// when `ranges` is on (otherwise the whole body, no Accept-Ranges).
fn content_reply(req: &Request, content: Content, ranges: bool, validators: bool) -> Reply {
    let (len, etag, modified) = match &content {
        Content::Bytes(b) => {
            let etag = format!("\"{}\"", &hex::encode(Sha256::digest(b.as_slice()))[..16]);
            (
                b.len() as u64,
                etag,
                UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            )
        }
        Content::File(_, m) => {
            let mtime = m.modified().unwrap();
            let nanos = mtime.duration_since(UNIX_EPOCH).unwrap().as_nanos();
            (m.len(), format!("\"{:x}-{nanos:x}\"", m.len()), mtime)
        }
    };
    let mut range = (0, len);
    let mut status = 200;
    if ranges && let Some(spec) = req.header("range").and_then(|r| r.strip_prefix("bytes=")) {
        let parsed = spec.split_once('-').and_then(|(a, b)| match (a, b) {
            ("", n) => n.parse::<u64>().ok().map(|n| (len.saturating_sub(n), len)),
            (a, "") => a.parse::<u64>().ok().map(|a| (a, len)),
            (a, b) => Some((
                a.parse::<u64>().ok()?,
                b.parse::<u64>().ok()?.min(len - 1) + 1,
            )),
        });
        match parsed {
            Some((a, b)) if a < b && a < len => {
                range = (a, b);
                status = 206;
            }
            _ => return Reply::new(416).header("Content-Range", format!("bytes */{len}")),
        }
    }
    let mut r = Reply::new(status).header("Content-Type", "application/octet-stream");
    if ranges {
        r = r.header("Accept-Ranges", "bytes");
    }
    if validators {
        r = r
            .header("ETag", etag)
            .header("Last-Modified", http_date(modified));
    }
    if status == 206 {
        r = r.header(
            "Content-Range",
            format!("bytes {}-{}/{len}", range.0, range.1 - 1),
        );
    }
    let n = range.1 - range.0;
    r.payload = match content {
        Content::Bytes(b) => Payload::Bytes(b, range.0, n),
        Content::File(p, _) => Payload::File(p, range.0, n),
    };
    r
}

type Handler = Arc<dyn Fn(&Request) -> Reply + Send + Sync>;

/// A listening fixture server; stops (with its connections) on drop.
struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    async fn start(handler: Handler) -> Server {
        Server::start_at(handler, "127.0.0.1").await
    }

    async fn start_at(handler: Handler, ip: &str) -> Server {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            // Dropping the set (when this task is aborted) aborts every connection.
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((sock, _)) = accepted else { continue };
                        conns.spawn(connection(sock, handler.clone()));
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Server { addr, task }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn connection(mut sock: TcpStream, handler: Handler) {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 64 << 10 {
            return;
        }
    };
    let Some(req) = parse_head(&String::from_utf8_lossy(&buf[..head_end])) else {
        return;
    };
    let reply = handler(&req);
    if let Fault::Late(after) = reply.fault {
        tokio::time::sleep(after).await;
    }
    let len = reply.len();
    let mut head = format!("HTTP/1.1 {} {}\r\n", reply.status, reason(reply.status));
    for (k, v) in &reply.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        reply.content_length.unwrap_or(len)
    ));
    if sock.write_all(head.as_bytes()).await.is_err() || req.method == "HEAD" {
        return;
    }
    let send = match reply.fault {
        Fault::None | Fault::Throttle(_) | Fault::Trickle(_) | Fault::Late(_) => len,
        Fault::TruncateAfter(n) | Fault::StallAfter(n) => n.min(len),
    };
    if let Fault::Throttle(rate) = reply.fault {
        throttled(&mut sock, reply.payload, send, rate).await;
        let _ = sock.shutdown().await;
        return;
    }
    if let Fault::Trickle(every) = reply.fault {
        let body = match reply.payload {
            Payload::Bytes(b, start, n) => b[start as usize..(start + n) as usize].to_vec(),
            Payload::File(path, start, n) => {
                use std::io::{Seek, SeekFrom};
                let mut f = fs::File::open(path).unwrap();
                f.seek(SeekFrom::Start(start)).unwrap();
                let mut v = Vec::new();
                f.take(n).read_to_end(&mut v).unwrap();
                v
            }
            Payload::Empty => Vec::new(),
        };
        for byte in body {
            if sock.write_all(&[byte]).await.is_err() || sock.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
        let _ = sock.shutdown().await;
        return;
    }
    let ok = match reply.payload {
        Payload::Empty => true,
        Payload::Bytes(b, start, _) => {
            let s = start as usize;
            sock.write_all(&b[s..s + send as usize]).await.is_ok()
        }
        Payload::File(path, start, _) => {
            let Ok(mut f) = tokio::fs::File::open(&path).await else {
                return;
            };
            f.seek(std::io::SeekFrom::Start(start)).await.is_ok()
                && tokio::io::copy(&mut f.take(send), &mut sock).await.is_ok()
        }
    };
    if ok && let Fault::StallAfter(_) = reply.fault {
        let _ = sock.flush().await;
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    let _ = sock.shutdown().await;
}

/// Writes `send` bytes of `payload` in 64 KiB pieces at `rate` bytes/s.
async fn throttled(sock: &mut TcpStream, payload: Payload, send: u64, rate: u64) {
    const PIECE: u64 = 64 << 10;
    // Only the bytes to send, read at their offset: a ranged request to
    // a large file must not read the whole file.
    let bytes: Vec<u8> = match payload {
        Payload::Empty => return,
        Payload::Bytes(b, start, _) => b[start as usize..(start + send) as usize].to_vec(),
        Payload::File(path, start, _) => {
            let Ok(mut f) = tokio::fs::File::open(&path).await else {
                return;
            };
            let mut v = Vec::with_capacity(send as usize);
            if f.seek(std::io::SeekFrom::Start(start)).await.is_err()
                || f.take(send).read_to_end(&mut v).await.is_err()
            {
                return;
            }
            v
        }
    };
    let pace = Duration::from_secs_f64(PIECE as f64 / rate.max(1) as f64);
    let mut at = 0;
    let end = send.min(bytes.len() as u64);
    while at < end {
        let n = PIECE.min(end - at);
        if sock
            .write_all(&bytes[at as usize..(at + n) as usize])
            .await
            .is_err()
        {
            return;
        }
        at += n;
        tokio::time::sleep(pace).await;
    }
}

fn parse_head(head: &str) -> Option<Request> {
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, target) = (first.next()?.to_string(), first.next()?);
    let (raw_path, query) = target.split_once('?').unwrap_or((target, ""));
    let segments = raw_path
        .trim_start_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let query = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(&v.replace('+', " ")))
        })
        .collect();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Some(Request {
        method,
        raw_path: raw_path.to_string(),
        segments,
        query,
        headers,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        416 => "Range Not Satisfiable",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Counts of requests by (method, decoded path).
#[derive(Default)]
struct Hits(
    Mutex<HashMap<(String, String), usize>>,
    /// Every request head, in order: what a credential test inspects.
    Mutex<Vec<Request>>,
);

impl Hits {
    fn add(&self, req: &Request) {
        *self
            .0
            .lock()
            .unwrap()
            .entry((req.method.clone(), req.path()))
            .or_default() += 1;
        self.1.lock().unwrap().push(req.clone());
    }

    fn requests(&self) -> Vec<Request> {
        self.1.lock().unwrap().clone()
    }

    fn get(&self, method: &str, path: &str) -> usize {
        let path = path.trim_start_matches('/');
        let hits = self.0.lock().unwrap();
        hits.get(&(method.to_string(), path.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

// ---------------------------------------------------------------- static files

#[derive(Default)]
struct FileKnobs {
    not_found: HashSet<String>,
    /// Path -> (503s still to send, Retry-After value).
    unavailable: HashMap<String, (usize, Option<String>)>,
    /// The same, for GETs only: HEADs (resolving) pass.
    unavailable_gets: HashMap<String, (usize, Option<String>)>,
    truncate: HashMap<String, u64>,
    stall: HashMap<String, u64>,
    /// Path -> stalled GETs still to send; a stalled path not here stalls every GET.
    stalls_left: HashMap<String, usize>,
    docs: HashMap<String, Arc<Vec<u8>>>,
    /// Path -> Location of a 302.
    redirects: HashMap<String, String>,
    /// Every body at this many bytes per second.
    throttle: Option<u64>,
    trickle: HashMap<String, Duration>,
    ignore_ranges: bool,
    no_validators: bool,
    /// Path -> GETs covering byte 0 still to serve with that byte flipped.
    corrupt: HashMap<String, usize>,
}

struct FileState {
    root: PathBuf,
    knobs: Mutex<FileKnobs>,
    hits: Hits,
}

/// Fixture: a static file server over a directory, with Range, ETag,
/// Last-Modified, HEAD, per-path counters and fault knobs. Paths given to
/// the knobs are relative to the root, decoded, like `1_Pooling/config.json`.
pub struct FileServer {
    server: Server,
    state: Arc<FileState>,
}

impl FileServer {
    pub async fn start(root: impl Into<PathBuf>) -> FileServer {
        FileServer::start_at(root, "127.0.0.1").await
    }

    /// As `start`, listening on `ip` (which must be up).
    pub async fn start_at(root: impl Into<PathBuf>, ip: &str) -> FileServer {
        let state = Arc::new(FileState {
            root: root.into(),
            knobs: Mutex::default(),
            hits: Hits::default(),
        });
        let s = state.clone();
        let server = Server::start_at(Arc::new(move |req| serve_file(&s, req)), ip).await;
        FileServer { server, state }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        self.server.base()
    }

    /// The URL of `path` (given already URL-safe).
    pub fn url(&self, path: &str) -> String {
        format!("{}/{}", self.base(), path.trim_start_matches('/'))
    }

    pub fn gets(&self, path: &str) -> usize {
        self.state.hits.get("GET", path)
    }

    pub fn heads(&self, path: &str) -> usize {
        self.state.hits.get("HEAD", path)
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state.hits.requests()
    }

    /// Sends every body at `bytes_per_sec`, like an origin with a known
    /// bandwidth.
    pub fn throttle(&self, bytes_per_sec: u64) {
        self.knobs().throttle = Some(bytes_per_sec);
    }

    /// Answers `path` with a 302 to `location`.
    pub fn redirect(&self, path: &str, location: &str) {
        self.knobs()
            .redirects
            .insert(path.trim_start_matches('/').into(), location.into());
    }

    fn knobs(&self) -> std::sync::MutexGuard<'_, FileKnobs> {
        self.state.knobs.lock().unwrap()
    }

    /// Serves `body` at `path` (in memory, over any file there).
    pub fn put(&self, path: &str, body: Vec<u8>) {
        self.knobs()
            .docs
            .insert(path.trim_start_matches('/').into(), Arc::new(body));
    }

    /// Answers 404 for `path`.
    pub fn not_found(&self, path: &str) {
        self.knobs().not_found.insert(path.into());
    }

    /// Answers the next `times` requests for `path` with 503 and, when
    /// given, `Retry-After: <retry_after>` (seconds or an HTTP date).
    pub fn unavailable(&self, path: &str, times: usize, retry_after: Option<&str>) {
        self.knobs()
            .unavailable
            .insert(path.into(), (times, retry_after.map(str::to_string)));
    }

    /// Like [`FileServer::unavailable`], but only GETs count and get the
    /// 503: a HEAD while resolving succeeds, the download is refused.
    pub fn unavailable_gets(&self, path: &str, times: usize, retry_after: Option<&str>) {
        self.knobs()
            .unavailable_gets
            .insert(path.into(), (times, retry_after.map(str::to_string)));
    }

    /// Cuts GET bodies of `path` after `after` bytes (Content-Length stays whole).
    pub fn truncate(&self, path: &str, after: u64) {
        self.knobs().truncate.insert(path.into(), after);
    }

    /// Sends headers and `after` body bytes of `path`, then goes silent.
    pub fn stall(&self, path: &str, after: u64) {
        let mut k = self.knobs();
        k.stall.insert(path.into(), after);
        k.stalls_left.remove(path);
    }

    /// Stalls only the next `times` GETs of `path` (each after `after` bytes
    /// of its body); later GETs are served whole.
    pub fn stall_times(&self, path: &str, after: u64, times: usize) {
        let mut k = self.knobs();
        k.stall.insert(path.into(), after);
        k.stalls_left.insert(path.into(), times);
    }

    /// Serves the next `times` GETs of `path` that cover its first byte
    /// with that byte flipped, as an origin whose bytes went wrong on the
    /// way would: the listing's sha256 no longer matches.
    pub fn corrupt_first_byte(&self, path: &str, times: usize) {
        self.knobs().corrupt.insert(path.into(), times);
    }

    /// Removes every fault set for `path`.
    pub fn heal(&self, path: &str) {
        let mut k = self.knobs();
        k.not_found.remove(path);
        k.unavailable.remove(path);
        k.unavailable_gets.remove(path);
        k.truncate.remove(path);
        k.stall.remove(path);
        k.stalls_left.remove(path);
    }

    /// Behaves like a server without range support: no Accept-Ranges, and
    /// a 200 with the whole body to a Range request.
    pub fn ignore_ranges(&self) {
        self.knobs().ignore_ranges = true;
    }

    /// Sends neither ETag nor Last-Modified.
    pub fn without_validators(&self) {
        self.knobs().no_validators = true;
    }

    /// Sends GET bodies of `path` one byte at a time, `every` apart.
    pub fn trickle(&self, path: &str, every: Duration) {
        self.knobs().trickle.insert(path.into(), every);
    }
}

/// Fixture: a server whose every answer a test writes itself, for servers
/// that lie (listings, lengths, ranges) in ways no knob covers.
pub struct ScriptServer {
    server: Server,
}

impl ScriptServer {
    pub async fn start(
        handler: impl Fn(&Request) -> Reply + Send + Sync + 'static,
    ) -> ScriptServer {
        let server = Server::start(Arc::new(move |req: &Request| handler(req))).await;
        ScriptServer { server }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        self.server.base()
    }
}

fn serve_file(state: &FileState, req: &Request) -> Reply {
    state.hits.add(req);
    if req.method != "GET" && req.method != "HEAD" {
        return Reply::new(405);
    }
    let path = req.path();
    let mut guard = state.knobs.lock().unwrap();
    // Through a plain reference, so that two knobs can be borrowed at once.
    let k = &mut *guard;
    if k.not_found.contains(&path) {
        return Reply::new(404);
    }
    if let Some(to) = k.redirects.get(&path) {
        return Reply::new(302).header("Location", to.clone());
    }
    let busy = match k.unavailable.get_mut(&path) {
        Some(entry) if entry.0 > 0 => Some(entry),
        _ if req.method == "GET" => k.unavailable_gets.get_mut(&path),
        _ => None,
    };
    if let Some((left, retry)) = busy
        && *left > 0
    {
        *left -= 1;
        let mut r = Reply::new(503);
        if let Some(v) = retry {
            r = r.header("Retry-After", v.clone());
        }
        return r;
    }
    let (ranges, validators) = (!k.ignore_ranges, !k.no_validators);
    let from_zero = req
        .header("range")
        .is_none_or(|r| r.trim().starts_with("bytes=0-"));
    let corrupt = match k.corrupt.get_mut(&path) {
        Some(left) if *left > 0 && req.method == "GET" && from_zero => {
            *left -= 1;
            true
        }
        _ => false,
    };
    let content = if corrupt && let Some(rel) = safe_rel(&path) {
        let mut bytes = fs::read(state.root.join(rel)).unwrap_or_default();
        if let Some(b) = bytes.first_mut() {
            *b ^= 0xff;
        }
        Content::Bytes(Arc::new(bytes))
    } else if let Some(doc) = k.docs.get(&path) {
        Content::Bytes(doc.clone())
    } else {
        let Some(rel) = safe_rel(&path) else {
            return Reply::new(404);
        };
        let full = state.root.join(rel);
        match fs::metadata(&full) {
            Ok(m) if m.is_file() => Content::File(full, m),
            _ => return Reply::new(404),
        }
    };
    let mut reply = content_reply(req, content, ranges, validators);
    if let Some(rate) = k.throttle {
        reply.fault = Fault::Throttle(rate);
    }
    if let Some(&n) = k.truncate.get(&path) {
        reply.fault = Fault::TruncateAfter(n);
    }
    if let Some(&every) = k.trickle.get(&path)
        && req.method == "GET"
    {
        reply.fault = Fault::Trickle(every);
    }
    if let Some(&n) = k.stall.get(&path) {
        let armed = match k.stalls_left.get_mut(&path) {
            None => true,
            Some(left) if *left > 0 && req.method == "GET" => {
                *left -= 1;
                true
            }
            Some(_) => false,
        };
        if armed {
            reply.fault = Fault::StallAfter(n);
        }
    }
    reply
}

// ---------------------------------------------------------------- Hugging Face Hub

/// The repo the Hub fixture serves.
pub const HUB_REPO: &str = "org/minilm";
/// The fixed (fake) commit the Hub fixture's `main` points at.
pub const HUB_SHA: &str = "8b3219a92973c328a8e22fadcfa821b5dc75636a";
/// Files at least this large are LFS files in the Hub fixture.
pub const HUB_LFS_MIN: u64 = 1 << 20;
/// Tree entries per page, small so that pagination is exercised.
pub const HUB_PAGE: usize = 5;

struct HubFile {
    path: String,
    size: u64,
    /// The sha256 for LFS files.
    lfs: Option<String>,
}

struct HubState {
    root: PathBuf,
    files: Vec<HubFile>,
    token: Mutex<Option<String>>,
    private: std::sync::atomic::AtomicBool,
    /// Bytes a second each content answer is sent at, when paced.
    throttle: Mutex<Option<u64>>,
    /// How long a gated refusal takes, when not at once.
    refuse_after: Mutex<Option<Duration>>,
    /// Tree entries per page.
    page: std::sync::atomic::AtomicUsize,
    base: OnceLock<String>,
    hits: Hits,
}

/// Fixture: the Hugging Face Hub endpoints `hf.rs` calls, serving a
/// directory as repo [`HUB_REPO`] at commit [`HUB_SHA`] (revisions `main`
/// and the sha): `/api/models/{repo}/revision/{rev}`,
/// `/api/models/{repo}/tree/{rev}?recursive=true` (paged by Link headers,
/// LFS oids = sha256), `/{repo}/resolve/{rev}/{path}` (LFS files redirect
/// to `/cdn-lfs/{sha256}`, like the Hub's CDN redirect), with ranges.
/// Unknown repos get the Hub's 401 `RepoNotFound`, unknown revisions 404
/// `RevisionNotFound`; with [`HubServer::gate`], 401 `GatedRepo` from
/// `/resolve/` only, as the Hub answers for a gated repo.
pub struct HubServer {
    server: Server,
    state: Arc<HubState>,
}

impl HubServer {
    /// Lists and hashes (LFS files only) `root` first.
    pub async fn start(root: impl Into<PathBuf>) -> HubServer {
        let root = root.into();
        let files = tokio::task::spawn_blocking({
            let root = root.clone();
            move || {
                tree_files(&root)
                    .into_iter()
                    .map(|(path, size)| HubFile {
                        lfs: (size >= HUB_LFS_MIN).then(|| sha256_file(&root.join(&path))),
                        path,
                        size,
                    })
                    .collect()
            }
        })
        .await
        .unwrap();
        let state = Arc::new(HubState {
            root,
            files,
            token: Mutex::default(),
            private: Default::default(),
            throttle: Mutex::default(),
            refuse_after: Mutex::default(),
            page: HUB_PAGE.into(),
            base: OnceLock::new(),
            hits: Hits::default(),
        });
        let s = state.clone();
        let server = Server::start(Arc::new(move |req| serve_hub(&s, req))).await;
        state.base.set(server.base()).unwrap();
        HubServer { server, state }
    }

    /// The endpoint to put in `hfEndpoint`.
    pub fn endpoint(&self) -> String {
        self.server.base()
    }

    /// Makes the repo gated, as the Hub gates one: its listing stays
    /// public, and only `/resolve/` needs `Authorization: Bearer <token>`
    /// (401 `GatedRepo` without it).
    pub fn gate(&self, token: &str) {
        *self.state.token.lock().unwrap() = Some(token.into());
    }

    /// Makes the repo private: every endpoint needs the token, and answers
    /// 401 `RepoNotFound` without it, as the Hub hides a private repo.
    pub fn make_private(&self, token: &str) {
        self.gate(token);
        self.state
            .private
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// GETs of a decoded path, like `org/minilm/resolve/<sha>/config.json`.
    pub fn gets(&self, path: &str) -> usize {
        self.state.hits.get("GET", path)
    }

    /// Sends each file's content at `bytes_per_sec` per connection.
    pub fn throttle(&self, bytes_per_sec: u64) {
        *self.state.throttle.lock().unwrap() = Some(bytes_per_sec);
    }

    /// Tree entries per page: the Hub pages its tree by 1000 (the
    /// default here is small, so that paging is exercised).
    pub fn page_size(&self, n: usize) {
        self.state
            .page
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Answers a gated refusal only `after` this long, as a Hub a round
    /// trip or two away does.
    pub fn refuse_after(&self, after: Duration) {
        *self.state.refuse_after.lock().unwrap() = Some(after);
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state.hits.requests()
    }
}

fn serve_hub(state: &HubState, req: &Request) -> Reply {
    state.hits.add(req);
    let seg: Vec<&str> = req.segments.iter().map(String::as_str).collect();
    let repo: Vec<&str> = HUB_REPO.split('/').collect();
    let not_repo = || {
        Reply::json(401, &json!({"error": "Repository not found"}))
            .header("X-Error-Code", "RepoNotFound")
    };
    let known_rev = |rev: &str| rev == "main" || rev == HUB_SHA;
    let authorized = || match &*state.token.lock().unwrap() {
        None => true,
        Some(t) => req.header("authorization") == Some(&format!("Bearer {t}")),
    };
    // A gated repo's listing is public; a private one's is not.
    let listed = || !state.private.load(std::sync::atomic::Ordering::Relaxed) || authorized();
    let gated = || {
        let mut r = Reply::json(401, &json!({"error": "Access to this model is restricted"}))
            .header("X-Error-Code", "GatedRepo");
        if let Some(after) = *state.refuse_after.lock().unwrap() {
            r.fault = Fault::Late(after);
        }
        r
    };
    let no_rev = || {
        Reply::json(404, &json!({"error": "Invalid rev id"}))
            .header("X-Error-Code", "RevisionNotFound")
    };
    match seg.as_slice() {
        ["api", "models", o, n, "revision", rev] => {
            if [*o, *n] != repo[..] || !listed() {
                return not_repo();
            }
            if !known_rev(rev) {
                return no_rev();
            }
            let siblings: Vec<Value> = state
                .files
                .iter()
                .map(|f| json!({"rfilename": f.path}))
                .collect();
            Reply::json(
                200,
                &json!({
                    "_id": "fixture",
                    "id": HUB_REPO,
                    "modelId": HUB_REPO,
                    "sha": HUB_SHA,
                    "private": false,
                    "gated": state.token.lock().unwrap().is_some(),
                    "tags": ["sentence-transformers"],
                    "siblings": siblings,
                }),
            )
        }
        ["api", "models", o, n, "tree", rev, rest @ ..] => {
            if [*o, *n] != repo[..] || !listed() {
                return not_repo();
            }
            if !known_rev(rev) || !rest.is_empty() {
                return no_rev();
            }
            let recursive = req.param("recursive") == Some("true");
            let mut entries: Vec<Value> = Vec::new();
            let mut dirs = BTreeMap::new();
            for f in &state.files {
                if let Some((dir, _)) = f.path.rsplit_once('/') {
                    dirs.insert(dir.to_string(), ());
                    if !recursive {
                        continue;
                    }
                }
                // Not git's blob sha1: hf.rs never reads it.
                let oid = &hex::encode(Sha256::digest(f.path.as_bytes()))[..40];
                let mut e = json!({"type": "file", "oid": oid, "size": f.size, "path": f.path});
                if let Some(sha) = &f.lfs {
                    e["lfs"] = json!({"oid": sha, "size": f.size, "pointerSize": 134});
                }
                entries.push(e);
            }
            for d in dirs.keys() {
                entries.push(
                    json!({"type": "directory", "oid": "0".repeat(40), "size": 0, "path": d}),
                );
            }
            let start: usize = req
                .param("cursor")
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let page = state.page.load(std::sync::atomic::Ordering::Relaxed);
            let end = (start + page).min(entries.len());
            let page: Vec<Value> = entries.get(start..end).unwrap_or(&[]).to_vec();
            let mut r = Reply::json(200, &Value::Array(page));
            if end < entries.len() {
                let next = format!(
                    "{}{}?recursive={}&cursor={end}",
                    state.base.get().unwrap(),
                    req.raw_path,
                    recursive
                );
                r = r.header("Link", format!("<{next}>; rel=\"next\""));
            }
            r
        }
        [o, n, "resolve", rev, path @ ..] if [*o, *n] == repo[..] => {
            if !authorized() {
                return gated();
            }
            if !known_rev(rev) {
                return no_rev();
            }
            let path = path.join("/");
            let Some(f) = state.files.iter().find(|f| f.path == path) else {
                return Reply::json(404, &json!({"error": "Entry not found"}))
                    .header("X-Error-Code", "EntryNotFound");
            };
            match &f.lfs {
                Some(sha) => Reply::new(302)
                    .header(
                        "Location",
                        format!("{}/cdn-lfs/{sha}", state.base.get().unwrap()),
                    )
                    .header("X-Repo-Commit", HUB_SHA),
                None => hub_content(state, req, &f.path),
            }
        }
        ["cdn-lfs", sha] => match state.files.iter().find(|f| f.lfs.as_deref() == Some(*sha)) {
            Some(f) => hub_content(state, req, &f.path),
            None => Reply::new(404),
        },
        _ => not_repo(),
    }
}

fn hub_content(state: &HubState, req: &Request, path: &str) -> Reply {
    let full = state.root.join(path);
    match fs::metadata(&full) {
        Ok(m) => {
            let mut reply = content_reply(req, Content::File(full, m), true, true)
                .header("X-Repo-Commit", HUB_SHA);
            if let Some(rate) = *state.throttle.lock().unwrap() {
                reply.fault = Fault::Throttle(rate);
            }
            reply
        }
        Err(_) => Reply::new(404),
    }
}

// ---------------------------------------------------------------- Model Registry

const MR_API: &str = "api/model_registry/v1alpha3";
/// Items per list page at most, small so that paging is exercised.
pub const REGISTRY_PAGE: usize = 2;

struct MrVersion {
    id: u64,
    name: String,
    state: String,
    artifact_uri: String,
}

struct RegistryState {
    model: String,
    versions: Mutex<Vec<MrVersion>>,
    token: Mutex<Option<String>>,
    log: Mutex<Vec<String>>,
}

/// Fixture: the Kubeflow Model Registry REST API v1alpha3 endpoints
/// `registry.rs` calls, for one registered model (id 1) whose versions
/// (ids 10, 11, ... in the order given, the last the newest) each hold a
/// doc artifact and one model artifact with the given URI:
/// `GET .../registered_model?name=`, `GET .../registered_models/1/versions`
/// (`name`, `pageSize`, `nextPageToken`, `orderBy=ID`, `sortOrder`), and
/// `GET .../model_versions/{id}/artifacts` (`artifactType`, paging).
/// Pages hold at most [`REGISTRY_PAGE`] items.
pub struct RegistryServer {
    server: Server,
    state: Arc<RegistryState>,
}

impl RegistryServer {
    /// `versions`: (version name, model artifact URI), oldest first.
    pub async fn start(model: &str, versions: &[(&str, &str)]) -> RegistryServer {
        let versions = versions
            .iter()
            .enumerate()
            .map(|(i, (name, uri))| MrVersion {
                id: 10 + i as u64,
                name: name.to_string(),
                state: "LIVE".into(),
                artifact_uri: uri.to_string(),
            })
            .collect();
        let state = Arc::new(RegistryState {
            model: model.into(),
            versions: Mutex::new(versions),
            token: Mutex::default(),
            log: Mutex::default(),
        });
        let s = state.clone();
        let server = Server::start(Arc::new(move |req| serve_registry(&s, req))).await;
        RegistryServer { server, state }
    }

    /// The base URL to put in `modelRegistryURL`.
    pub fn url(&self) -> String {
        self.server.base()
    }

    /// `host:port`, as KServe writes it in `model-registry://host:port/model/version`.
    pub fn authority(&self) -> String {
        self.server.addr.to_string()
    }

    /// Requires `Authorization: Bearer <token>`.
    pub fn require_token(&self, token: &str) {
        *self.state.token.lock().unwrap() = Some(token.into());
    }

    /// Marks a version ARCHIVED.
    pub fn archive(&self, version: &str) {
        for v in self.state.versions.lock().unwrap().iter_mut() {
            if v.name == version {
                v.state = "ARCHIVED".into();
            }
        }
    }

    /// Every request as `METHOD /path?query`, in order.
    pub fn requests(&self) -> Vec<String> {
        self.state.log.lock().unwrap().clone()
    }
}

fn mr_time(id: u64) -> String {
    (1_700_000_000_000 + id * 1000).to_string()
}

/// One page of `items` as a v1alpha3 list (items, size, pageSize, nextPageToken).
fn mr_page(req: &Request, items: Vec<Value>) -> Reply {
    let size: usize = req
        .param("pageSize")
        .and_then(|s| s.parse().ok())
        .unwrap_or(100)
        .min(REGISTRY_PAGE);
    let start: usize = req
        .param("nextPageToken")
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let end = (start + size).min(items.len());
    let page: Vec<Value> = items.get(start..end).unwrap_or(&[]).to_vec();
    let next = if end < items.len() {
        end.to_string()
    } else {
        String::new()
    };
    Reply::json(
        200,
        &json!({"items": page, "size": end - start.min(end), "pageSize": size, "nextPageToken": next}),
    )
}

fn mr_error(status: u16, message: &str) -> Reply {
    Reply::json(
        status,
        &json!({"code": status.to_string(), "message": message}),
    )
}

fn serve_registry(state: &RegistryState, req: &Request) -> Reply {
    let q: Vec<String> = req.query.iter().map(|(k, v)| format!("{k}={v}")).collect();
    state
        .log
        .lock()
        .unwrap()
        .push(format!("{} {}?{}", req.method, req.raw_path, q.join("&")));
    if let Some(t) = &*state.token.lock().unwrap()
        && req.header("authorization") != Some(&format!("Bearer {t}"))
    {
        return mr_error(401, "unauthorized");
    }
    let path = req.path();
    let Some(rest) = path.strip_prefix(MR_API) else {
        return mr_error(404, "not found");
    };
    let seg: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    let versions = state.versions.lock().unwrap();
    match seg.as_slice() {
        ["registered_model"] => match req.param("name") {
            Some(n) if n == state.model => Reply::json(
                200,
                &json!({
                    "id": "1",
                    "name": state.model,
                    "state": "LIVE",
                    "owner": "fixture",
                    "customProperties": {},
                    "createTimeSinceEpoch": mr_time(0),
                    "lastUpdateTimeSinceEpoch": mr_time(0),
                }),
            ),
            _ => mr_error(404, "no registered model found"),
        },
        ["registered_models", "1", "versions"] => {
            let mut items: Vec<&MrVersion> = versions
                .iter()
                .filter(|v| req.param("name").is_none_or(|n| n == v.name))
                .collect();
            if req.param("sortOrder") == Some("DESC") {
                items.reverse();
            }
            let items = items
                .into_iter()
                .map(|v| {
                    json!({
                        "id": v.id.to_string(),
                        "name": v.name,
                        "registeredModelId": "1",
                        "state": v.state,
                        "author": "fixture",
                        "customProperties": {},
                        "createTimeSinceEpoch": mr_time(v.id),
                        "lastUpdateTimeSinceEpoch": mr_time(v.id),
                    })
                })
                .collect();
            mr_page(req, items)
        }
        ["registered_models", _, "versions"] => mr_error(404, "no registered model found"),
        ["model_versions", id, "artifacts"] => {
            let Some(v) = versions.iter().find(|v| v.id.to_string() == *id) else {
                return mr_error(404, "no model version found");
            };
            let all = [
                json!({
                    "artifactType": "doc-artifact",
                    "id": (v.id * 100).to_string(),
                    "name": format!("{}-readme", v.name),
                    "uri": "https://example.invalid/README.md",
                    "state": "LIVE",
                    "createTimeSinceEpoch": mr_time(v.id * 100),
                }),
                json!({
                    "artifactType": "model-artifact",
                    "id": (v.id * 100 + 1).to_string(),
                    "name": v.name,
                    "uri": v.artifact_uri,
                    "state": "LIVE",
                    "modelFormatName": "safetensors",
                    "modelFormatVersion": "1",
                    "customProperties": {},
                    "createTimeSinceEpoch": mr_time(v.id * 100 + 1),
                    "lastUpdateTimeSinceEpoch": mr_time(v.id * 100 + 1),
                }),
            ];
            let items = all
                .into_iter()
                .filter(|a| {
                    req.param("artifactType")
                        .is_none_or(|t| a["artifactType"] == t)
                })
                .collect();
            mr_page(req, items)
        }
        _ => mr_error(404, "not found"),
    }
}

/// Bytes of `file` in the page cache, as `fincore` (util-linux) reports them.
pub fn resident_bytes(file: &Path) -> u64 {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
        .arg(file)
        .output()
        .expect("run fincore");
    assert!(out.status.success(), "fincore: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("fincore printed {out:?}: {e}"))
}
