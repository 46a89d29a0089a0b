//! `verify: full` within kubelet's deadline: rehashing a 100 GB model takes
//! minutes, and NodeStage has about two. The rehash runs in a job of its
//! own, one per sealed source on this node, through the staging mount (what
//! pods will read is what is hashed). A NodeStage that reaches its deadline
//! answers UNAVAILABLE with the progress and leaves the mount and the job
//! in place; kubelet's retry finds the mount and joins the job. A source
//! verified once stays verified for this process: its seal is immutable.
//! A failed rehash is never cached: the next stage tries again.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cache::manifest::{self, Seal};
use crate::error::{Error, Result};

type Outcome = crate::outcome::Outcome<()>;

struct Job {
    done: watch::Receiver<Outcome>,
    hashed: Arc<AtomicU64>,
    total: u64,
    started: Instant,
}

/// Full verifications on this node.
#[derive(Default)]
pub struct Verifier {
    running: Mutex<HashMap<String, Arc<Job>>>,
    /// Sources (and seal time) fully verified by this process.
    verified: Mutex<HashSet<String>>,
}

fn key(seal: &Seal) -> String {
    format!("{}@{}", seal.source, seal.sealed_unix)
}

impl Verifier {
    /// Rehashes every file of `seal` under `staging`, or joins the rehash
    /// that runs, waiting at most `wait`.
    pub async fn verify(
        &self,
        seal: &Seal,
        staging: PathBuf,
        wait: Option<Duration>,
    ) -> Result<()> {
        let k = key(seal);
        if self
            .verified
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&k)
        {
            return Ok(());
        }
        let job = self.join_or_start(&k, seal, staging);
        let Some(outcome) = crate::outcome::wait(&job.done, "a verification", wait).await else {
            let mib = |b: u64| b as f64 / 1048576.0;
            return Err(Error::Transient(format!(
                "verifying source {} (verify: full) for {}s: {:.1} of {:.1} MiB rehashed; \
                 the rehash goes on, and a retry of NodeStage joins it",
                seal.source,
                job.started.elapsed().as_secs(),
                mib(job.hashed.load(Ordering::Relaxed)),
                mib(job.total)
            )));
        };
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, j| !Arc::ptr_eq(j, &job));
        match outcome {
            Ok(()) => {
                self.verified
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(k);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn join_or_start(&self, k: &str, seal: &Seal, staging: PathBuf) -> Arc<Job> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(j) = running.get(k) {
            return j.clone();
        }
        let (tx, rx) = watch::channel(None);
        let hashed = Arc::new(AtomicU64::new(0));
        let total = seal.total_bytes;
        let (seal, h) = (seal.clone(), hashed.clone());
        tokio::task::spawn_blocking(move || {
            let outcome = rehash(&seal, &staging, &h).map_err(Arc::new);
            let _ = tx.send(Some(outcome));
        });
        let job = Arc::new(Job {
            done: rx,
            hashed,
            total,
            started: Instant::now(),
        });
        running.insert(k.to_string(), job.clone());
        job
    }
}

/// Sizes first (cheap, and a missing file is named at once), then every
/// file's sha256, counting bytes as it goes.
fn rehash(seal: &Seal, staging: &std::path::Path, hashed: &AtomicU64) -> Result<()> {
    manifest::verify(staging, seal, false)?;
    for f in &seal.files {
        let path = staging.join(&f.path);
        let (_, sha) = manifest::hash_file(&path)?;
        if sha != f.sha256 {
            return Err(Error::Precondition(format!(
                "source {} is damaged: file {} has sha256 {sha}, the seal recorded {}; it must be \
                 re-created",
                seal.source, f.path, f.sha256
            )));
        }
        hashed.fetch_add(f.size, Ordering::Relaxed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::manifest::{FORMAT, scan};

    fn sealed(dir: &std::path::Path) -> Seal {
        let tree = scan(dir).unwrap();
        Seal {
            format: FORMAT,
            source: "m0123456789abcdef0123456789abcde".into(),
            origin: "test".into(),
            revision: None,
            sealed_unix: 1,
            total_bytes: tree.total_bytes(),
            chunk_bytes: crate::cache::manifest::CHUNK_BYTES,
            files: tree.files,
            dirs: tree.dirs,
            symlinks: tree.symlinks,
            filled_from: Vec::new(),
            signed_by: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rehash_past_the_deadline_goes_on_and_is_joined_then_remembered() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..8 {
            std::fs::write(d.path().join(format!("shard-{i}")), vec![i as u8; 32 << 20]).unwrap();
        }
        let seal = sealed(d.path());
        let v = Verifier::default();
        let e = v
            .verify(&seal, d.path().into(), Some(Duration::from_millis(1)))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Transient(m) if m.contains("rehash goes on")),
            "{e:?}"
        );
        v.verify(&seal, d.path().into(), None).await.unwrap();
        // Verified once: the next stage does not hash 256 MiB again.
        let t = Instant::now();
        v.verify(&seal, d.path().into(), Some(Duration::from_millis(1)))
            .await
            .unwrap();
        assert!(t.elapsed() < Duration::from_millis(50));
    }

    #[tokio::test]
    async fn damage_is_refused_and_never_remembered() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("w"), b"weights").unwrap();
        let seal = sealed(d.path());
        std::fs::write(d.path().join("w"), b"WEIGHTS").unwrap();
        let v = Verifier::default();
        for _ in 0..2 {
            let e = v.verify(&seal, d.path().into(), None).await.unwrap_err();
            assert!(
                matches!(&e, Error::Precondition(m) if m.contains("damaged")),
                "{e:?}"
            );
        }
    }
}
