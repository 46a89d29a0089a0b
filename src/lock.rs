//! Per-volume operation guards and per-source mutexes.
//!
//! An RPC takes an `OpGuard` for its volume (or, for CreateVolume, its name)
//! before doing anything; a second call for the same key while the first runs
//! gets `Aborted`, which CSI defines as "operation pending" and COs retry.
//! Publishing and unpublishing hold their volume only at their own target:
//! kubelet starts a Deployment's pods, which share one claim, at once, and
//! an `Aborted` costs each of them a retry after half a second or more.
//! `KeyedMutex` serialises short critical sections on one source, where
//! waiting is right (e.g. two clones of one source added concurrently).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// How a key is held: whole, or at some paths (publish targets) only.
enum Held {
    Whole,
    At(HashSet<String>),
}

type Table = Arc<Mutex<HashMap<String, Held>>>;

#[derive(Clone, Default)]
pub struct OpLocks {
    held: Table,
}

/// Holds its key (or its path of the key) until it is dropped, on every
/// return path, including panics, and until the blocking work started
/// under `hold` has ended.
pub struct OpGuard(Arc<Release>);

/// Releases the key when the last holder goes: the guard, or blocking work
/// that outlived its call (`hold`).
struct Release {
    held: Table,
    key: String,
    at: Option<String>,
}

tokio::task_local! {
    /// The keys the running call holds (`OpGuard::hold`), for blocking work
    /// it starts to keep.
    static HELD: Vec<Arc<Release>>;
}

/// What blocking work started now must keep held until it ends: the keys
/// of the call that starts it. Opaque; dropped when the work ends.
pub struct Kept(#[allow(dead_code, reason = "held for its drop")] Vec<Arc<Release>>);

/// The keys held by the running call, for blocking work to keep (see
/// `OpGuard::hold`).
pub fn kept() -> Kept {
    Kept(HELD.try_with(Clone::clone).unwrap_or_default())
}

impl OpGuard {
    /// Runs `fut` holding the key, and lets blocking work it starts
    /// (`offload::blocking`) keep the key until that work has ended. When
    /// the caller gives up (its deadline passes and `fut` is dropped), a
    /// call stuck inside a filesystem (a network one whose server went
    /// away) still holds the volume: a retry gets ABORTED ("in progress")
    /// instead of running beside it, until the stuck call returns.
    pub async fn hold<F: std::future::Future>(self, fut: F) -> F::Output {
        let mut keys = HELD.try_with(Clone::clone).unwrap_or_default();
        keys.push(self.0);
        HELD.scope(keys, fut).await
    }
}

impl OpLocks {
    /// Whether an operation holds `key`, whole or at a path.
    pub fn is_held(&self, key: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }

    /// The whole key: no other operation on it, at any path, runs meanwhile.
    pub fn try_lock(&self, key: &str) -> Result<OpGuard> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.contains_key(key) {
            return Err(Error::Busy(format!(
                "an operation on {key} is already in progress; retry later"
            )));
        }
        held.insert(key.to_string(), Held::Whole);
        Ok(OpGuard(Arc::new(Release {
            held: self.held.clone(),
            key: key.to_string(),
            at: None,
        })))
    }

    /// The key at one path: operations at other paths of it run alongside,
    /// one that takes the whole key does not.
    pub fn try_lock_at(&self, key: &str, path: &Path) -> Result<OpGuard> {
        let at = path.to_string_lossy().into_owned();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let paths = match held
            .entry(key.to_string())
            .or_insert_with(|| Held::At(HashSet::new()))
        {
            Held::Whole => {
                return Err(Error::Busy(format!(
                    "an operation on {key} (a stage or unstage) is in progress; retry later"
                )));
            }
            Held::At(paths) => paths,
        };
        if !paths.insert(at.clone()) {
            return Err(Error::Busy(format!(
                "an operation on {key} at {at} is already in progress; retry later"
            )));
        }
        Ok(OpGuard(Arc::new(Release {
            held: self.held.clone(),
            key: key.to_string(),
            at: Some(at),
        })))
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let last = match (held.get_mut(&self.key), &self.at) {
            (Some(Held::At(paths)), Some(at)) => {
                paths.remove(at);
                paths.is_empty()
            }
            _ => true,
        };
        if last {
            held.remove(&self.key);
        }
    }
}

/// One async mutex per key, created on demand and dropped when unused.
#[derive(Clone, Default)]
pub struct KeyedMutex {
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

pub struct KeyedGuard {
    _guard: tokio::sync::OwnedMutexGuard<()>,
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    key: String,
}

impl KeyedMutex {
    fn mutex(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(key.to_string()).or_default().clone()
    }

    fn guard(&self, key: &str, g: tokio::sync::OwnedMutexGuard<()>) -> KeyedGuard {
        KeyedGuard {
            _guard: g,
            locks: self.locks.clone(),
            key: key.to_string(),
        }
    }

    pub async fn lock(&self, key: &str) -> KeyedGuard {
        let g = self.mutex(key).lock_owned().await;
        self.guard(key, g)
    }

    /// The key at once, or None while someone else holds it.
    pub fn try_lock(&self, key: &str) -> Option<KeyedGuard> {
        let g = self.mutex(key).try_lock_owned().ok()?;
        Some(self.guard(key, g))
    }
}

/// Permits shared out per key and in all: one key holds at most
/// `per_key` at once and all keys together at most `all`; a waiter waits
/// for its own key's turn first, never behind another key's queue.
pub struct Shares<K: std::hash::Hash + Eq + Clone> {
    all: Arc<tokio::sync::Semaphore>,
    per_key: usize,
    keys: Arc<Mutex<HashMap<K, Arc<tokio::sync::Semaphore>>>>,
}

/// One key's permit, given back when dropped.
pub struct Share<K: std::hash::Hash + Eq + Clone> {
    _all: tokio::sync::OwnedSemaphorePermit,
    _own: tokio::sync::OwnedSemaphorePermit,
    keys: Arc<Mutex<HashMap<K, Arc<tokio::sync::Semaphore>>>>,
    key: K,
}

impl<K: std::hash::Hash + Eq + Clone> Drop for Share<K> {
    fn drop(&mut self) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        // The map's and our permit's: nobody else holds or waits for this
        // key's permits once this one goes.
        if keys
            .get(&self.key)
            .is_some_and(|s| Arc::strong_count(s) <= 2)
        {
            keys.remove(&self.key);
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> Shares<K> {
    pub fn new(all: usize, per_key: usize) -> Shares<K> {
        Shares {
            all: Arc::new(tokio::sync::Semaphore::new(all.max(1))),
            per_key: per_key.max(1),
            keys: Arc::default(),
        }
    }

    /// Waits for `key`'s turn, then for one of all the permits.
    pub async fn acquire(&self, key: K) -> Share<K> {
        let own = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.entry(key.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.per_key)))
                .clone()
        };
        let own = own
            .acquire_owned()
            .await
            .expect("a share's semaphore is never closed");
        let all = self
            .all
            .clone()
            .acquire_owned()
            .await
            .expect("the shares' semaphore is never closed");
        Share {
            _all: all,
            _own: own,
            keys: self.keys.clone(),
            key,
        }
    }

    /// Keys that hold or wait for permits now.
    pub fn keys(&self) -> usize {
        self.keys.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for KeyedGuard {
    fn drop(&mut self) {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        // Two references: the map's and the one our guard holds.
        if locks
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) <= 2)
        {
            locks.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_aborted_until_release() {
        let locks = OpLocks::default();
        let g = locks.try_lock("v1").unwrap();
        assert!(matches!(locks.try_lock("v1"), Err(Error::Busy(_))));
        assert!(locks.try_lock("v2").is_ok());
        drop(g);
        assert!(locks.try_lock("v1").is_ok());
    }

    /// Publishes of one volume at different targets run together; a stage
    /// or unstage waits for all of them, and they for it.
    #[test]
    fn paths_of_one_key_run_together_and_exclude_the_whole() {
        let locks = OpLocks::default();
        let (a, b) = (Path::new("/pods/a"), Path::new("/pods/b"));
        let ga = locks.try_lock_at("v1", a).unwrap();
        let gb = locks.try_lock_at("v1", b).unwrap();
        assert!(matches!(locks.try_lock_at("v1", a), Err(Error::Busy(_))));
        assert!(matches!(locks.try_lock("v1"), Err(Error::Busy(_))));
        assert!(locks.try_lock_at("v2", a).is_ok());
        drop(ga);
        assert!(matches!(locks.try_lock("v1"), Err(Error::Busy(_))));
        let ga = locks.try_lock_at("v1", a).unwrap();
        drop((ga, gb));
        let whole = locks.try_lock("v1").unwrap();
        assert!(matches!(locks.try_lock_at("v1", a), Err(Error::Busy(_))));
        drop(whole);
        assert!(locks.held.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn keyed_mutex_cleans_up() {
        let m = KeyedMutex::default();
        {
            let _a = m.lock("s").await;
        }
        assert!(m.locks.lock().unwrap().is_empty());
    }
}
