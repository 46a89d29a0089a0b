//! On each node: pulls the models that `ModelPrefetch` objects ask to keep
//! warm there, before any pod asks, and holds each in a cache volume of
//! this node's controller (a reference, so eviction leaves it alone) while
//! the object exists and selects the node. Each node writes its own line of
//! the object's status: Pending, Pulling with bytes, Ready with the
//! revision, Failed with why.
//!
//! In the controller, `summary` counts the nodes each object selects and
//! those Ready, for `kubectl get` and `kubectl wait`. On each node,
//! `labels` tells the scheduler which classes' models it holds.
//!
//! What is pulled is what a PVC of the named StorageClass would pull (its
//! `source`, parameters and provisioner secret), so such a PVC on a warm
//! node finds the model sealed and binds at once.

pub mod labels;
pub mod resource;
pub mod summary;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tracing::{Instrument, info, info_span, warn};

use crate::csi::VolumeCapability;
use crate::csi::volume_capability::{self, AccessType, MountVolume};
use crate::error::{Error, Result};
use crate::provision::Agent;
use crate::provision::CreateRequest;
use crate::puller::engine::{Progress, ProgressSink};

use resource::{ModelPrefetch, NodeStatus, Phase, VOLUME_PREFIX};

/// How often every declaration is looked at again: a node's labels may
/// have changed, a failed pull is retried, a released model is noticed.
const RESYNC: Duration = Duration::from_secs(60);
/// How often a running pull writes its bytes into the status.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

struct Ctx {
    agent: Agent,
    /// Volume names whose pull is running in this process.
    running: Mutex<BTreeSet<String>>,
}

impl std::ops::Deref for Ctx {
    type Target = Agent;
    fn deref(&self) -> &Agent {
        &self.agent
    }
}

/// Runs until the process ends.
pub async fn run(agent: Agent) {
    let api = Api::<ModelPrefetch>::all(agent.kube.client());
    let ctx = Arc::new(Ctx {
        agent,
        running: Mutex::new(BTreeSet::new()),
    });
    info!(node = %ctx.node, "keeping ModelPrefetch models warm on this node");
    let sweeper = ctx.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(RESYNC / 2);
        loop {
            tick.tick().await;
            if let Err(e) = release_unwanted(&sweeper).await {
                warn!(error = %e, "could not release the models of deleted ModelPrefetches");
            }
        }
    });
    Controller::new(api, watcher::Config::default())
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

fn line(node: &str, phase: Phase) -> NodeStatus {
    NodeStatus {
        node: node.to_string(),
        phase,
        updated: Some(now()),
        ..Default::default()
    }
}

/// Writes this node's line of `name`'s status (none: removes it). Each node
/// applies its own line as its own field manager, so nodes never overwrite
/// each other.
async fn report(client: &Client, node: &str, name: &str, status: Option<NodeStatus>) -> Result<()> {
    let nodes: Vec<NodeStatus> = status.into_iter().collect();
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", resource::GROUP, resource::VERSION),
        "kind": resource::KIND,
        "metadata": {"name": name},
        "status": {"nodes": nodes},
    });
    let manager = format!("{}/{node}", resource::GROUP);
    Api::<ModelPrefetch>::all(client.clone())
        .patch_status(
            name,
            &PatchParams::apply(&manager).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(|_| ())
        .map_err(|e| Error::Transient(format!("writing the status of ModelPrefetch {name}: {e}")))
}

fn mine<'a>(mp: &'a ModelPrefetch, node: &str) -> Option<&'a NodeStatus> {
    mp.status.as_ref()?.nodes.iter().find(|n| n.node == node)
}

async fn node_labels(ctx: &Ctx) -> Result<std::collections::BTreeMap<String, String>> {
    ctx.kube.node_labels(&ctx.node).await
}

/// This node's volume records, read off the async runtime's threads.
async fn volumes(ctx: &Ctx) -> Result<Vec<crate::cache::VolumeRecord>> {
    let p = ctx.provisioner.clone();
    crate::offload::blocking(move || Ok(p.list()?.into_iter().map(|(r, _)| r).collect())).await
}

/// The cache volume named `name`, when this node has it.
async fn volume_of(ctx: &Ctx, name: &str) -> Result<Option<crate::cache::VolumeRecord>> {
    Ok(volumes(ctx).await?.into_iter().find(|r| r.name == name))
}

async fn reconcile(mp: Arc<ModelPrefetch>, ctx: Arc<Ctx>) -> Result<Action> {
    let name = mp.name_any();
    let span = info_span!("prefetch", prefetch = %name, class = %mp.spec.storage_class_name);
    reconcile_one(mp, ctx).instrument(span).await
}

async fn reconcile_one(mp: Arc<ModelPrefetch>, ctx: Arc<Ctx>) -> Result<Action> {
    let name = mp.name_any();
    let volume = resource::volume_name(&mp);
    let labels = node_labels(&ctx).await?;
    match resource::selects(mp.spec.node_selector.as_ref(), &labels) {
        Err(m) => {
            let mut l = line(&ctx.node, Phase::Failed);
            l.message = Some(m);
            report(&ctx.kube.client(), &ctx.node, &name, Some(l)).await?;
            return Ok(Action::await_change());
        }
        Ok(false) => {
            release(&ctx, &volume).await?;
            if mine(&mp, &ctx.node).is_some() {
                report(&ctx.kube.client(), &ctx.node, &name, None).await?;
            }
            return Ok(Action::requeue(RESYNC));
        }
        Ok(true) => {}
    }
    if ctx
        .running
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&volume)
    {
        return Ok(Action::requeue(RESYNC));
    }
    if let Some(rec) = volume_of(&ctx, &volume).await? {
        if mine(&mp, &ctx.node).is_none_or(|l| l.phase != Phase::Ready) {
            report(
                &ctx.kube.client(),
                &ctx.node,
                &name,
                Some(ready(&ctx.node, &rec)),
            )
            .await?;
        }
        return Ok(Action::requeue(RESYNC));
    }
    if mine(&mp, &ctx.node).is_some_and(|l| l.phase == Phase::Failed)
        && failed_recently(mine(&mp, &ctx.node))
    {
        return Ok(Action::requeue(RESYNC));
    }
    ctx.running
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(volume.clone());
    let c = ctx.clone();
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let outcome = pull(&c, &mp, &volume).await;
            c.running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&volume);
            let status = match &outcome {
                Ok(rec) => {
                    info!(revision = ?rec.revision, "model warm on this node");
                    ready(&c.node, rec)
                }
                Err(e) => {
                    warn!(error = %e, "prefetch failed");
                    let mut l = line(&c.node, Phase::Failed);
                    l.message = Some(e.to_string());
                    l
                }
            };
            if let Err(e) = report(&c.kube.client(), &c.node, &mp.name_any(), Some(status)).await {
                warn!(error = %e, "could not report the prefetch's outcome");
            }
        }
        .instrument(span),
    );
    Ok(Action::requeue(RESYNC))
}

/// A failed pull is tried again after a resync, not at every event.
fn failed_recently(l: Option<&NodeStatus>) -> bool {
    let Some(at) = l.and_then(|l| l.updated.as_deref()) else {
        return false;
    };
    let Ok(at) = at.parse::<k8s_openapi::jiff::Timestamp>() else {
        return false;
    };
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(at);
    age.as_secs() >= 0 && (age.as_secs() as u64) < RESYNC.as_secs()
}

fn ready(node: &str, rec: &crate::cache::VolumeRecord) -> NodeStatus {
    NodeStatus {
        revision: rec.revision.clone(),
        bytes: Some(rec.capacity_bytes.max(0) as u64),
        total_bytes: Some(rec.capacity_bytes.max(0) as u64),
        ..line(node, Phase::Ready)
    }
}

/// Pulls the class's model into a cache volume named `volume`.
async fn pull(
    ctx: &Arc<Ctx>,
    mp: &ModelPrefetch,
    volume: &str,
) -> Result<crate::cache::VolumeRecord> {
    let name = mp.name_any();
    let class = &mp.spec.storage_class_name;
    report(
        &ctx.kube.client(),
        &ctx.node,
        &name,
        Some(line(&ctx.node, Phase::Pulling)),
    )
    .await?;
    let sc = ctx.kube.storage_class(class).await.map_err(|e| match e {
        Error::NotFound(_) => Error::invalid(
            "spec.storageClassName",
            format!("StorageClass {class} does not exist"),
        ),
        e => e,
    })?;
    let driver = ctx.driver();
    if sc.provisioner != driver {
        return Err(Error::invalid(
            "spec.storageClassName",
            format!(
                "StorageClass {class} belongs to {}, not {driver}",
                sc.provisioner
            ),
        ));
    }
    let raw = sc.parameters.clone().unwrap_or_default();
    let params = crate::provision::params::class_parameters(sc.parameters);
    if !params.contains_key(crate::provision::params::SOURCE) {
        return Err(Error::invalid(
            "spec.storageClassName",
            format!(
                "StorageClass {class} names no model (parameter source): a prefetch pulls the \
                 model of a class, as its PVCs would"
            ),
        ));
    }
    let secrets = class_secret(ctx, class, &raw).await?;
    let sink = Arc::new(StatusSink {
        client: ctx.kube.client(),
        node: ctx.node.clone(),
        name: name.clone(),
        last: Mutex::new(None),
        handle: tokio::runtime::Handle::current(),
    });
    let (rec, _) = ctx
        .provisioner
        .create(CreateRequest {
            name: volume.to_string(),
            params,
            mutable: HashMap::new(),
            capabilities: vec![VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(volume_capability::AccessMode {
                    mode: volume_capability::access_mode::Mode::SingleNodeReaderOnly as i32,
                }),
            }],
            capacity: None,
            content_volume: None,
            topology: None,
            secrets,
            budget: None,
            inline: None,
            progress: Some(sink),
            class: Some(class.clone()),
        })
        .await?;
    Ok(rec)
}

/// The class's provisioner secret, as external-provisioner would pass it.
/// A template (`${pvc.namespace}`) needs a PVC, which a prefetch has not.
async fn class_secret(
    ctx: &Ctx,
    class: &str,
    raw: &std::collections::BTreeMap<String, String>,
) -> Result<HashMap<String, String>> {
    let name = raw.get("csi.storage.k8s.io/provisioner-secret-name");
    let ns = raw.get("csi.storage.k8s.io/provisioner-secret-namespace");
    match (name, ns) {
        (None, None) => Ok(HashMap::new()),
        (Some(n), Some(s)) if !n.contains("${") && !s.contains("${") => {
            Ok(ctx.kube.secret(s, n).await?.into_iter().collect())
        }
        _ => Err(Error::invalid(
            "spec.storageClassName",
            format!(
                "StorageClass {class}'s provisioner secret is templated or half-named; a \
                 prefetch has no PVC to fill a template from: name the secret and its namespace \
                 literally"
            ),
        )),
    }
}

/// Releases this node's volume of a prefetch that no longer wants it here.
async fn release(ctx: &Ctx, volume: &str) -> Result<()> {
    if let Some(rec) = volume_of(ctx, volume).await? {
        ctx.provisioner.delete(&rec.id).await?;
        info!(volume = %volume, "released a prefetched model");
    }
    Ok(())
}

/// Volumes of prefetches that are gone (no event says so: nothing holds a
/// finalizer on them).
async fn release_unwanted(ctx: &Arc<Ctx>) -> Result<()> {
    let all = Api::<ModelPrefetch>::all(ctx.kube.client())
        .list(&ListParams::default())
        .await
        .map_err(|e| Error::Transient(format!("listing ModelPrefetches: {e}")))?;
    let wanted: BTreeSet<String> = all.items.iter().map(resource::volume_name).collect();
    let running = ctx
        .running
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for rec in volumes(ctx).await? {
        if rec.name.starts_with(VOLUME_PREFIX)
            && !wanted.contains(&rec.name)
            && !running.contains(&rec.name)
        {
            ctx.provisioner.delete(&rec.id).await?;
            info!(volume = %rec.name, "released the model of a deleted ModelPrefetch");
        }
    }
    Ok(())
}

fn error_policy(_mp: Arc<ModelPrefetch>, err: &Error, _ctx: Arc<Ctx>) -> Action {
    warn!(error = %err, "prefetch reconcile failed; retrying");
    Action::requeue(Duration::from_secs(10))
}

/// A pull's progress as this node's status line, every few seconds.
struct StatusSink {
    client: Client,
    node: String,
    name: String,
    last: Mutex<Option<Instant>>,
    handle: tokio::runtime::Handle,
}

impl ProgressSink for StatusSink {
    fn progress(&self, p: &Progress) {
        {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|l| l.elapsed() < PROGRESS_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let mut l = line(&self.node, Phase::Pulling);
        l.bytes = Some(p.bytes);
        l.total_bytes = p.total;
        l.message = Some(format!(
            "{:.1} MiB/s{}",
            p.rate_bytes_per_sec / 1048576.0,
            p.eta
                .map(|e| format!(", ETA {}s", e.as_secs()))
                .unwrap_or_default()
        ));
        let (client, node, name) = (self.client.clone(), self.node.clone(), self.name.clone());
        // Best effort: a slow API must not slow the pull.
        self.handle.spawn(async move {
            if let Err(e) = report(&client, &node, &name, Some(l)).await {
                tracing::debug!(error = %e, "could not report prefetch progress");
            }
        });
    }
}
