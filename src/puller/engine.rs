//! The download engine: one resolved model into one sealed source.
//!
//! - **Content-addressed.** The source id is a digest of the normalized URI
//!   and its immutable revision, so every volume of one model revision
//!   shares one copy, and a moved tag becomes a new model, not a changed one.
//! - **Crash-safe.** Work happens in `sources/.pull-<sid>/`, beside the
//!   final place, under an flock. Progress is recorded per file in
//!   `state/`, after the bytes it describes are fsynced. A retry after
//!   `kill -9` resumes from there. The seal is written last and the
//!   directory renamed into place, so a half-written model is never visible.
//!   Losing the rename to another puller is a success.
//! - **Fast and bounded.** Large files are fetched as parallel ranges,
//!   largest file first, and written with O_DIRECT positioned writes
//!   (`direct.rs`), so bytes are copied once, into an aligned buffer, and
//!   never through the page cache. sha256 is one in-order pass over memory:
//!   the range at the hashed frontier is hashed as it is written, and a
//!   buffer that arrives ahead of it is held, up to a small per-file
//!   reorder window, until the frontier reaches it. A range that would run
//!   further ahead waits while enough other streams keep the pull moving;
//!   otherwise its bytes are read back from disk later, so a single large
//!   file still gets all its connections. Finished ranges are made durable
//!   in batches, one fdatasync each, off the connections' path. Buffers
//!   share one memory budget, whatever the model's size or the number of
//!   connections.
//! - **Patient.** Retryable failures back off exponentially with jitter and
//!   honour Retry-After. A stream that yields nothing for `stall` is
//!   dropped and its range resumed from the last byte written.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tracing::{Instrument, info, info_span, warn};

use super::direct::{ALIGN, PartFile, Window};
use super::source::{Compression, PullLimits, RemoteFile, Resolved, Source, Unpack};
use super::unpack::Budget;
use crate::cache::manifest::{self, FileEntry, LinkEntry, Tree};
use crate::cache::{self, Backend, Root, Seal};
pub use crate::config::EngineConfig;
use crate::error::{Error, IoContext, Result};
use crate::lock::KeyedMutex;
use crate::offload::blocking;
pub use crate::progress::{NoProgress, Progress, ProgressSink};
use crate::{mount, state};

/// Unpacks a verified layer blob into a directory within a budget,
/// returning its files.
pub type Extract = fn(&Path, Compression, &Path, &Budget) -> Result<Vec<FileEntry>>;

pub struct Pulled {
    pub sid: String,
    pub seal: Seal,
    /// True when the model was already sealed and nothing was fetched.
    pub hit: bool,
}

pub struct Engine {
    cfg: EngineConfig,
    extract: Extract,
    inflight: KeyedMutex,
    models: Arc<Semaphore>,
}

/// The source id of a model revision.
pub fn model_id(uri: &str, revision: &str) -> String {
    let mut h = Sha256::new();
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(revision.as_bytes());
    format!("m{}", &hex::encode(h.finalize())[..31])
}

/// Per-file progress, persisted after the bytes it describes are durable.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct FileState {
    path: String,
    /// Finished chunk indexes, whose bytes are durable.
    done: BTreeSet<u64>,
    /// Chunks in flight when last recorded: index -> leading bytes that are
    /// durable. A restart resumes each after them, so a `kill -9` costs
    /// at most [`PARTIAL_EVERY`] per connection instead of whole chunks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    partial: BTreeMap<u64, u64>,
    /// The chunk size `done` counts in; another size starts over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chunk_bytes: Option<u64>,
    /// The size the listing gave when `done` was recorded: a server may
    /// list the same version at another size later (a lying
    /// Content-Length under one strong ETag), and then `done` means nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    size_listed: Option<u64>,
    /// Set once the whole file is verified and in place.
    sha256: Option<String>,
    size: Option<u64>,
    /// For layers: the files they unpacked to.
    extracted: Option<Vec<FileEntry>>,
}

struct Work {
    dir: PathBuf,
    /// Where model files go: `data/`, or the mounted image for xfs.
    data: PathBuf,
    state: PathBuf,
    blobs: PathBuf,
    /// Files being downloaded, named by a digest of their model path, so
    /// no name a source lists (`a` and `a.part`) can collide with them.
    partial: PathBuf,
    mounted: Option<PathBuf>,
    /// Held for the whole pull; released on drop, or by the kernel on death.
    _lock: nix::fcntl::Flock<File>,
}

impl Drop for Work {
    fn drop(&mut self) {
        if let Some(mnt) = &self.mounted
            && mount::is_mount_point(mnt).unwrap_or(false)
        {
            let _ = mount::unmount(mnt);
        }
    }
}

/// What one pull is about, once its listing passed [`check_listing`].
struct Pull<'a> {
    sid: &'a str,
    resolved: &'a Resolved,
    /// The model's size, when every file's size is listed.
    total: Option<u64>,
    limits: PullLimits,
}

/// Shared by the tasks of one pull.
struct Ctx {
    source: Arc<dyn Source>,
    /// Bytes the pull may fetch in all (files of unlisted size included).
    max_bytes: u64,
    cfg: EngineConfig,
    bytes: AtomicU64,
    /// Bytes really downloaded by this process (resumed ones excluded).
    fetched: AtomicU64,
    state_lock: Mutex<()>,
    /// Bytes a stream buffers before it writes them.
    flush_at: usize,
    flow: Arc<Flow>,
}

impl Ctx {
    /// A frontier for one file of `size` bytes, with its reorder window;
    /// a small file's buffers are no larger than the file.
    fn frontier(&self, size: Option<u64>) -> Arc<Frontier> {
        let window = size.map_or(self.flush_at, |s| {
            usize::try_from(s)
                .unwrap_or(usize::MAX)
                .clamp(1, self.flush_at)
                .div_ceil(ALIGN)
                * ALIGN
        });
        Arc::new(Frontier::new(
            window,
            self.cfg.connections.max(1),
            self.flow.clone(),
        ))
    }
}

/// The streams of one pull that are transferring rather than waiting for a
/// reorder window. Waiting costs nothing while others keep the pull
/// moving (the bytes stay in memory and are hashed from there); when too
/// few would, a stream writes on, and its bytes are read back from disk
/// instead: a single large file behind a slow link keeps every connection.
struct Flow {
    moving: std::sync::atomic::AtomicUsize,
    /// Fewest streams that must keep moving.
    floor: usize,
    /// Bytes written ahead of a full reorder window, hashed from disk.
    spilled: AtomicU64,
}

impl Flow {
    fn new(floor: usize) -> Flow {
        Flow {
            moving: std::sync::atomic::AtomicUsize::new(0),
            floor,
            spilled: AtomicU64::new(0),
        }
    }

    /// Counts a stream as moving for as long as the guard lives.
    fn enter(self: &Arc<Self>) -> Moving {
        self.moving.fetch_add(1, Ordering::SeqCst);
        Moving(self.clone())
    }

    /// Whether one of the moving streams may stop and wait.
    fn may_pause(&self) -> bool {
        self.moving.load(Ordering::SeqCst) > self.floor
    }
}

struct Moving(Arc<Flow>);

impl Drop for Moving {
    fn drop(&mut self) {
        self.0.moving.fetch_sub(1, Ordering::SeqCst);
    }
}

fn state_path(work: &Work, path: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(path.as_bytes());
    work.state
        .join(format!("{}.json", &hex::encode(h.finalize())[..32]))
}

fn is_retryable(e: &Error) -> bool {
    matches!(e, Error::Unavailable(_) | Error::RetryAfter { .. })
}

/// Inside the xfs image, which is the model's root, partial files live
/// in this directory; a source may not list anything under it.
pub const PARTIAL_DIR: &str = ".modelcache-partial";

/// The longest file name and path a model may hold (Linux NAME_MAX and
/// PATH_MAX): longer ones would fail deep in the pull with ENAMETOOLONG.
const MAX_NAME_BYTES: usize = 255;
const MAX_PATH_BYTES: usize = 4096;

/// Refuses a model path a source listed, as it was sent, never altered:
/// '/'-separated, relative, no empty, '.' or '..' component, no control
/// character, within NAME_MAX and PATH_MAX, not under [`PARTIAL_DIR`].
fn check_path(p: &str) -> Result<()> {
    let why = if p.split('/').any(|c| matches!(c, "" | "." | "..")) {
        Some("which would land outside the model")
    } else if p.chars().any(char::is_control) {
        Some("which has a control character in it")
    } else if p.len() > MAX_PATH_BYTES || p.split('/').any(|c| c.len() > MAX_NAME_BYTES) {
        Some("which is longer than a path or file name may be")
    } else if p.split('/').next() == Some(PARTIAL_DIR) {
        Some("which is where the driver keeps partial files")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::SourceFault(format!(
            "it lists a file at {p:?}, {why}; refused"
        ))),
        None => Ok(()),
    }
}

/// The one place a listing is judged before anything is fetched: every
/// name (see [`check_path`]), no name twice, no file inside a file, sizes
/// that add up, and the pull's limits. Returns the model's size when every
/// file's size is known.
fn check_listing(r: &Resolved, limits: &PullLimits) -> Result<Option<u64>> {
    if r.files.is_empty() {
        return Err(Error::NotFound(format!("{} has no files", r.uri)));
    }
    let count = r.files.len() as u64;
    if count > limits.max_files {
        return Err(Error::ResourceExhausted(format!(
            "{} lists {count} files, more than this driver or StorageClass allows ({} files: \
             --max-model-files or the class's maxModelFiles); nothing was fetched",
            r.uri, limits.max_files
        )));
    }
    let mut names = BTreeSet::new();
    for f in &r.files {
        if f.path.is_empty() && f.unpack != Unpack::None {
            continue; // a layer unpacked at the model root
        }
        check_path(&f.path)?;
        if f.unpack == Unpack::None && !names.insert(f.path.as_str()) {
            return Err(Error::SourceFault(format!(
                "{} lists the file {:?} twice",
                r.uri, f.path
            )));
        }
    }
    for n in &names {
        for (i, _) in n.match_indices('/') {
            if names.contains(&n[..i]) {
                return Err(Error::SourceFault(format!(
                    "{} lists {:?} both as a file and as a directory (of {n:?})",
                    r.uri,
                    &n[..i]
                )));
            }
        }
    }
    let total = r.total_bytes()?;
    let known = r.known_bytes();
    if known > limits.max_bytes {
        return Err(Error::ResourceExhausted(format!(
            "{} lists {known} bytes, more than this driver or StorageClass allows ({} bytes: \
             --max-model-bytes or the class's maxModelBytes); nothing was fetched",
            r.uri, limits.max_bytes
        )));
    }
    Ok(total)
}

impl Engine {
    pub fn new(cfg: EngineConfig, extract: Extract) -> Engine {
        let models = Arc::new(Semaphore::new(cfg.models.max(1)));
        Engine {
            cfg,
            extract,
            inflight: KeyedMutex::default(),
            models,
        }
    }

    /// Resolves, then returns the sealed model, pulling it if needed.
    /// Concurrent calls for one model join the same pull.
    pub async fn pull(
        &self,
        root: &Root,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
    ) -> Result<Pulled> {
        let resolved = self.retry("resolve", || source.resolve()).await?;
        let limits = self.cfg.limits.lower(source.limits());
        let total = check_listing(&resolved, &limits)?;
        let scope = source.key_scope();
        let sid = if scope.is_empty() {
            model_id(&resolved.uri, &resolved.revision)
        } else {
            model_id(&format!("{}\0{scope}", resolved.uri), &resolved.revision)
        };
        let span =
            info_span!("pull", model = %resolved.uri, revision = %resolved.revision, source = %sid);
        let scheme = crate::metrics::scheme_of(&resolved.uri);
        let m = crate::metrics::global();
        let started = Instant::now();
        let result = async {
            if let Some(seal) = cache::read_seal(root, &sid)? {
                return Ok(Pulled {
                    sid,
                    seal,
                    hit: true,
                });
            }
            let _joined = self.inflight.lock(&sid).await;
            if let Some(seal) = cache::read_seal(root, &sid)? {
                return Ok(Pulled {
                    sid,
                    seal,
                    hit: true,
                });
            }
            let _permit = self
                .models
                .acquire()
                .await
                .map_err(|_| Error::Internal("puller is shutting down".into()))?;
            sink.started(&resolved.uri, total);
            let pull = Pull {
                sid: &sid,
                resolved: &resolved,
                total,
                limits,
            };
            match self.fetch(root, &pull, source, sink).await {
                Ok((seal, fetched)) => {
                    m.pull_bytes
                        .get_or_create(&crate::metrics::Scheme {
                            scheme: scheme.clone(),
                        })
                        .inc_by(fetched);
                    let took = started.elapsed();
                    info!(
                        bytes = seal.total_bytes,
                        secs = took.as_secs_f64(),
                        "sealed"
                    );
                    sink.sealed(&resolved.uri, &resolved.revision, seal.total_bytes, took);
                    Ok(Pulled {
                        sid,
                        seal,
                        hit: false,
                    })
                }
                Err(e) => {
                    warn!(error = %e, "pull failed");
                    Err(e)
                }
            }
        }
        .instrument(span)
        .await;
        let outcome = match &result {
            Ok(p) if p.hit => {
                m.cache_hits
                    .get_or_create(&crate::metrics::Scheme {
                        scheme: scheme.clone(),
                    })
                    .inc();
                None
            }
            Ok(_) => Some("sealed"),
            Err(_) => Some("failed"),
        };
        if let Some(outcome) = outcome {
            m.pulls
                .get_or_create(&crate::metrics::PullOutcome {
                    scheme: scheme.clone(),
                    outcome: outcome.into(),
                })
                .inc();
            m.pull_duration
                .get_or_create(&crate::metrics::Scheme { scheme })
                .observe(started.elapsed().as_secs_f64());
        }
        result
    }

    async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut attempt = 0;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if is_retryable(&e) && attempt + 1 < self.cfg.attempts => {
                    let wait = backoff(&self.cfg, attempt, &e);
                    warn!(error = %e, attempt, wait_ms = wait.as_millis() as u64, "{what} failed; retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn fetch(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
    ) -> Result<(Seal, u64)> {
        let (sid, need) = (pull.sid, pull.total);
        let capacity = self.cfg.capacity.get(&root.backend).copied();
        if let Some(need) = need {
            let (r, s) = (root.clone(), sid.to_string());
            blocking(move || cache::evict::make_room(&r, need, capacity, &s)).await?;
        }
        let (r, s) = (root.clone(), sid.to_string());
        let work = Arc::new(blocking(move || open_work(&r, &s, need)).await?);
        let result = self
            .fetch_into(root, pull, source, sink, &work, capacity)
            .await;
        // Work a retry could resume is kept (a crash, a dead server, a
        // failure the next attempt may not meet). Work that failed for want
        // of space, for being over its limits, or because the source served
        // garbage would only hold space no later pull can use, so it goes
        // now, while the lock is still ours.
        if let Err(e) = &result
            && (e.is_no_space() || matches!(e, Error::ResourceExhausted(_) | Error::SourceFault(_)))
        {
            let w = work.clone();
            if let Err(d) = blocking(move || discard_work(&w)).await {
                warn!(error = %d, "could not remove the failed pull's work directory");
            }
        }
        result
    }

    async fn fetch_into(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
        work: &Arc<Work>,
        capacity: Option<u64>,
    ) -> Result<(Seal, u64)> {
        let (sid, resolved, need) = (pull.sid, pull.resolved, pull.total);
        let ctx = Arc::new(Ctx {
            source,
            max_bytes: pull.limits.max_bytes,
            cfg: self.cfg.clone(),
            bytes: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            state_lock: Mutex::new(()),
            flush_at: flush_at(&self.cfg),
            flow: Arc::new(Flow::new(self.cfg.connections.max(1))),
        });

        // Largest first: the biggest file bounds the pull, so it must not
        // wait behind small ones. The seal's order does not depend on this.
        let mut order: Vec<(usize, RemoteFile)> =
            resolved.files.iter().cloned().enumerate().collect();
        order.sort_by_key(|(_, f)| std::cmp::Reverse(f.size.unwrap_or(0)));
        // Streams, not files, are what a pull runs at once: a file of one
        // range is one stream, a larger one up to `connections`. So small
        // files, which are bound by round trips and fsyncs, not bytes, run
        // many at a time, and large ones as before. The semaphore is fair:
        // a large file waiting for its streams holds back the files after it.
        let connections = self.cfg.connections.max(1);
        let budget = self.cfg.files.max(1) * connections;
        let streams = Arc::new(Semaphore::new(budget));
        let files = futures::stream::iter(order)
            .map(|(i, f)| {
                let (ctx, work, streams) = (ctx.clone(), work.clone(), streams.clone());
                let need = if f.size.is_some_and(|s| s <= ctx.cfg.chunk_bytes) {
                    1
                } else {
                    connections
                };
                async move {
                    let _streams = streams
                        .acquire_many_owned(need as u32)
                        .await
                        .map_err(|_| Error::Internal("pull is shutting down".into()))?;
                    fetch_file(ctx, work, i, f).await
                }
            })
            .buffer_unordered(budget);
        let mut files = std::pin::pin!(files);
        let mut results = Vec::new();
        let start = Instant::now();
        let mut tick = tokio::time::interval_at(
            tokio::time::Instant::now() + self.cfg.progress_every,
            self.cfg.progress_every,
        );
        loop {
            tokio::select! {
                next = files.next() => match next {
                    // The first failure that retries could not mend ends the
                    // pull at once; what other files made durable is resumed.
                    Some(Err(e)) => return Err(e),
                    Some(Ok(r)) => results.push(r),
                    None => break,
                },
                _ = tick.tick() => {
                    let p = progress(&resolved.uri, ctx.bytes.load(Ordering::Relaxed), need, start.elapsed());
                    info!(
                        bytes = p.bytes,
                        total = ?p.total,
                        rate_mib_s = p.rate_bytes_per_sec / 1048576.0,
                        eta_s = ?p.eta.map(|e| e.as_secs()),
                        "pulling"
                    );
                    sink.progress(&p);
                }
            }
        }
        let mut entries = Vec::new();
        let mut layers = Vec::new();
        for r in results {
            match r {
                Fetched::File(f) => entries.push(f),
                l @ Fetched::Layer { .. } => layers.push(l),
            }
        }
        // Every file is in place: the partial directory must not become
        // part of the model (inside the xfs image it is at its root).
        let w = work.clone();
        blocking(move || {
            let _ = fs::remove_dir_all(&w.partial);
            Ok(())
        })
        .await?;
        if !layers.is_empty() {
            // What layers may unpack to: the model's limits less its plain
            // files, and never more than the cache has room for.
            let plain: u64 = entries
                .iter()
                .map(|e: &FileEntry| e.size)
                .fold(0, u64::saturating_add);
            let (w, x, r, limits) = (work.clone(), self.extract, root.clone(), pull.limits);
            let plain_files = entries.len() as u64;
            entries.extend(
                blocking(move || {
                    let room = cache::evict::available(&r, capacity)?;
                    let by_limit = limits.max_bytes.saturating_sub(plain);
                    let budget = Budget {
                        bytes: by_limit.min(room),
                        bytes_limit: if by_limit <= room {
                            format!(
                                "the model's limit of {} bytes, --max-model-bytes or the class's maxModelBytes",
                                limits.max_bytes
                            )
                        } else {
                            format!("the room left in {}", r.describe())
                        },
                        entries: limits.max_files.saturating_sub(plain_files),
                        entries_limit: format!(
                            "the model's limit of {} files, --max-model-files or the class's maxModelFiles",
                            limits.max_files
                        ),
                    };
                    unpack_layers(&w, x, layers, budget)
                })
                .await?,
            );
        }

        let (r, s, uri, rev) = (
            root.clone(),
            sid.to_string(),
            resolved.uri.clone(),
            resolved.revision.clone(),
        );
        let work2 = work.clone();
        let seal = blocking(move || seal_work(&r, &s, &work2, entries, &uri, &rev)).await?;
        let spilled = ctx.flow.spilled.load(Ordering::Relaxed);
        if spilled > 0 {
            info!(
                spilled_bytes = spilled,
                "bytes that ran ahead of a full reorder window were hashed from disk"
            );
        }
        Ok((seal, ctx.fetched.load(Ordering::Relaxed)))
    }
}

/// Bytes of one buffer: the budget shared by every buffer that may exist,
/// one per stream and one more per stream for the reorder windows; whole
/// blocks, so that full buffers go out with O_DIRECT.
fn flush_at(cfg: &EngineConfig) -> usize {
    let buffers = (cfg.models.max(1) * cfg.files.max(1) * cfg.connections.max(1) * 2) as u64;
    let n = (cfg.buffer_budget / buffers).clamp(256 << 10, 4 << 20) as usize;
    n / ALIGN * ALIGN
}

fn progress(uri: &str, bytes: u64, total: Option<u64>, elapsed: Duration) -> Progress {
    let rate = bytes as f64 / elapsed.as_secs_f64().max(1e-3);
    let eta = total
        .filter(|_| rate > 0.0)
        .map(|t| Duration::from_secs_f64(t.saturating_sub(bytes) as f64 / rate));
    Progress {
        uri: uri.to_string(),
        bytes,
        total,
        rate_bytes_per_sec: rate,
        eta,
    }
}

fn backoff(cfg: &EngineConfig, attempt: u32, e: &Error) -> Duration {
    if let Error::RetryAfter { after, .. } = e {
        // A server may ask for hours; a pull waits at most ten minutes a time.
        return (*after).min(Duration::from_secs(600));
    }
    let exp = cfg.backoff.saturating_mul(1u32 << attempt.min(16));
    let capped = exp.min(cfg.backoff_max);
    // Full jitter: retries from many nodes do not arrive in lockstep.
    capped.mul_f64(0.5 + fastrand::f64() * 0.5)
}

/// Opens (or resumes) the work directory of a pull and locks it.
fn open_work(root: &Root, sid: &str, need: Option<u64>) -> Result<Work> {
    let dir = root.sources_dir().join(format!(".pull-{sid}"));
    fs::create_dir_all(&dir).ctx("create", &dir)?;
    let lock_path = dir.join("lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .ctx("open", &lock_path)?;
    // Another process (a second controller replica on a shared root) may be
    // pulling the same model; it will seal it, and the CO retries us.
    let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
        |_| {
            Error::Aborted(format!(
                "model {sid} is being pulled by another process; retry later"
            ))
        },
    )?;
    let state = dir.join("state");
    let blobs = dir.join("blobs");
    fs::create_dir_all(&state).ctx("create", &state)?;
    fs::create_dir_all(&blobs).ctx("create", &blobs)?;
    let (data, mounted) = match root.backend {
        Backend::Local | Backend::Shared => {
            let data = dir.join("data");
            fs::create_dir_all(&data).ctx("create", &data)?;
            (data, None)
        }
        Backend::Xfs => {
            let image = dir.join("image.xfs");
            if !image.exists() {
                let need = need.unwrap_or(1 << 30);
                // Room for XFS metadata and layer unpacking on top of the model.
                let size = (need + need / 8 + (64 << 20)).max(cache::xfs::MIN_IMAGE_BYTES);
                cache::xfs::create_image(&image, size)?;
            }
            let mnt = dir.join("mnt");
            fs::create_dir_all(&mnt).ctx("create", &mnt)?;
            if !mount::is_mount_point(&mnt).ctx("inspect", &mnt)? {
                let lo =
                    mount::loopdev::attach(&image, false).ctx("attach loop device for", &image)?;
                mount::mount_device(lo.path(), &mnt, "xfs", false, "").ctx("mount", &image)?;
            }
            (mnt.clone(), Some(mnt))
        }
    };
    let partial = match mounted {
        Some(_) => data.join(PARTIAL_DIR),
        None => dir.join("partial"),
    };
    fs::create_dir_all(&partial).ctx("create", &partial)?;
    Ok(Work {
        dir,
        data,
        state,
        blobs,
        partial,
        mounted,
        _lock: lock,
    })
}

/// Removes a failed pull's work directory, which the caller holds locked.
fn discard_work(work: &Work) -> Result<()> {
    if let Some(mnt) = &work.mounted
        && mount::is_mount_point(mnt).ctx("inspect", mnt)?
    {
        mount::unmount(mnt).ctx("unmount", mnt)?;
    }
    remove_tree(&work.dir)
}

/// `remove_dir_all`, where a tree already gone is success.
fn remove_tree(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", dir, e)),
    }
}

fn load_state(work: &Work, path: &str) -> Result<FileState> {
    let p = state_path(work, path);
    Ok(state::read_json(&p)
        .ctx("read pull state", &p)?
        .unwrap_or_else(|| FileState {
            path: path.to_string(),
            ..FileState::default()
        }))
}

fn save_state(work: &Work, st: &FileState) -> Result<()> {
    let p = state_path(work, &st.path);
    state::write_json(&p, st).ctx("write pull state", &p)
}

/// What one remote file became.
enum Fetched {
    File(FileEntry),
    /// A verified layer blob, unpacked later in manifest order.
    Layer {
        index: usize,
        key: String,
        blob: PathBuf,
        compression: Compression,
        subdir: String,
        extracted: Option<Vec<FileEntry>>,
    },
}

/// Fetches and verifies one remote file (or layer blob).
async fn fetch_file(
    ctx: Arc<Ctx>,
    work: Arc<Work>,
    index: usize,
    file: RemoteFile,
) -> Result<Fetched> {
    // Layers are keyed by position too: a manifest may repeat a digest.
    let key = match file.unpack {
        Unpack::None => file.path.clone(),
        Unpack::Tar(_) => format!("layer-{index}-{}", file.locator),
    };
    let w = work.clone();
    let k = key.clone();
    let mut st = blocking(move || load_state(&w, &k)).await?;
    let stem = state_path(&work, &key)
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let (dest, part) = match file.unpack {
        Unpack::None => (
            work.data.join(&file.path),
            work.partial.join(format!("{stem}.part")),
        ),
        // Blobs are named by digest in a directory of their own.
        Unpack::Tar(_) => (
            work.blobs.join(format!("{stem}.blob")),
            work.blobs.join(format!("{stem}.blob.part")),
        ),
    };
    let layer = |extracted: Option<Vec<FileEntry>>, compression| Fetched::Layer {
        index,
        key: key.clone(),
        blob: dest.clone(),
        compression,
        subdir: file.path.clone(),
        extracted,
    };
    if let Unpack::Tar(c) = file.unpack
        && st.extracted.is_some()
    {
        ctx.bytes.fetch_add(st.size.unwrap_or(0), Ordering::Relaxed);
        return Ok(layer(st.extracted.clone(), c));
    }
    // A finished file is kept only at the size the listing gives now.
    let same_size = file.size.is_none_or(|s| st.size == Some(s));
    let (size, sha) = match (&st.sha256, dest.exists() && same_size) {
        (Some(sha), true) => {
            let size = st.size.unwrap_or(0);
            ctx.bytes.fetch_add(size, Ordering::Relaxed);
            (size, sha.clone())
        }
        _ => {
            st.path = key.clone();
            let (size, sha) = download(&ctx, &work, &file, &dest, &part, &mut st).await?;
            if let Some(expected) = &file.sha256
                && !expected.eq_ignore_ascii_case(&sha)
            {
                let (d, w, k) = (dest.clone(), work.clone(), key.clone());
                let _ = blocking(move || {
                    let _ = fs::remove_file(&d);
                    state::remove_file(&state_path(&w, &k)).ctx("remove pull state", &w.state)
                })
                .await;
                return Err(Error::FailedPrecondition(format!(
                    "{} failed verification: the source promised sha256 {expected}, the bytes hash to {sha}; nothing was sealed",
                    file.path_or_locator()
                )));
            }
            st.sha256 = Some(sha.clone());
            st.size = Some(size);
            let (w, s) = (work.clone(), st.clone());
            blocking(move || save_state(&w, &s)).await?;
            (size, sha)
        }
    };
    Ok(match file.unpack {
        Unpack::None => Fetched::File(FileEntry {
            path: file.path.clone(),
            size,
            sha256: sha,
        }),
        Unpack::Tar(c) => layer(None, c),
    })
}

/// Unpacks verified layers one at a time, in manifest order, so later
/// layers override and white out earlier ones as the image spec says.
fn unpack_layers(
    work: &Work,
    extract: Extract,
    mut layers: Vec<Fetched>,
    mut budget: Budget,
) -> Result<Vec<FileEntry>> {
    layers.sort_by_key(|l| match l {
        Fetched::Layer { index, .. } => *index,
        Fetched::File(_) => 0,
    });
    let mut lists = Vec::new();
    for l in layers {
        let Fetched::Layer {
            key,
            blob,
            compression,
            subdir,
            extracted,
            ..
        } = l
        else {
            continue;
        };
        // Each layer gets what the ones before it left.
        let spend = |budget: &mut Budget, files: &[FileEntry]| {
            let bytes = files.iter().map(|f| f.size).fold(0, u64::saturating_add);
            budget.bytes = budget.bytes.saturating_sub(bytes);
            budget.entries = budget.entries.saturating_sub(files.len() as u64);
        };
        if let Some(done) = extracted {
            spend(&mut budget, &done);
            lists.push(done);
            continue;
        }
        let target = if subdir.is_empty() {
            work.data.clone()
        } else {
            work.data.join(&subdir)
        };
        fs::create_dir_all(&target).ctx("create", &target)?;
        let mut files = extract_growing(work, extract, &blob, compression, &target, &budget)?;
        spend(&mut budget, &files);
        if !subdir.is_empty() {
            for f in &mut files {
                f.path = format!("{subdir}/{}", f.path);
            }
        }
        let mut st = load_state(work, &key)?;
        st.extracted = Some(files.clone());
        save_state(work, &st)?;
        let _ = fs::remove_file(&blob);
        lists.push(files);
    }
    super::unpack::merge(&work.data, lists)
}

/// Times an xfs image may grow for one layer: 2^8 times its first size.
const MAX_GROWTH: u32 = 8;

/// Unpacks one layer. On the xfs backend the image was sized from the
/// compressed bytes, so a layer can unpack to more than it holds: then the
/// image grows (doubling, as far as the disk under it allows) and the
/// layer is unpacked again from the start, which replaces every file the
/// failed attempt wrote.
fn extract_growing(
    work: &Work,
    extract: Extract,
    blob: &Path,
    compression: Compression,
    target: &Path,
    budget: &Budget,
) -> Result<Vec<FileEntry>> {
    let mut grown = 0;
    loop {
        let err = match extract(blob, compression, target, budget) {
            Err(e) if e.is_no_space() && grown < MAX_GROWTH => e,
            r => return r,
        };
        let Some(mnt) = &work.mounted else {
            return Err(err);
        };
        let image = work.dir.join("image.xfs");
        let size = fs::metadata(&image).ctx("stat", &image)?.len();
        let vfs = nix::sys::statvfs::statvfs(&work.dir)
            .map_err(|e| Error::io("statfs", &work.dir, e.into()))?;
        // Leave the disk under the image some room of its own: a loop
        // device whose backing file cannot grow fails writes with EIO.
        let free =
            (vfs.blocks_available() as u64 * vfs.fragment_size() as u64).saturating_sub(RESERVE);
        let growth = size.min(free);
        if growth < RESERVE {
            return Err(Error::ResourceExhausted(format!(
                "layer {} unpacks to more than its {size}-byte image holds, and {} has no room to grow it ({free} bytes free beyond a {RESERVE}-byte reserve): {err}",
                blob.display(),
                work.dir.display()
            )));
        }
        warn!(
            image_bytes = size,
            grow_to = size + growth,
            "a layer unpacks to more than its image holds; growing the image"
        );
        cache::xfs::grow_mounted(&image, mnt, size + growth)?;
        grown += 1;
    }
}

/// Disk kept free under a growing image.
const RESERVE: u64 = 64 << 20;

impl RemoteFile {
    fn path_or_locator(&self) -> &str {
        if self.path.is_empty() {
            &self.locator
        } else {
            &self.path
        }
    }
}

/// Downloads `file` to `dest` through `part`, returning its size and sha256.
async fn download(
    ctx: &Arc<Ctx>,
    work: &Arc<Work>,
    file: &RemoteFile,
    dest: &Path,
    part: &Path,
    st: &mut FileState,
) -> Result<(u64, String)> {
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).ctx("create", parent)?;
    }
    let ranged = ctx.source.ranges() && file.size.is_some();
    // Chunks recorded as done describe `.part`. Without it (a kill between
    // the rename into place and the state that records the sha256), they
    // describe nothing, and trusting them would seal a zero-filled file.
    if !part.exists() {
        st.done.clear();
    }
    // O_DIRECT pays for itself on large files; a small one would only
    // cost a second descriptor.
    let direct = ranged && file.size.is_some_and(|s| s >= ctx.flush_at as u64);
    let out = Arc::new(PartFile::open(part, !ranged, direct)?);
    let (size, sha) = if let (true, Some(size)) = (ranged, file.size) {
        out.reserve(size, part)?;
        ranged_download(ctx, work, file, &out, part, size, st).await?
    } else {
        st.done.clear();
        whole_download(ctx, file, &out, part).await?
    };
    let (p, d) = (part.to_path_buf(), dest.to_path_buf());
    blocking(move || {
        fs::rename(&p, &d).ctx("rename into place", &d)?;
        Ok(())
    })
    .await?;
    Ok((size, sha))
}

fn chunks(size: u64, chunk: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < size {
        let end = start.saturating_add(chunk.max(1)).min(size);
        out.push((start, end));
        start = end;
    }
    out
}

/// How far a range gets between records of its progress: finer than a
/// chunk, coarse enough that recording (one fdatasync and one small state
/// write, batched across connections) stays out of the way.
const PARTIAL_EVERY: u64 = 8 << 20;

/// What a connection tells the committer.
enum Finished {
    /// Chunk `i` is written whole.
    Chunk(u64),
    /// Chunk `i`'s first `n` bytes are written.
    Prefix(u64, u64),
}

/// Parallel ranges written with positioned writes and hashed by a
/// [`Frontier`]. A finished range is handed to a committer, which makes
/// every range finished so far durable with one fdatasync and only then
/// records them in `state/`; connections never wait for the disk.
async fn ranged_download(
    ctx: &Arc<Ctx>,
    work: &Arc<Work>,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    size: u64,
    st: &mut FileState,
) -> Result<(u64, String)> {
    let chunk = ctx.cfg.chunk_bytes.max(1);
    // Chunk indexes mean nothing under another chunk size, nor for a file
    // the server now lists at another size.
    if st.chunk_bytes != Some(chunk) || st.size_listed != Some(size) {
        st.done.clear();
        st.partial.clear();
        st.chunk_bytes = Some(chunk);
        st.size_listed = Some(size);
    }
    let all = chunks(size, chunk);
    let n = all.len() as u64;
    st.done.retain(|i| *i < n);
    let done = st.done.clone();
    st.partial.retain(|i, b| {
        *i < n && !done.contains(i) && *b > 0 && *b < all[*i as usize].1 - all[*i as usize].0
    });
    let frontier = ctx.frontier(Some(size));
    for i in &st.done {
        let (start, end) = all[*i as usize];
        frontier.mark_written(start, end);
        ctx.bytes.fetch_add(end - start, Ordering::Relaxed);
    }
    for (i, b) in &st.partial {
        let start = all[*i as usize].0;
        frontier.mark_written(start, start + b);
        ctx.bytes.fetch_add(*b, Ordering::Relaxed);
    }
    let hasher = {
        let (f, out, part) = (frontier.clone(), out.clone(), part.to_path_buf());
        tokio::task::spawn_blocking(move || f.read_back(&out, &part, size))
    };
    // This future is dropped mid-way when another file of the pull fails;
    // the hasher thread must then stop waiting for writers that are gone.
    let _close = CloseOnDrop(frontier.clone());
    let (finished_tx, finished_rx) = tokio::sync::mpsc::unbounded_channel::<Finished>();
    let committer = tokio::spawn(commit_ranges(
        ctx.clone(),
        work.clone(),
        out.clone(),
        part.to_path_buf(),
        st.clone(),
        all.len() > 1,
        finished_rx,
    ));
    let missing: Vec<u64> = (0..all.len() as u64)
        .filter(|i| !st.done.contains(i))
        .collect();
    let fetched: Result<()> = futures::stream::iter(missing)
        .map(|i| {
            let (ctx, out, frontier, tx) = (
                ctx.clone(),
                out.clone(),
                frontier.clone(),
                finished_tx.clone(),
            );
            let file = file.clone();
            let (start, end) = all[i as usize];
            let resume_at = start + st.partial.get(&i).copied().unwrap_or(0);
            let part = part.to_path_buf();
            async move {
                let reported = AtomicU64::new(resume_at);
                let report = |pos: u64| {
                    if pos.saturating_sub(reported.load(Ordering::Relaxed)) >= PARTIAL_EVERY {
                        reported.store(pos, Ordering::Relaxed);
                        let _ = tx.send(Finished::Prefix(i, pos - start));
                    }
                };
                fetch_range(&ctx, &file, &out, &part, resume_at, end, &frontier, &report).await?;
                let _ = tx.send(Finished::Chunk(i));
                Ok(())
            }
        })
        .buffer_unordered(ctx.cfg.connections.max(1))
        .try_collect()
        .await;
    drop(finished_tx);
    frontier.close();
    // What was fetched is made durable and recorded even when another
    // range failed: a retry resumes from it.
    let committed = committer
        .await
        .map_err(|e| Error::Internal(format!("committer failed: {e}")))?;
    if let Ok(s) = &committed {
        *st = s.clone();
    }
    fetched?;
    committed?;
    let sha = hasher
        .await
        .map_err(|e| Error::Internal(format!("hasher failed: {e}")))??;
    Ok((size, sha))
}

/// Makes finished ranges durable in batches: waits for one, takes every
/// other already finished, fdatasyncs once, then records them all. So
/// `state/` only ever names ranges whose bytes are on disk. A file of one
/// range is not recorded per range: its sha256 record follows at once.
async fn commit_ranges(
    ctx: Arc<Ctx>,
    work: Arc<Work>,
    out: Arc<PartFile>,
    part: PathBuf,
    mut st: FileState,
    record: bool,
    mut finished: tokio::sync::mpsc::UnboundedReceiver<Finished>,
) -> Result<FileState> {
    while let Some(first) = finished.recv().await {
        let mut batch = vec![first];
        while let Ok(f) = finished.try_recv() {
            batch.push(f);
        }
        let (o, p) = (out.clone(), part.clone());
        blocking(move || o.sync_data().ctx("sync", &p)).await?;
        for f in batch {
            match f {
                Finished::Chunk(i) => {
                    st.partial.remove(&i);
                    st.done.insert(i);
                }
                Finished::Prefix(i, n) if !st.done.contains(&i) => {
                    let b = st.partial.entry(i).or_default();
                    *b = (*b).max(n);
                }
                Finished::Prefix(..) => {}
            }
        }
        if !record {
            continue;
        }
        let snapshot = {
            let _g = ctx.state_lock.lock().unwrap_or_else(|p| p.into_inner());
            st.clone()
        };
        let w = work.clone();
        blocking(move || save_state(&w, &snapshot)).await?;
    }
    Ok(st)
}

/// Fetches `[start, end)` into `out`, resuming after the last byte written
/// when a stream fails or stalls; `report` hears each written position.
#[allow(clippy::too_many_arguments)]
async fn fetch_range(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    start: u64,
    end: u64,
    frontier: &Arc<Frontier>,
    report: &(dyn Fn(u64) + Send + Sync),
) -> Result<()> {
    let mut pos = start;
    let mut attempt = 0u32;
    loop {
        let r = stream_into(
            ctx,
            file,
            out,
            part,
            &mut pos,
            Some(end),
            true,
            frontier,
            report,
        )
        .await;
        match r {
            Ok(()) if pos == end => return Ok(()),
            Ok(()) => {
                let e = Error::Unavailable(format!(
                    "{} ended at byte {pos}, expected {end}",
                    file.path_or_locator()
                ));
                if attempt + 1 >= ctx.cfg.attempts {
                    return Err(e);
                }
                tokio::time::sleep(backoff(&ctx.cfg, attempt, &e)).await;
            }
            Err(e) if is_retryable(&e) && attempt + 1 < ctx.cfg.attempts => {
                warn!(file = file.path_or_locator(), error = %e, attempt, "range failed; resuming");
                tokio::time::sleep(backoff(&ctx.cfg, attempt, &e)).await;
            }
            Err(e) => return Err(e),
        }
        attempt += 1;
    }
}

/// A source that cannot serve ranges: fetched whole, hashed inline, and
/// restarted from 0 after a failure.
async fn whole_download(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
) -> Result<(u64, String)> {
    let mut attempt = 0u32;
    loop {
        out.set_len(0).ctx("truncate", part)?;
        let mut pos = 0;
        // One stream from byte 0 always leads: every byte is hashed inline.
        let frontier = ctx.frontier(file.size);
        // A listed size bounds the stream: a longer body is refused as it
        // arrives, not after it filled the disk.
        let (size, report) = (file.size, &|_| {});
        match stream_into(
            ctx, file, out, part, &mut pos, size, false, &frontier, report,
        )
        .await
        {
            Ok(()) if file.size.is_none_or(|s| s == pos) => {
                let (o, p) = (out.clone(), part.to_path_buf());
                let sha = blocking(move || {
                    o.sync_data().ctx("sync", &p)?;
                    frontier.close();
                    frontier.read_back(&o, &p, pos)
                })
                .await?;
                return Ok((pos, sha));
            }
            Ok(()) => {
                let e = Error::Unavailable(format!(
                    "{} was cut short at byte {pos}",
                    file.path_or_locator()
                ));
                if attempt + 1 >= ctx.cfg.attempts {
                    return Err(e);
                }
                tokio::time::sleep(backoff(&ctx.cfg, attempt, &e)).await;
            }
            Err(e) if is_retryable(&e) && attempt + 1 < ctx.cfg.attempts => {
                tokio::time::sleep(backoff(&ctx.cfg, attempt, &e)).await;
            }
            Err(e) => return Err(e),
        }
        ctx.bytes.fetch_sub(pos, Ordering::Relaxed);
        attempt += 1;
    }
}

/// Streams one request into `out` at `*pos`, advancing it as bytes are
/// written (telling `report` each new position), refusing bytes past
/// `end`; with `ranged`, asks for `[*pos, end)` only. Returns Ok when the stream ends (the caller checks length), and
/// Unavailable when it stalls: fewer than `stall_min_bytes_per_sec x stall`
/// bytes in a stall window, so a trickle counts as a stall too.
#[allow(clippy::too_many_arguments)]
async fn stream_into(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    pos: &mut u64,
    end: Option<u64>,
    ranged: bool,
    frontier: &Arc<Frontier>,
    report: &(dyn Fn(u64) + Send + Sync),
) -> Result<()> {
    let len = end.filter(|_| ranged).map(|e| e.saturating_sub(*pos));
    let start = *pos;
    let mut stream =
        match tokio::time::timeout(ctx.cfg.stall, ctx.source.read(file, *pos, len)).await {
            Ok(s) => s?,
            Err(_) => {
                return Err(Error::Unavailable(format!(
                    "no answer for {} within {:?}",
                    file.path_or_locator(),
                    ctx.cfg.stall
                )));
            }
        };
    let _moving = ctx.flow.enter();
    let mut win = frontier.take_window();
    let min_bytes = u64::try_from(
        u128::from(ctx.cfg.stall_min_bytes_per_sec) * ctx.cfg.stall.as_millis() / 1000,
    )
    .unwrap_or(u64::MAX)
    .max(1);
    let mut window_end = tokio::time::Instant::now() + ctx.cfg.stall;
    let mut in_window = 0u64;
    loop {
        let next = tokio::time::timeout_at(window_end, stream.next()).await;
        let item = match next {
            Err(_) if in_window >= min_bytes => {
                // Moving fast enough: judge the next window afresh.
                window_end = tokio::time::Instant::now() + ctx.cfg.stall;
                in_window = 0;
                continue;
            }
            Err(_) => {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                return Err(Error::Unavailable(format!(
                    "{} stalled: {in_window} bytes in {:?}, less than the {min_bytes} \
                     (--pull-stall-min-bytes-per-second x --pull-stall-seconds) a live stream sends",
                    file.path_or_locator(),
                    ctx.cfg.stall
                )));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                return Err(e);
            }
            Ok(Some(Ok(b))) => b,
        };
        in_window = in_window.saturating_add(item.len() as u64);
        let after = pos
            .saturating_add(win.len() as u64)
            .saturating_add(item.len() as u64);
        if let Some(end) = end
            && after > end
        {
            return Err(Error::SourceFault(format!(
                "{} sent more bytes than asked for: bytes {start}-{} were asked, {after} reached",
                file.path_or_locator(),
                end.saturating_sub(1)
            )));
        }
        if end.is_none() && ctx.bytes.load(Ordering::Relaxed) > ctx.max_bytes {
            return Err(Error::ResourceExhausted(format!(
                "{} is larger than the model may be ({} bytes: --max-model-bytes or the \
                 class's maxModelBytes); its size was not listed",
                file.path_or_locator(),
                ctx.max_bytes
            )));
        }
        let mut rest: &[u8] = &item;
        while !rest.is_empty() {
            rest = win.fill(rest);
            if win.is_full() {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                report(*pos);
            }
        }
    }
    flush(out, part, pos, &mut win, frontier, ctx).await?;
    frontier.give_window(win);
    Ok(())
}

/// Writes the window at `*pos` and hands it to the frontier, which hashes
/// it or holds it; `win` comes back empty (the same buffer or another).
async fn flush(
    out: &Arc<PartFile>,
    part: &Path,
    pos: &mut u64,
    win: &mut Window,
    frontier: &Arc<Frontier>,
    ctx: &Ctx,
) -> Result<()> {
    if win.is_empty() {
        return Ok(());
    }
    let w = std::mem::replace(win, Window::empty());
    let n = w.len() as u64;
    let (o, p, f, at) = (out.clone(), part.to_path_buf(), frontier.clone(), *pos);
    *win = blocking(move || {
        o.write_window(&w, at, &p)?;
        Ok(f.hand_over(at, w))
    })
    .await?;
    *pos += n;
    ctx.bytes.fetch_add(n, Ordering::Relaxed);
    ctx.fetched.fetch_add(n, Ordering::Relaxed);
    Ok(())
}

/// The sha256 of one file whose ranges arrive in any order, hashed from
/// memory in one in-order pass.
///
/// A window written exactly at the hashed frontier is hashed by its writer.
/// A window written beyond it is held, in memory, until the frontier
/// reaches it; `read_back` hashes held windows then. At most `spares`
/// windows are held per file: a writer further ahead waits until the
/// frontier catches up or a held window is hashed, if the [`Flow`] lets it;
/// else its bytes are *spilled*, left on disk to be read back. Waiting
/// cannot deadlock: the range at the frontier is always being fetched, and
/// its writer never waits. Ranges already on disk (spilled, or resumed
/// from an earlier run) are read back from the file.
struct Frontier {
    state: Mutex<FrontierState>,
    wake: std::sync::Condvar,
    /// Bytes of one window.
    window: usize,
    /// Windows this file may hold ahead of the frontier.
    spares: usize,
    flow: Arc<Flow>,
}

struct FrontierState {
    /// None while a writer or the read-back is hashing outside the lock.
    sha: Option<Sha256>,
    /// Bytes `[0, hashed)` are in `sha`.
    hashed: u64,
    /// Ahead of the frontier, in memory: offset -> window.
    held: BTreeMap<u64, Window>,
    /// Ahead of the frontier, on disk (spilled or resumed): start -> end,
    /// merged.
    written: BTreeMap<u64, u64>,
    /// Emptied windows, for reuse.
    free: Vec<Window>,
    /// No more bytes will be written.
    closed: bool,
}

impl Frontier {
    fn new(window: usize, spares: usize, flow: Arc<Flow>) -> Frontier {
        Frontier {
            state: Mutex::new(FrontierState {
                sha: Some(Sha256::new()),
                hashed: 0,
                held: BTreeMap::new(),
                written: BTreeMap::new(),
                free: Vec::new(),
                closed: false,
            }),
            wake: std::sync::Condvar::new(),
            window,
            spares,
            flow,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FrontierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(
        &self,
        s: std::sync::MutexGuard<'a, FrontierState>,
    ) -> std::sync::MutexGuard<'a, FrontierState> {
        self.wake.wait(s).unwrap_or_else(|p| p.into_inner())
    }

    /// An empty window for a stream.
    fn take_window(&self) -> Window {
        self.lock()
            .free
            .pop()
            .unwrap_or_else(|| Window::new(self.window))
    }

    fn give_window(&self, mut w: Window) {
        w.clear();
        self.lock().free.push(w);
    }

    /// Records bytes already in the file (a resumed range): read back later.
    fn mark_written(&self, start: u64, end: u64) {
        insert_range(&mut self.lock().written, start, end);
        self.wake.notify_all();
    }

    /// Takes the window just written at `at`: hashes it if it is at the
    /// frontier, else holds it; if the reorder window is full, waits for
    /// room while the flow allows, else spills it. Returns an empty window
    /// for the writer to go on with.
    fn hand_over(&self, at: u64, mut w: Window) -> Window {
        let n = w.len() as u64;
        let mut s = self.lock();
        loop {
            // Abandoned: the bytes are on disk but will not be recorded.
            if s.closed {
                w.clear();
                return w;
            }
            if s.hashed == at
                && let Some(mut h) = s.sha.take()
            {
                // Hash outside the lock: other ranges keep writing meanwhile.
                drop(s);
                h.update(w.data());
                s = self.lock();
                s.sha = Some(h);
                s.hashed = at + n;
                drop(s);
                self.wake.notify_all();
                w.clear();
                return w;
            }
            if s.held.len() < self.spares {
                let spare = s.free.pop().unwrap_or_else(|| Window::new(self.window));
                s.held.insert(at, w);
                drop(s);
                self.wake.notify_all();
                return spare;
            }
            if !self.flow.may_pause() {
                insert_range(&mut s.written, at, at + n);
                drop(s);
                self.flow.spilled.fetch_add(n, Ordering::Relaxed);
                self.wake.notify_all();
                w.clear();
                return w;
            }
            // Paused, this stream no longer counts as moving; it looks
            // again now and then, since others may stop or end meanwhile.
            self.flow.moving.fetch_sub(1, Ordering::SeqCst);
            s = self
                .wake
                .wait_timeout(s, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.flow.moving.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// No more writes: `read_back` finishes what is left, then returns.
    fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }

    /// Hashes held windows, and resumed ranges from `out`, as the frontier
    /// reaches them, until closed; then the sha256 of `[0, size)`.
    fn read_back(&self, out: &File, part: &Path, size: u64) -> Result<String> {
        let mut buf = Vec::new();
        let mut s = self.lock();
        loop {
            let at = s.hashed;
            if s.sha.is_some()
                && let Some(mut w) = s.held.remove(&at)
            {
                let mut h = s.sha.take().expect("checked above");
                drop(s);
                h.update(w.data());
                let end = at + w.len() as u64;
                w.clear();
                s = self.lock();
                s.sha = Some(h);
                s.hashed = end;
                s.free.push(w);
                self.wake.notify_all();
                continue;
            }
            let resumed = match (s.sha.is_some(), s.written.get(&at).copied()) {
                (true, Some(end)) => Some(end),
                _ => None,
            };
            if let Some(end) = resumed {
                s.written.remove(&at);
                let mut h = s.sha.take().expect("checked above");
                drop(s);
                buf.resize(1 << 20, 0);
                let mut pos = at;
                let mut read = Ok(());
                while pos < end {
                    let n = ((end - pos) as usize).min(buf.len());
                    if let Err(e) = out.read_exact_at(&mut buf[..n], pos) {
                        read = Err(e).ctx("read back", part);
                        break;
                    }
                    h.update(&buf[..n]);
                    pos += n as u64;
                }
                s = self.lock();
                s.sha = Some(h);
                s.hashed = pos;
                self.wake.notify_all();
                read?;
                continue;
            }
            // Closed with nothing at the frontier: done, or a gap that no
            // writer will fill (the download failed).
            if s.closed && s.sha.is_some() {
                break;
            }
            s = self.wait(s);
        }
        match s.sha.take() {
            Some(h) if s.hashed == size && s.written.is_empty() && s.held.is_empty() => {
                Ok(hex::encode(h.finalize()))
            }
            _ => Err(Error::Internal(format!(
                "download of {} ended with {} of {size} bytes hashed",
                part.display(),
                s.hashed
            ))),
        }
    }
}

/// Closes a [`Frontier`] however its download ends, cancellation included.
struct CloseOnDrop(Arc<Frontier>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Adds `[start, end)` to disjoint merged ranges.
fn insert_range(ranges: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) {
    if start == end {
        return;
    }
    if let Some((&s, &e)) = ranges.range(..=start).next_back()
        && e == start
    {
        ranges.remove(&s);
        start = s;
    }
    if let Some(e) = ranges.remove(&end) {
        end = e;
    }
    ranges.insert(start, end);
}

/// Verifies sizes, writes the seal, and renames the work directory into
/// place. Bookkeeping is removed only after the rename, so a crash in
/// between never forces a re-download.
fn seal_work(
    root: &Root,
    sid: &str,
    work: &Work,
    entries: Vec<FileEntry>,
    uri: &str,
    revision: &str,
) -> Result<Seal> {
    let mut files: BTreeMap<String, FileEntry> = BTreeMap::new();
    for e in entries {
        files.insert(e.path.clone(), e);
    }
    // Layers may have overwritten or whited-out files of earlier layers:
    // keep what is really there.
    files.retain(|p, _| {
        work.data
            .join(p)
            .symlink_metadata()
            .map(|m| m.is_file())
            .unwrap_or(false)
    });
    let mut tree = Tree::default();
    walk_dirs(&work.data, Path::new(""), &mut tree)?;
    for f in files.values() {
        let len = fs::metadata(work.data.join(&f.path))
            .ctx("stat", &work.data.join(&f.path))?
            .len();
        if len != f.size {
            return Err(Error::Internal(format!(
                "{} has {len} bytes after the pull, expected {}",
                f.path, f.size
            )));
        }
    }
    tree.files = files.into_values().collect();
    if let Some(mnt) = &work.mounted {
        mount::unmount(mnt).ctx("unmount", mnt)?;
        let _ = fs::remove_dir(mnt);
        cache::xfs::make_readonly(&work.dir.join("image.xfs"))?;
    }
    let seal = Seal {
        format: manifest::FORMAT,
        source: sid.to_string(),
        origin: uri.to_string(),
        revision: Some(revision.to_string()),
        sealed_unix: cache::now_unix(),
        total_bytes: tree.total_bytes(),
        files: tree.files,
        dirs: tree.dirs,
        symlinks: tree.symlinks,
    };
    state::write_json(&work.dir.join("seal.json"), &seal).ctx("write seal", &work.dir)?;
    let final_dir = root.source(sid).dir;
    match fs::rename(&work.dir, &final_dir) {
        Ok(()) => {}
        Err(_) if cache::read_seal(root, sid)?.is_some() => {
            let _ = fs::remove_dir_all(&work.dir);
            return cache::read_seal(root, sid)?
                .ok_or_else(|| Error::Internal("seal vanished".into()));
        }
        Err(e) => return Err(Error::io("rename into place", &final_dir, e)),
    }
    state::sync_dir(&root.sources_dir()).ctx("sync", &root.sources_dir())?;
    for leftover in ["state", "blobs", "partial", "lock"] {
        let p = final_dir.join(leftover);
        let _ = fs::remove_dir_all(&p).or_else(|_| fs::remove_file(&p));
    }
    Ok(seal)
}

/// Directories and symlinks of the unpacked tree; files come from the
/// hashes computed while downloading.
fn walk_dirs(base: &Path, rel: &Path, tree: &mut Tree) -> Result<()> {
    let dir = base.join(rel);
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .ctx("read directory", &dir)?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let child = rel.join(&name);
        let s = child.to_string_lossy().into_owned();
        let m = fs::symlink_metadata(e.path()).ctx("stat", &e.path())?;
        if m.is_dir() {
            tree.dirs.push(s);
            walk_dirs(base, &child, tree)?;
        } else if m.file_type().is_symlink() {
            let target = fs::read_link(e.path()).ctx("read link", &e.path())?;
            tree.symlinks.push(LinkEntry {
                path: s,
                target: target.to_string_lossy().into_owned(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_covers_the_file_exactly() {
        assert_eq!(chunks(10, 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(chunks(8, 4), vec![(0, 4), (4, 8)]);
        assert!(chunks(0, 4).is_empty());
    }

    #[test]
    fn written_ranges_merge() {
        let mut r = BTreeMap::new();
        insert_range(&mut r, 8, 12);
        insert_range(&mut r, 0, 4);
        insert_range(&mut r, 4, 8);
        insert_range(&mut r, 20, 20);
        insert_range(&mut r, 16, 20);
        assert_eq!(r, BTreeMap::from([(0, 12), (16, 20)]));
    }

    fn window(bytes: &[u8]) -> Window {
        let mut w = Window::new(bytes.len());
        assert!(w.fill(bytes).is_empty());
        w
    }

    /// Four writers, each taking every fourth piece in order as the
    /// connections of one file do, plus a range resumed from disk: the
    /// frontier hashes every byte once, in order, holding no more than its
    /// reorder window, and never deadlocks, whether writers ahead of a full
    /// window wait (floor 0) or spill to disk (floor 8).
    #[test]
    fn the_frontier_hashes_every_byte_once_in_order() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f.part");
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let want = hex::encode(Sha256::digest(&data));
        let out = Arc::new(
            OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&path)
                .unwrap(),
        );
        out.set_len(data.len() as u64).unwrap();
        out.write_all_at(&data[30_000..32_000], 30_000).unwrap();
        let data = Arc::new(data);
        for (spares, floor) in [(1, 0), (2, 0), (5, 0), (1, 8), (2, 8)] {
            let flow = Arc::new(Flow::new(floor));
            let f = Arc::new(Frontier::new(1000, spares, flow.clone()));
            f.mark_written(30_000, 32_000);
            let reader = {
                let (f, o, p) = (f.clone(), out.clone(), path.clone());
                std::thread::spawn(move || f.read_back(&o, &p, 40_000))
            };
            let writers: Vec<_> = (0..4u64)
                .map(|k| {
                    let (f, data, out, flow) = (f.clone(), data.clone(), out.clone(), flow.clone());
                    std::thread::spawn(move || {
                        let _moving = flow.enter();
                        let mut held_max = 0;
                        for i in (k..40).step_by(4).filter(|i| !(30..32).contains(i)) {
                            let (a, b) = (i as usize * 1000, (i as usize + 1) * 1000);
                            out.write_all_at(&data[a..b], a as u64).unwrap();
                            let back = f.hand_over(a as u64, window(&data[a..b]));
                            assert!(back.is_empty());
                            held_max = held_max.max(f.lock().held.len());
                        }
                        held_max
                    })
                })
                .collect();
            for w in writers {
                assert!(w.join().unwrap() <= spares);
            }
            f.close();
            assert_eq!(
                reader.join().unwrap().unwrap(),
                want,
                "spares {spares}, floor {floor}"
            );
            let spilled = flow.spilled.load(Ordering::Relaxed);
            if floor == 0 {
                assert_eq!(spilled, 0, "writers may wait: nothing is spilled");
            } else {
                assert!(spilled > 0, "writers may not wait: something is spilled");
            }
        }
    }

    #[test]
    fn a_frontier_with_a_gap_fails_instead_of_hashing_a_hole() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f.part");
        let out = File::create(&path).unwrap();
        let f = Frontier::new(4, 1, Arc::new(Flow::new(0)));
        f.hand_over(0, window(b"abcd"));
        f.hand_over(8, window(b"ijkl"));
        f.close();
        assert!(f.read_back(&out, &path, 12).is_err());
    }

    /// A writer ahead of a full reorder window is released by closing,
    /// as when another file of the pull fails.
    #[test]
    fn closing_releases_a_waiting_writer() {
        let flow = Arc::new(Flow::new(0));
        let f = Arc::new(Frontier::new(4, 1, flow.clone()));
        f.hand_over(8, window(b"ijkl"));
        let waiting = {
            let f = f.clone();
            std::thread::spawn(move || {
                let _moving = flow.enter();
                f.hand_over(12, window(b"mnop"))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiting.is_finished());
        f.close();
        assert!(waiting.join().unwrap().is_empty());
    }

    #[test]
    fn write_buffers_share_one_budget() {
        let cfg = EngineConfig::default();
        assert_eq!(flush_at(&cfg), 2 << 20);
        let many = EngineConfig {
            connections: 16,
            ..EngineConfig::default()
        };
        assert_eq!(flush_at(&many), 512 << 10);
        let huge = EngineConfig {
            connections: 1000,
            ..EngineConfig::default()
        };
        assert_eq!(flush_at(&huge), 256 << 10);
    }

    #[test]
    fn model_paths_stay_inside() {
        for bad in ["/etc/passwd", "../x", "a/../../x", "a/./b", ""] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        check_path("1_Pooling/config.json").unwrap();
    }

    #[test]
    fn names_are_refused_as_sent_never_altered() {
        let long = "n".repeat(256);
        for bad in [
            "a\u{7}b",
            "tab\there",
            "new\nline",
            "del\u{7f}",
            "c1\u{85}",
            long.as_str(),
            ".modelcache-partial/x",
        ] {
            let e = check_path(bad).unwrap_err();
            assert!(matches!(e, Error::SourceFault(_)), "{bad:?}: {e:?}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        check_path("ünïcode/名前.bin").unwrap();
        check_path("x/.modelcache-partial").unwrap();
    }

    fn listing(files: &[(&str, Option<u64>)]) -> Resolved {
        Resolved {
            uri: "test://m".into(),
            revision: "r".into(),
            files: files
                .iter()
                .map(|(p, size)| RemoteFile {
                    path: p.to_string(),
                    size: *size,
                    sha256: None,
                    locator: p.to_string(),
                    unpack: Unpack::None,
                })
                .collect(),
        }
    }

    #[test]
    fn a_listing_is_judged_before_anything_is_fetched() {
        let limits = PullLimits::default();
        let fault = |files: &[(&str, Option<u64>)]| {
            let e = check_listing(&listing(files), &limits).unwrap_err();
            assert!(matches!(e, Error::SourceFault(_)), "{e:?}");
            e.to_string()
        };
        let e = fault(&[("a", Some(u64::MAX)), ("b", Some(1))]);
        assert!(e.contains("more than 2^64"), "{e}");
        let e = fault(&[("a", Some(1)), ("a", Some(1))]);
        assert!(e.contains("\"a\" twice"), "{e}");
        let e = fault(&[("a", Some(1)), ("a/b", Some(1))]);
        assert!(e.contains("both as a file and as a directory"), "{e}");
        let e = fault(&[("d/a", Some(1)), ("d/a/b/c", Some(1))]);
        assert!(e.contains("\"d/a\""), "{e}");
        assert_eq!(
            check_listing(
                &listing(&[("a", Some(1)), ("a.part", Some(2)), ("ab/c", None)]),
                &limits
            )
            .unwrap(),
            None
        );
        assert_eq!(
            check_listing(&listing(&[("a", Some(1)), ("b", Some(2))]), &limits).unwrap(),
            Some(3)
        );
        let tight = PullLimits {
            max_bytes: 2,
            max_files: 1,
        };
        let e = check_listing(&listing(&[("a", Some(1)), ("b", None)]), &tight).unwrap_err();
        assert!(
            matches!(&e, Error::ResourceExhausted(m) if m.contains("maxModelFiles")),
            "{e:?}"
        );
        let e = check_listing(
            &listing(&[("a", Some(3)), ("b", None)]),
            &PullLimits {
                max_files: 9,
                ..tight
            },
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::ResourceExhausted(m) if m.contains("maxModelBytes")),
            "{e:?}"
        );
    }

    #[test]
    fn backoff_honours_retry_after_and_grows() {
        let cfg = EngineConfig::default();
        let e = Error::RetryAfter {
            message: "busy".into(),
            after: Duration::from_secs(3),
        };
        assert_eq!(backoff(&cfg, 0, &e), Duration::from_secs(3));
        let u = Error::Unavailable("x".into());
        assert!(backoff(&cfg, 0, &u) <= cfg.backoff);
        assert!(backoff(&cfg, 20, &u) <= cfg.backoff_max);
    }
}
