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

use bytes::Bytes;
use futures::stream::BoxStream;

use crate::error::Result;

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
    pub fn total_bytes(&self) -> Option<u64> {
        self.files.iter().map(|f| f.size).sum()
    }
}

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
}
