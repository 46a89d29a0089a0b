//! A pull's progress, and where it is reported besides the log (Kubernetes
//! events, metrics, a terminal): the puller writes it, everyone else reads
//! it, so it lives below both.

use std::time::Duration;

/// Where pull progress goes besides the log (Kubernetes events, metrics).
pub trait ProgressSink: Send + Sync {
    fn started(&self, _uri: &str, _total: Option<u64>) {}
    fn progress(&self, _p: &Progress) {}
    /// `from`: where the bytes came from, when not only the origin.
    fn sealed(
        &self,
        _uri: &str,
        _revision: &str,
        _bytes: u64,
        _took: Duration,
        _from: Option<&str>,
    ) {
    }
    /// Called by the pull's caller, for every failure (resolving included).
    fn failed(&self, _uri: &str, _error: &str) {}
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
