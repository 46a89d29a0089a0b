//! The download engine: one resolved model into one sealed source.
//!
//! - **Content-addressed.** The source id is a digest of the normalized URI
//!   and its immutable revision, so every volume of one model revision
//!   shares one copy, and a moved tag becomes a new model, not a changed one.
//! - **Crash-safe.** Bytes go into the cache's pull area
//!   (`cache::pull::PullArea`: beside the final place, under an flock,
//!   committed by one rename, so a half-written model is never visible).
//!   Progress is recorded per file after the bytes it describes are
//!   fsynced; a retry after `kill -9` resumes from there.
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
//!
//! Here: the engine, what a pull is asked and resolved to, and one pull's
//! shared context; `pull_for` resolves, checks the listing and hands on.
//! Its parts, in the order a pull meets them: `outage` (what the request
//! means while the origin is down), `listing` (a listing judged before
//! any fetch), `gate` (the class's signature policy: on the listing, on a
//! hit, before the seal), `join` (one pull per model, and who proves
//! access), `access` (which requesters proved it), `deadline` (slots,
//! deadlines, retry and backoff), `area` (room, the files, layers, the
//! seal), `dispatch` (which file next, with how many streams), `fetch`
//! (one file, as ranges or a stream), `resume` (per-file progress),
//! `frontier` (in-order hashing of ranges that arrive out of order),
//! `layers` (unpacking in manifest order, growing an area a layer
//! overflows), `report` (the sink, the log and the metrics). What is on
//! disk, and how it becomes a seal, is the cache's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use super::slots::{Slot, Slots};
use tracing::{Instrument, info, info_span, warn};

use super::direct::{ALIGN, PartFile, Window};
use super::source::{Compression, Fill, Pinned, PullLimits, RemoteFile, Resolved, Source, Unpack};
use super::unpack::Budget;
use crate::cache::manifest::{FileEntry, FileHasher};
use crate::cache::partial::Partial;
use crate::cache::pull::PullArea;
use crate::cache::{self, Root, Seal, SourceId};
pub use crate::config::EngineConfig;
use crate::error::{Error, IoContext, Result};
use crate::lock::KeyedMutex;
use crate::offload::blocking;
pub use crate::progress::{NoProgress, Progress, ProgressSink};
use crate::signing::Policy;
use crate::state;

mod access;
mod area;
mod deadline;
mod dispatch;
mod fetch;
mod frontier;
mod gate;
mod join;
mod layers;
mod listing;
mod outage;
mod report;
mod resume;

use access::Access;
use deadline::*;
use fetch::*;
use frontier::*;
use gate::*;
use listing::*;
use report::*;
use resume::*;

/// Unpacks a verified layer blob into a directory within a budget,
/// returning its files.
pub type Extract = fn(&Path, Compression, &Path, &Budget) -> Result<Vec<FileEntry>>;

pub struct Pulled {
    pub sid: SourceId,
    pub seal: Seal,
    /// True when the model was already sealed and nothing was fetched.
    pub hit: bool,
    /// Who signed it, as the asking class's policy verified; without a
    /// policy, what the seal recorded.
    pub signed: Option<String>,
}

pub struct Engine {
    cfg: EngineConfig,
    extract: Extract,
    inflight: KeyedMutex,
    slots: Slots,
    /// Transfers that run at once, with a slot or without (a slow pull
    /// gives its slot back and goes on): in all and per namespace, so
    /// slow origins cannot make a node run transfers without bound.
    transfers: crate::lock::Shares<String>,
    /// Which requesters proved their access to which models lately.
    access: Access,
    /// The revision the origin gave each asker (a volume's CreateVolume,
    /// with the requester) the last time it resolved: a retry of that
    /// request while the origin is down is pinned to it.
    resolved_for: Mutex<HashMap<String, (Pinned, Instant)>>,
    /// Where bytes may come from besides the origin (peer fill).
    fill: Option<Arc<dyn Fill>>,
    /// Where its pulls, hits and evictions are counted.
    metrics: Arc<crate::metrics::Metrics>,
    /// What keyless signatures are checked against.
    sigstore: Arc<crate::signing::SigstoreRoot>,
}

/// Transfers a node runs at once per pull slot (`--pull-parallel-models`),
/// slow ones included; one namespace may run half of them.
const TRANSFERS_PER_SLOT: usize = 4;

/// The source id of a model revision.
pub fn model_id(uri: &str, revision: &str) -> SourceId {
    let mut h = Sha256::new();
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(revision.as_bytes());
    SourceId::model(&h.finalize())
}

/// The seal of `sid`, read on the blocking pool: on a shared root a miss
/// is confirmed by listing directories, and a seal another node just made
/// is waited for (`cache::read_seal`).
async fn sealed(root: &Root, sid: &SourceId) -> Result<Option<Seal>> {
    let (r, s) = (root.clone(), sid.clone());
    blocking(move || cache::read_seal(&r, &s)).await
}

/// The source id of `uri` at `revision` as `source` serves it (its key
/// scope is part of the id).
fn source_id(source: &dyn Source, uri: &str, revision: &str) -> SourceId {
    let scope = source.key_scope();
    if scope.is_empty() {
        model_id(uri, revision)
    } else {
        model_id(&format!("{uri}\0{scope}"), revision)
    }
}

/// What one pull is about, once its listing passed [`check_listing`].
struct Pull<'a> {
    sid: &'a SourceId,
    resolved: &'a Resolved,
    /// The model's size, when every file's size is listed.
    total: Option<u64>,
    /// What it takes in the cache (`listing::need_of`).
    charged: Option<u64>,
    inodes: u64,
    limits: PullLimits,
    /// The asking class's signature policy, checked before the seal.
    signature: Option<&'a Arc<Policy>>,
    /// Fetch in the listing's order (`EngineConfig::listing_order`).
    listing_order: bool,
    /// Pods read the files as they are verified (`Ask::readers`).
    readers: bool,
    /// Who pulls (`Source::requester`): once every byte is verified it
    /// has read them with its own credentials, or proved its access
    /// before peers served them.
    requester: Option<String>,
}

/// What a pull resolved to, and when it began.
struct Listed<'a> {
    resolved: &'a Resolved,
    sid: &'a SourceId,
    /// The listing came from peers: the origin is down.
    outage: bool,
    /// The model's size, when every file's size is listed.
    total: Option<u64>,
    limits: PullLimits,
    started: Instant,
}

/// Who asks for a pull, and how.
#[derive(Clone, Copy, Default)]
pub struct Ask<'a> {
    /// The asking namespace ("" for no tenant): slots are shared fairly
    /// between namespaces (`slots`).
    pub who: &'a str,
    /// The request (a volume's name), so that its retries while the origin
    /// is down keep the revision the origin gave it.
    pub asker: Option<&'a str>,
    /// The asking class's policy, which a fresh pull must pass before it
    /// is sealed and a sealed model before it is handed out.
    pub signature: Option<&'a Arc<Policy>>,
    /// A progressive volume waits on this pull: fetch in the listing's
    /// order, whatever the engine's default.
    pub listing_order: bool,
    /// Pods may read each file as soon as it is verified, before the seal
    /// (`jobs::Until`): write through the page cache, and tell each file
    /// verified before its last bytes are durable.
    pub readers: bool,
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
    /// Pods read each file as soon as it is verified (`Ask::readers`).
    /// So it is written through the page cache, not O_DIRECT (they would
    /// read O_DIRECT bytes back from the disk), and put in place and told
    /// verified before its last ranges are durable. What is recorded is
    /// not changed: ranges are fdatasynced before they are recorded, and
    /// a file's sha256 and the seal only follow its durability.
    page_cache: bool,
    /// Make ranges durable (and record them) only once the file's
    /// transfer ends, not batch by batch while it runs: a volume answered
    /// once verified whose model fits in a share of this node's memory
    /// (`defers_durability`). Its bytes stay in the page cache, where its
    /// pods read them, and reach the disk after the transfer instead of
    /// competing with it. A crash mid-file fetches that file again.
    defer_durable: bool,
    /// Files that failed their digest and are fetched again, told to the
    /// pull's sink as they happen.
    refetched: tokio::sync::mpsc::UnboundedSender<Refetched>,
}

/// A file of the pull failed its digest and is fetched again.
struct Refetched {
    file: String,
    /// What failed, and what happens next.
    why: String,
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

impl Engine {
    pub fn new(cfg: EngineConfig, extract: Extract) -> Engine {
        let slots = Slots::new(cfg.models);
        let transfers = crate::lock::Shares::new(
            cfg.models.max(1) * TRANSFERS_PER_SLOT,
            cfg.models.max(1) * TRANSFERS_PER_SLOT / 2,
        );
        Engine {
            sigstore: Arc::new(crate::signing::SigstoreRoot::new(
                cfg.sigstore_trust_root.clone(),
            )),
            cfg,
            extract,
            inflight: KeyedMutex::default(),
            slots,
            transfers,
            access: Access::default(),
            resolved_for: Mutex::new(HashMap::new()),
            fill: None,
            metrics: Arc::new(crate::metrics::Metrics::new()),
        }
    }

    /// Counts into `metrics` instead of a handle nothing serves.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Engine {
        self.metrics = metrics;
        self
    }

    /// Where this engine counts.
    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// Pulls take bytes from `fill` first (peers), the origin for the rest.
    pub fn with_fill(mut self, fill: Arc<dyn Fill>) -> Engine {
        self.fill = Some(fill);
        self
    }

    /// Resolves, then returns the sealed model, pulling it if needed.
    /// Concurrent calls for one model join the same pull.
    pub async fn pull(
        &self,
        root: &Root,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
    ) -> Result<Pulled> {
        self.pull_for(&Ask::default(), root, source, sink).await
    }

    /// `pull` on behalf of `ask` (see [`Ask`]).
    pub async fn pull_for(
        &self,
        ask: &Ask<'_>,
        root: &Root,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
    ) -> Result<Pulled> {
        let (resolved, outage) = self.resolve(root, source.as_ref(), ask.asker).await?;
        let limits = self.cfg.limits.lower(source.limits());
        let total = check_listing(&resolved, &limits)?;
        if let Some(policy) = ask.signature {
            unsigned_listing(&self.sigstore, policy, &resolved)?;
        }
        let sid = source_id(source.as_ref(), &resolved.uri, &resolved.revision);
        let span =
            info_span!("pull", model = %resolved.uri, revision = %resolved.revision, source = %sid);
        let started = Instant::now();
        let listed = Listed {
            resolved: &resolved,
            sid: &sid,
            outage,
            total,
            limits,
            started,
        };
        let result = self
            .hit_or_pull(ask, root, source, sink, &listed)
            .instrument(span)
            .await;
        self.count(&resolved.uri, &result, started.elapsed());
        result
    }
}
