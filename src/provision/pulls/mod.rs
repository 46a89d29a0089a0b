//! Pulls that outlive the call that asked for them, and their one owner:
//! the jobs that run them (`jobs`), the records a restart resumes them
//! from (`wanted`), and the follower that sees each through to its seal
//! (`follow`). A create joins a pull here and is answered when its `Until`
//! says; everything after that answer happens in this module.

mod follow;
pub mod jobs;
mod wanted;

pub use wanted::{Phase, Wanted};

use std::collections::HashMap;

use crate::cache::{self, Root};
use crate::error::{Error, Result};
use crate::offload::blocking;
use crate::puller;
use jobs::Until;

use super::Provisioner;
use super::plan::CreateRequest;
use super::resolve::PullInputs;

/// Whether a restart takes a pull up without its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resumable {
    /// Not recorded: its secret cannot be named again, or kubelet itself
    /// asks again for the inline volume that wants it.
    No,
    /// Recorded; when `class_secret`, the resume first reads its class's
    /// provisioner secret again (secrets never touch the disk).
    Yes { class_secret: bool },
}

impl Provisioner {
    /// Whether a pull for volume `name` runs in this process now.
    pub fn is_pulling(&self, name: &str) -> bool {
        // A job that ended keeps its place until a create collects its
        // outcome: it is not pulling.
        self.jobs.is_working(name)
    }

    /// Waits until this process's pull for volume `name` has its outcome
    /// (its model sealed, or its error), or returns at once when none
    /// runs: a create answered before the seal leaves its pull running.
    pub async fn pull_ended(&self, name: &str) {
        self.jobs.ended(name).await;
    }

    /// Whether a restart can resume `req`'s pull. Secrets are never
    /// written: a tenant's is read again from its PVC's annotation, the
    /// class's from the class, if a read now gives what
    /// external-provisioner passed (else the pull waits for the
    /// provisioner's next call). An inline volume's pull is recorded only
    /// when it is progressive: kubelet asks again for an unpublished
    /// volume, never for a published one, whose readers wait on the pull.
    /// Its secret (nodePublishSecretRef) is the pod's and cannot be named
    /// again.
    async fn resumable(&self, req: &CreateRequest, tenant: bool, until: Until) -> Resumable {
        let class_secret = req.inline.is_none() && !req.secrets.is_empty() && !tenant;
        let yes = Resumable::Yes { class_secret };
        match &req.inline {
            None if class_secret => match self.class_secret_again(req).await {
                Ok(again) if again == req.secrets => yes,
                Ok(_) => {
                    tracing::info!(
                        "the class's provisioner secret read now differs from the request's; a restart will not resume this pull"
                    );
                    Resumable::No
                }
                Err(e) => {
                    tracing::info!(error = %e, "the class's provisioner secret cannot be read again; a restart will not resume this pull");
                    Resumable::No
                }
            },
            None => yes,
            Some(_) if until == Until::Listed && req.secrets.is_empty() => yes,
            Some(_) => Resumable::No,
        }
    }

    /// Pulls a model URI into `root` through the pull job of this volume
    /// name, which outlives the call: at the caller's deadline it answers
    /// "still pulling", and the retry joins the same job. Answers early
    /// (before the seal) as `until` says, and the job goes on.
    pub(in crate::provision) async fn pull(
        &self,
        req: &CreateRequest,
        uri: &str,
        root: &Root,
        pull: &PullInputs,
        deadline: Option<std::time::Instant>,
        until: Until,
    ) -> Result<(jobs::Early, bool)> {
        let shown = crate::trust::allowed::shown(uri).to_string();
        let tenant = pull.options.tenant.is_some();
        let source = match puller::open(uri, &pull.options).await {
            Ok(s) => s,
            Err(e) => {
                pull.sink.failed(&shown, &e.to_string());
                return Err(e);
            }
        };
        // Recorded so that a restart resumes it, where it can be.
        let resumable = self.resumable(req, tenant, until).await;
        // A volume answered once verified is served from the pull's files
        // until the seal, which only a running pull brings: one that a
        // restart would not resume waits for the seal. (A progressive
        // volume was asked for by name, and its readers are told EIO if
        // its pull never comes back.)
        let until = match until {
            Until::Verified if resumable == Resumable::No => Until::Sealed,
            u => u,
        };
        let job = jobs::Request {
            key: req.name.clone(),
            uri: shown,
            owner: pull.owner.clone(),
            root: root.clone(),
            source,
            signature: pull.signature.clone(),
            sink: pull.sink.clone(),
            until,
        };
        if let Resumable::Yes { class_secret } = resumable
            && !self.jobs.is_running(&req.name)
        {
            let (d, w) = (self.wanted_dir(), req.clone());
            blocking(move || wanted::save(&d, &w, class_secret)).await?;
        }
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        tracing::debug!(budget = ?left, "joining the pull job");
        let pulled = match until != Until::Sealed {
            true => {
                let early = self.jobs.pull_early(&self.engine, job.clone(), left).await;
                if let Ok(jobs::Early::Arriving { .. }) = &early {
                    let recorded = resumable != Resumable::No;
                    self.see_through(job, recorded.then(|| self.wanted_dir()));
                }
                early
            }
            false => self
                .jobs
                .pull(&self.engine, job, left)
                .await
                .map(jobs::Early::Sealed),
        };
        // A pull another process holds (a node sharing the root) did not
        // run here: its record stays for whoever asks again, the
        // provisioner's retry or a resume.
        let elsewhere = matches!(pulled, Err(Error::Busy(_)));
        if resumable != Resumable::No && !self.jobs.is_running(&req.name) && !elsewhere {
            let (d, n) = (self.wanted_dir(), req.name.clone());
            blocking(move || wanted::remove(&d, &n)).await?;
        }
        // Whether a durable record of this pull stands behind the answer
        // (a job started by an earlier call that was not resumable made
        // none). An inline volume's is not enough: a resume drops it when
        // the volume's record is unreadable, as a crash may leave one
        // written unsynced, and kubelet's next NodePublish would then
        // find that record with nothing to say it may be written again.
        let backed = resumable != Resumable::No && req.inline.is_none() && {
            let (d, n) = (self.wanted_dir(), req.name.clone());
            blocking(move || Ok(wanted::exists(&d, &n))).await?
        };
        Ok((pulled?, backed))
    }

    /// Notes on the wanted record of volume `name`'s pull that the volume
    /// was answered before its seal, as `until` says. Off the answer's
    /// path: the record is synced, and the answer waits for no fsync.
    pub(in crate::provision) fn answered(&self, name: &str, until: Until) {
        let phase = match until {
            Until::Listed => Phase::Listed,
            Until::Verified => Phase::Verified,
            Until::Sealed => return,
        };
        let (d, n) = (self.wanted_dir(), name.to_string());
        tokio::spawn(async move {
            if let Err(e) = blocking(move || wanted::advance(&d, &n, phase)).await {
                tracing::warn!(error = %e, "could not note how far a wanted pull had come; a restart resumes it all the same");
            }
        });
    }

    /// Cancels pull jobs whose PVC, or whose inline volume's pod, is gone
    /// or going: no retry will ever come for them. Their finished ranges
    /// stay resumable and evictable.
    pub async fn sweep_jobs(&self) {
        let Some(kube) = &self.kube else {
            return;
        };
        for (key, owner) in self.jobs.owners() {
            let deleting = match &owner {
                jobs::Owner::Pvc { namespace, name } => kube
                    .pvc(namespace, name)
                    .await
                    .map(|o| o.metadata.deletion_timestamp.is_some()),
                jobs::Owner::Pod { namespace, name } => kube.pod_deleting(namespace, name).await,
            };
            let gone = match deleting {
                Err(Error::NotFound(_)) => true,
                Ok(deleting) => deleting,
                Err(_) => false,
            };
            if gone {
                self.jobs.cancel(&key);
                self.forget_wanted(&key).await;
            }
        }
    }

    /// This process's wanted-pull records (see `wanted`).
    pub(super) fn wanted_dir(&self) -> std::path::PathBuf {
        self.cfg.state_dir.join("wanted")
    }

    /// The requests whose pulls were running when this process last
    /// stopped (see `wanted`).
    pub async fn wanted(&self) -> Vec<wanted::Wanted> {
        let d = self.wanted_dir();
        blocking(move || Ok(wanted::load(&d)))
            .await
            .unwrap_or_default()
    }

    /// The provisioner secret of `req`'s PVC's class, read again for a
    /// pull a restart resumes (`wanted`): the PVC must be named in the
    /// request (`--extra-create-metadata`), and the class's template
    /// filled from the claim alone.
    pub async fn class_secret_again(&self, req: &CreateRequest) -> Result<HashMap<String, String>> {
        let kube = self.kube.as_ref().ok_or_else(|| {
            Error::Precondition("no Kubernetes API access to read the class's secret again".into())
        })?;
        let got = |k: &str| {
            req.params.get(k).ok_or_else(|| {
                Error::Precondition(format!(
                    "the request does not name {k} (external-provisioner --extra-create-metadata)"
                ))
            })
        };
        let (ns, pvc, pv) = (
            got(crate::kubeapi::PVC_NAMESPACE)?,
            got(crate::kubeapi::PVC_NAME)?,
            got(super::params::PV_NAME)?,
        );
        Ok(kube
            .claim_class_secret(ns, pvc, pv)
            .await?
            .unwrap_or_default()
            .into_iter()
            .collect())
    }

    /// Whether a volume named `name` (the CreateVolume name) exists in
    /// some root of this process.
    pub async fn has_volume_named(&self, name: &str) -> bool {
        let uuid = cache::uuid_for_name(&self.cfg.driver_name, name);
        let roots = self.roots.clone();
        blocking(move || {
            Ok(roots
                .roots
                .iter()
                .any(|r| matches!(cache::read_volume(r, &uuid), Ok(Some(_)))))
        })
        .await
        .unwrap_or(false)
    }

    /// Drops the record of the pull for volume `name`.
    pub async fn forget_wanted(&self, name: &str) {
        let (d, name) = (self.wanted_dir(), name.to_string());
        let _ = blocking(move || wanted::remove(&d, &name)).await;
    }
}

/// Whether a pull for volume `name` is recorded in `dir`, for a create
/// that finds its volume's record torn by a crash.
pub(in crate::provision) fn wanted_exists(dir: &std::path::Path, name: &str) -> bool {
    wanted::exists(dir, name)
}
