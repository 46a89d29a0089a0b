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
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::id::SourceId;
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
    /// get EIO.
    Failed(String),
    /// Bytes `[0, bytes)` of the file, at `at`, matched a chunk table a
    /// verified copy states ([`Partial::expect_chunks`]), chunk by chunk
    /// as the pull's hasher passed them: readable before the file's own
    /// verdict. 0: the file starts arriving again.
    Readable { bytes: u64, at: PathBuf },
    /// Its bytes failed their digest and are fetched again: what readers
    /// may read is back to nothing, and they wait on (an EIO now would
    /// fail a model load that the next fetch mends).
    Refetching(String),
}

/// Told the path of each file the pull decided, and what.
pub type Listener = Box<dyn Fn(&str, &Verdict) + Send + Sync>;

/// A chunk table one file's bytes are matched against as they are hashed.
struct Expected {
    table: Vec<String>,
    /// Leading chunks that matched.
    matched: usize,
}

/// What listeners were told, so that one subscribing late hears it too.
#[derive(Default)]
struct Told {
    /// Files whole, verified and in place.
    done: std::collections::BTreeSet<String>,
    /// Files readable up to a point before their verdict.
    readable: HashMap<String, (u64, PathBuf)>,
    listeners: Vec<Listener>,
}

/// The partial view of one model's pull in this process.
#[derive(Default)]
pub struct Partial {
    files: Mutex<HashMap<String, FileView>>,
    /// Chunk tables files are matched against (`expect_chunks`).
    expected: Mutex<HashMap<String, Expected>>,
    /// Verdicts so far, and who wants to hear of more.
    told: Mutex<Told>,
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
    /// A create answered on this pull's verdicts has recorded its volume.
    answered: tokio::sync::watch::Sender<bool>,
    stage: tokio::sync::watch::Sender<Stage>,
}

/// How far a pull has come before its seal, in the order it gets there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Its area is open; what it will hold is not known yet.
    #[default]
    Opened,
    /// Its listing is known: every file and final size.
    Listed,
    /// Every listed file is whole and verified.
    Verified,
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
            self.reached(Stage::Listed);
            if self.all_verified() {
                self.reached(Stage::Verified);
            }
        }
    }

    fn reached(&self, stage: Stage) {
        self.stage.send_if_modified(|s| {
            let later = stage > *s;
            *s = (*s).max(stage);
            later
        });
    }

    /// Changes as the pull reaches each [`Stage`].
    pub fn stage(&self) -> tokio::sync::watch::Receiver<Stage> {
        self.stage.subscribe()
    }

    /// The model's files and sizes, once the pull listed them.
    pub fn listing(&self) -> Option<&[(String, u64)]> {
        self.listing.get().map(Vec::as_slice)
    }

    fn told(&self) -> std::sync::MutexGuard<'_, Told> {
        self.told.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A file starts (or resumes) arriving at `at`: nothing of it is
    /// readable until its chunks are matched again.
    pub fn begin(&self, path: &str, size: u64, at: PathBuf) {
        self.files().insert(
            path.to_string(),
            FileView {
                size,
                at: at.clone(),
                hashed: 0,
                chunks: Vec::new(),
            },
        );
        self.expected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(path);
        let mut told = self.told();
        if told.readable.remove(path).is_some_and(|(n, _)| n > 0) {
            let v = Verdict::Readable { bytes: 0, at };
            told.listeners.iter().for_each(|l| l(path, &v));
        }
    }

    /// `path`'s chunks, as they are hashed, are matched against `table`;
    /// each leading chunk that matches is readable at once.
    pub fn expect_chunks(&self, path: &str, table: Vec<String>) {
        self.expected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(path.to_string(), Expected { table, matched: 0 });
    }

    /// The hasher of `path` reached `hashed`, with `chunks` the digests of
    /// every whole chunk so far.
    pub fn hashed(&self, path: &str, hashed: u64, chunks: &[String]) {
        let size = {
            let mut files = self.files();
            let Some(f) = files.get_mut(path) else {
                return;
            };
            f.hashed = f.hashed.max(hashed);
            if chunks.len() > f.chunks.len() {
                f.chunks.extend_from_slice(&chunks[f.chunks.len()..]);
            }
            f.size
        };
        self.changed.notify_waiters();
        let readable = {
            let mut expected = self.expected.lock().unwrap_or_else(|p| p.into_inner());
            let Some(e) = expected.get_mut(path) else {
                return;
            };
            let before = e.matched;
            // A chunk that does not match stops the readable prefix there
            // for this fetch: nothing after it is read before the verdict.
            while e.matched < chunks.len().min(e.table.len())
                && chunks[e.matched].eq_ignore_ascii_case(&e.table[e.matched])
            {
                e.matched += 1;
            }
            if e.matched == before {
                return;
            }
            (e.matched as u64 * CHUNK_BYTES).min(size)
        };
        // Only when the prefix moved: the path is not cloned per window.
        let Some(at) = self.files().get(path).map(|f| f.at.clone()) else {
            return;
        };
        let mut told = self.told();
        if told.done.contains(path) {
            return;
        }
        told.readable
            .insert(path.to_string(), (readable, at.clone()));
        let v = Verdict::Readable {
            bytes: readable,
            at,
        };
        told.listeners.iter().for_each(|l| l(path, &v));
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
        let mut told = self.told();
        told.readable.remove(path);
        if told.done.insert(path.to_string()) {
            for l in &told.listeners {
                l(path, &Verdict::Verified);
            }
        }
        drop(told);
        if self.all_verified() {
            self.reached(Stage::Verified);
        }
    }

    /// A create answered before the seal has recorded its volume: the
    /// pull may now make its bytes durable. (An fsync of the volume's
    /// record waited seconds behind a model's writeback on ext4 here.)
    pub fn answered(&self) {
        self.answered.send_replace(true);
    }

    /// Waits until [`Partial::answered`], or a moment after every file
    /// is verified (nobody is answering then), or `bound`; at once while
    /// much of the model is still to arrive, or while some file has not
    /// begun: then the answer is far off, and a file that ended early is
    /// made durable now, so that a crash before the answer resumes from
    /// it. (A file waiting here holds its transfer slot: with files still
    /// queued behind the slots, the answer, which needs their verdicts,
    /// would only come at `bound`, one wave of files at a time.)
    pub async fn until_answered(&self, bound: Duration) {
        /// How long a create told of the last verdict takes to record its
        /// volume and say so.
        const GRACE: Duration = Duration::from_secs(1);
        if !self.all_begun() {
            return;
        }
        let total: u64 = self.listing().map_or(0, |l| l.iter().map(|(_, n)| n).sum());
        let left = total.saturating_sub(self.moved());
        if left > (64 << 20u64).max(total / 20) {
            return;
        }
        let mut rx = self.answered.subscribe();
        let mut stage = self.stage.subscribe();
        let deadline = tokio::time::Instant::now() + bound;
        let mut verified_at = None;
        loop {
            if *rx.borrow_and_update() {
                return;
            }
            let until = if *stage.borrow_and_update() == Stage::Verified {
                let at = *verified_at.get_or_insert_with(tokio::time::Instant::now);
                (at + GRACE).min(deadline)
            } else {
                deadline
            };
            tokio::select! {
                _ = rx.changed() => {}
                _ = stage.changed() => {}
                () = tokio::time::sleep_until(until) => return,
            }
        }
    }

    /// Every listed file has begun arriving or is in place: none waits
    /// for a transfer slot.
    fn all_begun(&self) -> bool {
        let Some(listing) = self.listing() else {
            return false;
        };
        let files = self.files();
        listing.iter().all(|(p, _)| files.contains_key(p))
    }

    /// Whether every file of the listing is verified (false before the
    /// listing is known).
    pub fn all_verified(&self) -> bool {
        let Some(listing) = self.listing() else {
            return false;
        };
        let told = self.told();
        listing.iter().all(|(p, _)| told.done.contains(p))
    }

    /// `path` failed its digest and will not be fetched again by this pull.
    pub fn failed(&self, path: &str, why: &str) {
        self.tell_failure(path, Verdict::Failed(why.to_string()));
    }

    /// `path` failed its digest and is fetched again.
    pub fn refetching(&self, path: &str, why: &str) {
        self.tell_failure(path, Verdict::Refetching(why.to_string()));
    }

    fn tell_failure(&self, path: &str, v: Verdict) {
        self.expected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(path);
        let mut told = self.told();
        told.readable.remove(path);
        told.listeners.iter().for_each(|l| l(path, &v));
    }

    /// Calls `listener` with every file verified or readable in part so
    /// far, then with each verdict from now on (under one lock: none is
    /// missed or told twice).
    pub fn subscribe(&self, listener: Listener) {
        let mut told = self.told();
        for path in &told.done {
            listener(path, &Verdict::Verified);
        }
        for (path, (bytes, at)) in &told.readable {
            listener(
                path,
                &Verdict::Readable {
                    bytes: *bytes,
                    at: at.clone(),
                },
            );
        }
        told.listeners.push(listener);
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

/// The views of the pulls running in one root in this process: how the
/// node's progressive volumes, its peer server and an early create find a
/// pull they did not start. Cloned with its root; the views are weak, so
/// a pull that ended is never found.
#[derive(Clone, Default)]
pub struct Pulls(Arc<PullsInner>);

#[derive(Default)]
struct PullsInner {
    views: Mutex<HashMap<SourceId, Weak<Partial>>>,
    /// Counts the pulls started: a waiter for a pull not yet begun is
    /// told when one is.
    started: tokio::sync::watch::Sender<u64>,
}

impl Pulls {
    /// A new view for the pull of `sid`, found by [`Pulls::get`] for as
    /// long as it lives.
    pub fn register(&self, sid: &SourceId) -> Arc<Partial> {
        let view = Arc::new(Partial::default());
        let mut views = self.0.views.lock().unwrap_or_else(|p| p.into_inner());
        views.retain(|_, w| w.strong_count() > 0);
        views.insert(sid.clone(), Arc::downgrade(&view));
        drop(views);
        self.0.started.send_modify(|n| *n += 1);
        view
    }

    /// The view of `sid`'s pull, while one runs.
    pub fn get(&self, sid: &SourceId) -> Option<Arc<Partial>> {
        self.0
            .views
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sid)
            .and_then(Weak::upgrade)
    }

    /// Changes each time a pull starts.
    pub fn starts(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.started.subscribe()
    }
}

impl std::fmt::Debug for Pulls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let views = self.0.views.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_set()
            .entries(
                views
                    .iter()
                    .filter(|(_, w)| w.strong_count() > 0)
                    .map(|(k, _)| k),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only leading chunks that match the table are readable: a chunk
    /// that does not stops the prefix, even if later ones match; a late
    /// subscriber hears the prefix; a refetch and a new fetch take it back.
    #[test]
    fn a_prefix_is_readable_only_as_far_as_the_chunk_table_matches() {
        let view = Partial::default();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        view.subscribe(Box::new(move |p, v| {
            h.lock().unwrap().push((p.to_string(), v.clone()));
        }));
        let at = PathBuf::from("/area/partial/x.part");
        view.begin("w", 4 * CHUNK_BYTES - 5, at.clone());
        view.expect_chunks("w", vec!["a".into(), "b".into(), "c".into(), "d".into()]);
        view.hashed("w", CHUNK_BYTES, &["A".into()]);
        view.hashed("w", 2 * CHUNK_BYTES, &["a".into(), "b".into()]);
        view.hashed("w", 3 * CHUNK_BYTES, &["a".into(), "b".into(), "x".into()]);
        let all: Vec<String> = ["a", "b", "x", "d"].map(String::from).to_vec();
        view.hashed("w", 4 * CHUNK_BYTES - 5, &all);
        let readable = |bytes| Verdict::Readable {
            bytes,
            at: at.clone(),
        };
        assert_eq!(
            *heard.lock().unwrap(),
            [
                ("w".to_string(), readable(CHUNK_BYTES)),
                ("w".to_string(), readable(2 * CHUNK_BYTES))
            ],
            "the first hash matched case-insensitively; the third chunk did not"
        );
        let late = Arc::new(Mutex::new(Vec::new()));
        let l = late.clone();
        view.subscribe(Box::new(move |p, v| {
            l.lock().unwrap().push((p.to_string(), v.clone()));
        }));
        assert_eq!(
            *late.lock().unwrap(),
            [("w".to_string(), readable(2 * CHUNK_BYTES))]
        );
        view.refetching("w", "sha256 mismatch");
        view.begin("w", 4 * CHUNK_BYTES - 5, at.clone());
        // No table this time (its peers distrusted): nothing is readable.
        view.hashed("w", CHUNK_BYTES, &["a".into()]);
        assert_eq!(
            late.lock().unwrap()[1..],
            [(
                "w".to_string(),
                Verdict::Refetching("sha256 mismatch".into())
            )]
        );
    }

    #[tokio::test]
    async fn a_reader_waits_for_a_chunk_while_the_pull_moves() {
        let pulls = Pulls::default();
        let sid = SourceId::parse("m0123456789abcdef0123456789abcd1").unwrap();
        let view = pulls.register(&sid);
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
        assert!(pulls.get(&sid).is_some());
        drop(view);
        assert!(pulls.get(&sid).is_none());
    }

    /// A file that ends while another waits to begin does not wait for
    /// the answer (which needs that other's verdict); once every file has
    /// begun, one waits for it.
    #[tokio::test]
    async fn durability_waits_for_the_answer_only_once_every_file_has_begun() {
        let view = Arc::new(Partial::default());
        view.listed(Some(vec![("a".into(), 10), ("b".into(), 10)]));
        view.begin("a", 10, PathBuf::from("/area/partial/a.part"));
        let started = std::time::Instant::now();
        view.until_answered(Duration::from_secs(30)).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "b has not begun"
        );
        view.begin("b", 10, PathBuf::from("/area/partial/b.part"));
        let waiting = tokio::spawn({
            let view = view.clone();
            async move { view.until_answered(Duration::from_secs(30)).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiting.is_finished(), "every file has begun: it waits");
        view.answered();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("answered: it goes on")
            .unwrap();
    }

    /// The stages come in order, each told once; a registry is told of
    /// each pull that starts and finds only the live ones.
    #[tokio::test]
    async fn a_pull_is_listed_then_verified_and_its_registry_hears_it_start() {
        let pulls = Pulls::default();
        let mut starts = pulls.starts();
        let sid = SourceId::parse("m0123456789abcdef0123456789abcd2").unwrap();
        let view = pulls.register(&sid);
        assert!(starts.has_changed().unwrap(), "a start is told");
        starts.borrow_and_update();
        let mut stage = view.stage();
        assert_eq!(*stage.borrow_and_update(), Stage::Opened);
        view.listed(None);
        assert!(!stage.has_changed().unwrap(), "no listing, no stage");
        view.listed(Some(vec![("a".into(), 3), ("b".into(), 4)]));
        assert_eq!(*stage.borrow_and_update(), Stage::Listed);
        view.finished("a", 3, "/area/a".into(), vec![]);
        assert!(!stage.has_changed().unwrap(), "b is still to come");
        view.finished("b", 4, "/area/b".into(), vec![]);
        assert_eq!(*stage.borrow_and_update(), Stage::Verified);
        view.finished("b", 4, "/area/b".into(), vec![]);
        assert!(!stage.has_changed().unwrap(), "told once");
        assert!(!starts.has_changed().unwrap());
        drop(view);
        assert!(pulls.get(&sid).is_none());
    }
}
