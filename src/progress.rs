//! A pull's progress, and where it is reported besides the log (Kubernetes
//! events, metrics, a terminal): the puller writes it, everyone else reads
//! it, so it lives below both.

use std::time::Duration;

/// Where pull progress goes besides the log (Kubernetes events, metrics).
pub trait ProgressSink: Send + Sync {
    /// The origin resolved the request to model `_sid`, which it calls
    /// `_uri` at `_revision` (before any byte, hit or pull).
    fn resolved(&self, _sid: &str, _uri: &str, _revision: &str) {}
    fn started(&self, _uri: &str, _total: Option<u64>) {}
    fn progress(&self, _p: &Progress) {}
    fn sealed(&self, _s: &Sealed<'_>) {}
    /// File `_file` of the pull of `_uri` failed its digest and is
    /// fetched again: `_why` says what failed and what happens next.
    fn refetching(&self, _uri: &str, _file: &str, _why: &str) {}
    /// Called by the pull's caller, for every failure (resolving included).
    fn failed(&self, _uri: &str, _error: &str) {}
}

/// A pull that ended in a seal.
#[derive(Clone, Copy, Debug)]
pub struct Sealed<'a> {
    pub uri: &'a str,
    pub revision: &'a str,
    pub bytes: u64,
    pub took: Duration,
    /// Where the bytes came from, when not only the origin.
    pub from: Option<&'a str>,
    /// Who signed the model, as the class's policy verified.
    pub signed_by: Option<&'a str>,
}

#[derive(Clone, Debug)]
pub struct Progress {
    pub uri: String,
    pub bytes: u64,
    pub total: Option<u64>,
    pub rate_bytes_per_sec: f64,
    pub eta: Option<Duration>,
    /// Where the bytes come from, when not only the origin ("from 2 peers
    /// and the origin").
    pub from: Option<String>,
}

pub struct NoProgress;
impl ProgressSink for NoProgress {}
