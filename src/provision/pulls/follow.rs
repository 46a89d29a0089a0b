//! Sees a pull through after its call: each volume answered before its
//! seal gets a follower that runs its pull again until the seal, and a
//! restart takes up the pulls this process was running (`wanted`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{Instrument, info_span};

use super::jobs;
use super::wanted::{self, Wanted};
use crate::cache;
use crate::error::{Error, Result};
use crate::offload::blocking;
use crate::provision::Provisioner;
use crate::retry::{self, Backoff};

/// How a volume's failed pull runs again: nobody else asks (the volume
/// exists), so for as long as the volume does, backing off to five minutes.
const REPULL: Backoff = Backoff {
    first: Duration::from_secs(10),
    max: Duration::from_secs(300),
    total: None,
    times: None,
};

/// How long a resume keeps trying: as long as a read of a volume answered
/// before its seal waits.
const RESUME: Backoff = Backoff {
    first: Duration::from_secs(5),
    max: Duration::from_secs(60),
    total: Some(crate::progressive::WAIT_BOUND),
    times: None,
};

/// How long a resume's create waits for its pull before it answers "still
/// pulling" and watches the job instead.
const RESUME_CALL: Duration = Duration::from_secs(1);

impl Provisioner {
    /// Keeps the pull of a volume answered before its seal (a progressive
    /// one, or one answered once verified) going after its create: a pull
    /// that fails runs again for as long as the volume exists. Its readers
    /// wait (bounded) meanwhile. The wanted record (`wanted`) goes once the
    /// model is sealed: a restart before then resumes the pull.
    pub(super) fn see_through(&self, job: jobs::Request, wanted: Option<PathBuf>) {
        let (jobs, engine) = (self.jobs.clone(), self.engine.clone());
        let (root, name) = (job.root.clone(), job.key.clone());
        let uuid = cache::uuid_for_name(&self.cfg.driver_name, &name);
        let span = info_span!("follow", volume.name = %name);
        tokio::spawn(
            async move {
                let first = AtomicBool::new(true);
                let (first, jobs, engine, job) = (&first, &jobs, &engine, &job);
                let (r, u) = (&root, &uuid);
                let attempt = move || async move {
                    // The first try comes before the volume's record is
                    // written; a later one only while the volume stands.
                    if !first.swap(false, Ordering::Relaxed) && !volume_stands(r, u).await {
                        return Ok(None);
                    }
                    jobs.pull(engine, job.clone(), None).await.map(Some)
                };
                let what = "the pull of a volume answered before its seal failed; its readers wait while it runs again";
                match retry::retry(what, REPULL, |_| true, attempt).await {
                    Ok(Some(pulled)) => sealed(root, uuid, name, pulled, wanted).await,
                    Ok(None) => tracing::info!("the volume is gone; its pull is not run again"),
                    Err(e) => tracing::warn!(error = %e, "the pull of a volume answered before its seal stopped"),
                }
            }
            .instrument(span),
        );
    }

    /// Starts again the pulls that were running when this process
    /// stopped: each joins its pull job and leaves it running, and the
    /// provisioner's next call finds it. A resume that fails for a reason
    /// that may pass (the API or the origin not answering at the restart)
    /// is tried again for as long as the readers of a volume answered
    /// before its seal wait: nobody else would.
    pub async fn resume_wanted(self: &Arc<Self>) {
        for w in self.wanted().await {
            let span = info_span!("resume", volume.name = %w.req.name, phase = ?w.phase);
            let p = self.clone();
            tokio::spawn(
                async move {
                    let (p, w) = (&p, &w);
                    let attempt = move || p.resume_one(w);
                    let what = "a wanted pull did not resume yet";
                    if let Err(e) = retry::retry(what, RESUME, may_pass, attempt).await {
                        tracing::warn!(
                            error = %e,
                            "a wanted pull did not resume; the provisioner's next call retries it"
                        );
                    }
                }
                .instrument(span),
            );
        }
    }

    /// One try at resuming wanted pull `w`. Ok: resumed, already done, no
    /// longer wanted, or in the hands of a call that holds its name. A pull
    /// job that outlives the create's short budget is watched to its end (a
    /// job that gives up, say on an origin still down, has nobody else to
    /// run it again), and the create is then asked once more.
    async fn resume_one(&self, w: &Wanted) -> Result<()> {
        let name = &w.req.name;
        let no_longer = |e: &Error| matches!(e, Error::NotFound(_) | Error::NoVolume { .. });
        loop {
            let mut req = w.req.clone();
            req.budget = Some(RESUME_CALL);
            if w.class_secret {
                match self.class_secret_again(&req).await {
                    Ok(s) => req.secrets = s,
                    Err(e) if no_longer(&e) => {
                        tracing::info!(error = %e, "a wanted pull is no longer wanted");
                        self.forget_wanted(name).await;
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            }
            // An inline volume is made by its pod's NodePublish alone: one
            // released meanwhile (NodeUnpublish) is not made again here.
            if req.inline.is_some() && !self.has_volume_named(name).await {
                tracing::info!("a wanted inline pull's volume is gone; not resumed");
                self.forget_wanted(name).await;
                return Ok(());
            }
            match self.create(req).await {
                // Answered before its seal: the volume's own follower
                // (`see_through`) runs its pull to the seal.
                Ok(_) if self.is_pulling(name) => {
                    tracing::info!(
                        "resumed the pull of a volume answered before its seal, which was running before the restart"
                    );
                    return Ok(());
                }
                // Answered again before its seal, its pull between tries
                // (another process held it): the volume's follower, not
                // this resume, runs it to the seal and removes the record.
                Ok((rec, _)) if !self.model_sealed(&rec).await => {
                    tracing::info!(
                        "resumed a volume answered before its seal; its follower tries its pull again"
                    );
                    return Ok(());
                }
                // A record outliving its pull (a phase noted just as the
                // seal removed it) goes now.
                Ok(_) => {
                    tracing::info!("a wanted pull had finished; volume ready");
                    self.forget_wanted(name).await;
                    return Ok(());
                }
                Err(e @ Error::Busy(_)) if self.name_held(name) => {
                    tracing::info!(error = %e, "a call that holds the volume's name carries its pull");
                    return Ok(());
                }
                // Another process holds the model's pull (a node sharing
                // the root): asked again until that pull ends, since this
                // volume's record has no other follower.
                Err(e @ Error::Busy(_)) => return Err(e),
                Err(e) if no_longer(&e) => {
                    tracing::info!(error = %e, "a wanted pull is no longer wanted");
                    self.forget_wanted(name).await;
                    return Ok(());
                }
                // Still running at the budget: watched until it ends; the
                // next create then collects its outcome (a failure returns
                // below, for the caller to judge).
                Err(_) if self.is_pulling(name) => {
                    tracing::info!(
                        "resumed a pull that was running before the restart; watching it"
                    );
                    self.jobs.ended(name).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the model volume `rec` reads is sealed (a source volume's
    /// is its owner's to seal: counted as sealed here).
    async fn model_sealed(&self, rec: &crate::cache::VolumeRecord) -> bool {
        if !rec.source.is_model() {
            return true;
        }
        let Some(root) = crate::cache::VolumeId::parse(&rec.id)
            .and_then(|id| self.roots.for_id(&id).ok().cloned())
        else {
            return true;
        };
        let sid = rec.source.clone();
        matches!(
            blocking(move || cache::read_seal(&root, &sid)).await,
            Ok(Some(_))
        )
    }
}

/// Whether the volume `uuid` still has its record in `root`.
async fn volume_stands(root: &cache::Root, uuid: &str) -> bool {
    let (r, u) = (root.clone(), uuid.to_string());
    matches!(
        blocking(move || cache::read_volume(&r, &u)).await,
        Ok(Some(_))
    )
}

/// The follower's pull sealed: the volume references the sealed model, and
/// the wanted record that stood behind it goes.
async fn sealed(
    root: cache::Root,
    uuid: String,
    name: String,
    pulled: Arc<crate::puller::engine::Pulled>,
    wanted: Option<PathBuf>,
) {
    // The reference made in the first pull's area is gone if that area was
    // discarded (its origin served garbage); this pull sealed without it.
    // The record and the reference may have been written unsynced
    // (`reference_arriving`): durable now, before the wanted record that
    // stood behind them goes.
    let sid = pulled.sid.clone();
    let referenced = blocking(move || match cache::read_volume(&root, &uuid)? {
        Some(_) => {
            cache::add_ref(&root, &sid, &uuid)?;
            cache::sync_volume(&root, &uuid, &sid)
        }
        None => Ok(()),
    })
    .await;
    match (referenced, wanted) {
        (Err(e), _) => {
            tracing::warn!(error = %e, "could not reference the sealed model; a restart references it again");
        }
        (Ok(()), Some(d)) => {
            let _ = blocking(move || wanted::remove(&d, &name)).await;
        }
        (Ok(()), None) => {}
    }
}

/// Whether a failed resume may succeed later, untouched: a server that did
/// not answer, a disk error. Not a refusal or a missing grant.
fn may_pass(e: &Error) -> bool {
    retry::transient(e) || matches!(e, Error::Io { .. } | Error::Busy(_))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;

    const QUICK: Backoff = Backoff {
        first: Duration::from_millis(1),
        max: Duration::from_millis(4),
        total: Some(Duration::from_millis(500)),
        times: None,
    };

    /// Calls of a resume that fails with `fail` `n` times, then succeeds.
    async fn tries(fail: fn() -> Error, n: u32) -> (u32, bool) {
        let calls = AtomicU32::new(0);
        let calls = &calls;
        let out = retry::retry("test", QUICK, may_pass, move || async move {
            match calls.fetch_add(1, Ordering::SeqCst) < n {
                true => Err(fail()),
                false => Ok(()),
            }
        })
        .await;
        (calls.load(Ordering::SeqCst), out.is_ok())
    }

    #[tokio::test]
    async fn a_resume_is_tried_again_only_while_its_failure_may_pass() {
        // The API down twice at the restart, then up: the third try resumes.
        let api_down = || Error::Transient("apiserver".into());
        assert_eq!(tries(api_down, 2).await, (3, true));
        let disk = || Error::Io {
            op: "read".into(),
            path: "/x".into(),
            source: std::io::Error::other("EIO"),
        };
        assert_eq!(tries(disk, 1).await, (2, true));
        // Another process pulling the model (a node sharing the root).
        let other = || Error::Busy("model m1 is being pulled by another process".into());
        assert_eq!(tries(other, 2).await, (3, true));
        // A refusal does not pass by waiting: one try.
        let refused = || Error::Precondition("no grant".into());
        assert_eq!(tries(refused, 5).await, (1, false));
        // Never answering: given up once the bound is spent.
        let (calls, ok) = tries(api_down, u32::MAX).await;
        assert!(!ok && calls > 3, "{calls}");
    }
}
