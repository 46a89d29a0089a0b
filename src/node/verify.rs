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
    /// `shared`: the source lives on a filesystem other writers reach
    /// (a shared root): a verdict holds only while every file is the one
    /// it was (device, inode, size, ctime, which no writer sets back), so
    /// a file changed since is rehashed.
    pub async fn verify(
        &self,
        seal: &Seal,
        staging: PathBuf,
        wait: Option<Duration>,
        shared: bool,
    ) -> Result<()> {
        let mut k = key(seal);
        if shared {
            let (s, st) = (seal.clone(), staging.clone());
            k.push_str(&crate::offload::blocking(move || Ok(stamp(&s, &st))).await?);
        }
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

/// What each file of `seal` under `staging` is now, as the filesystem
/// says without reading it; a missing file stamps as such.
fn stamp(seal: &Seal, staging: &std::path::Path) -> String {
    use sha2::Digest;
    use std::os::unix::fs::MetadataExt;
    let mut h = sha2::Sha256::new();
    for f in &seal.files {
        match std::fs::symlink_metadata(staging.join(&f.path)) {
            Ok(m) => h.update(format!(
                "{}:{}:{}:{}.{}\n",
                m.dev(),
                m.ino(),
                m.size(),
                m.ctime(),
                m.ctime_nsec()
            )),
            Err(_) => h.update(b"missing\n"),
        }
    }
    format!("#{}", hex::encode(h.finalize()))
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
            .verify(
                &seal,
                d.path().into(),
                Some(Duration::from_millis(1)),
                false,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Transient(m) if m.contains("rehash goes on")),
            "{e:?}"
        );
        v.verify(&seal, d.path().into(), None, false).await.unwrap();
        // Verified once: the next stage does not hash 256 MiB again (a
        // rehash could not end within 1 ms).
        v.verify(
            &seal,
            d.path().into(),
            Some(Duration::from_millis(1)),
            false,
        )
        .await
        .unwrap();
    }

    /// On a shared root a verdict lasts only while the files are the ones
    /// verified: a writer that changes a byte (same size) is caught at the
    /// next stage. Node-local sources, which no one else writes, keep it.
    #[tokio::test]
    async fn a_shared_source_changed_since_its_verdict_is_rehashed() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("w"), b"weights").unwrap();
        let seal = sealed(d.path());
        let v = Verifier::default();
        v.verify(&seal, d.path().into(), None, true).await.unwrap();
        v.verify(&seal, d.path().into(), None, true).await.unwrap();
        std::fs::write(d.path().join("w"), b"WEIGHTS").unwrap();
        let e = v
            .verify(&seal, d.path().into(), None, true)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Precondition(m) if m.contains("damaged")),
            "{e:?}"
        );
        // Not shared: the verdict is kept (nobody else writes there).
        let local = Verifier::default();
        std::fs::write(d.path().join("w"), b"weights").unwrap();
        local
            .verify(&seal, d.path().into(), None, false)
            .await
            .unwrap();
        std::fs::write(d.path().join("w"), b"WEIGHTS").unwrap();
        local
            .verify(&seal, d.path().into(), None, false)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn damage_is_refused_and_never_remembered() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("w"), b"weights").unwrap();
        let seal = sealed(d.path());
        std::fs::write(d.path().join("w"), b"WEIGHTS").unwrap();
        let v = Verifier::default();
        for _ in 0..2 {
            let e = v
                .verify(&seal, d.path().into(), None, false)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::Precondition(m) if m.contains("damaged")),
                "{e:?}"
            );
        }
    }
}
