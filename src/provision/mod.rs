//! Provisioning: turning a request into a volume in a root — resolving what
//! it names (the API), planning (pure), executing, sealing, deleting — for
//! the controller's handlers and for the node's own agents alike.
//!
//! The API is `Provisioner`'s methods; its parts stay private so that the
//! controller service, inline volumes, prefetch and the modify agent all go
//! through the same calls and the same locks.

mod execute;
pub mod health;
pub mod node_report;
pub mod params;
pub mod plan;
pub mod pulls;
mod resolve;
mod volumes;
pub use pulls::{Phase, Wanted};

pub use crate::cache::VolumeRecord;
pub use crate::cache::warm::ClassModel;
pub use plan::{CreateRequest, DEFAULT_CAPACITY, InlineSource};

use std::sync::Arc;

use crate::cache::{self, Role, Root, Roots, VolumeId};
use crate::config::Config;
use crate::context::Context;
use crate::csi::Topology;
use crate::error::Result;
use crate::kubeapi::KubeApi;
use crate::lock::{KeyedMutex, OpLocks};
use crate::offload::blocking;
use crate::puller::engine::Engine;
use pulls::jobs::Jobs;

use params::Params;

/// A volume as ListVolumes reports it: its record and where it is reachable.
pub type Listed = (VolumeRecord, Vec<Topology>);

pub struct Provisioner {
    cfg: Arc<Config>,
    roots: Roots,
    /// Serialises clone, seal and delete on one source within this process.
    sources: KeyedMutex,
    engine: Arc<Engine>,
    /// Pulls that outlive the CreateVolume calls that want them.
    jobs: Arc<Jobs>,
    /// API access, for per-PVC sources, `pvc://` and PVC events.
    kube: Option<KubeApi>,
    /// One create per volume name at a time, whoever calls: a retry may
    /// race its original, and a resume its provisioner's call.
    names: OpLocks,
    metrics: Arc<crate::metrics::Metrics>,
}

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
            jobs: Arc::default(),
            kube: ctx.kube.clone(),
            names: OpLocks::default(),
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

    /// The classes whose own model one of this node's node-local roots
    /// holds sealed, with that model (`cache::warm`), read off the runtime.
    pub async fn warm_classes(&self) -> Result<std::collections::BTreeMap<String, ClassModel>> {
        let roots: Vec<Root> = self
            .roots
            .roots
            .iter()
            .filter(|r| r.node.is_some())
            .cloned()
            .collect();
        blocking(move || Ok(cache::warm::warm(&roots))).await
    }

    /// A volume's root and record, read off the runtime.
    pub async fn lookup(&self, volume_id: &str) -> Result<(Root, VolumeRecord)> {
        cache::lookup_off_runtime(&self.roots, volume_id).await
    }

    /// CreateVolume: resolve what the request names (the API), plan it
    /// (pure, `plan`), then do the plan's one kind of work. Holds the
    /// volume's name: a second create of it meanwhile is told Busy.
    pub async fn create(&self, req: CreateRequest) -> Result<(VolumeRecord, Vec<Topology>)> {
        let guard = self.names.try_lock(&name_key(&req.name))?;
        guard.hold(self.create_held(req)).await
    }

    /// Whether a call of this process holds volume `name`.
    pub(crate) fn name_held(&self, name: &str) -> bool {
        self.names.is_held(&name_key(name))
    }

    async fn create_held(&self, req: CreateRequest) -> Result<(VolumeRecord, Vec<Topology>)> {
        // The caller's budget runs from now: what comes before the pull
        // (the API, opening the source, the record) spends it too.
        let deadline = req.budget.map(|b| std::time::Instant::now() + b);
        let params = Params::parse(&req.params)?;
        let mutable = params::parse_mutable(&req.mutable)?;
        let (resolved, pull) = self.resolve(&req, params).await?;
        let class = pull.class.clone();
        let plan = plan::plan(&self.cfg, &self.roots, &req, resolved)?;
        let root = plan.root.clone();
        if let Some(existing) = self.existing(&plan).await? {
            // A progressive volume exists before its model: until the seal,
            // a repeat (a restart resuming wanted pulls) sees its pull run.
            if existing.0.progressive && !self.is_pulling(&req.name) {
                let (at, sid) = (plan.root.clone(), existing.0.source.clone());
                if blocking(move || cache::read_seal(&at, &sid))
                    .await?
                    .is_none()
                {
                    let rec = self.execute(&req, plan, pull, deadline).await?;
                    remember_class(&root, class, &rec).await;
                    return Ok((rec, existing.1));
                }
            }
            remember_class(&root, class, &existing.0).await;
            return Ok(existing);
        }
        let rec = self.execute(&req, plan, pull, deadline).await?;
        remember_class(&root, class, &rec).await;
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
}

/// Notes on a node-local root that `class`'s model is `rec`'s, so the node
/// can say it is warm for the class (`prefetch::labels`). Only a pulled
/// model of a class's own `source` counts; a miss costs a label, never
/// the volume.
async fn remember_class(root: &Root, class: Option<(String, String)>, rec: &VolumeRecord) {
    let (Some((class, source)), true, true) = (
        class,
        rec.role == Role::Cache && rec.source.is_model(),
        root.node.is_some(),
    ) else {
        return;
    };
    let model = ClassModel {
        source,
        sid: rec.source.clone(),
    };
    let root = root.clone();
    let name = class.clone();
    if let Err(e) = blocking(move || cache::warm::remember(&root, &name, &model)).await {
        tracing::warn!(%class, error = %e, "could not note which model this class pulled");
    }
}

/// What a node's own agents (prefetch, the modify agent) work with: the
/// process's context, its API access, this node and its provisioner.
#[derive(Clone)]
pub struct Agent {
    pub ctx: Context,
    pub kube: KubeApi,
    pub node: String,
    pub provisioner: Arc<Provisioner>,
}

impl Agent {
    /// The agent for `flag`, or why the process cannot run it.
    pub fn new(
        flag: &str,
        ctx: &Context,
        provisioner: Option<&Arc<Provisioner>>,
    ) -> std::result::Result<Agent, String> {
        let (Some(p), Some(node)) = (provisioner, ctx.cfg.node_id.clone()) else {
            return Err(format!(
                "{flag} needs --node-id and the controller service (--mode controller or all)"
            ));
        };
        let Some(kube) = ctx.kube.clone() else {
            return Err(format!("{flag} needs Kubernetes API access (--kube-api)"));
        };
        Ok(Agent {
            ctx: ctx.clone(),
            kube,
            node,
            provisioner: p.clone(),
        })
    }

    /// The driver name its objects (classes, PVs) must carry.
    pub fn driver(&self) -> &str {
        &self.ctx.cfg.driver_name
    }
}

/// The key of a volume's name among `Provisioner::names`.
fn name_key(name: &str) -> String {
    format!("name/{name}")
}
