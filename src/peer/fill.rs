//! Filling a model from peers: a `Source` in front of the origin.
//!
//! The origin still resolves the model (its listing and digests are what
//! every byte is checked against; while it is down, a pinned model's
//! listing comes from a peer's seal). A file is taken from peers only when
//! the origin vouches for its bytes (a sha256, or an S3 ETag's MD5) and a
//! peer holds it: sealed, listing the same file with a chunk table, or
//! still pulling it, serving the chunks its hasher has passed with their
//! digests. Chunks come whole, striped over the
//! peers that hold the file, and each is checked against the chunk table
//! before a byte of it is handed on: a peer whose disk rotted is caught at
//! the chunk, dropped for the model, and the chunk fetched elsewhere. A
//! peer that lies consistently (a forged table) is caught by the origin's
//! sha256 of the whole file; the engine then asks this source to distrust
//! the file, and the origin serves it. A range no peer can serve at once
//! (all busy, slow, gone or dropped) comes from the origin.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use super::directory::{Claim, Directory, Peer};
use super::relay::{Ask, deal, rank};
use super::{CHUNK_DIGEST, SLOT_WAIT, Tokens, WAIT_FOR_CHUNK};
use crate::cache::manifest::{CHUNK_BYTES, Seal, chunk_digest};
use crate::cache::{Root, SourceId};
use crate::error::Result;
use crate::puller::source::{Fill, Pinned, Provenance, RemoteFile, Resolved, Source, Unpack};

/// Whole chunks held in memory at once, across every pull of this node,
/// while they are fetched, checked and handed on: 96 MiB.
const CHUNKS_IN_FLIGHT: usize = 12;
/// What this node must take in from peers, shared by the chunks that may
/// arrive at once (`CHUNKS_IN_FLIGHT`): a chunk slower than its share is
/// left for the next peer. Held per chunk instead, a downlink under
/// `CHUNKS_IN_FLIGHT` times this (about 100 MiB/s) failed every peer and
/// sent the chunks to the origin.
const MIN_PEER_BYTES_PER_SEC: u64 = 8 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How late past its own wait for a chunk a leader may answer: it then
/// takes a slot and may hash the chunk, which on a loaded node takes
/// seconds.
const LEADER_LATE: Duration = Duration::from_secs(10);

pub struct PeerFill {
    finder: Finder,
    /// One TLS client per peer certificate its Lease pins.
    clients: Arc<super::tls::Clients>,
    buffers: Arc<Semaphore>,
    node: String,
    metrics: Arc<crate::metrics::Metrics>,
}

impl PeerFill {
    pub fn new(
        dir: Arc<Directory>,
        tokens: Arc<Tokens>,
        node: String,
        networks: Vec<ipnet::IpNet>,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> PeerFill {
        PeerFill {
            finder: Finder {
                dir,
                tokens,
                networks: networks.into(),
            },
            clients: Arc::new(super::tls::Clients::new(CONNECT_TIMEOUT)),
            buffers: Arc::new(Semaphore::new(CHUNKS_IN_FLIGHT)),
            node,
            metrics,
        }
    }

    async fn seal_of(&self, peer: &Peer, sid: &str) -> Option<Seal> {
        let url = format!("https://{}/v1/models/{sid}/seal", peer.addr);
        let resp = self
            .clients
            .of(&peer.pin)
            .get(&url)
            .bearer_auth(self.finder.tokens.presented())
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            warn!(peer = %peer.node, status = %resp.status(), "peer did not give its seal");
            return None;
        }
        let body = match at_most(resp, crate::cache::manifest::MAX_SEAL_BYTES).await {
            Ok(b) => b,
            Err(why) => {
                warn!(peer = %peer.node, %why, "peer's seal refused");
                return None;
            }
        };
        let seal: Seal = serde_json::from_slice(&body).ok()?;
        (seal.source == sid).then_some(seal)
    }
}

/// Asks the directory who holds or pulls a model, and keeps the peers
/// this node may dial.
#[derive(Clone)]
struct Finder {
    dir: Arc<Directory>,
    tokens: Arc<Tokens>,
    /// The networks a peer's address must be in (`PeerConfig::networks`).
    networks: Arc<[ipnet::IpNet]>,
}

impl Finder {
    /// Live peers holding or pulling `sid` that this node may dial: their
    /// address is in the peer networks, and never link-local (cloud
    /// metadata), whatever a Lease says.
    async fn holders(&self, sid: &str, fresh: bool) -> Vec<Peer> {
        if !self.tokens.ready() {
            debug!(sid, "no peer token read yet: no peer is asked");
            return Vec::new();
        }
        let holders = self.dir.holders(sid, fresh).await;
        // One node is one peer, however many Leases name it: a node cannot
        // be two peers that agree.
        let mut seen = HashSet::new();
        self.dialable(holders.into_iter().filter(|p| seen.insert(p.node.clone())))
    }

    /// The peers whose address is one this node may dial.
    fn dialable(&self, peers: impl IntoIterator<Item = Peer>) -> Vec<Peer> {
        peers
            .into_iter()
            .filter(|p| {
                let ok = dialable(&p.addr, &self.networks);
                if !ok {
                    warn!(peer = %p.node, address = %p.addr, "a peer's Lease names an address outside --peer-networks; not dialled");
                }
                ok
            })
            .collect()
    }
}

#[async_trait::async_trait]
impl Fill for PeerFill {
    /// Says that this node pulls `sid` (so that nodes starting after it
    /// can read what it holds), then looks for peers: sealed copies, and
    /// pulls under way. With no sealed copy anywhere, the
    /// one node whose claim the API took pulls from the origin.
    async fn around(
        &self,
        root: &Root,
        sid: &SourceId,
        resolved: &Resolved,
        origin: Arc<dyn Source>,
    ) -> Option<Arc<dyn Source>> {
        if !super::fillable(root) {
            return None;
        }
        let started = now_ms();
        if let Err(e) = self.finder.dir.begin(sid.as_str(), started).await {
            warn!(error = %e, "could not tell peers about this pull");
        }
        let mut holders = self.finder.holders(sid.as_str(), true).await;
        let mut leader = None;
        if !holders.iter().any(Peer::sealed) {
            match self.finder.dir.claim(sid.as_str()).await {
                // A pull seen under way whose claim is free now has ended,
                // and its holder's record said how before it let go: a
                // sealed copy is read, not pulled again.
                Claim::Leads if holders.iter().any(|p| p.pulling_since().is_some()) => {
                    holders = self.finder.holders(sid.as_str(), true).await;
                    if !holders.iter().any(Peer::sealed) {
                        return None;
                    }
                }
                Claim::Leads => return None,
                Claim::Follows(node) => {
                    // Pulls that start together begin moments apart: the
                    // ones that began after this one listed are known
                    // before the first chunks are dealt (`relay`).
                    tokio::time::sleep(SETTLE).await;
                    holders = self.finder.holders(sid.as_str(), true).await;
                    // A page of holders may leave the leader out.
                    if self.finder.tokens.ready()
                        && !holders.iter().any(|p| p.node == node)
                        && let Some(p) = self.finder.dir.holder(sid.as_str(), &node).await
                    {
                        holders.extend(self.finder.dialable([p]));
                    }
                    leader = Some(node);
                }
            }
        }
        // Every pull under way relays a share of the chunks, whenever it
        // started (`relay`).
        let (sealed, pulling): (Vec<Peer>, Vec<Peer>) = holders.into_iter().partition(Peer::sealed);
        if sealed.is_empty() && pulling.is_empty() {
            return None;
        }
        // The seals of a few sealed peers, two at a time: each may be tens
        // of MiB, parsed in memory.
        let sealed: Vec<Peer> = sealed.into_iter().take(SEALS_ASKED).collect();
        let mut seals: Vec<Option<Seal>> = Vec::with_capacity(sealed.len());
        for pair in sealed.chunks(2) {
            let read = pair.iter().map(|p| self.seal_of(p, sid.as_str()));
            seals.extend(futures::future::join_all(read).await);
        }
        let mut copies: Vec<Copy> = sealed
            .into_iter()
            .zip(seals)
            .filter_map(|(peer, seal)| {
                seal.map(|seal| Copy {
                    peer,
                    held: Held::Sealed(Box::new(seal)),
                })
            })
            .collect();
        copies.extend(pulling.into_iter().map(|peer| Copy {
            held: Held::Pulling {
                leads: leader.as_deref() == Some(peer.node.as_str()),
            },
            peer,
        }));
        let any_pulling = copies
            .iter()
            .any(|c| matches!(c.held, Held::Pulling { .. }));
        let mut plan: HashMap<String, Vec<usize>> = HashMap::new();
        for f in &resolved.files {
            // The origin must vouch for the file's bytes, so that a peer's
            // can be checked against it: a sha256, else an MD5 (S3 ETags).
            let (Unpack::None, Some(size)) = (&f.unpack, f.size) else {
                continue;
            };
            let md5 = origin.origin_md5(f);
            if f.sha256.is_none() && md5.is_none() {
                continue;
            }
            let holders: Vec<usize> = copies
                .iter()
                .enumerate()
                .filter(|(_, c)| match &c.held {
                    Held::Sealed(seal) => seal.chunks_of(&f.path).is_some_and(|e| {
                        e.size == size
                            && f.sha256
                                .as_ref()
                                .is_none_or(|s| e.sha256.eq_ignore_ascii_case(s))
                    }),
                    Held::Pulling { .. } => false,
                })
                .map(|(i, _)| i)
                .collect();
            // The same model id is the same listing: a pull under way pulls
            // this file.
            if (!holders.is_empty() || any_pulling) && size > 0 {
                plan.insert(f.path.clone(), holders);
            }
        }
        if plan.is_empty() {
            info!(
                peers = copies.len(),
                "peers hold the model, but the origin vouches for no file's bytes (no sha256, no MD5 ETag): pulling from the origin"
            );
            return None;
        }
        let bytes: u64 = resolved
            .files
            .iter()
            .filter(|f| plan.contains_key(&f.path))
            .filter_map(|f| f.size)
            .sum();
        let names: Vec<String> = copies.iter().map(|c| c.describe()).collect();
        info!(
            peers = ?names,
            files = plan.len(),
            bytes,
            "filling from peers; the origin serves the rest"
        );
        let now = tokio::time::Instant::now();
        Some(Arc::new(PeerSource {
            inner: Arc::new(Inner {
                origin,
                sid: sid.to_string(),
                clients: self.clients.clone(),
                buffers: self.buffers.clone(),
                copies: RwLock::new(copies.into_iter().map(Arc::new).collect()),
                plan,
                node: self.node.clone(),
                finder: self.finder.clone(),
                // Pulls that began after this one looked are found later:
                // in a rollout, nodes begin within moments of each other.
                looks: Mutex::new(match leader {
                    Some(_) => LOOK_AGAIN.iter().rev().map(|d| now + *d).collect(),
                    None => Vec::new(),
                }),
                dropped: Mutex::new(HashSet::new()),
                strikes: Mutex::new(HashMap::new()),
                distrusted: Mutex::new(HashSet::new()),
                served_by: Mutex::new(HashMap::new()),
                from_peers: AtomicU64::new(0),
                from_origin: AtomicU64::new(0),
                last_from_peer: Mutex::new(tokio::time::Instant::now()),
                metrics: self.metrics.clone(),
            }),
        }))
    }

    /// The listing sealed peers' seals give while the origin is down, when
    /// they seal exactly the pinned model (same id, URI and revision) and
    /// hold only files (no links to recreate). Their sha256s are peers'
    /// word, so one peer's is not enough: unless the URI pins every file's
    /// sha256 itself (`#sha256=`, then the pin's are used), at least
    /// `CONFIRMED_BY` peers' seals must agree on every file's path, size
    /// and sha256, so that no single node (its driver compromised, its
    /// Lease forged) gets its bytes sealed here.
    async fn listing(&self, root: &Root, sid: &SourceId, pin: &Pinned) -> Option<Resolved> {
        if !super::fillable(root) {
            return None;
        }
        let holders = self.finder.holders(sid.as_str(), true).await;
        let pinned = !pin.files.is_empty();
        let mut agreeing: Vec<(String, Vec<(String, u64, String)>)> = Vec::new();
        for peer in holders.iter().filter(|p| p.sealed()) {
            let Some(seal) = self.seal_of(peer, sid.as_str()).await else {
                continue;
            };
            let same = seal.origin == pin.uri
                && seal.revision.as_deref() == Some(pin.revision.as_str())
                && seal.symlinks.is_empty()
                && (!pinned || pin.files.keys().eq(seal.files.iter().map(|f| &f.path)));
            if !same {
                warn!(peer = %peer.node, "its seal does not match the pinned model; not used while the origin is down");
                continue;
            }
            let files: Vec<(String, u64, String)> = seal
                .files
                .iter()
                .map(|f| {
                    let sha = pin
                        .files
                        .get(&f.path)
                        .cloned()
                        .unwrap_or_else(|| f.sha256.to_ascii_lowercase());
                    (f.path.clone(), f.size, sha)
                })
                .collect();
            if let Some((first, theirs)) = agreeing.first()
                && *theirs != files
            {
                warn!(peer = %peer.node, other = %first, "two peers' seals of the pinned model disagree; no listing is taken from peers while the origin is down");
                return None;
            }
            agreeing.push((peer.node.clone(), files));
            if pinned || agreeing.len() >= CONFIRMED_BY {
                break;
            }
        }
        if !pinned && agreeing.len() < CONFIRMED_BY {
            if !agreeing.is_empty() {
                warn!(
                    peers = agreeing.len(),
                    "the origin is down and fewer peers than a listing needs hold the pinned model sealed ({CONFIRMED_BY} that agree, or a URI that pins every file's sha256)"
                );
            }
            return None;
        }
        let (_, files) = agreeing.into_iter().next()?;
        let files = files
            .into_iter()
            .map(|(path, size, sha256)| RemoteFile {
                path,
                size: Some(size),
                sha256: Some(sha256),
                locator: String::new(),
                unpack: Unpack::None,
            })
            .collect();
        info!("the origin is down: the pinned model's listing comes from peers' seals that agree");
        Some(Resolved {
            uri: pin.uri.clone(),
            revision: pin.revision.clone(),
            files,
        })
    }

    fn ended(&self, _root: &Root, sid: &SourceId, sealed: bool) {
        self.finder.dir.end(sid.as_str(), sealed);
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a peer holds of the model.
enum Held {
    /// Sealed: its seal, with a chunk table per file.
    Sealed(Box<Seal>),
    /// Still pulling it: it serves the chunks it has hashed, each with
    /// its digest. The one that `leads` pulls from the origin; the others
    /// relay chunks to each other by their ranks (`relay`).
    Pulling { leads: bool },
}

/// Hands `bytes` on in pieces of 1 MiB, each a copy: the whole chunk's
/// buffer is freed as soon as its last piece is queued, not when the
/// engine gets to it (it may pause a stream behind its reorder window), so
/// chunk buffers stay within `CHUNKS_IN_FLIGHT`. False when the reader
/// went away.
async fn hand_on(tx: &tokio::sync::mpsc::Sender<Result<Bytes>>, bytes: Bytes) -> bool {
    for piece in bytes.chunks(1 << 20) {
        if tx.send(Ok(Bytes::copy_from_slice(piece))).await.is_err() {
            return false;
        }
    }
    true
}

/// Whether a peer address (`ip:port`, as its Lease names it) is one to
/// dial: in `networks`, and not link-local.
fn dialable(addr: &str, networks: &[ipnet::IpNet]) -> bool {
    let Ok(a) = addr.parse::<std::net::SocketAddr>() else {
        return false;
    };
    let ip = match a.ip() {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(std::net::IpAddr::V4)
            .unwrap_or(std::net::IpAddr::V6(v6)),
        v4 => v4,
    };
    let link_local = match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    !link_local && networks.iter().any(|n| n.contains(&ip))
}

/// `e` and what caused it, down the chain: a client error's own text
/// ("error sending request") says nothing of a refused connection, a
/// timeout or a failed handshake.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// A miss that took this long is a strike against its peer; `STRIKES`
/// drop it for the pull.
const SLOW_MISS: Duration = Duration::from_secs(2);
const STRIKES: u32 = 3;
/// How long a peer with `STRIKES` is left out before it is asked again:
/// a peer slowed for a while (its disk, its CPU) is often the one that
/// will hold every chunk, and the rest of the model should not cost the
/// origin for it.
const BENCHED_FOR: Duration = Duration::from_secs(20);

/// A copy's slow misses since it was last benched, and until when it is.
#[derive(Default)]
struct Strikes {
    count: u32,
    benched_until: Option<tokio::time::Instant>,
}

impl Strikes {
    fn benched_at(&self, now: tokio::time::Instant) -> bool {
        self.benched_until.is_some_and(|until| until > now)
    }
}

/// How many sealed peers' seals a fill reads: enough for two that agree,
/// and a spare.
const SEALS_ASKED: usize = 4;

/// A response's body, refused once it runs past `max` bytes (a peer that
/// sends more than it was asked cannot make this node buffer it).
async fn at_most(mut resp: reqwest::Response, max: u64) -> std::result::Result<Bytes, String> {
    if resp.content_length().is_some_and(|n| n > max) {
        return Err(format!(
            "it announced {} bytes, more than the {max} asked",
            resp.content_length().unwrap_or(0)
        ));
    }
    let mut body = bytes::BytesMut::new();
    while let Some(piece) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() as u64 + piece.len() as u64 > max {
            return Err(format!("it sent more than the {max} bytes asked"));
        }
        body.extend_from_slice(&piece);
    }
    Ok(body.freeze())
}

/// How many peers must state the same thing before it is taken without
/// the origin's word: a listing while the origin is down, a chunk table
/// that lets a progressive volume read a file before its verdict.
const CONFIRMED_BY: usize = 2;

/// The chunk table every sealed copy of a file records, when at least
/// `CONFIRMED_BY` copies record it, or none. Sealed copies of one file
/// hold one table; copies that disagree mean one of them lies, and none
/// is taken at its word; nor is one copy's alone (the file is then gated
/// by the origin's sha256 alone).
fn agreed_table<'a>(mut tables: impl Iterator<Item = &'a Vec<String>>) -> Option<Vec<String>> {
    let first = tables.next()?;
    let mut seen = 1;
    for t in tables {
        if t != first {
            return None;
        }
        seen += 1;
    }
    (seen >= CONFIRMED_BY).then(|| first.clone())
}

/// A peer and what it holds.
struct Copy {
    peer: Peer,
    held: Held,
}

impl Copy {
    fn describe(&self) -> String {
        match self.held {
            Held::Sealed(_) => format!("{} (sealed)", self.peer.node),
            Held::Pulling { leads: true } => {
                format!("{} (pulling from the origin)", self.peer.node)
            }
            Held::Pulling { leads: false } => format!("{} (pulling)", self.peer.node),
        }
    }
}

/// How long a pull that follows a leader waits before it lists the pulls
/// under way again, and deals its first chunks among them.
const SETTLE: Duration = Duration::from_millis(250);

/// When, after it began, a pull that follows a leader asks again who
/// pulls the model.
const LOOK_AGAIN: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(4),
    Duration::from_secs(16),
];

/// How long a chunk is asked of peers that are only busy, while no peer
/// serves this pull anything, before the origin serves it.
const BUSY_PATIENCE: Duration = Duration::from_secs(10);

/// The pauses between rounds of asking busy peers (bounded by
/// `BUSY_PATIENCE`, not by a count).
const BUSY_PAUSE: crate::retry::Backoff = crate::retry::Backoff {
    first: Duration::from_millis(40),
    max: Duration::from_millis(320),
    total: None,
    times: None,
};

struct PeerSource {
    inner: Arc<Inner>,
}

struct Inner {
    origin: Arc<dyn Source>,
    sid: String,
    clients: Arc<super::tls::Clients>,
    buffers: Arc<Semaphore>,
    /// Every copy found, in the order found: an index names one for the
    /// whole pull.
    copies: RwLock<Vec<Arc<Copy>>>,
    /// File path -> the sealed copies that hold it as the origin describes
    /// it. Every pull under way holds every file planned.
    plan: HashMap<String, Vec<usize>>,
    /// This node's name: its rank for each chunk (`relay`).
    node: String,
    finder: Finder,
    /// When this pull looks again for pulls under way it did not know of,
    /// latest first.
    looks: Mutex<Vec<tokio::time::Instant>>,
    /// Copies that served a wrong chunk: never asked again for this model.
    dropped: Mutex<HashSet<usize>>,
    /// Copies' slow misses (`STRIKES` bench a copy for `BENCHED_FOR`).
    strikes: Mutex<HashMap<usize, Strikes>>,
    /// Files whose peer bytes failed the origin's sha256: origin only.
    distrusted: Mutex<HashSet<String>>,
    /// File path -> the copies that served bytes of it.
    served_by: Mutex<HashMap<String, BTreeSet<usize>>>,
    from_peers: AtomicU64,
    from_origin: AtomicU64,
    /// When a peer last served this pull a chunk: busy peers are waited
    /// for as long as peers keep serving (a leader slowed by its disk or
    /// CPU is still cheaper than the origin), not a fixed time.
    last_from_peer: Mutex<tokio::time::Instant>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// Why a chunk did not come from a peer.
enum Miss {
    /// It served bytes that are not the chunk: drop it for the model.
    Wrong(String),
    /// It no longer holds or pulls the model: drop it for the model.
    Gone(String),
    /// Every upload slot of it is taken, or the chunk has not reached it
    /// yet (what it said): ask again in a moment.
    Busy(String),
    /// Busy, slow, gone: ask the next one.
    Unavailable(String),
}

impl Inner {
    fn copy(&self, c: usize) -> Arc<Copy> {
        self.copies.read().unwrap_or_else(|p| p.into_inner())[c].clone()
    }

    fn candidates(&self, path: &str) -> Vec<usize> {
        if self
            .distrusted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(path)
        {
            return Vec::new();
        }
        let Some(sealed) = self.plan.get(path) else {
            return Vec::new();
        };
        let dropped = self.dropped.lock().unwrap_or_else(|p| p.into_inner());
        let copies = self.copies.read().unwrap_or_else(|p| p.into_inner());
        let pulling = (0..copies.len()).filter(|&c| matches!(copies[c].held, Held::Pulling { .. }));
        sealed
            .iter()
            .copied()
            .chain(pulling)
            .filter(|c| !dropped.contains(c))
            .collect()
    }

    /// Once each `LOOK_AGAIN` after it began, a pull that follows a
    /// leader asks again who pulls the model: the pulls that began after
    /// it looked relay chunks too, and it waits on those that rank lower.
    async fn look_again(&self) {
        let now = tokio::time::Instant::now();
        let due = {
            let mut looks = self.looks.lock().unwrap_or_else(|p| p.into_inner());
            let due = looks.last().is_some_and(|at| *at <= now);
            if due {
                looks.pop();
            }
            due
        };
        if !due {
            return;
        }
        let found = self.finder.holders(&self.sid, false).await;
        let mut joined = Vec::new();
        let mut copies = self.copies.write().unwrap_or_else(|p| p.into_inner());
        for peer in found {
            if peer.sealed() || copies.iter().any(|c| c.peer.node == peer.node) {
                continue;
            }
            joined.push(peer.node.clone());
            copies.push(Arc::new(Copy {
                peer,
                held: Held::Pulling { leads: false },
            }));
        }
        drop(copies);
        if !joined.is_empty() {
            info!(model = %self.sid, peers = ?joined, "more pulls of this model under way relay chunks to this one");
        }
    }

    fn count(&self, from: &str, n: u64) {
        let total = if from == "peer" {
            &self.from_peers
        } else {
            &self.from_origin
        };
        total.fetch_add(n, Ordering::Relaxed);
        self.metrics
            .fill_bytes
            .get_or_create(&crate::metrics::FillFrom {
                model: self.sid.clone(),
                from: from.into(),
            })
            .inc_by(n);
    }

    /// The copies to ask for chunk `idx` of `path`, in order
    /// (`relay::deal`). Benched and dropped copies are left out.
    fn order(&self, path: &str, idx: u64) -> Vec<Ask> {
        let now = tokio::time::Instant::now();
        let cands: Vec<usize> = {
            let strikes = self.strikes.lock().unwrap_or_else(|p| p.into_inner());
            self.candidates(path)
                .into_iter()
                .filter(|c| !strikes.get(c).is_some_and(|s| s.benched_at(now)))
                .collect()
        };
        let copies = self.copies.read().unwrap_or_else(|p| p.into_inner());
        let of = |want: fn(&Held) -> bool| -> Vec<usize> {
            cands
                .iter()
                .copied()
                .filter(|c| want(&copies[*c].held))
                .collect()
        };
        let sealed = of(|h| matches!(h, Held::Sealed(_)));
        let pulling: Vec<(usize, u64)> = of(|h| matches!(h, Held::Pulling { leads: false }))
            .into_iter()
            .map(|c| (c, rank(&copies[c].peer.node, path, idx)))
            .collect();
        let leaders = of(|h| matches!(h, Held::Pulling { leads: true }));
        let mine = rank(&self.node, path, idx);
        deal(&sealed, &pulling, &leaders, mine, idx as usize)
    }

    /// Chunk `idx` of `file` (`[start, end)`) as `ask` says, checked
    /// against that copy's chunk table (sealed) or the digest it sends
    /// with the chunk (still pulling).
    async fn chunk(
        &self,
        ask: Ask,
        file: &RemoteFile,
        idx: u64,
        start: u64,
        end: u64,
    ) -> std::result::Result<(Bytes, OwnedSemaphorePermit), Miss> {
        let copy = self.copy(ask.copy);
        let (table, wait) = match &copy.held {
            Held::Sealed(seal) => (
                Some(
                    seal.chunks_of(&file.path)
                        .and_then(|e| e.chunks.get(idx as usize))
                        .ok_or_else(|| Miss::Wrong("its chunk table has no such chunk".into()))?
                        .clone(),
                ),
                None,
            ),
            Held::Pulling { .. } => (None, Some(ask.wait)),
        };
        let url = format!("https://{}/v1/models/{}/file", copy.peer.addr, self.sid);
        let len = end - start;
        // The answer's head may be held while the peer waits for the
        // chunk (the leader) and for an upload slot; the body must then
        // come at the least rate, or the next peer is asked. Waiting for
        // this node's own chunk memory counts against neither.
        let mut head_within = CONNECT_TIMEOUT + SLOT_WAIT;
        if wait == Some(true) {
            head_within += WAIT_FOR_CHUNK + LEADER_LATE;
        }
        let slow = || {
            Miss::Unavailable(format!(
                "slower than {} MiB/s",
                MIN_PEER_BYTES_PER_SEC >> 20
            ))
        };
        let mut req = self
            .clients
            .of(&copy.peer.pin)
            .get(&url)
            .query(&[("path", file.path.as_str())])
            .bearer_auth(self.finder.tokens.presented())
            .header(reqwest::header::RANGE, format!("bytes={start}-{}", end - 1));
        if let Some(w) = wait {
            req = req.query(&[("wait", if w { "1" } else { "0" })]);
        }
        let resp = tokio::time::timeout(head_within, req.send())
            .await
            .map_err(|_| slow())?
            .map_err(|e| match e.is_connect() {
                // Nothing answers at its address (its driver died): it is
                // not asked again for this pull, and the pull that ranks
                // next relays its chunks.
                true => Miss::Gone(with_causes(&e)),
                false => Miss::Unavailable(with_causes(&e)),
            })?;
        match resp.status() {
            reqwest::StatusCode::PARTIAL_CONTENT => {}
            // A sealed copy that lost the model is gone; a pull may just
            // be between states (its area not open yet, or sealing).
            reqwest::StatusCode::NOT_FOUND if wait.is_none() => {
                return Err(Miss::Gone(format!("answered {}", resp.status())));
            }
            s => {
                let reason = resp
                    .headers()
                    .get(super::REFUSED)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                // The leader waited for the chunk and has not got it yet:
                // it is still coming, as busy as a peer with no slot.
                if reason == "busy" || (wait == Some(true) && reason == "not_yet") {
                    let said = at_most(resp, 1024).await.unwrap_or_default();
                    return Err(Miss::Busy(String::from_utf8_lossy(&said).into_owned()));
                }
                return Err(Miss::Unavailable(format!("answered {s} {reason}")));
            }
        }
        let sent = resp
            .headers()
            .get(CHUNK_DIGEST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // The body's memory is bounded, not the wait before it (a pull
        // still running holds the request until it has the chunk).
        let buffer = self
            .buffers
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Miss::Unavailable("shutting down".into()))?;
        // This chunk's share of the floor: as many bodies as there are
        // buffers may arrive beside it on the node's downlink, and more
        // may start while it arrives.
        let body_within = CONNECT_TIMEOUT
            + Duration::from_secs_f64(
                len as f64 * CHUNKS_IN_FLIGHT as f64 / MIN_PEER_BYTES_PER_SEC as f64,
            );
        let body = tokio::time::timeout(body_within, at_most(resp, len))
            .await
            .map_err(|_| slow())?
            .map_err(Miss::Wrong)?;
        let want = table
            .or(sent)
            .ok_or_else(|| Miss::Wrong("it sent a chunk without its digest".into()))?;
        if body.len() as u64 != len {
            return Err(Miss::Wrong(format!(
                "sent {} bytes of a {len}-byte chunk",
                body.len()
            )));
        }
        let got = crate::offload::blocking({
            let b = body.clone();
            move || Ok(chunk_digest(&b))
        })
        .await
        .map_err(|e| Miss::Unavailable(with_causes(&e)))?;
        if !got.eq_ignore_ascii_case(&want) {
            return Err(Miss::Wrong(format!(
                "chunk {idx} of {} hashes to {got}, the peer says {want}",
                file.path
            )));
        }
        Ok((body, buffer))
    }

    /// Sends `[offset, end)` of `file` to `tx`: chunk by chunk from peers,
    /// then from the origin once no peer can serve a chunk.
    async fn fill_range(
        self: Arc<Self>,
        file: RemoteFile,
        offset: u64,
        end: u64,
        tx: tokio::sync::mpsc::Sender<Result<Bytes>>,
    ) {
        let mut pos = offset;
        while pos < end {
            let idx = pos / CHUNK_BYTES;
            let size = file.size.unwrap_or(end);
            let (cs, ce) = (idx * CHUNK_BYTES, ((idx + 1) * CHUNK_BYTES).min(size));
            if self.candidates(&file.path).is_empty() {
                break;
            }
            let got = self.chunk_from_peers(&file, idx, cs, ce).await;
            let until = end.min(ce);
            let piece = match got {
                Some((c, chunk, buffer)) => {
                    self.served_by
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(file.path.clone())
                        .or_default()
                        .insert(c);
                    self.count("peer", until - pos);
                    Ok((
                        chunk.slice((pos - cs) as usize..(until - cs) as usize),
                        buffer,
                    ))
                }
                // No peer could serve this chunk now: the origin does, and
                // peers are asked again for the next.
                None => self.origin_range(&file, pos, until).await,
            };
            match piece {
                Ok((bytes, buffer)) => {
                    if !hand_on(&tx, bytes).await {
                        return;
                    }
                    drop(buffer);
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            }
            pos = until;
        }
        if pos >= end {
            return;
        }
        // No peer left for this file: the rest of the range from the origin.
        if file.locator.is_empty() {
            // A listing from peers while the origin is down: it has none.
            let _ = tx
                .send(Err(crate::error::Error::Transient(format!(
                    "{}: no peer serves it now and the origin is unreachable; a retry tries again",
                    file.path
                ))))
                .await;
            return;
        }
        match self.origin.read(&file, pos, Some(end - pos)).await {
            Err(e) => {
                let _ = tx.send(Err(e)).await;
            }
            Ok(mut s) => {
                while let Some(item) = s.next().await {
                    if let Ok(b) = &item {
                        self.count("origin", b.len() as u64);
                    }
                    if tx.send(item).await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Chunk `idx` from the first peer in `order` that serves it right.
    /// Peers that are only busy are asked again, round after round, as
    /// long as some peer keeps serving this pull: their slots free up as
    /// the chunks they wait for arrive, and the origin is the last resort
    /// (the peers stalled), not the next one.
    async fn chunk_from_peers(
        &self,
        file: &RemoteFile,
        idx: u64,
        cs: u64,
        ce: u64,
    ) -> Option<(usize, Bytes, OwnedSemaphorePermit)> {
        self.look_again().await;
        let first_asked = tokio::time::Instant::now();
        let mut round = 0u32;
        let mut pauses = BUSY_PAUSE.delays();
        loop {
            let mut busy = Vec::new();
            // Why each peer asked last did not serve it: said when the
            // origin serves the chunk, since those bytes cost the origin.
            let mut misses = Vec::new();
            for ask in self.order(&file.path, idx) {
                let c = ask.copy;
                let copy = self.copy(c);
                let node = &copy.peer.node;
                let asked = tokio::time::Instant::now();
                let got = self.chunk(ask, file, idx, cs, ce).await;
                // Busy is an honest answer, even late (a leader holds a
                // request while its chunk arrives, then queues it for a
                // slot): only a peer that failed or timed out strikes.
                if matches!(got, Err(Miss::Unavailable(_))) && asked.elapsed() >= SLOW_MISS {
                    self.strike(c);
                }
                match got {
                    Ok((b, buffer)) => {
                        *self
                            .last_from_peer
                            .lock()
                            .unwrap_or_else(|p| p.into_inner()) = tokio::time::Instant::now();
                        return Some((c, b, buffer));
                    }
                    Err(Miss::Wrong(why)) => {
                        warn!(peer = %node, model = %self.sid, %why, "peer served a wrong chunk; it is dropped for this model");
                        self.drop_copy(c);
                        misses.push(format!("{node}: wrong ({why})"));
                    }
                    Err(Miss::Gone(why)) => {
                        tracing::debug!(peer = %node, %why, "peer no longer holds the model");
                        self.drop_copy(c);
                        misses.push(format!("{node}: gone ({why})"));
                    }
                    Err(Miss::Busy(why)) => {
                        tracing::debug!(peer = %node, %why, waited_ms = asked.elapsed().as_millis() as u64, wait = ask.wait, "peer busy");
                        busy.push(c);
                        misses.push(format!("{node}: busy"));
                    }
                    Err(Miss::Unavailable(why)) => {
                        tracing::debug!(peer = %node, %why, "peer could not serve a chunk");
                        misses.push(format!("{node}: {why}"));
                    }
                }
            }
            let serving = *self
                .last_from_peer
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let patience = serving.max(first_asked) + BUSY_PATIENCE;
            if busy.is_empty() || tokio::time::Instant::now() >= patience {
                // A peer busy for a whole patience strikes: one that
                // answers busy for ever costs a few patiences, not one per
                // chunk.
                for c in busy {
                    self.strike(c);
                }
                if !misses.is_empty() {
                    info!(model = %self.sid, file = %file.path, chunk = idx, rounds = round + 1, ?misses, "no peer served this chunk; the origin serves it");
                }
                return None;
            }
            round += 1;
            let pause = pauses.next().unwrap_or(BUSY_PAUSE.max);
            tokio::time::sleep(pause).await;
        }
    }

    /// A peer made this pull wait and then failed (timed out, errored,
    /// crawled): after `STRIKES` of those it is benched for `BENCHED_FOR`,
    /// so one unresponsive peer costs a pull a few waits now and then,
    /// not one per chunk.
    fn strike(&self, c: usize) {
        let now = tokio::time::Instant::now();
        let mut strikes = self.strikes.lock().unwrap_or_else(|p| p.into_inner());
        let s = strikes.entry(c).or_default();
        if s.benched_at(now) {
            return;
        }
        s.count += 1;
        if s.count >= STRIKES {
            warn!(peer = %self.copy(c).peer.node, model = %self.sid, strikes = s.count, benched_for = ?BENCHED_FOR, "peer kept this pull waiting without serving; it is left out for a while");
            s.count = 0;
            s.benched_until = Some(now + BENCHED_FOR);
        }
    }

    fn drop_copy(&self, c: usize) {
        self.dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(c);
    }

    /// `[start, end)` of `file` from the origin, whole, in memory (at
    /// most a chunk).
    async fn origin_range(
        &self,
        file: &RemoteFile,
        start: u64,
        end: u64,
    ) -> Result<(Bytes, OwnedSemaphorePermit)> {
        if file.locator.is_empty() {
            return Err(crate::error::Error::Transient(format!(
                "{}: no peer serves this chunk now and the origin is unreachable; a retry tries again",
                file.path
            )));
        }
        let buffer = self
            .buffers
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| crate::error::Error::Internal("shutting down".into()))?;
        let mut s = self.origin.read(file, start, Some(end - start)).await?;
        let mut buf = bytes::BytesMut::with_capacity((end - start) as usize);
        while let Some(b) = s.next().await {
            let b = b?;
            self.count("origin", b.len() as u64);
            buf.extend_from_slice(&b);
        }
        Ok((buf.freeze(), buffer))
    }
}

#[async_trait::async_trait]
impl Source for PeerSource {
    async fn resolve(&self) -> Result<Resolved> {
        self.inner.origin.resolve().await
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        let inner = self.inner.clone();
        let size = file.size.unwrap_or(0);
        if inner.candidates(&file.path).is_empty() || offset >= size {
            let stream = inner.origin.read(file, offset, len).await?;
            return Ok(stream
                .inspect(move |item| {
                    if let Ok(b) = item {
                        inner.count("origin", b.len() as u64);
                    }
                })
                .boxed());
        }
        let end = len.map_or(size, |l| offset.saturating_add(l).min(size));
        // One piece queued: memory per stream stays at about 1 MiB.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(inner.fill_range(file.clone(), offset, end, tx));
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx).boxed())
    }

    fn distrust(&self, file: &RemoteFile) -> bool {
        let served = self
            .inner
            .served_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&file.path);
        let Some(served) = served else {
            return false;
        };
        let mut dropped = self.inner.dropped.lock().unwrap_or_else(|p| p.into_inner());
        for c in served {
            warn!(peer = %self.inner.copy(c).peer.node, model = %self.inner.sid, file = %file.path, "peer bytes failed the origin's sha256; it is dropped for this model");
            dropped.insert(c);
        }
        self.inner
            .distrusted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(file.path.clone());
        true
    }

    fn chunk_table(&self, file: &RemoteFile) -> Option<Vec<String>> {
        let inner = &self.inner;
        let copies: Vec<Arc<Copy>> = inner
            .candidates(&file.path)
            .into_iter()
            .map(|c| inner.copy(c))
            .collect();
        agreed_table(copies.iter().filter_map(|c| match &c.held {
            Held::Sealed(seal) => seal.chunks_of(&file.path).map(|e| &e.chunks),
            Held::Pulling { .. } => None,
        }))
    }

    fn provenance(&self) -> Option<Provenance> {
        let served = self
            .inner
            .served_by
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut peers: Vec<String> = served
            .values()
            .flatten()
            .map(|c| self.inner.copy(*c).peer.node.clone())
            .collect();
        peers.sort();
        peers.dedup();
        Some(Provenance {
            peers,
            origin: self.inner.from_origin.load(Ordering::Relaxed) > 0,
        })
    }

    fn content_md5(&self, file: &RemoteFile) -> Option<String> {
        let served = self
            .inner
            .served_by
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&file.path)
            .is_some_and(|s| !s.is_empty());
        served.then(|| self.inner.origin.origin_md5(file)).flatten()
    }

    fn ranges(&self) -> bool {
        self.inner.origin.ranges()
    }

    fn key_scope(&self) -> String {
        self.inner.origin.key_scope()
    }

    fn limits(&self) -> Option<crate::puller::source::PullLimits> {
        self.inner.origin.limits()
    }

    fn requester(&self) -> Option<String> {
        self.inner.origin.requester()
    }

    async fn authorize(&self, resolved: &Resolved) -> Result<()> {
        self.inner.origin.authorize(resolved).await
    }
}

#[cfg(test)]
mod tests {
    use super::{agreed_table, at_most, dialable};

    /// A Lease names the address a node dials: only one in the peer
    /// networks, never metadata, whatever is listed.
    #[test]
    fn only_peer_networks_are_dialled() {
        let nets: Vec<ipnet::IpNet> = ["10.0.0.0/8", "169.254.0.0/16", "fc00::/7"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        assert!(dialable("10.244.1.7:7420", &nets));
        assert!(dialable("[fd00::7]:7420", &nets));
        assert!(!dialable("169.254.169.254:80", &nets));
        assert!(!dialable("[::ffff:169.254.169.254]:80", &nets));
        assert!(!dialable("127.0.0.1:7420", &nets));
        assert!(!dialable("8.8.8.8:443", &nets));
        assert!(!dialable("[fe80::1]:7420", &nets));
        assert!(!dialable("kubernetes.default:443", &nets));
    }
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that answers every request with `head` and then `body_len`
    /// bytes (or until the reader goes).
    async fn peer(head: &'static str, body_len: usize) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = c.read(&mut buf).await;
                    let _ = c.write_all(head.as_bytes()).await;
                    let piece = vec![b'x'; 1 << 16];
                    let mut sent = 0;
                    while sent < body_len {
                        if c.write_all(&piece).await.is_err() {
                            return;
                        }
                        sent += piece.len();
                    }
                });
            }
        });
        format!("http://{addr}/")
    }

    /// A peer that sends more than it was asked, or says it will, is cut
    /// off at the bound; before, a seal or chunk body was read whole.
    #[tokio::test]
    async fn a_body_past_its_bound_is_refused_not_buffered() {
        let http = reqwest::Client::new();
        let announced = peer(
            "HTTP/1.1 200 OK\r\ncontent-length: 2000000000\r\n\r\n",
            1 << 20,
        )
        .await;
        let r = http.get(&announced).send().await.unwrap();
        let e = at_most(r, 1 << 20).await.unwrap_err();
        assert!(e.contains("announced"), "{e}");
        let streamed = peer("HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", 64 << 20).await;
        let r = http.get(&streamed).send().await.unwrap();
        let e = at_most(r, 1 << 20).await.unwrap_err();
        assert!(e.contains("more than"), "{e}");
        let fits = peer("HTTP/1.1 200 OK\r\ncontent-length: 65536\r\n\r\n", 1 << 16).await;
        let r = http.get(&fits).send().await.unwrap();
        assert_eq!(at_most(r, 1 << 20).await.unwrap().len(), 1 << 16);
    }

    fn table(digests: &[&str]) -> Vec<String> {
        digests.iter().map(|d| d.to_string()).collect()
    }

    #[test]
    fn sealed_copies_that_disagree_on_a_files_chunks_give_no_table() {
        let honest = table(&["aa", "bb", "cc"]);
        let liar = table(&["aa", "bb", "dd"]);
        let short = table(&["aa", "bb"]);
        // One copy alone is not confirmed: a liar's table would pass.
        assert_eq!(agreed_table([&honest].into_iter()), None);
        assert_eq!(
            agreed_table([&honest, &honest.clone()].into_iter()),
            Some(honest.clone())
        );
        // One liar among honest copies, first or last: no table at all.
        assert_eq!(agreed_table([&honest, &honest, &liar].into_iter()), None);
        assert_eq!(agreed_table([&liar, &honest].into_iter()), None);
        // A table that stops early is no prefix of the truth to trust.
        assert_eq!(agreed_table([&honest, &short].into_iter()), None);
        assert_eq!(agreed_table(std::iter::empty()), None);
    }
}
