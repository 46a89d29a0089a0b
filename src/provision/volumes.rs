//! The controller's domain: provisioning, sealing and deleting volumes in
//! their roots. Handlers in `mod.rs` validate and lock; CreateVolume is
//! resolved here (the API), decided in `plan`, and executed here.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::cache::{self, External, Role, Root, Roots, Seal, VolumeId, VolumeRecord};
use crate::config::Config;
use crate::context::Context;
use crate::csi::Topology;
use crate::error::{Error, Result};
use crate::kubeapi::{self, KubeApi};
use crate::lock::KeyedMutex;
use crate::puller::engine::{Engine, NoProgress, ProgressSink};
use crate::puller::jobs::{self, Jobs};

use super::wanted;
use crate::puller::{self, SourceOptions};
use crate::trust::Tenant;
use kube::ResourceExt;

use super::params::Params;
use super::plan::{self, Plan, Resolved, Work};
use super::plan::{CreateRequest, InlineSource};

/// A volume as ListVolumes reports it: its record and where it is reachable.
pub type Listed = (VolumeRecord, Vec<Topology>);

pub struct Provisioner {
    cfg: Arc<Config>,
    roots: Roots,
    /// Serialises clone, seal and delete on one source within this process.
    sources: KeyedMutex,
    engine: Arc<Engine>,
    /// Pulls that outlive the CreateVolume calls that want them.
    jobs: Jobs,
    /// API access, for per-PVC sources, `pvc://` and PVC events.
    kube: Option<KubeApi>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// How a pull goes: with what credentials and policy, told to whom, for
/// which PVC.
struct PullInputs {
    options: SourceOptions,
    /// The class's signature policy: never the tenant's to set.
    signature: Option<Arc<crate::signing::Policy>>,
    sink: Arc<dyn ProgressSink>,
    owner: Option<jobs::Owner>,
}

/// What a `pvc://` source turned out to be.
enum PvcSource {
    /// A volume of this driver: read its sealed source in place.
    Volume {
        id: String,
        sub_path: Option<String>,
    },
    /// Another PV's bytes on this node, read-only in place.
    External {
        external: External,
        sub_path: Option<String>,
    },
}

pub use crate::offload::blocking;

impl Provisioner {
    /// A provisioner for the context's roots; it sweeps what a previous
    /// process left half-done in them.
    pub fn new(ctx: &Context) -> Provisioner {
        for r in &ctx.roots.roots {
            cache::sweep(r);
        }
        Provisioner {
            cfg: ctx.cfg.clone(),
            roots: ctx.roots.clone(),
            sources: KeyedMutex::default(),
            engine: Arc::new(Self::engine(ctx.cfg.as_ref(), &ctx.metrics)),
            jobs: Jobs::default(),
            kube: ctx.kube.clone(),
            metrics: ctx.metrics.clone(),
        }
    }

    fn engine(cfg: &Config, metrics: &Arc<crate::metrics::Metrics>) -> Engine {
        Engine::new(cfg.pull.clone(), crate::puller::extract_layer).with_metrics(metrics.clone())
    }

    /// Pulls fill from `fill` (peers) before the origin.
    pub fn with_fill(mut self, fill: Arc<dyn crate::puller::source::Fill>) -> Provisioner {
        self.engine = Arc::new(Self::engine(&self.cfg, &self.metrics).with_fill(fill));
        self
    }

    /// Whether a pull for volume `name` runs in this process now.
    pub fn is_pulling(&self, name: &str) -> bool {
        self.jobs.is_running(name)
    }

    /// The roots this provisioner serves.
    pub fn roots(&self) -> &crate::cache::Roots {
        &self.roots
    }

    /// A volume's root and record, read off the runtime.
    pub async fn lookup(&self, volume_id: &str) -> Result<(Root, VolumeRecord)> {
        cache::lookup_off_runtime(&self.roots, volume_id).await
    }

    /// CreateVolume: resolve what the request names (the API), plan it
    /// (pure, `plan`), then do the plan's one kind of work.
    pub async fn create(&self, req: CreateRequest) -> Result<(VolumeRecord, Vec<Topology>)> {
        // The caller's budget runs from now: what comes before the pull
        // (the API, opening the source, the record) spends it too.
        let deadline = req.budget.map(|b| std::time::Instant::now() + b);
        let params = Params::parse(&req.params)?;
        let mutable = super::params::parse_mutable(&req.mutable)?;
        let (resolved, pull) = self.resolve(&req, params).await?;
        let plan = plan::plan(&self.cfg, &self.roots, &req, resolved)?;
        if let Some(existing) = self.existing(&plan).await? {
            return Ok(existing);
        }
        let root = plan.root.clone();
        let rec = self.execute(&req, plan, pull, deadline).await?;
        if mutable.pinned.is_some() && rec.role == Role::Cache && rec.model.is_some() {
            let (r, sid, pin) = (
                root.clone(),
                rec.source.clone(),
                mutable.pinned == Some(true),
            );
            let uuid = VolumeId::parse(&rec.id).map(|i| i.uuid).unwrap_or_default();
            blocking(move || cache::evict::set_volume_pin(&r, &sid, &uuid, pin)).await?;
        }
        if mutable.sealed == Some(true) && rec.role == Role::Source {
            self.seal(&rec.id).await?;
        }
        Ok((rec, plan::topology_of(&self.cfg, &root)))
    }

    /// What the request names, from the API: the PVC's own source and
    /// secret, a pod's inline source, a `pvc://` claim, the content volume.
    async fn resolve(
        &self,
        req: &CreateRequest,
        mut params: Params,
    ) -> Result<(Resolved, PullInputs)> {
        let mut secrets: BTreeMap<String, String> = req.secrets.clone().into_iter().collect();
        // The requesting PVC (external-provisioner --extra-create-metadata)
        // may name its own source and pull secret.
        let pvc = match (
            &self.kube,
            req.params.get(kubeapi::PVC_NAMESPACE),
            req.params.get(kubeapi::PVC_NAME),
        ) {
            (Some(k), Some(ns), Some(name)) => Some((ns.clone(), k.pvc(ns, name).await?)),
            _ => None,
        };
        // A source the PVC names is the tenant's choice: bounded by the
        // class's allowedSources, pulled through the egress guard, and with
        // the PVC's own secret only, never the class's or the driver's.
        let mut tenant = None;
        let events = match (&self.kube, &pvc, &req.inline) {
            (Some(k), Some((_, claim)), _) => {
                Some(Arc::new(k.pull_events(claim, self.cfg.progress_every)))
            }
            (
                Some(k),
                None,
                Some(InlineSource {
                    pod: Some((ns, name)),
                    ..
                }),
            ) => Some(Arc::new(k.pod_pull_events(
                ns,
                name,
                self.cfg.progress_every,
            ))),
            _ => None,
        };
        if let Some(inline) = &req.inline {
            let field = "volumeAttributes.source";
            tenant = Some(
                self.admit(field, &inline.uri, &params, events.as_deref())
                    .await?,
            );
            params.source = Some(inline.uri.clone());
        }
        if let (Some((ns, claim)), Some(k)) = (&pvc, &self.kube) {
            if let Some(src) = claim.annotations().get(kubeapi::SOURCE_ANNOTATION) {
                let field = format!("PVC annotation {}", kubeapi::SOURCE_ANNOTATION);
                tenant = Some(self.admit(&field, src, &params, events.as_deref()).await?);
                params.source = Some(src.clone());
                secrets.clear();
            }
            if let Some(secret) = claim.annotations().get(kubeapi::SECRET_ANNOTATION) {
                // A missing grant is the admin's to fix: say so on the PVC too.
                let read = k.secret(ns, secret).await.inspect_err(|e| {
                    if let Some(ev) = &events {
                        let uri = params.source.as_deref().unwrap_or("the model");
                        ev.failed(crate::trust::allowed::shown(uri), &e.to_string());
                    }
                })?;
                secrets.extend(read);
            }
        }
        // A pvc:// source is either one of our volumes (read like a clone)
        // or another PV's bytes on this node.
        let mut content_volume = req.content_volume.clone();
        let mut external = None;
        if let Some(src) = params.source.clone()
            && src.starts_with("pvc://")
        {
            let requester_ns = pvc.as_ref().map(|(ns, _)| ns.clone());
            match self
                .resolve_pvc(&src, requester_ns.as_deref(), params.allow_cross_namespace)
                .await?
            {
                PvcSource::Volume { id, sub_path } => {
                    content_volume = Some(id);
                    params.sub_path = join_sub(sub_path, params.sub_path.take());
                }
                PvcSource::External {
                    external: e,
                    sub_path,
                } => {
                    external = Some(e);
                    params.sub_path = join_sub(sub_path, params.sub_path.take());
                }
            }
            params.source = None;
        }
        let content = match content_volume {
            Some(id) => {
                let found = cache::lookup_off_runtime(&self.roots, &id).await;
                Some(found.map_err(|_| {
                    Error::NotFound(format!(
                        "volume_content_source.volume.volume_id {id} does not exist"
                    ))
                })?)
            }
            None => None,
        };
        let sink: Arc<dyn ProgressSink> = match (&events, &req.progress) {
            (Some(e), _) => e.clone(),
            (None, Some(p)) => p.clone(),
            (None, None) => Arc::new(NoProgress),
        };
        let pull = PullInputs {
            options: SourceOptions {
                params: params.source_options.clone(),
                secrets,
                tenant,
                bounds: crate::trust::Bounds {
                    allowed: params.allowed_sources.clone(),
                    credentialed: params.artifact_credentials.clone(),
                    ranges: self.cfg.tenant_ranges.clone(),
                },
                admin_guard: None,
            },
            signature: params.signature.clone(),
            sink,
            owner: match (&pvc, req.inline.as_ref().and_then(|i| i.pod.as_ref())) {
                (Some((ns, c)), _) => Some(jobs::Owner::Pvc {
                    namespace: ns.clone(),
                    name: c.name_any(),
                }),
                (None, Some((ns, pod))) => Some(jobs::Owner::Pod {
                    namespace: ns.clone(),
                    name: pod.clone(),
                }),
                (None, None) => None,
            },
        };
        Ok((
            Resolved {
                params,
                content,
                external,
            },
            pull,
        ))
    }

    /// A volume of this name already made: the same (a retry), or a
    /// conflict.
    async fn existing(&self, plan: &Plan) -> Result<Option<(VolumeRecord, Vec<Topology>)>> {
        let (roots, want) = (self.roots.clone(), plan.record.clone());
        let found = blocking(move || -> Result<Option<(Root, VolumeRecord)>> {
            let uuid = VolumeId::parse(&want.id)
                .map(|i| i.uuid)
                .unwrap_or_default();
            for r in &roots.roots {
                if let Some(existing) = cache::read_volume(r, &uuid)? {
                    return Ok(Some((r.clone(), existing)));
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
    async fn execute(
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
        let sid = match work {
            Work::NewSource => {
                let (r, rec) = (root, rec);
                return blocking(move || {
                    check_free(&r, rec.capacity_bytes as u64)?;
                    cache::create_source(&r, &rec.source, rec.capacity_bytes as u64)?;
                    cache::write_volume(&r, &rec)?;
                    Ok(rec)
                })
                .await;
            }
            Work::CopySource { from } => {
                let _g = self.sources.lock(&from.source).await;
                let (r, rec) = (root, rec);
                return blocking(move || {
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
                .await;
            }
            Work::External { path } => {
                let (r, rec) = (root, rec);
                return blocking(move || {
                    if !std::path::Path::new(&path).exists() {
                        return Err(Error::NotFound(format!(
                            "{path} does not exist on node {}",
                            r.node.clone().unwrap_or_default()
                        )));
                    }
                    cache::write_volume(&r, &rec)?;
                    Ok(rec)
                })
                .await;
            }
            Work::Clone { from } => {
                // A sealed source of a tenant's own is judged by the
                // class's policy as a pulled model is.
                if let Some(policy) = &pull.signature {
                    let (r, s) = (root.clone(), from.source.clone());
                    let seal = blocking(move || sealed(&r, &s, Some(&from.id))).await?;
                    rec.signed_by =
                        puller::engine::vouch_sealed(&root, &from.source, &seal, Some(policy))
                            .await?;
                }
                from.source
            }
            Work::Pull { uri } => {
                let ns = pull.owner.as_ref().map(|o| o.namespace().to_string());
                if let Some(ns) = &ns {
                    let (r, n, u, max) = (
                        root.clone(),
                        ns.clone(),
                        crate::trust::allowed::shown(&uri).to_string(),
                        self.cfg.max_models_per_namespace,
                    );
                    blocking(move || namespace_has_room(&r, &n, &u, max)).await?;
                }
                rec.namespace = ns;
                let pulled = self.pull(req, &uri, &root, pull, deadline).await?;
                rec.model = pulled.seal.origin.clone().into();
                rec.revision = pulled.seal.revision.clone();
                rec.signed_by = pulled.signed.clone();
                pulled.sid.clone()
            }
        };
        // A cache volume: a reference to a sealed source, checked under the
        // source's lock so that neither a delete nor an eviction slips in.
        let _g = self.sources.lock(&sid).await;
        blocking(move || {
            let seal = sealed(&root, &sid, rec.content_source.as_deref())?;
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
            // Eviction renames a model away before it looks for
            // references; if that won, ours must not dangle.
            if cache::read_seal(&root, &sid)?.is_none() {
                cache::remove_ref(&root, &sid, &uuid)?;
                return Err(Error::Transient(format!(
                    "source {sid} was evicted while this volume was being created; retry"
                )));
            }
            if sid.is_model() {
                cache::evict::touch(&root, &sid)?;
            }
            cache::write_volume(&root, &rec)?;
            Ok(rec)
        })
        .await
    }

    /// Pulls a model URI into `root` through the pull job of this volume
    /// name, which outlives the call: at the caller's deadline it answers
    /// "still pulling", and the retry joins the same job.
    async fn pull(
        &self,
        req: &CreateRequest,
        uri: &str,
        root: &Root,
        pull: PullInputs,
        deadline: Option<std::time::Instant>,
    ) -> Result<Arc<crate::puller::engine::Pulled>> {
        let shown = crate::trust::allowed::shown(uri).to_string();
        let tenant = pull.options.tenant.is_some();
        let source = match puller::open(uri, &pull.options).await {
            Ok(s) => s,
            Err(e) => {
                pull.sink.failed(&shown, &e.to_string());
                return Err(e);
            }
        };
        let job = jobs::Request {
            key: req.name.clone(),
            uri: shown,
            owner: pull.owner,
            root: root.clone(),
            source,
            signature: pull.signature,
            sink: pull.sink,
        };
        // Recorded so that a restart resumes it; a class secret would have
        // to be written too, so such a pull waits for the provisioner's
        // next call. An inline volume's pull is not: kubelet asks again.
        let resumable = req.inline.is_none() && (req.secrets.is_empty() || tenant);
        if resumable && !self.jobs.is_running(&req.name) {
            let (d, w) = (self.wanted_dir(), req.clone());
            blocking(move || wanted::save(&d, &w)).await?;
        }
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        tracing::debug!(budget = ?left, "joining the pull job");
        let pulled = self.jobs.pull(&self.engine, job, left).await;
        if resumable && !self.jobs.is_running(&req.name) {
            let (d, n) = (self.wanted_dir(), req.name.clone());
            blocking(move || wanted::remove(&d, &n)).await?;
        }
        pulled
    }

    /// A source a tenant named (in `field`), admitted under the class's
    /// allowedSources; a refusal is told on the PVC or pod, too.
    async fn admit(
        &self,
        field: &str,
        uri: &str,
        params: &Params,
        events: Option<&kubeapi::PvcEvents>,
    ) -> Result<Arc<Tenant>> {
        let admitted = match puller::validate_uri(uri) {
            Err(m) => Err(Error::invalid(field, m)),
            Ok(()) => {
                Tenant::admit(
                    field,
                    uri,
                    params.allowed_sources.as_ref(),
                    &params.source_options,
                    &self.cfg.tenant_ranges,
                )
                .await
            }
        };
        if let (Err(e), Some(ev)) = (&admitted, events) {
            ev.refused(&e.to_string());
        }
        admitted
    }

    pub async fn delete(&self, volume_id: &str) -> Result<()> {
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let root = self.roots.for_id(&id)?.clone();
        let rec = {
            let (r, uuid) = (root.clone(), id.uuid.clone());
            blocking(move || cache::read_volume(&r, &uuid)).await?
        };
        let Some(rec) = rec else {
            return Ok(());
        };
        let _g = self.sources.lock(&rec.source).await;
        blocking(move || delete_volume(&root, &id.uuid, &rec)).await
    }

    /// ControllerExpandVolume to `target` bytes. Returns the size and
    /// whether the node must finish it. A directory source has no size
    /// beyond its record, which grows here; an image's bytes grow on the
    /// node that has it staged (NodeExpandVolume), where its loop device
    /// and mount are, so this only checks that it may and has the room.
    /// Another node's volume is that node's to check and grow.
    pub async fn expand(&self, volume_id: &str, target: i64) -> Result<(i64, bool)> {
        if let Some(id) = VolumeId::parse(volume_id)
            && self.roots.for_id(&id).is_err()
        {
            return Ok((target, true));
        }
        let (root, rec) = self.lookup(volume_id).await?;
        let _g = self.sources.lock(&rec.source).await;
        blocking(move || {
            cache::grow::check(&root, &rec, target)?;
            // An image (a store with a filesystem type) grows where it is
            // mounted; a directory is its record.
            if root.backend.store().fs_type().is_some() {
                return Ok((target.max(rec.capacity_bytes), true));
            }
            Ok((cache::grow::record(&root, &rec, target)?, false))
        })
        .await
    }

    /// Seals a source volume; a cache volume is sealed by construction.
    pub async fn seal(&self, volume_id: &str) -> Result<Seal> {
        let (root, rec) = self.lookup(volume_id).await?;
        let _g = self.sources.lock(&rec.source).await;
        let origin = format!("volume {} ({})", rec.name, rec.id);
        let sid = rec.source.clone();
        blocking(move || cache::seal_source(&root, &sid, &origin)).await
    }

    pub async fn modify(&self, volume_id: &str, mutable: &HashMap<String, String>) -> Result<()> {
        let (attributes, pv_name) = super::params::split_modify_metadata(mutable);
        let attributes: HashMap<_, _> = attributes.into_iter().collect();
        let m = super::params::parse_mutable(&attributes)?;
        if let Some(id) = VolumeId::parse(volume_id)
            && let Err(not_here) = self.roots.for_id(&id)
        {
            return self
                .modified_on_node(volume_id, &attributes, pv_name.as_deref(), not_here)
                .await;
        }
        let (root, rec) = self.lookup(volume_id).await?;
        if let Some(pin) = m.pinned {
            if !rec.source.is_model() {
                return Err(Error::invalid(
                    "mutable_parameters.pinned",
                    "only volumes of pulled models (parameter source) can pin them; source volumes are never evicted",
                ));
            }
            let (r, sid) = (root.clone(), rec.source.clone());
            let uuid = VolumeId::parse(&rec.id).map(|i| i.uuid).unwrap_or_default();
            blocking(move || cache::evict::set_volume_pin(&r, &sid, &uuid, pin)).await?;
        }
        match (m.sealed, rec.role) {
            (Some(true), Role::Source) => self.seal(volume_id).await.map(|_| ()),
            (Some(false), _) => {
                let sealed = blocking(move || cache::read_seal(&root, &rec.source)).await?;
                if sealed.is_some() {
                    return Err(Error::invalid(
                        "mutable_parameters.sealed",
                        format!("volume {volume_id} is sealed, and sealing cannot be undone"),
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// ControllerModifyVolume for a volume in a root this process does not
    /// serve: a node-local volume of another node, whose driver applies the
    /// change and reports on the PV (`node_report`). Without the PV's name
    /// (external-resizer's --extra-modify-metadata) or API access there is
    /// nothing to read, and the answer says so.
    async fn modified_on_node(
        &self,
        volume_id: &str,
        attributes: &HashMap<String, String>,
        pv_name: Option<&str>,
        not_here: Error,
    ) -> Result<()> {
        let (Some(kube), Some(pv_name)) = (&self.kube, pv_name) else {
            return Err(Error::Precondition(format!(
                "{not_here}. A node-local volume is modified by its node's driver, which reports on \
                 the PV: run external-resizer with --extra-modify-metadata and give this \
                 controller Kubernetes API access, so it can read that report"
            )));
        };
        let pv = kube.pv(pv_name).await?;
        let handle = pv.spec.as_ref().and_then(|s| s.csi.as_ref());
        if handle.map(|c| c.volume_handle.as_str()) != Some(volume_id) {
            return Err(Error::Precondition(format!(
                "PV {pv_name} is not volume {volume_id}"
            )));
        }
        let Some(node) = node_of(&pv, &self.cfg.topology_key()) else {
            return Err(not_here);
        };
        let wanted = attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let report = super::node_report::Report::from_annotations(pv.metadata.annotations.as_ref());
        super::node_report::answer(volume_id, &node, &wanted, report.as_ref())
    }

    /// Every volume this controller serves, ordered by id.
    pub fn list(&self) -> Result<Vec<Listed>> {
        Ok(self.list_page("", usize::MAX)?.0)
    }

    /// Up to `max` volumes whose ids sort after `after`, in id order, and
    /// the token for the next page (empty when none is left). Only the
    /// page's records are read: a page costs the same with 10 volumes as
    /// with 10,000, beyond listing the directories' names.
    pub fn list_page(&self, after: &str, max: usize) -> Result<(Vec<Listed>, String)> {
        let mut ids = Vec::new();
        for r in &self.roots.roots {
            for uuid in cache::volume_uuids(r)? {
                let id = r.volume_id(&uuid);
                if id.as_str() > after {
                    ids.push((id, r, uuid));
                }
            }
        }
        ids.sort_by(|a, b| a.0.cmp(&b.0));
        let mut page = Vec::new();
        let mut left = ids.into_iter();
        for (_, root, uuid) in left.by_ref() {
            if let Some(rec) = cache::read_listed(root, &uuid)? {
                page.push((rec, plan::topology_of(&self.cfg, root)));
            }
            if page.len() == max {
                break;
            }
        }
        let next = match (left.len(), page.last()) {
            (0, _) | (_, None) => String::new(),
            (_, Some((rec, _))) => rec.id.clone(),
        };
        Ok((page, next))
    }

    /// Free bytes where a volume with these parameters would go, or 0 for a
    /// topology segment this controller cannot provision in, and at a node
    /// for one claim's shared volume when a central controller provisions
    /// those.
    pub fn capacity(
        &self,
        params: &HashMap<String, String>,
        topology: Option<&Topology>,
    ) -> Result<i64> {
        // Read before the class is judged whole: a shared class with a bad
        // parameter is still the central controller's (which names the
        // parameter), never a node's to take and fail the same way.
        let says_shared = |key: &str| params.get(key).is_some_and(|v| v == "shared");
        let names_shared =
            says_shared(super::params::BACKEND) || says_shared(super::params::IMAGE_LOCATION);
        let parsed = Params::parse(params);
        let shared = match &parsed {
            Ok(p) => !plan::is_node_local(p),
            Err(_) => names_shared,
        };
        if self.cfg.shared_central && shared && params.contains_key(crate::kubeapi::PVC_NAME) {
            // A question about one claim (external-provisioner's node
            // deployment asks it, with --extra-create-metadata, before it
            // takes an Immediate claim): a shared volume is the central
            // controller's to provision, so this node has no room for it,
            // or every node would race the controller for each shared
            // claim (and for one the controller cannot provision yet, take
            // it and fail the same way). Without a claim it is
            // CSIStorageCapacity's question, and the room is real: the
            // scheduler places WaitForFirstConsumer pods of shared classes
            // by it.
            return Ok(0);
        }
        let p = parsed?;
        let root = match plan::select_root(&self.cfg, &self.roots, &p) {
            Ok(r) => r,
            Err(Error::Precondition(_)) => return Ok(0),
            Err(e) => return Err(e),
        };
        if let (Some(node), Some(t)) = (&root.node, topology)
            && t.segments.get(&self.cfg.topology_key()) != Some(node)
        {
            return Ok(0);
        }
        let cap = self.cfg.pull.capacity.get(&root.backend).copied();
        let free = cache::evict::available(&root, cap)?;
        Ok(free.min(i64::MAX as u64) as i64)
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
    fn wanted_dir(&self) -> std::path::PathBuf {
        self.cfg.state_dir.join("wanted")
    }

    /// The requests whose pulls were running when this process last
    /// stopped (see `wanted`).
    pub async fn wanted(&self) -> Vec<CreateRequest> {
        let d = self.wanted_dir();
        blocking(move || Ok(wanted::load(&d)))
            .await
            .unwrap_or_default()
    }

    /// Drops the record of the pull for volume `name`.
    pub async fn forget_wanted(&self, name: &str) {
        let (d, name) = (self.wanted_dir(), name.to_string());
        let _ = blocking(move || wanted::remove(&d, &name)).await;
    }

    /// Evicts pulled models nobody has used for `idle`, in every root.
    pub fn evict_idle(&self, idle: std::time::Duration) {
        for root in &self.roots.roots {
            match cache::evict::evict_idle(root, idle) {
                Ok(gone) if !gone.is_empty() => {
                    self.metrics.evictions.inc_by(gone.len() as u64);
                    tracing::info!(root = %root.dir.display(), evicted = ?gone, "evicted idle models")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(root = %root.dir.display(), error = %e, "eviction failed"),
            }
        }
    }

    pub fn volume_context(
        &self,
        rec: &VolumeRecord,
        root_dir: &std::path::Path,
    ) -> HashMap<String, String> {
        let mut ctx = HashMap::from([
            ("backend".to_string(), rec.backend.to_string()),
            ("role".to_string(), rec.role.as_str().to_string()),
            ("source".to_string(), rec.source.to_string()),
            ("verify".to_string(), rec.verify.as_str().to_string()),
            ("root".to_string(), root_dir.display().to_string()),
        ]);
        if let Some(s) = &rec.sub_path {
            ctx.insert("subPath".into(), s.clone());
        }
        if let Some(m) = &rec.model {
            ctx.insert("model".into(), m.clone());
        }
        if let Some(r) = &rec.revision {
            ctx.insert("revision".into(), r.clone());
        }
        if let Some(w) = &rec.signed_by {
            ctx.insert("signedBy".into(), w.clone());
        }
        ctx
    }
}

/// Removes a volume's record and what only it held, under its source's
/// lock; a source still read or written is refused, naming who.
fn delete_volume(root: &Root, uuid: &str, rec: &VolumeRecord) -> Result<()> {
    match rec.role {
        Role::Cache => {
            // The record goes first: while it exists, so does its reference.
            cache::remove_volume(root, uuid)?;
            cache::remove_ref(root, &rec.source, uuid)?;
        }
        Role::Source => {
            let mut users = Vec::new();
            for r in cache::refs(root, &rec.source)? {
                match cache::read_volume(root, &r)? {
                    Some(v) => users.push(format!("{} ({})", v.name, v.id)),
                    // A reference without a record: a create that died.
                    None => cache::remove_ref(root, &rec.source, &r)?,
                }
            }
            if !users.is_empty() {
                return Err(Error::Precondition(format!(
                    "source volume {} is read by cache volumes {}; delete them first",
                    rec.id,
                    users.join(", ")
                )));
            }
            let writers = cache::writers(root, &rec.source)?;
            if !writers.is_empty() {
                return Err(Error::Precondition(format!(
                    "source volume {} is still staged on node(s) {}",
                    rec.id,
                    writers.join(", ")
                )));
            }
            cache::delete_source(root, &rec.source)?;
            cache::remove_volume(root, uuid)?;
        }
    }
    Ok(())
}

/// The seal of a source a cache volume is about to read.
fn sealed(root: &Root, sid: &str, from: Option<&str>) -> Result<Seal> {
    cache::read_seal(root, sid)?.ok_or_else(|| {
        Error::Precondition(format!(
            "source volume {} is not sealed: finish writing it, stop the pods that write it, \
             then seal it (mutable parameter sealed=true through a VolumeAttributesClass, \
             or `modelcache-csi seal`)",
            from.unwrap_or(sid)
        ))
    })
}

/// A writable source may never be promised more than the filesystem can
/// still give: its free space beyond the reserve (`--min-free`). Neither
/// a directory nor a sparse image is allocated up front, so this is the
/// bound a size gets where no quota enforces it.
/// A claim named across namespaces must say that the requester's
/// namespace may read it (`modelcache.csi.io/shared-with`): the class's
/// `allowCrossNamespacePVC` is the admin's leave, this is the owner's.
fn consented(
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaim,
    ns: &str,
    requester_ns: &str,
    uri: &str,
) -> Result<()> {
    let shared = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kubeapi::SHARED_WITH_ANNOTATION));
    let ok = shared.is_some_and(|v| {
        v.split(',')
            .map(str::trim)
            .any(|n| n == requester_ns || n == "*")
    });
    if ok {
        return Ok(());
    }
    Err(Error::NotAllowed(format!(
        "{uri}: claim {ns}/{} does not consent to be read from namespace {requester_ns}; its owner \
         may annotate it {}: \"{requester_ns}\" (comma-separated namespaces, or \"*\")",
        claim.metadata.name.as_deref().unwrap_or_default(),
        kubeapi::SHARED_WITH_ANNOTATION
    )))
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

fn join_sub(a: Option<String>, b: Option<String>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) => Some(format!("{a}/{b}")),
        (a, b) => a.or(b),
    }
}

impl Provisioner {
    /// Resolves `pvc://[ns:]claim[/path]` to what its bound PV holds.
    async fn resolve_pvc(
        &self,
        uri: &str,
        requester_ns: Option<&str>,
        cross_ns: bool,
    ) -> Result<PvcSource> {
        let field = "parameters.source";
        let u = crate::uri::parse_pvc_uri(uri).map_err(|m| Error::invalid(field, m))?;
        let kube = self.kube.as_ref().ok_or_else(|| {
            Error::Precondition(format!(
                "{uri} needs Kubernetes API access and the PVC's namespace: run the provisioner with --extra-create-metadata and the driver in the cluster (or with --kubeconfig)"
            ))
        })?;
        let requester_ns = requester_ns.ok_or_else(|| {
            Error::Precondition(format!("{uri}: the requesting PVC is unknown; run external-provisioner with --extra-create-metadata"))
        })?;
        let ns = match &u.namespace {
            Some(ns) if ns != requester_ns && !cross_ns => {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{uri} names a claim in namespace {ns}, but the PVC is in {requester_ns}; a StorageClass must set {}: \"true\" to allow that",
                        super::params::ALLOW_CROSS_NAMESPACE
                    ),
                ));
            }
            Some(ns) => ns.clone(),
            None => requester_ns.to_string(),
        };
        let claim = kube.pvc(&ns, &u.claim).await?;
        if ns != requester_ns {
            consented(&claim, &ns, requester_ns, uri)?;
        }
        let pv_name = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|_| claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .ok_or_else(|| {
                Error::Precondition(format!("claim {ns}/{} is not bound yet", u.claim))
            })?;
        let pv = kube.pv(&pv_name).await?;
        let spec = pv.spec.unwrap_or_default();
        if let Some(csi) = &spec.csi
            && csi.driver == self.cfg.driver_name
        {
            return Ok(PvcSource::Volume {
                id: csi.volume_handle.clone(),
                sub_path: u.path,
            });
        }
        let block = spec.volume_mode.as_deref() == Some("Block");
        let local_path = spec.local.as_ref().map(|l| l.path.clone());
        let host_path = spec.host_path.as_ref().map(|h| h.path.clone());
        let trusted = pv
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(kubeapi::TRUSTED_FILESYSTEM_ANNOTATION))
            .is_some_and(|v| v == "true");
        match (local_path.or(host_path), block) {
            (Some(_), true) if !trusted => Err(Error::NotAllowed(format!(
                "{uri}: PV {pv_name} is a block device whose filesystem its users can write;                  the node's kernel mounts only filesystems the driver sealed itself or an admin                  vouched for. An admin may annotate the PV {}: \"true\" once its content is \
                 trusted and no longer written",
                kubeapi::TRUSTED_FILESYSTEM_ANNOTATION
            ))),
            (Some(device), true) => {
                if u.path.is_some() {
                    return Err(Error::invalid(
                        field,
                        format!(
                            "{uri}: a block PV has no directories; drop the path and use parameter subPath"
                        ),
                    ));
                }
                Ok(PvcSource::External {
                    external: External::XfsBlock { device },
                    sub_path: None,
                })
            }
            (Some(path), false) => Ok(PvcSource::External {
                external: External::Dir { path },
                sub_path: u.path,
            }),
            (None, _) => Err(Error::invalid(
                field,
                format!(
                    "PV {pv_name} behind {uri} is of a type that cannot be exposed read-only in place; supported: volumes of {}, hostPath and local PVs (directories), and block-mode local PVs holding XFS",
                    self.cfg.driver_name
                ),
            )),
        }
    }
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

/// The node a node-local PV is pinned to, by the driver's topology key.
pub fn node_of(pv: &k8s_openapi::api::core::v1::PersistentVolume, key: &str) -> Option<String> {
    pv.spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == key && e.operator == "In")
        .and_then(|e| e.values.as_ref()?.first().cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_local_pv_names_its_node_by_the_topology_key() {
        let pv = |key: &str, op: &str| -> k8s_openapi::api::core::v1::PersistentVolume {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "pv1"},
                "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": key, "operator": op, "values": ["node-2"]}]}
                ]}}}
            }))
            .unwrap()
        };
        let key = "topology.modelcache.csi.io/node";
        assert_eq!(node_of(&pv(key, "In"), key), Some("node-2".into()));
        assert_eq!(node_of(&pv("kubernetes.io/hostname", "In"), key), None);
        assert_eq!(node_of(&pv(key, "NotIn"), key), None);
        assert_eq!(node_of(&Default::default(), key), None);
    }

    /// A namespace at its bound may still use the models it holds, and
    /// other namespaces are not counted against it.
    #[test]
    fn a_namespace_holds_at_most_its_share_of_models() {
        let d = tempfile::tempdir().unwrap();
        let cfg = crate::config::Config::for_node("n", d.path());
        let root = cfg.roots().roots.remove(0);
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
