//! What a pull in progress has hashed so far, file by file: the prefix of
//! each file its in-order hasher has covered, and that prefix's chunk
//! digests. Peers serve from it while the model is still arriving.
//!
//! These bytes are written, not yet verified: a file's sha256 is checked
//! against the origin's only once it is whole. A reader of a partial view
//! (another node's pull) checks every chunk against the digest it is sent
//! and the whole file against the origin's own sha256, so a prefix is
//! never trusted on this node's word alone.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use super::manifest::CHUNK_BYTES;

/// One file of a pull in progress.
#[derive(Clone, Debug)]
pub struct FileView {
    pub size: u64,
    /// Where its bytes are now: the partial file, then the file in place.
    pub at: PathBuf,
    /// Bytes `[0, hashed)` are written and hashed.
    pub hashed: u64,
    /// The digests of the whole chunks in `[0, hashed)` (and of the last,
    /// short one once the file is whole).
    pub chunks: Vec<String>,
}

impl FileView {
    /// Whether chunk `idx` is written and hashed.
    pub fn has_chunk(&self, idx: u64) -> bool {
        (idx as usize) < self.chunks.len()
    }

    /// The bytes of chunk `idx`: `[start, end)`.
    pub fn chunk_range(&self, idx: u64) -> (u64, u64) {
        let start = idx.saturating_mul(CHUNK_BYTES);
        (start, start.saturating_add(CHUNK_BYTES).min(self.size))
    }
}

/// What a pull decided about one of its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Whole, verified and in place.
    Verified,
    /// Its bytes failed their digest and the pull gave up on it: readers
    /// get EIO. (A failure the pull mends by fetching the file again is
    /// not told: readers wait on through it.)
    Failed(String),
}

/// Told the path of each file the pull decided, and what.
pub type Listener = Box<dyn Fn(&str, &Verdict) + Send + Sync>;

/// The partial view of one model's pull in this process.
#[derive(Default)]
pub struct Partial {
    files: Mutex<HashMap<String, FileView>>,
    /// Files whole, verified and in place, and who wants to hear of more.
    done: Mutex<(std::collections::BTreeSet<String>, Vec<Listener>)>,
    /// Bytes arrived so far across files: a reader waiting for a chunk
    /// waits while this moves.
    moved: AtomicU64,
    changed: tokio::sync::Notify,
    /// Files readers are waiting for, in the order they asked: the pull
    /// fetches these next.
    wanted: Mutex<Vec<String>>,
    /// Every file the model will hold, with its final size, in the
    /// listing's order: known before any byte, so a progressive volume can
    /// show the whole tree at once.
    listing: std::sync::OnceLock<Vec<(String, u64)>>,
}

impl Partial {
    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<String, FileView>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pull knows its listing: `files` with their final sizes, or None
    /// when some size is not listed (a layer still to unpack), and the tree
    /// cannot be shown before its bytes.
    pub fn listed(&self, files: Option<Vec<(String, u64)>>) {
        if let Some(files) = files {
            let _ = self.listing.set(files);
        }
    }

    /// The model's files and sizes, once the pull listed them.
    pub fn listing(&self) -> Option<&[(String, u64)]> {
        self.listing.get().map(Vec::as_slice)
    }

    /// A file starts (or resumes) arriving at `at`.
    pub fn begin(&self, path: &str, size: u64, at: PathBuf) {
        self.files().insert(
            path.to_string(),
            FileView {
                size,
                at,
                hashed: 0,
                chunks: Vec::new(),
            },
        );
    }

    /// The hasher of `path` reached `hashed`, with `chunks` the digests of
    /// every whole chunk so far.
    pub fn hashed(&self, path: &str, hashed: u64, chunks: &[String]) {
        {
            let mut files = self.files();
            let Some(f) = files.get_mut(path) else {
                return;
            };
            f.hashed = f.hashed.max(hashed);
            if chunks.len() > f.chunks.len() {
                f.chunks.extend_from_slice(&chunks[f.chunks.len()..]);
            }
        }
        self.changed.notify_waiters();
    }

    /// `n` more bytes of the model arrived (written, hashed or not yet):
    /// what tells a waiting reader the pull is moving. The hashed prefix
    /// alone moves in steps (a range ahead of it waits for the one before),
    /// which would look like a stall.
    pub fn arrived(&self, n: u64) {
        self.moved.fetch_add(n, Ordering::Relaxed);
    }

    /// A reader waits for `path`: the pull takes it next.
    pub fn want(&self, path: &str) {
        let mut w = self.wanted.lock().unwrap_or_else(|p| p.into_inner());
        if !w.iter().any(|p| p == path) {
            w.push(path.to_string());
        }
    }

    /// Files readers wait for and the pull has not finished, first asked
    /// first.
    pub fn wanted(&self) -> Vec<String> {
        self.wanted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `path` is whole, verified and in place at `at`.
    pub fn finished(&self, path: &str, size: u64, at: PathBuf, chunks: Vec<String>) {
        self.wanted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|p| p != path);
        self.files().insert(
            path.to_string(),
            FileView {
                size,
                at,
                hashed: size,
                chunks,
            },
        );
        self.changed.notify_waiters();
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.0.insert(path.to_string()) {
            for l in &done.1 {
                l(path, &Verdict::Verified);
            }
        }
    }

    /// Whether every file of the listing is verified (false before the
    /// listing is known).
    pub fn all_verified(&self) -> bool {
        let Some(listing) = self.listing() else {
            return false;
        };
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        listing.iter().all(|(p, _)| done.0.contains(p))
    }

    /// `path` failed its digest and will not be fetched again by this pull.
    pub fn failed(&self, path: &str, why: &str) {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        for l in &done.1 {
            l(path, &Verdict::Failed(why.to_string()));
        }
    }

    /// Calls `listener` with every file verified so far, then with each
    /// one verified from now on (under one lock: none is missed or told
    /// twice).
    pub fn subscribe(&self, listener: Listener) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        for path in &done.0 {
            listener(path, &Verdict::Verified);
        }
        done.1.push(listener);
    }

    pub fn file(&self, path: &str) -> Option<FileView> {
        self.files().get(path).cloned()
    }

    /// Bytes arrived so far, across files.
    pub fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    /// Waits until `ready` holds of `path`'s view, as long as the pull
    /// keeps moving at least `min_bytes` every `window`; returns the view,
    /// or None when the pull stalled, ended or `max` passed.
    pub async fn wait_for(
        &self,
        path: &str,
        ready: impl Fn(&FileView) -> bool,
        min_bytes: u64,
        window: Duration,
        max: Duration,
    ) -> Option<FileView> {
        let deadline = tokio::time::Instant::now() + max;
        let mut mark = (tokio::time::Instant::now(), self.moved());
        loop {
            let notified = self.changed.notified();
            if let Some(f) = self.file(path).filter(|f| ready(f)) {
                return Some(f);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return None;
            }
            if now.duration_since(mark.0) >= window {
                if self.moved().saturating_sub(mark.1) < min_bytes {
                    return None;
                }
                mark = (now, self.moved());
            }
            let _ = tokio::time::timeout(
                window.min(deadline.saturating_duration_since(now)),
                notified,
            )
            .await;
        }
    }
}

static PULLS: LazyLock<Mutex<HashMap<String, Weak<Partial>>>> = LazyLock::new(Default::default);

/// A new view for the pull of `sid` in this process, findable by
/// [`lookup`] for as long as it lives.
pub fn register(sid: &str) -> Arc<Partial> {
    let view = Arc::new(Partial::default());
    let mut pulls = PULLS.lock().unwrap_or_else(|p| p.into_inner());
    pulls.retain(|_, w| w.strong_count() > 0);
    pulls.insert(sid.to_string(), Arc::downgrade(&view));
    view
}

/// The view of `sid`'s pull, while one runs in this process.
pub fn lookup(sid: &str) -> Option<Arc<Partial>> {
    PULLS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(sid)
        .and_then(Weak::upgrade)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reader_waits_for_a_chunk_while_the_pull_moves() {
        let view = register("m0123456789abcdef0123456789abcd1");
        view.begin("w", 3 * CHUNK_BYTES, "/nowhere".into());
        let v = view.clone();
        let writer = tokio::spawn(async move {
            for i in 1..=2u64 {
                tokio::time::sleep(Duration::from_millis(30)).await;
                let chunks: Vec<String> = (0..i).map(|k| format!("c{k}")).collect();
                v.arrived(CHUNK_BYTES);
                v.hashed("w", i * CHUNK_BYTES, &chunks);
            }
        });
        let got = view
            .wait_for(
                "w",
                |f| f.has_chunk(1),
                1,
                Duration::from_secs(1),
                Duration::from_secs(5),
            )
            .await
            .expect("chunk 1 arrives");
        assert_eq!(got.chunks, ["c0", "c1"]);
        writer.await.unwrap();
        // Nothing moves any more: a wait for chunk 2 gives up after a window.
        let started = std::time::Instant::now();
        let none = view
            .wait_for(
                "w",
                |f| f.has_chunk(2),
                1,
                Duration::from_millis(100),
                Duration::from_secs(5),
            )
            .await;
        assert!(none.is_none());
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(lookup("m0123456789abcdef0123456789abcd1").is_some());
        drop(view);
        assert!(lookup("m0123456789abcdef0123456789abcd1").is_none());
    }
}
