//! The doing side of CreateVolume: a plan's one kind of work, run off the
//! async runtime, and the volume a model URI's pull is referenced by.

use std::sync::Arc;

use super::pulls::jobs::{self, Until};
use crate::cache::{self, Root, Seal, VolumeId, VolumeRecord};
use crate::csi::Topology;
use crate::error::{Error, Result};
use crate::offload::blocking;

use super::Provisioner;
use super::plan::{self, CreateRequest, Plan, Work};
use super::pulls::wanted_exists;
use super::resolve::PullInputs;

/// Pulls of one model a create makes when eviction keeps taking it before
/// the volume can reference it.
const PULLS_PER_EVICTION: u32 = 3;

impl Provisioner {
    /// A volume of this name already made: the same (a retry), or a
    /// conflict.
    pub(super) async fn existing(
        &self,
        plan: &Plan,
    ) -> Result<Option<(VolumeRecord, Vec<Topology>)>> {
        let (roots, want) = (self.roots.clone(), plan.record.clone());
        let wanted = self.wanted_dir();
        let found = blocking(move || -> Result<Option<(Root, VolumeRecord)>> {
            let uuid = VolumeId::parse(&want.id)
                .map(|i| i.uuid)
                .unwrap_or_default();
            for r in &roots.roots {
                match cache::read_volume(r, &uuid) {
                    Ok(Some(existing)) => return Ok(Some((r.clone(), existing))),
                    Ok(None) => {}
                    // Written unsynced (answered before its seal) and cut
                    // short by a crash of the machine: its pull's durable
                    // record says so, and this create writes it again.
                    Err(Error::Precondition(why)) if wanted_exists(&wanted, &want.name) => {
                        tracing::warn!(%why, "a volume record written before its seal did not survive a crash whole; writing it again");
                        cache::remove_volume(r, &uuid)?;
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(None)
        })
        .await?;
        match found {
            None => Ok(None),
            Some((r, existing))
                if existing.request == plan.record.request && existing.id == plan.record.id =>
            {
                Ok(Some((existing, plan::topology_of(&self.cfg, &r))))
            }
            Some((_, existing)) => Err(Error::Conflict(format!(
                "volume name {} is already used by volume {} with different arguments",
                plan.record.name, existing.id
            ))),
        }
    }

    /// Does a plan's work; each kind's filesystem work runs off the async
    /// runtime. Returns the record as written.
    pub(super) async fn execute(
        &self,
        req: &CreateRequest,
        plan: Plan,
        pull: PullInputs,
        deadline: Option<std::time::Instant>,
    ) -> Result<VolumeRecord> {
        let Plan {
            root,
            record: mut rec,
            work,
            required,
            limit,
        } = plan;
        match work {
            Work::NewSource => {
                let (r, rec) = (root, rec);
                blocking(move || {
                    check_free(&r, rec.capacity_bytes as u64)?;
                    cache::create_source(&r, &rec.source, rec.capacity_bytes as u64)?;
                    cache::write_volume(&r, &rec)?;
                    Ok(rec)
                })
                .await
            }
            Work::CopySource { from } => {
                let _g = self.sources.lock(&from.source).await;
                let (r, rec) = (root, rec);
                blocking(move || {
                    let writers = cache::writers(&r, &from.source)?;
                    if !writers.is_empty() && cache::read_seal(&r, &from.source)?.is_none() {
                        return Err(Error::Precondition(format!(
                            "source volume {} is being written on node(s) {}; a copy now would be torn",
                            from.id,
                            writers.join(", ")
                        )));
                    }
                    check_free(&r, rec.capacity_bytes as u64)?;
                    cache::copy_source(&r, &from.source, &rec.source)?;
                    cache::write_volume(&r, &rec)?;
                    Ok(rec)
                })
                .await
            }
            Work::External { path } => {
                let (r, rec) = (root, rec);
                blocking(move || {
                    if !std::path::Path::new(&path).exists() {
                        return Err(Error::NotFound(format!(
                            "{path} does not exist on node {}",
                            r.node.clone().unwrap_or_default()
                        )));
                    }
                    cache::write_volume(&r, &rec)?;
                    Ok(rec)
                })
                .await
            }
            Work::Clone { from } => {
                // A sealed source of a tenant's own is judged by the
                // class's policy as a pulled model is.
                if let Some(policy) = &pull.signature {
                    let (r, s) = (root.clone(), from.source.clone());
                    let seal = blocking(move || sealed(&r, &s, Some(&from.id))).await?;
                    rec.signed_by = self
                        .engine
                        .vouch_sealed(&root, &from.source, &seal, Some(policy))
                        .await?;
                }
                self.reference(root, from.source, rec, required, limit)
                    .await
            }
            Work::Pull { uri, until } => {
                self.execute_pull(
                    req,
                    &uri,
                    until,
                    root,
                    rec,
                    pull,
                    (required, limit),
                    deadline,
                )
                .await
            }
        }
    }

    /// A model URI's work: join its pull, then reference the model (sealed)
    /// or the pull's area (answered before the seal).
    #[allow(clippy::too_many_arguments)]
    async fn execute_pull(
        &self,
        req: &CreateRequest,
        uri: &str,
        until: Until,
        root: Root,
        mut rec: VolumeRecord,
        pull: PullInputs,
        (required, limit): (i64, i64),
        deadline: Option<std::time::Instant>,
    ) -> Result<VolumeRecord> {
        let ns = pull.owner.as_ref().map(|o| o.namespace().to_string());
        if let Some(ns) = &ns {
            let (r, n, u, max) = (
                root.clone(),
                ns.clone(),
                crate::trust::allowed::shown(uri).to_string(),
                self.cfg.max_models_per_namespace,
            );
            blocking(move || namespace_has_room(&r, &n, &u, max)).await?;
        }
        rec.namespace = ns;
        // Eviction may take the model between its seal and our
        // reference (it never waits for a create); a new pull
        // brings it back. Bounded: a cache evicting every model as
        // soon as it lands answers UNAVAILABLE instead.
        let until = until_on(&kernel_release(), until)?;
        let mut attempt = 1;
        loop {
            let (early, backed) = self.pull(req, uri, &root, &pull, deadline, until).await?;
            let sid = match early {
                jobs::Early::Sealed(pulled) => {
                    rec.model = pulled.seal.origin.clone().into();
                    rec.revision = pulled.seal.revision.clone();
                    rec.signed_by = pulled.signed.clone();
                    pulled.sid.clone()
                }
                jobs::Early::Arriving { model, partial } => {
                    // What the seal will say, known since the
                    // origin resolved the request.
                    rec.model = Some(model.uri);
                    rec.revision = Some(model.revision);
                    match self
                        .reference_arriving(
                            &root,
                            &model.sid,
                            &partial,
                            &rec,
                            (required, limit),
                            !backed,
                        )
                        .await?
                    {
                        Some(rec) => {
                            partial.answered();
                            if backed {
                                self.answered(&req.name, until);
                            }
                            return Ok(rec);
                        }
                        // Sealed meanwhile: referenced as any sealed
                        // model (asking the job again could start
                        // another pull, a cache hit, once the job
                        // is done).
                        None => cache::SourceId::parse(&model.sid).ok_or_else(|| {
                            Error::Internal(format!("malformed model id {}", model.sid))
                        })?,
                    }
                }
            };
            match self
                .reference(root.clone(), sid, rec.clone(), required, limit)
                .await
            {
                Err(Error::Evicted { source_id }) if attempt < PULLS_PER_EVICTION => {
                    tracing::info!(source = %source_id, attempt, "the model was evicted before this volume referenced it; pulling it again");
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    /// Makes `rec` a cache volume reading the sealed source `sid`: a
    /// reference, checked under the source's lock so that a delete cannot
    /// slip in, and against eviction, which takes no lock: it renames a
    /// model away before it looks for references, so the seal is read again
    /// after ours is made.
    async fn reference(
        &self,
        root: Root,
        sid: cache::SourceId,
        mut rec: VolumeRecord,
        required: i64,
        limit: i64,
    ) -> Result<VolumeRecord> {
        let _g = self.sources.lock(&sid).await;
        blocking(move || {
            let evicted = || Error::Evicted {
                source_id: sid.to_string(),
            };
            let seal = match sealed(&root, &sid, rec.content_source.as_deref()) {
                Err(_) if sid.is_model() && !cache::source_exists(&root, &sid) => {
                    return Err(evicted());
                }
                r => r?,
            };
            if let Some(sub) = &rec.sub_path
                && !seal.has_dir(sub)
            {
                return Err(Error::invalid(
                    "parameters.subPath",
                    format!(
                        "{sub:?} is not a directory of the source (directories: {})",
                        preview(&seal.dirs)
                    ),
                ));
            }
            let total = seal.total_bytes as i64;
            if limit > 0 && limit < total {
                return Err(Error::Unsatisfiable(format!(
                    "capacity_range.limit_bytes {limit} is smaller than the {total} bytes the source holds"
                )));
            }
            let uuid = std::mem::replace(&mut rec.source, sid.clone());
            rec.capacity_bytes = required.max(total);
            cache::add_ref(&root, &sid, &uuid)?;
            if cache::read_seal(&root, &sid)?.is_none() {
                cache::remove_ref(&root, &sid, &uuid)?;
                return Err(evicted());
            }
            // Our reference stands from here: an eviction that renames the
            // model away now finds it and puts the model back. Only the
            // advisory last-used stamp can miss it in that instant.
            if sid.is_model()
                && let Err(e) = cache::evict::touch(&root, &sid)
            {
                tracing::warn!(source = %sid, error = %e, "could not record the model's use");
            }
            cache::write_volume(&root, &rec)?;
            Ok(rec)
        })
        .await
    }

    /// Makes `rec` a progressive volume of model `sid`, still arriving:
    /// its reference goes into the pull's area (see `cache::add_pull_ref`)
    /// and its record says so. None: the area is gone (the model sealed or
    /// the pull ended), and the caller references it the ordinary way.
    /// Not `durable` when the pull's wanted record brings both back after
    /// a crash: the answer then waits for no fsync on a disk busy with the
    /// model's writeback, and `see_through` syncs them at the seal.
    async fn reference_arriving(
        &self,
        root: &Root,
        sid: &cache::SourceId,
        partial: &Arc<crate::cache::partial::Partial>,
        rec: &VolumeRecord,
        (required, limit): (i64, i64),
        durable: bool,
    ) -> Result<Option<VolumeRecord>> {
        let files = partial.listing().unwrap_or_default();
        let total: u64 = files.iter().map(|(_, n)| n).sum();
        if let Some(sub) = &rec.sub_path
            && !files.iter().any(|(p, _)| p.starts_with(&format!("{sub}/")))
        {
            return Err(Error::invalid(
                "parameters.subPath",
                format!("{sub:?} is not a directory of the model's listing"),
            ));
        }
        let total = i64::try_from(total).unwrap_or(i64::MAX);
        if limit > 0 && limit < total {
            return Err(Error::Unsatisfiable(format!(
                "capacity_range.limit_bytes {limit} is smaller than the {total} bytes the model holds"
            )));
        }
        let _g = self.sources.lock(sid).await;
        let (root, mut rec, sid) = (root.clone(), rec.clone(), sid.clone());
        blocking(move || {
            let uuid = std::mem::replace(&mut rec.source, sid.clone());
            rec.capacity_bytes = required.max(total);
            rec.progressive = true;
            if !cache::add_pull_ref(&root, &sid, &uuid, durable)? {
                return Ok(None);
            }
            match durable {
                true => cache::write_volume(&root, &rec)?,
                false => cache::write_volume_unsynced(&root, &rec)?,
            }
            Ok(Some(rec))
        })
        .await
    }
}

fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// When a create may answer on a node running kernel `release`: a volume
/// answered before its seal is served through a FUSE view, whose verified
/// files are read by passthrough, which came in 6.9. A class that asked
/// for a progressive volume is refused on an older kernel, with why (a
/// silent fallback left its pods waiting for the whole model with no word
/// of it); one answered once verified is answered at the seal instead,
/// which is the same volume a little later.
fn until_on(release: &str, until: Until) -> Result<Until> {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) >= (6, 9) {
        return Ok(until);
    }
    match until {
        Until::Listed => Err(Error::Precondition(format!(
            "parameters.progressive: progressive volumes need Linux 6.9 or later (FUSE passthrough), and this node runs {release}; use a class without progressive: \"true\" here (its volumes are usable once the model is verified and sealed), or upgrade the node's kernel"
        ))),
        Until::Verified => {
            tracing::info!(kernel = %release, "kernel before 6.9: this volume answers once its model is sealed");
            Ok(Until::Sealed)
        }
        Until::Sealed => Ok(Until::Sealed),
    }
}

/// The seal of a source a cache volume is about to read.
fn sealed(root: &Root, sid: &cache::SourceId, from: Option<&str>) -> Result<Seal> {
    cache::read_seal(root, sid)?.ok_or_else(|| {
        Error::Precondition(format!(
            "source volume {} is not sealed: finish writing it, stop the pods that write it, \
             then seal it (mutable parameter sealed=true through a VolumeAttributesClass, \
             or `modelcache-csi seal`)",
            from.unwrap_or(sid)
        ))
    })
}

/// Whether a namespace may pull `uri` into `root`: its volumes hold fewer
/// than `max` distinct pulled models, or one of them is of this URI
/// already. Inline volumes have no ResourceQuota, so without this one
/// namespace could fill a node's cache with models nobody else uses.
/// Concurrent first pulls of one namespace may overshoot by how many run
/// at once.
fn namespace_has_room(root: &Root, ns: &str, uri: &str, max: usize) -> Result<()> {
    if max == 0 {
        return Ok(());
    }
    let mut models = std::collections::BTreeSet::new();
    for v in cache::list_volumes(root)? {
        if v.namespace.as_deref() != Some(ns) || !v.source.is_model() {
            continue;
        }
        if v.model.as_deref().map(crate::trust::allowed::shown) == Some(uri) {
            return Ok(());
        }
        models.insert(v.source);
    }
    if models.len() >= max {
        return Err(Error::OverLimit(format!(
            "namespace {ns} already holds {} pulled models in {} (--max-models-per-namespace {max}); \
             delete the volumes of models it no longer uses, or ask an admin to raise the limit",
            models.len(),
            root.describe()
        )));
    }
    Ok(())
}

fn check_free(root: &Root, bytes: u64) -> Result<()> {
    let space = cache::space(root)?;
    if bytes > space.usable() {
        return Err(Error::OverLimit(format!(
            "{bytes} bytes were requested, but {} has {space}",
            root.describe()
        )));
    }
    Ok(())
}

fn preview(items: &[String]) -> String {
    if items.is_empty() {
        return "none".into();
    }
    let mut s: Vec<_> = items.iter().take(8).cloned().collect();
    if items.len() > 8 {
        s.push(format!("… {} more", items.len() - 8));
    }
    s.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Role, VolumeRecord};

    /// A progressive class on a kernel without FUSE passthrough is refused
    /// naming the parameter and the kernel; a volume answered once verified
    /// waits for the seal there instead; 6.9 and later serve both.
    #[test]
    fn progressive_needs_a_kernel_that_serves_it() {
        let e = until_on("5.15.0-91-generic", Until::Listed).unwrap_err();
        assert!(
            matches!(&e, Error::Precondition(m) if m.contains("parameters.progressive") && m.contains("5.15.0-91-generic")),
            "{e}"
        );
        assert_eq!(
            until_on("6.8.0-31-generic", Until::Verified).unwrap(),
            Until::Sealed
        );
        assert_eq!(until_on("6.9.0", Until::Listed).unwrap(), Until::Listed);
        assert_eq!(
            until_on("6.18.2", Until::Verified).unwrap(),
            Until::Verified
        );
        assert_eq!(until_on("4.19.0", Until::Sealed).unwrap(), Until::Sealed);
    }

    /// A namespace at its bound may still use the models it holds, and
    /// other namespaces are not counted against it.
    #[test]
    fn a_namespace_holds_at_most_its_share_of_models() {
        let d = tempfile::tempdir().unwrap();
        let cfg = crate::config::Config::for_node("n", d.path());
        let root = crate::cache::Roots::of(&cfg).roots.remove(0);
        let volume = |i: u32, ns: &str, model: &str| {
            let uuid = format!("{i:032x}");
            let rec = VolumeRecord {
                id: root.volume_id(&uuid),
                name: format!("v{i}"),
                backend: root.backend,
                role: Role::Cache,
                source: cache::SourceId::parse(&format!("m{:031x}", i % 100)).unwrap(),
                sub_path: None,
                verify: Default::default(),
                capacity_bytes: 1,
                node: Some("n".into()),
                model: Some(model.into()),
                revision: None,
                external: None,
                content_source: None,
                namespace: Some(ns.into()),
                signed_by: None,
                progressive: false,
                request: String::new(),
                created_unix: 0,
            };
            cache::write_volume(&root, &rec).unwrap();
        };
        volume(1, "team-a", "s3://m/one");
        volume(2, "team-a", "s3://m/two");
        volume(3, "team-b", "s3://m/three");
        // Two volumes of one model count once.
        volume(101, "team-a", "s3://m/one");
        namespace_has_room(&root, "team-a", "s3://m/new", 3).unwrap();
        let e = namespace_has_room(&root, "team-a", "s3://m/new", 2).unwrap_err();
        assert!(matches!(e, Error::OverLimit(_)), "{e}");
        assert!(e.to_string().contains("--max-models-per-namespace"), "{e}");
        namespace_has_room(&root, "team-a", "s3://m/two", 2).unwrap();
        namespace_has_room(&root, "team-b", "s3://m/new", 2).unwrap();
        namespace_has_room(&root, "team-a", "s3://m/new", 0).unwrap();
    }
}
