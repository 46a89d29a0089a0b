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
//! Here: the engine, one pull's shared context, retry and backoff. Its
//! parts: `listing` (a listing judged before any fetch), `resume` (per-file
//! progress), `fetch` (one file, as ranges or a stream), `frontier`
//! (in-order hashing of ranges that arrive out of order), `layers`
//! (unpacking in manifest order, growing an area a layer overflows). What
//! is on disk, and how it becomes a seal, is the cache's.

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
mod fetch;
mod frontier;
mod layers;
mod listing;
mod resume;

use access::Access;
use fetch::*;
use frontier::*;
use layers::*;
use listing::*;
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

/// How long a revision resolved for an asker pins its retries.
const RESOLVED_PINS_FOR: Duration = Duration::from_secs(24 * 3600);

/// The source id of a model revision.
pub fn model_id(uri: &str, revision: &str) -> SourceId {
    let mut h = Sha256::new();
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(revision.as_bytes());
    SourceId::model(&h.finalize())
}

/// The source id of `uri` at `revision` as `source` serves it (its key
/// scope is part of the id).
/// The seal of `sid`, read on the blocking pool: on a shared root a miss
/// is confirmed by listing directories, and a seal another node just made
/// is waited for (`cache::read_seal`).
async fn sealed(root: &Root, sid: &SourceId) -> Result<Option<Seal>> {
    let (r, s) = (root.clone(), sid.clone());
    blocking(move || cache::read_seal(&r, &s)).await
}

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

fn is_retryable(e: &Error) -> bool {
    matches!(e, Error::Transient(_) | Error::RetryAfter { .. })
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

    /// A sealed model judged by the asking class's policy: its signature
    /// file is read from the seal, never fetched again with the weights.
    /// Without a policy, what the seal recorded.
    pub async fn vouch_sealed(
        &self,
        root: &Root,
        sid: &SourceId,
        seal: &Seal,
        policy: Option<&Arc<Policy>>,
    ) -> Result<Option<String>> {
        let Some(policy) = policy.cloned() else {
            return Ok(seal.signed_by.clone());
        };
        // No signature in the seal: nothing to read, so no view (an XFS
        // image would be mounted for it) is opened.
        if !seal.files.iter().any(|f| f.path == policy.file) {
            return policy.check_dir(&self.sigstore, &seal.files, &seal.symlinks, Path::new(""));
        }
        let (r, s, seal) = (root.clone(), sid.clone(), seal.clone());
        let sigstore = self.sigstore.clone();
        blocking(move || {
            let mut verdict = None;
            r.backend.store().view_sealed(&r, &s, &mut |data| {
                verdict = Some(policy.check_dir(&sigstore, &seal.files, &seal.symlinks, data));
            })?;
            verdict
                .unwrap_or_else(|| Err(Error::Internal("the sealed view was never opened".into())))
        })
        .await
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

    /// The source a pull reads: `origin`, or peers in front of it. Peers
    /// hand over bytes the origin never sees asked for, so the requester
    /// proves access to the origin first, as for a cache hit.
    async fn filled(
        &self,
        root: &Root,
        sid: &SourceId,
        resolved: &Resolved,
        origin: Arc<dyn Source>,
        outage: bool,
    ) -> Result<Arc<dyn Source>> {
        let Some(fill) = &self.fill else {
            return Ok(origin);
        };
        match fill.around(root, sid, resolved, origin.clone()).await {
            Some(filled) => {
                self.access
                    .admit(sid.as_str(), origin.as_ref(), resolved, outage)
                    .await?;
                Ok(filled)
            }
            None if outage => Err(Error::Transient(format!(
                "the origin of {} is unreachable and no peer can serve the model now; a retry tries again",
                resolved.uri
            ))),
            None => Ok(origin),
        }
    }

    /// The listing of a pinned model from peers while its origin is down
    /// (`error`, retryable), if the engine fills from peers and one holds it.
    async fn listing_from_peers(
        &self,
        root: &Root,
        source: &dyn Source,
        asker: Option<&str>,
        error: &Error,
    ) -> Option<Resolved> {
        let fill = self.fill.as_ref()?;
        let pin = source
            .pinned()
            .or_else(|| self.resolved_before(asker, source))?;
        let sid = source_id(source, &pin.uri, &pin.revision);
        let listing = fill.listing(root, &sid, &pin).await?;
        warn!(model = %pin.uri, revision = %pin.revision, origin_error = %error,
            "the origin is unreachable: building the pinned model from peers alone");
        Some(listing)
    }

    /// The key under which what the origin resolved for `asker` is kept:
    /// the same request (a volume's name) by the same requester.
    fn asker_key(asker: Option<&str>, source: &dyn Source) -> Option<String> {
        Some(format!(
            "{}\0{}\0{}",
            asker?,
            source.requester().unwrap_or_default(),
            source.key_scope()
        ))
    }

    fn remember_resolved(&self, asker: Option<&str>, source: &dyn Source, r: &Resolved) {
        let Some(key) = Self::asker_key(asker, source) else {
            return;
        };
        let pin = Pinned {
            uri: r.uri.clone(),
            revision: r.revision.clone(),
            files: Default::default(),
        };
        let mut kept = self.resolved_for.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() > 10_000 {
            kept.retain(|_, (_, at)| at.elapsed() < RESOLVED_PINS_FOR);
        }
        kept.insert(key, (pin, Instant::now()));
    }

    /// The revision the origin resolved for this same request before, as
    /// a pin: the origin's own word for what the request means.
    fn resolved_before(&self, asker: Option<&str>, source: &dyn Source) -> Option<Pinned> {
        let key = Self::asker_key(asker, source)?;
        self.resolved_for
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .filter(|(_, at)| at.elapsed() < RESOLVED_PINS_FOR)
            .map(|(pin, _)| pin.clone())
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
        let Ask {
            who,
            asker,
            signature,
            ..
        } = *ask;
        // The origin first; while it is down, a pinned model's listing may
        // come from peers that hold it sealed (`outage`), as may that of
        // a request the origin resolved before.
        let (resolved, outage) = match source.resolve().await {
            Ok(r) => {
                self.remember_resolved(asker, source.as_ref(), &r);
                (r, false)
            }
            Err(e) if is_retryable(&e) => {
                match self
                    .listing_from_peers(root, source.as_ref(), asker, &e)
                    .await
                {
                    Some(r) => (r, true),
                    None => (self.retry("resolve", || source.resolve()).await?, false),
                }
            }
            Err(e) => return Err(e),
        };
        let limits = self.cfg.limits.lower(source.limits());
        let total = check_listing(&resolved, &limits)?;
        if let Some(policy) = signature {
            unsigned_listing(&self.sigstore, policy, &resolved)?;
        }
        let sid = source_id(source.as_ref(), &resolved.uri, &resolved.revision);
        let span =
            info_span!("pull", model = %resolved.uri, revision = %resolved.revision, source = %sid);
        let scheme = crate::metrics::scheme_of(&resolved.uri);
        let m = &self.metrics;
        let started = Instant::now();
        let result = async {
            if let Some(hit) = self.hit(root, &sid, source.as_ref(), &resolved, signature).await? {
                sink.resolved(sid.as_str(), &resolved.uri, &resolved.revision);
                return Ok(hit);
            }
            // Whoever learns the model's id may be answered from the pull
            // that holds it (`jobs::Early`): a requester that will not
            // fetch every byte itself (another pull runs, or work an
            // earlier one left is resumed) proves its access first, and so
            // does every tenant, so that a refusal looks the same whether
            // the model is sealed, arriving or neither. Joining a pull that
            // presents the same credentials is pulling.
            let (lead, joins_own) = self
                .access
                .lead_or_join(sid.as_str(), source.as_ref(), || self.inflight.try_lock(&sid));
            let own = lead.is_some() && !source.tenant_named() && {
                let (r, s) = (root.clone(), sid.clone());
                !blocking(move || Ok(cache::pull::left_over(&r, &s))).await?
            };
            if !own && !joins_own {
                self.access
                    .admit(sid.as_str(), source.as_ref(), &resolved, outage)
                    .await?;
            }
            sink.resolved(sid.as_str(), &resolved.uri, &resolved.revision);
            // The lead goes before the lock (declared after it), so the
            // next leader is never named while this one's name stands.
            let (_joined, _lead) = match lead {
                Some(held) => held,
                None => {
                    let g = self.inflight.lock(&sid).await;
                    (g, self.access.lead(sid.as_str(), source.as_ref()))
                }
            };
            if let Some(hit) = self.hit(root, &sid, source.as_ref(), &resolved, signature).await? {
                return Ok(hit);
            }
            let _transfer = self.transfers.acquire(who.to_string()).await;
            let slot = self.slots.acquire(who).await;
            sink.started(&resolved.uri, total);
            let (charged, inodes) = need_of(&resolved, total);
            let pull = Pull {
                sid: &sid,
                resolved: &resolved,
                total,
                charged,
                inodes,
                limits,
                signature,
                listing_order: self.cfg.listing_order || ask.listing_order,
                readers: ask.readers || ask.listing_order,
                requester: source.requester(),
            };
            let counted = Counted {
                inner: sink,
                bytes: AtomicU64::new(0),
            };
            let source = self.filled(root, &sid, &resolved, source, outage).await;
            let fetched = async {
                self.fetch_within_deadline(root, &pull, source?, &counted)
                    .await
            };
            let fetched = self
                .give_up_slot_when_slow(slot, &counted.bytes, fetched)
                .await;
            if let Some(fill) = &self.fill {
                fill.ended(root, &sid, fetched.is_ok());
            }
            match fetched {
                Ok((seal, fetched, from)) => {
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
                    let from = match (from, outage) {
                        (Some(f), true) => Some(format!(
                            "{f}: the origin was unreachable, so the pinned model was built from peers alone"
                        )),
                        (f, _) => f,
                    };
                    sink.sealed(&crate::progress::Sealed {
                        uri: &resolved.uri,
                        revision: &resolved.revision,
                        bytes: seal.total_bytes,
                        took,
                        from: from.as_deref(),
                        signed_by: seal.signed_by.as_deref(),
                    });
                    Ok(Pulled {
                        sid,
                        signed: seal.signed_by.clone(),
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

    /// The sealed model, if it is, for a requester the origin would serve
    /// (`Access::prove`) and the class's policy admits.
    async fn hit(
        &self,
        root: &Root,
        sid: &SourceId,
        source: &dyn Source,
        resolved: &Resolved,
        signature: Option<&Arc<Policy>>,
    ) -> Result<Option<Pulled>> {
        let Some(seal) = sealed(root, sid).await? else {
            return Ok(None);
        };
        self.access.prove(sid.as_str(), source, resolved).await?;
        let signed = self.vouch_sealed(root, sid, &seal, signature).await?;
        Ok(Some(Pulled {
            sid: sid.clone(),
            seal,
            hit: true,
            signed,
        }))
    }

    /// Runs a pull's transfer holding `slot` while it moves at least
    /// `slow_bytes_per_sec`; a slower one gives the slot to a waiting pull
    /// and goes on without it, so slow origins (a tenant's, say) cannot
    /// hold every slot while others queue.
    async fn give_up_slot_when_slow<T>(
        &self,
        slot: Slot,
        bytes: &AtomicU64,
        transfer: impl std::future::Future<Output = T>,
    ) -> T {
        let window = self.cfg.stall;
        let floor = u128::from(self.cfg.slow_bytes_per_sec) * window.as_millis() / 1000;
        let watch = async {
            let mut slot = Some(slot);
            let mut last = bytes.load(Ordering::Relaxed);
            loop {
                tokio::time::sleep(window).await;
                let now = bytes.load(Ordering::Relaxed);
                let moved = u128::from(now.saturating_sub(last));
                last = now;
                if moved < floor && self.slots.waiting() > 0 {
                    info!(
                        bytes_in_window = moved as u64,
                        window_secs = window.as_secs_f64(),
                        "slow transfer: its pull slot goes to a waiting pull"
                    );
                    drop(slot.take());
                    return futures::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            out = transfer => out,
            _ = watch => unreachable!("the watch never ends"),
        }
    }

    /// The transfer, within a deadline that grows with the model: a grace
    /// period plus its size at `min_average_bytes_per_sec`. A live but
    /// hopeless trickle ends there (Unavailable; a retry resumes the work)
    /// instead of holding the pull's resources for ever.
    async fn fetch_within_deadline(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &Counted<'_>,
    ) -> Result<(Seal, u64, Option<String>)> {
        if self.cfg.min_average_bytes_per_sec == 0 {
            return self.fetch(root, pull, source, sink).await;
        }
        let Some(total) = pull.total else {
            return self.fetch_at_floor(root, pull, source, sink).await;
        };
        let at_floor = Duration::from_secs(total / self.cfg.min_average_bytes_per_sec);
        let deadline = self.cfg.deadline_grace.saturating_add(at_floor);
        match tokio::time::timeout(deadline, self.fetch(root, pull, source, sink)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Transient(format!(
                "the pull of {total} bytes did not finish within {}s (--pull-deadline-grace-seconds plus its size at \
                 --pull-min-average-bytes-per-second {}); {} bytes arrived; a retry resumes it",
                deadline.as_secs(),
                self.cfg.min_average_bytes_per_sec,
                sink.bytes.load(Ordering::Relaxed)
            ))),
        }
    }

    /// A transfer of unlisted size, held to the same floor as a listed one
    /// as its bytes arrive: past the grace period it must have averaged
    /// `min_average_bytes_per_sec`, so a server that trickles a body
    /// without a length cannot hold a pull for ever.
    async fn fetch_at_floor(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &Counted<'_>,
    ) -> Result<(Seal, u64, Option<String>)> {
        let floor = self.cfg.min_average_bytes_per_sec;
        let started = tokio::time::Instant::now();
        let behind = async {
            loop {
                tokio::time::sleep(self.cfg.progress_every).await;
                let bytes = sink.bytes.load(Ordering::Relaxed);
                let allowed = self
                    .cfg
                    .deadline_grace
                    .saturating_add(Duration::from_secs(bytes / floor));
                if started.elapsed() > allowed {
                    return bytes;
                }
            }
        };
        tokio::select! {
            r = self.fetch(root, pull, source, sink) => r,
            bytes = behind => Err(Error::Transient(format!(
                "the pull of unlisted size averaged under --pull-min-average-bytes-per-second {floor} past \
                 --pull-deadline-grace-seconds {}: {bytes} bytes in {}s; a retry resumes it",
                self.cfg.deadline_grace.as_secs(),
                started.elapsed().as_secs()
            ))),
        }
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
    ) -> Result<(Seal, u64, Option<String>)> {
        let (sid, need) = (pull.sid, pull.total);
        let capacity = self.cfg.capacity.get(&root.backend).copied();
        // Bytes are checked once every size is known; inodes always.
        let room = cache::evict::Need {
            bytes: pull.charged.unwrap_or(0),
            inodes: pull.inodes,
        };
        let (r, s) = (root.clone(), sid.clone());
        let m = self.metrics.clone();
        blocking(move || {
            cache::evict::make_room(&r, room, capacity, &s, &|_| {
                m.evictions.inc();
            })
        })
        .await?;
        let (r, s) = (root.clone(), sid.clone());
        let work = Arc::new(blocking(move || PullArea::open(&r, &s, need)).await?);
        let result = self
            .fetch_into(root, pull, source, sink, &work, capacity)
            .await;
        // Work a retry could resume is kept (a crash, a dead server, a
        // failure the next attempt may not meet). Work that failed for want
        // of space, for being over its limits, or because the source served
        // garbage would only hold space no later pull can use, so it goes
        // now, while the lock is still ours.
        if let Err(e) = &result
            && (e.is_no_space() || matches!(e, Error::OverLimit(_) | Error::SourceFault(_)))
        {
            let w = work.clone();
            if let Err(d) = blocking(move || w.discard()).await {
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
        work: &Arc<PullArea>,
        capacity: Option<u64>,
    ) -> Result<(Seal, u64, Option<String>)> {
        let (resolved, need) = (pull.resolved, pull.total);
        work.partial().listed(
            resolved
                .files
                .iter()
                .map(|f| match f.unpack {
                    Unpack::None => Some((f.path.clone(), f.size?)),
                    Unpack::Tar(_) => None,
                })
                .collect(),
        );
        let (refetched, mut refetches) = tokio::sync::mpsc::unbounded_channel();
        let ctx = Arc::new(Ctx {
            refetched,
            source,
            max_bytes: pull.limits.max_bytes,
            cfg: self.cfg.clone(),
            bytes: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            state_lock: Mutex::new(()),
            flush_at: flush_at(&self.cfg),
            flow: Arc::new(Flow::new(self.cfg.connections.max(1))),
            page_cache: pull.readers,
            defer_durable: pull.readers
                && !pull.listing_order
                && pull.total.is_some_and(defers_durability),
        });

        // Largest first: the biggest file bounds the pull, so it must not
        // wait behind small ones; or the listing's order, when readers are
        // waiting for the first files. The seal's order depends on neither.
        let mut order: Vec<(usize, RemoteFile)> =
            resolved.files.iter().cloned().enumerate().collect();
        if !pull.listing_order {
            order.sort_by_key(|(_, f)| std::cmp::Reverse(f.size.unwrap_or(0)));
        }
        // Streams, not files, are what a pull runs at once: a file of one
        // range is one stream, a larger one up to `connections`. So small
        // files, which are bound by round trips and fsyncs, not bytes, run
        // many at a time, and large ones as before. The semaphore is fair:
        // a large file waiting for its streams holds back the files after it.
        let connections = self.cfg.connections.max(1);
        // In listing order, a large file takes every stream: the next one
        // starts as it ends, not beside it.
        let files_at_once = match pull.listing_order {
            true => 1,
            false => self.cfg.files.max(1),
        };
        let budget = files_at_once * connections;
        let streams = Arc::new(Semaphore::new(budget));
        // Which file goes next is decided as late as possible: when a
        // stream frees, one dispatcher at a time takes the first file a
        // reader of a progressive volume is waiting for (`Partial::want`),
        // else the head of the order, then the rest of the streams it
        // needs. A read of a file far down the listing jumps the queue.
        let queue = Arc::new(Mutex::new(std::collections::VecDeque::from(order)));
        let dispatch = Arc::new(tokio::sync::Mutex::new(()));
        let files = futures::stream::iter(0..resolved.files.len())
            .map(|_| {
                let (ctx, work, streams) = (ctx.clone(), work.clone(), streams.clone());
                let (queue, dispatch) = (queue.clone(), dispatch.clone());
                async move {
                    let shutting = || Error::Internal("pull is shutting down".into());
                    let turn = dispatch.lock().await;
                    let mut held = streams
                        .clone()
                        .acquire_owned()
                        .await
                        .map_err(|_| shutting())?;
                    let next = {
                        let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
                        let wanted = work.partial().wanted();
                        let at = wanted
                            .iter()
                            .find_map(|w| q.iter().position(|(_, f)| &f.path == w))
                            .unwrap_or(0);
                        q.remove(at)
                    };
                    let Some((i, f)) = next else {
                        return Err(Error::Internal(
                            "a pull dispatched more files than it listed".into(),
                        ));
                    };
                    if f.size.is_none_or(|s| s > ctx.cfg.chunk_bytes) && connections > 1 {
                        let rest = streams
                            .clone()
                            .acquire_many_owned(connections as u32 - 1)
                            .await
                            .map_err(|_| shutting())?;
                        held.merge(rest);
                    }
                    drop(turn);
                    let _streams = held;
                    fetch_file(ctx, work, i, f).await
                }
            })
            .buffer_unordered(budget);
        let mut files = std::pin::pin!(files);
        let mut results = Vec::new();
        // A file that failed verification fails the pull, but only once
        // the other files are in: each one verified and made durable is
        // never fetched again, and a progressive volume's readers of the
        // others are not held by it.
        let mut failed: Option<Error> = None;
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
                    Some(Ok(Fetched::Failed(e))) => {
                        warn!(error = %e, "a file failed verification; the other files go on");
                        failed.get_or_insert(e);
                    }
                    Some(Ok(r)) => results.push(r),
                    None => break,
                },
                Some(r) = refetches.recv() => sink.refetching(&resolved.uri, &r.file, &r.why),
                _ = tick.tick() => {
                    let mut p = progress(&resolved.uri, ctx.bytes.load(Ordering::Relaxed), need, start.elapsed());
                    p.from = ctx.source.provenance().map(|f| f.describe());
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
        if let Some(e) = failed {
            return Err(e);
        }
        let mut entries = Vec::new();
        let mut layers = Vec::new();
        for r in results {
            match r {
                Fetched::File(f) => entries.push(f),
                l @ Fetched::Layer { .. } => layers.push(l),
                Fetched::Failed(_) => {}
            }
        }
        // Every file is in place: the partial directory must not become
        // part of the model (inside the xfs image it is at its root).
        let w = work.clone();
        blocking(move || w.clear_partial()).await?;
        if !layers.is_empty() {
            // What layers may unpack to: the model's limits less its plain
            // files, and never more than the cache has room for.
            let plain: u64 = entries
                .iter()
                .map(|e: &FileEntry| e.size)
                .fold(0, u64::saturating_add);
            let (w, x, r, limits) = (work.clone(), self.extract, root.clone(), pull.limits);
            let plain_files = entries.len() as u64;
            let mut seal = cache::manifest::SealMeter::default();
            for e in &entries {
                seal.file(&e.path, e.size);
            }
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
                        seal: std::sync::Mutex::new(seal),
                    };
                    unpack_layers(&w, x, layers, budget)
                })
                .await?,
            );
        }

        let (uri, rev, w) = (
            resolved.uri.clone(),
            resolved.revision.clone(),
            work.clone(),
        );
        let peers = ctx.source.provenance().map(|p| p.peers).unwrap_or_default();
        let (policy, sigstore) = (pull.signature.cloned(), self.sigstore.clone());
        // Remembered before the seal is visible: a requester that finds it
        // sealed (a join that waited for this pull) is then not asked to
        // prove at the origin what this pull just read there.
        if let Some(r) = &pull.requester {
            self.access.remember(pull.sid.as_str(), r.clone());
        }
        let seal = blocking(move || {
            let vouch = |tree: &cache::manifest::Tree, data: &Path| match &policy {
                Some(p) => p.check_dir(&sigstore, &tree.files, &tree.symlinks, data),
                None => Ok(None),
            };
            w.commit(entries, &uri, &rev, peers, &vouch)
        })
        .await?;
        let spilled = ctx.flow.spilled.load(Ordering::Relaxed);
        if spilled > 0 {
            info!(
                spilled_bytes = spilled,
                "bytes that ran ahead of a full reorder window were hashed from disk"
            );
        }
        let from = ctx
            .source
            .provenance()
            .filter(|p| !p.peers.is_empty())
            .map(|p| p.describe());
        Ok((seal, ctx.fetched.load(Ordering::Relaxed), from))
    }
}

/// A listing that cannot pass a required signature policy: no signature
/// file among plain files (layers may still unpack one), refused before
/// a byte is fetched.
fn unsigned_listing(
    sigstore: &crate::signing::SigstoreRoot,
    policy: &Policy,
    resolved: &Resolved,
) -> Result<()> {
    let layered = resolved
        .files
        .iter()
        .any(|f| !matches!(f.unpack, super::source::Unpack::None));
    if policy.mode != crate::signing::Mode::Required
        || layered
        || resolved.files.iter().any(|f| f.path == policy.file)
    {
        return Ok(());
    }
    policy
        .check(sigstore, None, &Default::default(), &[])
        .map(drop)
}

/// Bytes of one buffer: the budget shared by every buffer that may exist,
/// one per stream and one more per stream for the reorder windows; whole
/// blocks, so that full buffers go out with O_DIRECT.
/// Whether a model of `total` bytes may stay in the page cache until each
/// file's transfer ends: up to a quarter of the memory available now, so
/// the kernel's own writeback (from a tenth of it dirty) and other pods
/// keep their share, and a crash loses at most that much transfer.
fn defers_durability(total: u64) -> bool {
    let available = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        .saturating_mul(1024);
    total <= available / 4
}

fn flush_at(cfg: &EngineConfig) -> usize {
    let buffers = (cfg.models.max(1) * cfg.files.max(1) * cfg.connections.max(1) * 2) as u64;
    let n = (cfg.buffer_budget / buffers).clamp(256 << 10, 4 << 20) as usize;
    n / ALIGN * ALIGN
}

/// A pull's sink that also remembers how far the transfer got, for the
/// slot watch and the deadline's message.
struct Counted<'a> {
    inner: &'a dyn ProgressSink,
    bytes: AtomicU64,
}

impl ProgressSink for Counted<'_> {
    fn started(&self, uri: &str, total: Option<u64>) {
        self.inner.started(uri, total)
    }
    fn progress(&self, p: &Progress) {
        self.bytes.store(p.bytes, Ordering::Relaxed);
        self.inner.progress(p)
    }
    fn sealed(&self, s: &crate::progress::Sealed<'_>) {
        self.inner.sealed(s)
    }
    fn refetching(&self, uri: &str, file: &str, why: &str) {
        self.inner.refetching(uri, file, why)
    }
    fn failed(&self, uri: &str, error: &str) {
        self.inner.failed(uri, error)
    }
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
        from: None,
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

#[cfg(test)]
mod tests {
    use super::*;
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
    fn backoff_honours_retry_after_and_grows() {
        let cfg = EngineConfig::default();
        let e = Error::RetryAfter {
            message: "busy".into(),
            after: Duration::from_secs(3),
        };
        assert_eq!(backoff(&cfg, 0, &e), Duration::from_secs(3));
        let u = Error::Transient("x".into());
        assert!(backoff(&cfg, 0, &u) <= cfg.backoff);
        assert!(backoff(&cfg, 20, &u) <= cfg.backoff_max);
    }
}
