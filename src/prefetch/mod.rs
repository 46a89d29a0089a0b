//! On each node: pulls the models that `ModelPrefetch` objects ask to keep
//! warm there, before any pod asks, and holds each in a cache volume of
//! this node's controller (a reference, so eviction leaves it alone) while
//! the object exists and selects the node. A node that holds the model
//! says so through its warm label (`labels`); a node whose pull failed
//! writes its own line of the object's status, why it failed, while fewer
//! than `LISTED_FAILURES` nodes' lines are there. Nothing else is written
//! per node, so the object and its writes stay the same size whatever the
//! number of nodes.
//!
//! In the controller, `summary` counts the nodes each object selects, those
//! warm and those failed, for `kubectl get` and `kubectl wait`.
//!
//! What is pulled is what a PVC of the named StorageClass would pull (its
//! `source`, parameters and provisioner secret), so such a PVC on a warm
//! node finds the model sealed and binds at once.

pub mod labels;
pub mod resource;
pub mod summary;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Api, Client, ResourceExt};
use tracing::{Instrument, info, info_span, warn};

use crate::csi::VolumeCapability;
use crate::csi::volume_capability::{self, AccessType, MountVolume};
use crate::error::{Error, Result};
use crate::provision::Agent;
use crate::provision::CreateRequest;

use resource::{ModelPrefetch, NodeStatus, Phase, VOLUME_PREFIX};

/// How often every declaration is looked at again: a failed pull is
/// retried, a released model is noticed.
const RESYNC: Duration = Duration::from_secs(60);
/// Failed nodes' lines in one status, at most: the rest are counted by
/// their own logs and metrics, not by the object, which stays small
/// (the CRD refuses more than twice as many, for nodes that fail at once).
pub const LISTED_FAILURES: usize = 32;
/// A failure's message in a line, at most, in characters.
const MESSAGE_CHARS: usize = 512;

struct Ctx {
    agent: Agent,
    /// Volume names whose pull is running in this process.
    running: Mutex<BTreeSet<String>>,
    /// Volume names whose last pull failed, and when: tried again a
    /// resync later, whether or not the failure got a line.
    failed: Mutex<HashMap<String, Instant>>,
    /// This node's own Node, from a watch of it alone: its labels are what
    /// a selector reads.
    own: Store<PartialObjectMeta<Node>>,
    /// Every ModelPrefetch as last seen: whether this node may still add a
    /// line is read from the object as it is now, not as it was when the
    /// pull began.
    prefetches: Store<ModelPrefetch>,
}

impl std::ops::Deref for Ctx {
    type Target = Agent;
    fn deref(&self) -> &Agent {
        &self.agent
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs until the process ends.
pub async fn run(agent: Agent) {
    let client = agent.kube.client();
    let (own, own_changed) = crate::kubeapi::informer(watcher(
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={}", agent.node)),
    ));
    let (prefetches, writer) = reflector::store();
    // Reconciled when a declaration's spec changes (its generation), not
    // at every status write: a fleet's worth of nodes reading their Node
    // at each of each other's writes is what this keeps from growing.
    let declared = reflector::reflector(
        writer,
        watcher(
            Api::<ModelPrefetch>::all(client),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let ctx = Arc::new(Ctx {
        agent,
        running: Mutex::new(BTreeSet::new()),
        failed: Mutex::new(HashMap::new()),
        own: own.clone(),
        prefetches: prefetches.clone(),
    });
    // The watch runs from here on, so that its store fills; the controller
    // hears of each relabelling through the channel.
    let (tx, relabels) = futures::channel::mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let mut tx = tx;
        let mut moved = std::pin::pin!(relabelled(own, own_changed));
        while moved.next().await.is_some() {
            // Full: every declaration is queued to be read again already.
            let _ = tx.try_send(());
        }
    });
    if ctx.own.wait_until_ready().await.is_err() {
        warn!("the watch of this node's Node never became ready; ModelPrefetches are not served");
        return;
    }
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
    Controller::for_stream(declared, prefetches)
        // Relabelled: every declaration's selector reads this node anew.
        .reconcile_all_on(relabels)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

/// One item each time the Node's labels change (not at each of its status
/// updates).
fn relabelled(
    own: Store<PartialObjectMeta<Node>>,
    changed: impl futures::Stream<Item = ()> + Send + 'static,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    let mut last: Option<BTreeMap<String, String>> = None;
    changed.filter_map(move |()| {
        let now = own.state().first().map(|n| n.labels().clone());
        let moved = now.is_some() && now != last;
        if moved {
            last = now;
        }
        std::future::ready(moved.then_some(()))
    })
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Applies `node`'s line of `name`'s status (none: removes it). Each
/// node applies its own line as its own field manager, so nodes never
/// overwrite each other (the controller removes a departed node's line as
/// that node's manager).
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

/// The line that says `node` failed for `why`, or `None` when `mp` lists
/// `LISTED_FAILURES` other nodes already (this node's failure is then in
/// its log and metrics only).
pub fn failure_line(mp: &ModelPrefetch, node: &str, why: &str) -> Option<NodeStatus> {
    let listed = mp.status.as_ref().map_or(0, |s| s.nodes.len());
    if mine(mp, node).is_none() && listed >= LISTED_FAILURES {
        return None;
    }
    let mut message: String = why.chars().take(MESSAGE_CHARS).collect();
    if message.len() < why.len() {
        message.push('…');
    }
    Some(NodeStatus {
        node: node.to_string(),
        phase: Phase::Failed,
        message: Some(message),
        updated: Some(now()),
        ..Default::default()
    })
}

/// The declaration `mp` as last seen (it may have changed while a pull ran).
fn latest(ctx: &Ctx, mp: &ModelPrefetch) -> Arc<ModelPrefetch> {
    ctx.prefetches
        .get(&ObjectRef::from_obj(mp))
        .unwrap_or_else(|| Arc::new(mp.clone()))
}

/// Says that this node's pull of `mp` failed: remembered here, so it is
/// tried again a resync later, and written as this node's line while
/// there is room.
async fn failed(ctx: &Ctx, mp: &ModelPrefetch, why: &str) -> Result<()> {
    locked(&ctx.failed).insert(resource::volume_name(mp), Instant::now());
    let now = latest(ctx, mp);
    let Some(line) = failure_line(&now, &ctx.node, why) else {
        info!(
            listed = LISTED_FAILURES,
            "the status lists enough failed nodes already; this one is in the log only"
        );
        return Ok(());
    };
    // Said already: every node's watch would carry the same line again.
    if mine(&now, &ctx.node).is_some_and(|l| l.phase == Phase::Failed && l.message == line.message)
    {
        return Ok(());
    }
    report(&ctx.kube.client(), &ctx.node, &mp.name_any(), Some(line)).await
}

/// Takes this node's line out of `mp`'s status, if it has one.
async fn cleared(ctx: &Ctx, mp: &ModelPrefetch) -> Result<()> {
    locked(&ctx.failed).remove(&resource::volume_name(mp));
    if mine(&latest(ctx, mp), &ctx.node).is_some() {
        report(&ctx.kube.client(), &ctx.node, &mp.name_any(), None).await?;
    }
    Ok(())
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
    let volume = resource::volume_name(&mp);
    let labels = ctx
        .own
        .get(&ObjectRef::new(&ctx.node))
        .map(|n| n.labels().clone())
        .ok_or_else(|| Error::Transient(format!("Node {} is not seen yet", ctx.node)))?;
    match resource::selects(mp.spec.node_selector.as_ref(), &labels) {
        Err(m) => {
            failed(&ctx, &mp, &m).await?;
            return Ok(Action::await_change());
        }
        Ok(false) => {
            release(&ctx, &volume).await?;
            cleared(&ctx, &mp).await?;
            return Ok(Action::requeue(RESYNC));
        }
        Ok(true) => {}
    }
    if !labels::labelable(&mp.spec.storage_class_name) {
        // The controller says why in the condition; a pull nobody could
        // count would only take room.
        return Ok(Action::await_change());
    }
    if locked(&ctx.running).contains(&volume) {
        return Ok(Action::requeue(RESYNC));
    }
    if volume_of(&ctx, &volume).await?.is_some() {
        cleared(&ctx, &mp).await?;
        return Ok(Action::requeue(RESYNC));
    }
    if let Some(wait) = locked(&ctx.failed)
        .get(&volume)
        .and_then(|at| RESYNC.checked_sub(at.elapsed()))
    {
        return Ok(Action::requeue(wait));
    }
    locked(&ctx.running).insert(volume.clone());
    let c = ctx.clone();
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let outcome = pull(&c, &mp, &volume).await;
            locked(&c.running).remove(&volume);
            let told = match &outcome {
                Ok(rec) => {
                    info!(revision = ?rec.revision, "model warm on this node");
                    cleared(&c, &mp).await
                }
                Err(e) => {
                    warn!(error = %e, "prefetch failed");
                    failed(&c, &mp, &e.to_string()).await
                }
            };
            if let Err(e) = told {
                warn!(error = %e, "could not report the prefetch's outcome");
            }
        }
        .instrument(span),
    );
    Ok(Action::requeue(RESYNC))
}

/// Pulls the class's model into a cache volume named `volume`.
async fn pull(
    ctx: &Arc<Ctx>,
    mp: &ModelPrefetch,
    volume: &str,
) -> Result<crate::cache::VolumeRecord> {
    let class = &mp.spec.storage_class_name;
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
            progress: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_lines(n: usize) -> ModelPrefetch {
        ModelPrefetch {
            status: Some(resource::PrefetchStatus {
                nodes: (0..n)
                    .map(|i| NodeStatus {
                        node: format!("n{i}"),
                        phase: Phase::Failed,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_failure_takes_a_line_only_while_there_is_room_or_its_own_is_there() {
        let room = with_lines(LISTED_FAILURES - 1);
        let l = failure_line(&room, "me", "no space").expect("room for one more");
        assert_eq!((l.node.as_str(), l.phase), ("me", Phase::Failed));
        assert_eq!(l.message.as_deref(), Some("no space"));
        let full = with_lines(LISTED_FAILURES);
        assert!(failure_line(&full, "me", "no space").is_none());
        // A node already listed keeps its line up to date.
        assert!(failure_line(&full, "n3", "again").is_some());
    }

    #[test]
    fn a_long_failure_is_cut_with_a_mark() {
        let why = "é".repeat(2 * MESSAGE_CHARS);
        let l = failure_line(&with_lines(0), "me", &why).unwrap();
        let m = l.message.unwrap();
        assert_eq!(m.chars().count(), MESSAGE_CHARS + 1);
        assert!(m.ends_with('…'));
    }
}
