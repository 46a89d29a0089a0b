//! What every model source implements: resolve a URI to one immutable
//! revision and its files, then serve byte ranges of those files.
//!
//! A source never writes to disk and never decides about the cache; the
//! engine does. Errors use the domain `Error`: `NotFound` for a missing
//! model or object, `Unavailable` for anything worth retrying (connection
//! failures, 5xx, 429, timeouts; `Error::RetryAfter` when the server said
//! when), `FailedPrecondition` for credentials the
//! server rejected, `InvalidArgument` for a malformed URI. A source never
//! puts a credential into an error, a log line or a `Resolved`.

use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;

pub use crate::config::{DEFAULT_MAX_MODEL_BYTES, DEFAULT_MAX_MODEL_FILES, PullLimits};
use crate::error::{Error, Result};

/// How the engine turns a downloaded file into model files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unpack {
    /// The file is a model file, stored at its `path`.
    None,
    /// The file is a tar archive (an OCI layer), unpacked into the model
    /// root (or into `path` when it is not empty).
    Tar(Compression),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// One file to fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    /// Where it goes in the model, relative, '/'-separated; validated by the
    /// engine (no '..', not absolute).
    pub path: String,
    /// Its size in bytes when the source knows it (needed for ranges and for
    /// the capacity check before anything is written).
    pub size: Option<u64>,
    /// The sha256 the source vouches for (HF LFS oid, OCI digest, S3
    /// checksum), lowercase hex. The engine always computes its own and
    /// refuses a mismatch.
    pub sha256: Option<String>,
    /// Opaque per-source locator (object key, blob digest, URL...), never
    /// containing credentials.
    pub locator: String,
    pub unpack: Unpack,
}

/// A URI resolved to an immutable revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The URI normalized (scheme, host and path canonical; no credentials,
    /// no query secrets). Part of the cache key.
    pub uri: String,
    /// The immutable revision: S3 ETags/versions digest, OCI manifest
    /// digest, HF commit sha, ... Part of the cache key and the volume
    /// context.
    pub revision: String,
    pub files: Vec<RemoteFile>,
}

impl Resolved {
    /// The sum of the listed sizes, None when a size is unknown. Sizes come
    /// from the server: a sum past 2^64 is its fault, not a panic of ours.
    pub fn total_bytes(&self) -> Result<Option<u64>> {
        let mut total = Some(0u64);
        for f in &self.files {
            let Some(size) = f.size else {
                total = None;
                continue;
            };
            if let Some(t) = total {
                total = Some(t.checked_add(size).ok_or_else(|| {
                    Error::SourceFault(format!(
                        "{} lists file sizes that add up to more than 2^64 bytes ({:?} is {size} bytes)",
                        self.uri, f.path
                    ))
                })?);
            }
        }
        Ok(total)
    }

    /// The sum of the sizes that are known, saturating: what a listing
    /// already says about the model's size even when some sizes are unknown.
    pub fn known_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter_map(|f| f.size)
            .fold(0u64, u64::saturating_add)
    }
}

/// Bytes with an optional K/M/G/T suffix (powers of 1024, `i` and `B`
/// optional), e.g. `512Mi` or `50G`: flags and StorageClass parameters.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().trim_end_matches('B').trim_end_matches('i');
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size like 512Mi or 50G"))
}

/// Entries a source lists before it gives up, whatever the flags say: the
/// listing is held in memory before the engine can judge it.
pub const MAX_LISTED_FILES: usize = 1 << 20;

#[async_trait::async_trait]
pub trait Source: Send + Sync {
    /// Lists the model's files at one immutable revision.
    async fn resolve(&self) -> Result<Resolved>;

    /// Streams bytes `[offset, offset + len)` of `file` (to the end when
    /// `len` is None). Must honour `offset` exactly: the engine resumes and
    /// splits large files into parallel ranges through it.
    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>>;

    /// Bytes of `file` failed the origin's digest. A source that took any
    /// of them from somewhere other than the origin (a peer) stops doing
    /// so for this file and returns true: the engine fetches the file
    /// again. The origin's own bytes are final: false.
    fn distrust(&self, _file: &RemoteFile) -> bool {
        false
    }

    /// The MD5 the engine must check `file`'s bytes against, lowercase
    /// hex: only for bytes that did not all come from the origin. An
    /// origin's claim ([`Source::origin_md5`]) is not always a digest (S3
    /// encryption with KMS changes ETags), and its own bytes are final; so
    /// only a source in front of the origin answers, for files it served
    /// from elsewhere.
    fn content_md5(&self, _file: &RemoteFile) -> Option<String> {
        None
    }

    /// The sha256 of each `CHUNK_BYTES` of `file` as a copy verified
    /// against the origin's digest states it (a sealed peer's chunk
    /// table), when such a copy serves it: what lets a reader of a
    /// progressive volume read each chunk the pull's hasher matched
    /// against it, before the whole file is checked. None for an origin:
    /// it states no chunk digests.
    fn chunk_table(&self, _file: &RemoteFile) -> Option<Vec<String>> {
        None
    }

    /// The MD5 of `file`'s bytes as the origin states it, when it states
    /// nothing stronger (an S3 ETag that looks like one), lowercase hex:
    /// what bytes from elsewhere are checked against.
    fn origin_md5(&self, _file: &RemoteFile) -> Option<String> {
        None
    }

    /// What the URI itself pins, when it pins the content (a commit sha,
    /// `#sha256=`): the normalized URI and the revision `resolve` would
    /// return, without asking the origin. A pull of a pinned model goes on
    /// from peers while the origin is down.
    fn pinned(&self) -> Option<Pinned> {
        None
    }

    /// Whether someone the admin does not vouch for named this source (a
    /// tenant's PVC or pod, a registry's answer): such a pull is served
    /// from peers only to a requester that proved its access at the
    /// origin, which cannot happen while the origin is down.
    fn tenant_named(&self) -> bool {
        false
    }

    /// Where the bytes served so far came from, when not only from the
    /// origin: the peers (node names) that served some, and whether the
    /// origin served any. For progress events, metrics and the seal.
    fn provenance(&self) -> Option<Provenance> {
        None
    }

    /// Whether `read` can start anywhere but 0. Sources that cannot are
    /// fetched whole, restarting from 0 after a failure.
    fn ranges(&self) -> bool {
        true
    }

    /// What else, beyond `Resolved::uri` and the revision, decides which
    /// bytes this source serves (its endpoint, a URL's query): part of the
    /// cache key, so a class pointing at another server can never seal
    /// bytes under the key of a real model. Never shown; may hold secrets.
    fn key_scope(&self) -> String {
        String::new()
    }

    /// Limits the StorageClass set for this source (`maxModelBytes`,
    /// `maxModelFiles`); they lower the driver's, never raise them.
    fn limits(&self) -> Option<PullLimits> {
        None
    }

    /// Who asks, as far as the origin can tell them apart: a digest of the
    /// credentials this source presents (never the credentials). A cache
    /// hit is authorised once per requester and model for a while
    /// (`Engine`), not on every volume. `puller::open` sets it on every
    /// source it makes; None (a source built by hand: tests, embedding)
    /// means no requester to tell apart, and no authorisation.
    fn requester(&self) -> Option<String> {
        None
    }

    /// Proves that this requester may read the model's content, before a
    /// cache hit hands it the sealed copy. A listing proves nothing: a
    /// gated Hub repo lists publicly and gates only `/resolve/`, and an
    /// S3 prefix may allow List but not Get. So one byte is read with the
    /// requester's own credentials from the largest file (the weights,
    /// what is worth gating) and from the first one listed: an origin
    /// that serves one small file ungated (`.gitattributes`) does not
    /// open the rest. For OCI, a blob, after the manifest `resolve`
    /// fetched with them.
    async fn authorize(&self, resolved: &Resolved) -> Result<()> {
        use futures::StreamExt;
        let non_empty = || {
            resolved
                .files
                .iter()
                .filter(|f| f.size.is_none_or(|s| s > 0))
        };
        let first = non_empty().next();
        let largest = non_empty().max_by_key(|f| f.size.unwrap_or(u64::MAX));
        let mut probes: Vec<&RemoteFile> = first.into_iter().chain(largest).collect();
        probes.dedup_by(|a, b| a.path == b.path);
        let len = self.ranges().then_some(1);
        let probe = |f: &RemoteFile| {
            let f = f.clone();
            async move {
                let mut stream = self.read(&f, 0, len).await?;
                // A source without ranges streams the whole file: the first
                // chunk answers the question, and dropping the stream ends
                // the request.
                match stream.next().await {
                    Some(Err(e)) => Err(e),
                    _ => Ok(()),
                }
            }
        };
        futures::future::try_join_all(probes.into_iter().map(probe))
            .await
            .map(drop)
    }
}

/// A model's identity as its URI pins it (`Source::pinned`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub uri: String,
    pub revision: String,
    /// Files whose sha256 the URI itself states (`#sha256=`): path ->
    /// sha256. Empty when the pin is the revision alone (a commit).
    pub files: std::collections::BTreeMap<String, String>,
}

/// Where a pull's bytes came from (`Source::provenance`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provenance {
    pub peers: Vec<String>,
    pub origin: bool,
}

impl Provenance {
    /// "from 2 peers and the origin", "from 1 peer".
    pub fn describe(&self) -> String {
        let peers = match self.peers.len() {
            0 => String::new(),
            1 => "1 peer".to_string(),
            n => format!("{n} peers"),
        };
        match (peers.is_empty(), self.origin) {
            (true, _) => "from the origin".into(),
            (false, true) => format!("from {peers} and the origin"),
            (false, false) => format!("from {peers}"),
        }
    }
}

/// Where a pull's bytes may come from besides its origin (peer fill):
/// given to the engine at start-up, asked once per pull.
#[async_trait::async_trait]
pub trait Fill: Send + Sync {
    /// A source for model `sid` in `root` that takes bytes from elsewhere
    /// first and from `origin` for the rest, or None when nothing else
    /// holds the model. Every byte it serves must be checked against a
    /// digest `resolved` (the origin) vouches for.
    async fn around(
        &self,
        root: &crate::cache::Root,
        sid: &crate::cache::SourceId,
        resolved: &Resolved,
        origin: Arc<dyn Source>,
    ) -> Option<Arc<dyn Source>>;

    /// The listing of pinned model `sid` from peers that hold it sealed,
    /// for a pull while its origin is down; None when none does.
    async fn listing(
        &self,
        root: &crate::cache::Root,
        sid: &crate::cache::SourceId,
        pin: &Pinned,
    ) -> Option<Resolved>;

    /// The pull `around` was asked about ended, `sealed` or not.
    fn ended(&self, root: &crate::cache::Root, sid: &crate::cache::SourceId, sealed: bool);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provenance_reads_as_a_phrase() {
        let p = |peers: &[&str], origin| Provenance {
            peers: peers.iter().map(|s| s.to_string()).collect(),
            origin,
        };
        assert_eq!(
            p(&["a", "b"], true).describe(),
            "from 2 peers and the origin"
        );
        assert_eq!(p(&["a"], false).describe(), "from 1 peer");
        assert_eq!(p(&[], true).describe(), "from the origin");
    }
}
