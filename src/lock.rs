//! Per-volume operation guards and per-source mutexes.
//!
//! An RPC takes an `OpGuard` for its volume (or, for CreateVolume, its name)
//! before doing anything; a second call for the same key while the first runs
//! gets `Aborted`, which CSI defines as "operation pending" and COs retry.
//! `KeyedMutex` serialises short critical sections on one source, where
//! waiting is right (e.g. two clones of one source added concurrently).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

#[derive(Clone, Default)]
pub struct OpLocks {
    held: Arc<Mutex<HashSet<String>>>,
}

/// Releases its key on drop, on every return path, including panics.
pub struct OpGuard {
    held: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl OpLocks {
    pub fn try_lock(&self, key: &str) -> Result<OpGuard> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if !held.insert(key.to_string()) {
            return Err(Error::Busy(format!(
                "an operation on {key} is already in progress; retry later"
            )));
        }
        Ok(OpGuard {
            held: self.held.clone(),
            key: key.to_string(),
        })
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.remove(&self.key);
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
    pub async fn lock(&self, key: &str) -> KeyedGuard {
        let m = {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            locks.entry(key.to_string()).or_default().clone()
        };
        KeyedGuard {
            _guard: m.lock_owned().await,
            locks: self.locks.clone(),
            key: key.to_string(),
        }
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

    #[tokio::test]
    async fn keyed_mutex_cleans_up() {
        let m = KeyedMutex::default();
        {
            let _a = m.lock("s").await;
        }
        assert!(m.locks.lock().unwrap().is_empty());
    }
}
