//! Prometheus metrics, following its naming conventions (base units,
//! `_total` counters), served on `--metrics-address` with a `/healthz`.
//!
//! Counters and histograms are updated where things happen; gauges that
//! describe the disk and the mount table are computed at scrape time, so
//! they are true after a restart too. Labels never carry a URI or a
//! credential, only the scheme.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::Backend;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Scheme {
    pub scheme: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PullOutcome {
    pub scheme: String,
    pub outcome: String,
}

/// Where a pull's bytes came from (`peer` or `origin`), per model.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FillFrom {
    pub model: String,
    pub from: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Method {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodCode {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct State {
    pub state: String,
}

/// A root as the gauges see it: where it is and how full. The store
/// implements it, so the gauges read a root without knowing the store.
pub trait GaugedRoot: Send + Sync {
    fn backend(&self) -> Backend;
    fn dir(&self) -> &std::path::Path;
    /// Where its sources live: a mount of something below it is ours.
    fn sources_dir(&self) -> std::path::PathBuf;
    /// Bytes its pulled models take.
    fn used(&self) -> crate::error::Result<u64>;
    /// Bytes a pull may still take, under `capacity` and the reserve.
    fn free(&self, capacity: Option<u64>) -> crate::error::Result<u64>;
}

pub struct Metrics {
    pub pulls: Family<PullOutcome, Counter>,
    pub pull_bytes: Family<Scheme, Counter>,
    pub pull_duration: Family<Scheme, Histogram>,
    pub cache_hits: Family<Scheme, Counter>,
    /// Counted by whoever evicts: the engine making room, idle eviction.
    pub evictions: Counter,
    pub cache_used: Family<BackendLabel, Gauge>,
    pub cache_free: Family<BackendLabel, Gauge>,
    pub volumes: Family<State, Gauge>,
    pub rpc_duration: Family<Method, Histogram>,
    pub rpc_errors: Family<MethodCode, Counter>,
    pub rescheduler_actions: Family<Reason, Counter>,
    /// Pull jobs running now, and the bytes they have fetched so far.
    pub pulls_in_flight: Gauge,
    pub pull_bytes_in_flight: Gauge,
    /// Bytes of pulls that had peers, by model and where they came from.
    pub fill_bytes: Family<FillFrom, Counter>,
    /// Bytes this node served to other nodes' pulls.
    pub peer_served_bytes: Counter,
    /// Peer requests refused, by reason (unauthorized, busy, not_held).
    pub peer_refused: Family<Reason, Counter>,
    registry: Mutex<Registry>,
    /// Roots whose disk and mount gauges `refresh_gauges` computes.
    roots: Mutex<Vec<Arc<dyn GaugedRoot>>>,
    /// Bumped by every CSI call that may change a gauge; the gauges are
    /// recomputed only when it moved (or they are old), so they cost the
    /// disk nothing while nothing happens.
    changes: std::sync::atomic::AtomicU64,
    /// Wakes `keep_gauges_fresh` when `changes` moves.
    changed: tokio::sync::Notify,
    /// The `changes` value and time the gauges were last computed at.
    computed: Mutex<Option<(u64, Instant)>>,
}

/// Gauges this old are computed again even if no call changed them: other
/// processes (a shared root's other nodes, an operator) change disks too.
const GAUGES_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a change waits before the gauges follow it, so a burst of
/// calls (kubelet publishing for a hundred pods) costs one recomputation.
const GAUGES_SETTLE: std::time::Duration = std::time::Duration::from_millis(200);

fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 4.0, 10)
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh set of metrics: one per process in production (built in
    /// `main`, served by `serve`), one per test where a test counts.
    pub fn new() -> Metrics {
        let m = Metrics {
            pulls: Family::default(),
            pull_bytes: Family::default(),
            pull_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.1, 3.0, 10))
            }),
            cache_hits: Family::default(),
            evictions: Counter::default(),
            cache_used: Family::default(),
            cache_free: Family::default(),
            volumes: Family::default(),
            rpc_duration: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
            rpc_errors: Family::default(),
            rescheduler_actions: Family::default(),
            pulls_in_flight: Gauge::default(),
            pull_bytes_in_flight: Gauge::default(),
            fill_bytes: Family::default(),
            peer_served_bytes: Counter::default(),
            peer_refused: Family::default(),
            registry: Mutex::new(Registry::with_prefix("modelcache")),
            roots: Mutex::new(Vec::new()),
            changes: Default::default(),
            changed: tokio::sync::Notify::new(),
            computed: Mutex::new(None),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|p| p.into_inner());
            r.register(
                "pulls",
                "Model pulls by scheme and outcome (sealed, failed)",
                m.pulls.clone(),
            );
            r.register(
                "pull_bytes",
                "Bytes downloaded by the puller",
                m.pull_bytes.clone(),
            );
            r.register(
                "pull_duration_seconds",
                "Time from resolve to seal",
                m.pull_duration.clone(),
            );
            r.register(
                "pulls_in_flight",
                "Pull jobs running now (they outlive the calls that started them)",
                m.pulls_in_flight.clone(),
            );
            r.register(
                "pull_bytes_in_flight",
                "Bytes fetched so far by the pull jobs running now",
                m.pull_bytes_in_flight.clone(),
            );
            r.register(
                "fill_bytes",
                "Bytes of pulls that had peers, by model and source (peer, origin)",
                m.fill_bytes.clone(),
            );
            r.register(
                "peer_served_bytes",
                "Bytes this node served to other nodes' pulls",
                m.peer_served_bytes.clone(),
            );
            r.register(
                "peer_refused",
                "Peer requests refused, by reason (unauthorized, busy, not_held, bad_request)",
                m.peer_refused.clone(),
            );
            r.register(
                "cache_hits",
                "Volumes served from an already sealed model",
                m.cache_hits.clone(),
            );
            r.register(
                "cache_evictions",
                "Pulled models evicted",
                m.evictions.clone(),
            );
            r.register(
                "cache_used_bytes",
                "Bytes held by sealed pulled models",
                m.cache_used.clone(),
            );
            r.register(
                "cache_free_bytes",
                "Bytes a new model may still use",
                m.cache_free.clone(),
            );
            r.register(
                "volumes",
                "Mounts of this driver's volumes by state (staged, published)",
                m.volumes.clone(),
            );
            r.register(
                "rpc_duration_seconds",
                "CSI call latency by method",
                m.rpc_duration.clone(),
            );
            r.register(
                "rpc_errors",
                "CSI calls that failed, by method and gRPC code",
                m.rpc_errors.clone(),
            );
            r.register(
                "rescheduler_actions",
                "PVCs whose selected node was cleared, by reason",
                m.rescheduler_actions.clone(),
            );
        }
        m
    }

    /// Counts one PVC whose selected node was cleared, for `reason`.
    pub fn rescheduled(&self, reason: &str) {
        self.rescheduler_actions
            .get_or_create(&Reason {
                reason: reason.into(),
            })
            .inc();
    }

    /// PVCs rescheduled for `reason` so far.
    pub fn reschedules(&self, reason: &str) -> u64 {
        self.rescheduler_actions
            .get_or_create(&Reason {
                reason: reason.into(),
            })
            .get()
    }

    /// PVCs rescheduled for any reason so far.
    pub fn reschedules_in_all(&self) -> u64 {
        let mut text = String::new();
        let mut r = Registry::default();
        r.register("r", "", self.rescheduler_actions.clone());
        let _ = encode(&mut text, &r);
        text.lines()
            .filter(|l| l.starts_with("r_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Includes these roots in the scrape-time gauges.
    pub fn watch_roots(&self, roots: impl IntoIterator<Item = Arc<dyn GaugedRoot>>) {
        self.roots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(roots);
    }

    pub fn rpc(&self, method: &str, started: Instant, code: Option<tonic::Code>) {
        if !read_only(method) {
            self.changes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.changed.notify_one();
        }
        let m = Method {
            method: method.to_string(),
        };
        self.rpc_duration
            .get_or_create(&m)
            .observe(started.elapsed().as_secs_f64());
        if let Some(code) = code.filter(|c| *c != tonic::Code::Ok) {
            self.rpc_errors
                .get_or_create(&MethodCode {
                    method: method.to_string(),
                    code: format!("{code:?}"),
                })
                .inc();
        }
    }

    fn refresh_gauges(&self, capacity: &dyn Fn(Backend) -> Option<u64>) {
        let roots = self.roots.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for root in &roots {
            let label = BackendLabel {
                backend: root.backend().to_string(),
            };
            if let Ok(used) = root.used() {
                self.cache_used.get_or_create(&label).set(used as i64);
            }
            if let Ok(free) = root.free(capacity(root.backend())) {
                self.cache_free
                    .get_or_create(&label)
                    .set(free.min(i64::MAX as u64) as i64);
            }
        }
        let (mut staged, mut published) = (0, 0);
        // One pass over the table, whatever the number of roots; a loop
        // device's backing file is looked up once per device, and only for
        // loop devices (a bind mount's source is the disk it lives on).
        let mut backing: HashMap<&str, Option<std::path::PathBuf>> = HashMap::new();
        let table = crate::mount::read_table().unwrap_or_default();
        for m in &table {
            let file = m
                .source
                .starts_with("/dev/loop")
                .then(|| {
                    backing
                        .entry(m.source.as_str())
                        .or_insert_with(|| {
                            crate::mount::loopdev::backing_file(std::path::Path::new(&m.source))
                                .ok()
                                .flatten()
                        })
                        .clone()
                })
                .flatten();
            let ours = roots.iter().any(|root| {
                let sources = root.sources_dir();
                (m.root.starts_with(&sources)
                    || file.as_ref().is_some_and(|b| b.starts_with(&sources)))
                    && !m.mount_point.starts_with(root.dir())
            });
            if !ours {
                continue;
            }
            // kubelet stages at .../globalmount (the volume is mounted
            // beneath it) and publishes elsewhere.
            let at = m.mount_point.as_path();
            let staging = if at.ends_with(crate::mount::STAGING_CONTENT) {
                at.parent().unwrap_or(at)
            } else {
                at
            };
            if staging.ends_with("globalmount") {
                staged += 1;
            } else {
                published += 1;
            }
        }
        self.volumes
            .get_or_create(&State {
                state: "staged".into(),
            })
            .set(staged);
        self.volumes
            .get_or_create(&State {
                state: "published".into(),
            })
            .set(published);
    }

    /// Whether the gauges are stale: a call may have changed them since,
    /// or they are older than `GAUGES_MAX_AGE`.
    fn gauges_stale(&self) -> bool {
        let now = self.changes.load(std::sync::atomic::Ordering::Relaxed);
        match *self.computed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((seen, at)) => seen != now || at.elapsed() > GAUGES_MAX_AGE,
            None => true,
        }
    }

    /// Computes the gauges if stale. Blocking (it reads seals and the mount
    /// table); callers serialise it, so a burst of scrapes costs one.
    fn refresh_if_stale(&self, capacity: &dyn Fn(Backend) -> Option<u64>) {
        if !self.gauges_stale() {
            return;
        }
        let seen = self.changes.load(std::sync::atomic::Ordering::Relaxed);
        self.refresh_gauges(capacity);
        *self.computed.lock().unwrap_or_else(|p| p.into_inner()) = Some((seen, Instant::now()));
    }

    /// Keeps the gauges following the node, off the scrape's path: a
    /// scrape costs the same with ten volumes as with thousands, and the
    /// gauges follow a change within `GAUGES_SETTLE` plus one computation.
    pub async fn keep_gauges_fresh(self: Arc<Self>, capacity: Capacity) {
        loop {
            let (m, c) = (self.clone(), capacity.clone());
            if tokio::task::spawn_blocking(move || m.refresh_if_stale(&*c))
                .await
                .is_err()
            {
                tracing::warn!("metrics: computing the gauges panicked");
            }
            let waited = tokio::time::timeout(GAUGES_MAX_AGE, self.changed.notified()).await;
            if waited.is_ok() {
                tokio::time::sleep(GAUGES_SETTLE).await;
            }
        }
    }

    /// The text exposition. The gauges are as `keep_gauges_fresh` last
    /// left them, or computed now if nothing has computed them yet.
    pub fn render(&self, capacity: &dyn Fn(Backend) -> Option<u64>) -> String {
        let never = self
            .computed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none();
        if never {
            self.refresh_if_stale(capacity);
        }
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        let _ = encode(&mut out, &r);
        out
    }
}

/// Whether a CSI call never changes what the gauges show.
fn read_only(method: &str) -> bool {
    method.contains("Get")
        || method.starts_with("List")
        || matches!(method, "Probe" | "ValidateVolumeCapabilities")
}

/// The scheme label of a model URI, never the URI itself.
pub fn scheme_of(uri: &str) -> String {
    uri.split_once("://")
        .map(|(s, _)| s.to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// How long `/healthz` answers from its last finished check: none, so a
/// change shows at once; probes that arrive while a check runs share it,
/// which is what bounds a burst.
const HEALTH_TTL: std::time::Duration = std::time::Duration::ZERO;
/// Connections answered at once; more wait in the kernel's backlog, so a
/// flood neither spawns without bound nor fills the blocking pool the CSI
/// calls share.
const MAX_CONNECTIONS: usize = 64;
/// Connections one source address is answered on at once (a scraper
/// needs one); more from it wait for its turn, so that a few clients
/// cannot hold every slot. Beyond `OPEN` connections in all, new ones are
/// closed at once.
const PER_SOURCE: usize = 8;
const OPEN: usize = 1024;
/// How long a client may take to send its request head, and a write of
/// the answer may wait for it to read.
const SLOW_CLIENT: std::time::Duration = std::time::Duration::from_secs(2);

type Capacity = Arc<dyn Fn(Backend) -> Option<u64> + Send + Sync>;
type Health = Arc<dyn Fn() -> Vec<String> + Send + Sync>;
type Shared<T> = futures::future::Shared<futures::future::BoxFuture<'static, T>>;

/// One computation at a time, its result shared by every caller that
/// arrives while it runs (and, for `ttl`, after).
struct SingleFlight<T: Clone> {
    current: Mutex<Option<(Instant, Shared<T>)>>,
    ttl: std::time::Duration,
}

impl<T: Clone + Send + Sync + 'static> SingleFlight<T> {
    fn new(ttl: std::time::Duration) -> Self {
        SingleFlight {
            current: Mutex::new(None),
            ttl,
        }
    }

    async fn get(&self, start: impl FnOnce() -> futures::future::BoxFuture<'static, T>) -> T {
        use futures::FutureExt;
        let fut = {
            let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            match &*cur {
                // Still running, or done within its time to live.
                Some((at, f)) if f.peek().is_none() || at.elapsed() < self.ttl => f.clone(),
                _ => {
                    let f = start().shared();
                    *cur = Some((Instant::now(), f.clone()));
                    f
                }
            }
        };
        fut.await
    }
}

/// What the endpoint needs to answer.
struct Endpoint {
    metrics: Arc<Metrics>,
    capacity: Capacity,
    health: Health,
    checked: SingleFlight<Vec<String>>,
    scraped: SingleFlight<String>,
}

/// Binds the metrics port before anything else listens, so a client that
/// sees the CSI socket finds `/healthz` too.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let std = std::net::TcpListener::bind(addr)?;
    std.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(std)
}

/// Serves `/metrics` and `/healthz` until the process ends. A minimal
/// HTTP/1.1 responder: one request per connection, nothing else.
/// `health` lists what is wrong right now; `/healthz` is 200 only when it is
/// empty, so a liveness probe restarts a driver that cannot work.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    capacity: Capacity,
    health: Health,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving metrics");
    }
    serve_connections(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        metrics,
        capacity,
        health,
    )
    .await;
    Ok(())
}

/// Answers every accepted connection. A failed accept (EMFILE, a
/// connection reset before it was taken) is logged and retried after a
/// short pause: it must not end the health endpoint for good, or a
/// liveness probe would restart a working driver.
async fn serve_connections<S>(
    mut accepted: S,
    metrics: Arc<Metrics>,
    capacity: Capacity,
    health: Health,
) where
    S: futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Unpin,
{
    use futures::StreamExt;
    let endpoint = Arc::new(Endpoint {
        metrics,
        capacity,
        health,
        checked: SingleFlight::new(HEALTH_TTL),
        scraped: SingleFlight::new(std::time::Duration::ZERO),
    });
    // Aborted with the server: its set drops when this future does.
    let mut background = tokio::task::JoinSet::new();
    background.spawn(
        endpoint
            .metrics
            .clone()
            .keep_gauges_fresh(endpoint.capacity.clone()),
    );
    let admission = Arc::new(crate::conns::Admission::new(
        MAX_CONNECTIONS,
        PER_SOURCE,
        OPEN,
        SLOW_CLIENT * 5,
    ));
    loop {
        let Some(next) = accepted.next().await else {
            return;
        };
        let sock = match next {
            Ok(sock) => sock,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(opened) = sock.peer_addr().ok().and_then(|a| admission.open(a.ip())) else {
            continue;
        };
        let (endpoint, admission) = (endpoint.clone(), admission.clone());
        tokio::spawn(async move {
            let Some(_slot) = admission.admit(opened).await else {
                return;
            };
            answer(crate::conns::Stalls::new(sock, SLOW_CLIENT), &endpoint).await;
        });
    }
}

async fn answer(mut sock: crate::conns::Stalls<tokio::net::TcpStream>, e: &Endpoint) {
    // Read the request head whole: clients may send it in pieces.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + SLOW_CLIENT;
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16384 {
        match tokio::time::timeout_at(deadline, sock.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return,
        }
    }
    let req = String::from_utf8_lossy(&buf);
    let path = req.split_whitespace().nth(1).unwrap_or("/");
    let (status, ctype, body) = match path {
        "/metrics" => {
            let (capacity, metrics) = (e.capacity.clone(), e.metrics.clone());
            let body = e
                .scraped
                .get(move || {
                    Box::pin(async move {
                        tokio::task::spawn_blocking(move || metrics.render(&*capacity))
                            .await
                            .unwrap_or_default()
                    })
                })
                .await;
            (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            )
        }
        "/healthz" => {
            let health = e.health.clone();
            let problems = e
                .checked
                .get(move || {
                    Box::pin(async move {
                        tokio::task::spawn_blocking(move || health())
                            .await
                            .unwrap_or_else(|e| vec![format!("health check panicked: {e}")])
                    })
                })
                .await;
            if problems.is_empty() {
                ("200 OK", "text/plain", "ok\n".to_string())
            } else {
                (
                    "503 Service Unavailable",
                    "text/plain",
                    problems.join("\n") + "\n",
                )
            }
        }
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body.as_bytes()).await;
    let _ = sock.shutdown().await;
}

#[cfg(test)]
mod accept_tests {
    use super::*;
    use futures::StreamExt;

    /// An accept error (here the first one, as EMFILE would give) is
    /// survived: the next connection is answered.
    #[tokio::test]
    async fn an_accept_error_does_not_stop_the_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let failing = futures::stream::iter([Err(std::io::Error::from_raw_os_error(libc::EMFILE))])
            .chain(tokio_stream::wrappers::TcpListenerStream::new(listener));
        let server = tokio::spawn(serve_connections(
            Box::pin(failing),
            Arc::default(),
            Arc::new(|_| None),
            Arc::new(Vec::new),
        ));
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            c.read_to_string(&mut answer),
        )
        .await
        .expect("answered")
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        server.abort();
    }
}

#[cfg(test)]
mod burst_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(20),
            c.read_to_string(&mut answer),
        )
        .await
        .expect("answered")
        .unwrap();
        answer
    }

    /// A burst at both paths from one source: every answer is right, and
    /// the slow health check ran a handful of times, not once per request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_costs_a_few_checks_and_every_answer_is_right() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let checks = Arc::new(AtomicUsize::new(0));
        let counted = checks.clone();
        let server = tokio::spawn(serve_connections(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            Arc::default(),
            Arc::new(|_| None),
            Arc::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(200));
                Vec::new()
            }),
        ));
        let mut all = Vec::new();
        for i in 0..80 {
            let path = if i % 2 == 0 { "/healthz" } else { "/metrics" };
            all.push(tokio::spawn(async move { (path, get(addr, path).await) }));
        }
        for a in all {
            let (path, answer) = a.await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{path}: {answer}");
            if path == "/healthz" {
                assert!(answer.ends_with("ok\n"), "{answer}");
            } else {
                assert!(answer.contains("# EOF"), "{answer}");
            }
        }
        // One source's burst is answered PER_SOURCE at a time: at most a
        // check per turn, never one per request.
        let n = checks.load(Ordering::SeqCst);
        assert!(
            (1..=80 / PER_SOURCE).contains(&n),
            "{n} health checks for 40 requests"
        );
        server.abort();
    }

    /// A hundred idle connections from one client (more than every slot
    /// of the listener) do not keep another client's probe waiting: each
    /// source takes its turn within its share. Before, the probe waited
    /// behind them for their head timeout (5 s then).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_of_one_client_do_not_starve_the_probe() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve_connections(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            Arc::default(),
            Arc::new(|_| None),
            Arc::new(Vec::new),
        ));
        let mut idle = Vec::new();
        for _ in 0..100 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            idle.push(s.connect(addr).await.unwrap());
        }
        let started = Instant::now();
        // Within kubelet's probe timeout (1 s).
        let answer = tokio::time::timeout(std::time::Duration::from_secs(1), get(addr, "/healthz"))
            .await
            .expect("the probe waited behind idle connections");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        eprintln!(
            "probe answered in {:?} beside 100 idle connections",
            started.elapsed()
        );
        drop(idle);
        server.abort();
    }

    /// Scrapes recompute the gauges only when a call may have changed them.
    #[test]
    fn gauges_are_recomputed_only_after_a_change() {
        let m = Metrics::new();
        assert!(m.gauges_stale());
        m.refresh_if_stale(&|_| None);
        assert!(!m.gauges_stale());
        m.rpc("Probe", Instant::now(), None);
        for call in [
            "GetCapacity",
            "NodeGetVolumeStats",
            "ListVolumes",
            "NodeGetInfo",
        ] {
            m.rpc(call, Instant::now(), None);
            assert!(
                !m.gauges_stale(),
                "{call}, read-only, made the gauges stale"
            );
        }
        m.rpc("NodeUnstageVolume", Instant::now(), None);
        assert!(m.gauges_stale());
    }

    /// The gauges follow a change by themselves, within the settling time
    /// and one computation: no scrape has to compute them.
    #[tokio::test]
    async fn gauges_follow_a_change_without_a_scrape() {
        let m = Arc::new(Metrics::new());
        let task = tokio::spawn(m.clone().keep_gauges_fresh(Arc::new(|_| None)));
        let seen = |m: &Metrics| m.computed.lock().unwrap().map(|(seen, _)| seen);
        let t0 = Instant::now();
        while seen(&m).is_none() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        for _ in 0..50 {
            m.rpc("NodePublishVolume", Instant::now(), None);
        }
        let t0 = Instant::now();
        while seen(&m) != Some(50) {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "gauges computed at {:?} changes, 50 made",
                seen(&m)
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            t0.elapsed() >= GAUGES_SETTLE,
            "a burst did not settle first"
        );
        task.abort();
    }
}

#[cfg(test)]
mod eviction_tests {
    use super::*;

    fn shown(text: &str) -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("modelcache_cache_evictions_total "))
            .and_then(|v| v.trim().parse().ok())
            .expect("the evictions counter is exposed")
    }

    /// An eviction counted by its evictor shows in the exposition, once
    /// however often it is scraped.
    #[test]
    fn evictions_reach_the_exposition_once() {
        let m = Metrics::new();
        assert_eq!(shown(&m.render(&|_| None)), 0);
        m.evictions.inc();
        for _ in 0..3 {
            assert_eq!(shown(&m.render(&|_| None)), 1);
        }
    }
}
