//! Which files of a model still arriving may be read: each is pending,
//! verified or failed, and a reader of a pending file waits, bounded, for
//! the pull to decide, unless what it reads lies in the file's prefix
//! already matched chunk by chunk against a chunk table. Readers are told
//! only what the verifier decided: nothing here looks at bytes.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a reader of one file may do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Not verified yet: wait.
    Pending,
    /// Every byte matched the origin's digest: read.
    Verified,
    /// Its bytes failed their digest (or could not be fetched): EIO until
    /// it is fetched again and verified.
    Failed(String),
}

/// The answer a waiting reader gets.
#[derive(Debug, PartialEq, Eq)]
pub enum Wait {
    Verified,
    Failed(String),
    /// Nothing was decided within the bound: the reader gets EIO rather
    /// than hanging forever on a stalled fill.
    TimedOut,
}

/// The gates of one model's files, by index in its listing.
pub struct Gates {
    state: Mutex<Inner>,
    changed: Condvar,
    /// Told of each file a reader starts waiting for (the fill's queue).
    asker: Mutex<Option<Asker>>,
}

/// Hears which file a reader waits for.
pub type Asker = Box<dyn Fn(usize) + Send + Sync>;

struct Inner {
    files: Vec<State>,
    /// Of each pending file, the prefix matched against a chunk table and
    /// where its bytes are (the pull's partial file).
    readable: Vec<Option<(u64, PathBuf)>>,
    /// Files a reader is waiting for now: the fill takes them first.
    asked: BTreeSet<usize>,
    /// Bumped at every verdict, for [`Gates::changed_since`].
    generation: u64,
}

impl Gates {
    /// `n` files, all pending.
    pub fn new(n: usize) -> Gates {
        Gates {
            state: Mutex::new(Inner {
                files: vec![State::Pending; n],
                readable: vec![None; n],
                asked: BTreeSet::new(),
                generation: 0,
            }),
            changed: Condvar::new(),
            asker: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn state(&self, file: usize) -> State {
        self.lock()
            .files
            .get(file)
            .cloned()
            .unwrap_or(State::Failed("no such file".into()))
    }

    fn set(&self, file: usize, s: State) {
        let mut g = self.lock();
        if let Some(f) = g.files.get_mut(file) {
            *f = s;
        }
        // A verdict ends what the chunk table said: verified, the whole
        // file is read; failed or fetched again, nothing before the next
        // match.
        if let Some(r) = g.readable.get_mut(file) {
            *r = None;
        }
        g.asked.remove(&file);
        g.generation += 1;
        drop(g);
        self.changed.notify_all();
    }

    /// Wakes whoever waits in [`Gates::changed_since`] without a verdict:
    /// something else it watches changed.
    pub fn nudge(&self) {
        self.lock().generation += 1;
        self.changed.notify_all();
    }

    /// Records that a reader waits for `file` (the fill takes it first),
    /// without blocking: for a server that parks the request.
    pub fn ask(&self, file: usize) {
        let mut g = self.lock();
        let first = g.files.get(file) == Some(&State::Pending) && g.asked.insert(file);
        drop(g);
        if first {
            let asker = self.asker.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(tell) = asker.as_ref() {
                tell(file);
            }
        }
    }

    /// Who hears of each file readers start waiting for.
    pub fn set_asker(&self, asker: Asker) {
        *self.asker.lock().unwrap_or_else(|p| p.into_inner()) = Some(asker);
    }

    /// The generation of verdicts now: what [`Gates::changed_since`] waits
    /// to move past.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Waits, at most `bound`, for a verdict after generation `seen`;
    /// returns the generation then. One waiter serves every parked reader
    /// of a volume.
    pub fn changed_since(&self, seen: u64, bound: Duration) -> u64 {
        let deadline = Instant::now() + bound;
        let mut g = self.lock();
        while g.generation == seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            g = self
                .changed
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.generation
    }

    /// The verifier matched every byte of `file`.
    pub fn verified(&self, file: usize) {
        self.set(file, State::Verified);
    }

    /// `file` failed (its digest, or its fetch): readers get EIO.
    pub fn failed(&self, file: usize, why: impl Into<String>) {
        self.set(file, State::Failed(why.into()));
    }

    /// `file` is being fetched again: readers wait once more.
    pub fn refetching(&self, file: usize) {
        self.set(file, State::Pending);
    }

    /// Bytes `[0, bytes)` of pending `file`, at `at`, matched a chunk
    /// table: readers of them need not wait for the verdict. 0: none.
    pub fn readable(&self, file: usize, bytes: u64, at: PathBuf) {
        let mut g = self.lock();
        if g.files.get(file) != Some(&State::Pending) {
            return;
        }
        if let Some(r) = g.readable.get_mut(file) {
            *r = (bytes > 0).then_some((bytes, at));
        }
        g.generation += 1;
        drop(g);
        self.changed.notify_all();
    }

    /// Where the bytes of pending `file` up to `end` may be read before
    /// its verdict, when they all lie in its matched prefix.
    pub fn readable_through(&self, file: usize, end: u64) -> Option<PathBuf> {
        let g = self.lock();
        match g.readable.get(file)? {
            Some((bytes, at)) if *bytes >= end && g.files.get(file) == Some(&State::Pending) => {
                Some(at.clone())
            }
            _ => None,
        }
    }

    /// Whether some prefix of pending `file` is readable.
    pub fn partly_readable(&self, file: usize) -> bool {
        self.lock().readable.get(file).is_some_and(Option::is_some)
    }

    /// Files readers are waiting for, lowest index first: the fill's
    /// queue jumpers.
    pub fn asked(&self) -> Vec<usize> {
        self.lock().asked.iter().copied().collect()
    }

    /// Waits until `file` is decided, at most `bound`.
    pub fn wait(&self, file: usize, bound: Duration) -> Wait {
        let deadline = Instant::now() + bound;
        let mut g = self.lock();
        loop {
            match g.files.get(file) {
                None => return Wait::Failed("no such file".into()),
                Some(State::Verified) => return Wait::Verified,
                Some(State::Failed(why)) => return Wait::Failed(why.clone()),
                Some(State::Pending) => {}
            }
            if !g.asked.contains(&file) {
                drop(g);
                self.ask(file);
                g = self.lock();
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Wait::TimedOut;
            }
            g = self
                .changed
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether every file is verified.
    pub fn all_verified(&self) -> bool {
        self.lock().files.iter().all(|s| *s == State::Verified)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_reader_waits_for_the_verdict_and_is_told_it() {
        let g = Arc::new(Gates::new(2));
        let waiting = {
            let g = g.clone();
            std::thread::spawn(move || g.wait(1, Duration::from_secs(10)))
        };
        while g.asked() != [1] {
            std::thread::yield_now();
        }
        g.verified(1);
        assert_eq!(waiting.join().unwrap(), Wait::Verified);
        assert!(g.asked().is_empty());
        g.failed(0, "sha256 mismatch");
        assert_eq!(
            g.wait(0, Duration::ZERO),
            Wait::Failed("sha256 mismatch".into())
        );
        g.refetching(0);
        assert_eq!(g.wait(0, Duration::from_millis(20)), Wait::TimedOut);
        assert!(!g.all_verified());
        g.verified(0);
        assert!(g.all_verified());
    }

    #[test]
    fn a_matched_prefix_is_readable_until_the_verdict_or_a_refetch() {
        let g = Gates::new(1);
        assert!(!g.partly_readable(0));
        g.readable(0, 16, "/p".into());
        assert!(g.partly_readable(0));
        assert_eq!(g.readable_through(0, 16), Some(PathBuf::from("/p")));
        assert_eq!(g.readable_through(0, 17), None);
        g.refetching(0);
        assert_eq!(g.readable_through(0, 1), None);
        g.readable(0, 8, "/q".into());
        assert_eq!(g.readable_through(0, 8), Some(PathBuf::from("/q")));
        g.failed(0, "sha256 mismatch");
        assert_eq!(g.readable_through(0, 1), None);
        // A prefix told after the verdict changes nothing.
        g.readable(0, 8, "/q".into());
        assert!(!g.partly_readable(0));
    }
}
