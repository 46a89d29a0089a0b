//! The rescheduler: clears `volume.kubernetes.io/selected-node` from pending
//! PVCs of this driver whose selected node has no running driver, so the
//! scheduler can pick another node.
//!
//! With distributed provisioning (external-provisioner `--node-deployment`
//! on every node), a PVC whose selected node lost its driver stays Pending
//! forever: nothing in Kubernetes clears the annotation for CSI drivers.
//! The decision is a pure function (`decide`) over what the informers see;
//! the change is a merge patch carrying the observed resourceVersion, so
//! of several replicas exactly one wins and emits the one event. It never
//! touches a bound PVC, another driver's PVC, or one whose node has the
//! driver registered.

mod decide;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{Instrument, info, warn};

pub use decide::{Decision, Observed, SELECTED_NODE, decide};

#[derive(Clone, Debug)]
pub struct Config {
    pub driver_name: String,
    /// The driver DaemonSet's node selector: a node outside it never gets a driver.
    pub node_selector: BTreeMap<String, String>,
    /// How long a node that should run the driver may go without it.
    pub grace: Duration,
    /// How often every PVC is looked at again, so grace periods expire.
    pub resync: Duration,
    /// Reporter instance for events (the pod name).
    pub instance: Option<String>,
}

/// Parses `k=v,k2=v2`.
pub fn parse_selector(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("--node-selector: {part:?} is not key=value"))?;
        out.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

struct Ctx {
    client: Client,
    cfg: Config,
    nodes: Store<Node>,
    csinodes: Store<CSINode>,
    classes: Store<StorageClass>,
    pvs: Store<PersistentVolume>,
    pvcs: Store<PersistentVolumeClaim>,
    recorder: Recorder,
    /// When each (PVC uid, selected node) was first seen.
    first_seen: Mutex<HashMap<(String, String), Instant>>,
    /// Actions taken, by reason (for metrics and tests).
    pub actions: Arc<Mutex<BTreeMap<&'static str, u64>>>,
}

fn store<K>(api: Api<K>) -> (Store<K>, impl futures::Stream<Item = ()>)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .touched_objects()
        .map(|_| ());
    (reader, stream)
}

/// Runs until the process ends. `actions` counts reschedules by reason.
pub async fn run(client: Client, cfg: Config, actions: Arc<Mutex<BTreeMap<&'static str, u64>>>) {
    let (nodes, nodes_stream) = store(Api::<Node>::all(client.clone()));
    let (csinodes, csinodes_stream) = store(Api::<CSINode>::all(client.clone()));
    let (classes, classes_stream) = store(Api::<StorageClass>::all(client.clone()));
    let (pvs, pvs_stream) = store(Api::<PersistentVolume>::all(client.clone()));
    let controller = Controller::new(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        watcher::Config::default(),
    );
    let pvcs = controller.store();
    let reporter = Reporter {
        controller: format!("{}-rescheduler", cfg.driver_name),
        instance: cfg.instance.clone(),
    };
    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        cfg: cfg.clone(),
        nodes: nodes.clone(),
        csinodes: csinodes.clone(),
        classes: classes.clone(),
        pvs: pvs.clone(),
        pvcs: pvcs.clone(),
        first_seen: Mutex::new(HashMap::new()),
        actions,
    });
    // Informers must be warm before a missing node means "deleted".
    tokio::spawn(nodes_stream.for_each(|_| async {}));
    tokio::spawn(csinodes_stream.for_each(|_| async {}));
    tokio::spawn(classes_stream.for_each(|_| async {}));
    tokio::spawn(pvs_stream.for_each(|_| async {}));
    for (what, ready) in [
        ("nodes", nodes.wait_until_ready().await.is_ok()),
        ("csinodes", csinodes.wait_until_ready().await.is_ok()),
        ("storageclasses", classes.wait_until_ready().await.is_ok()),
        ("persistentvolumes", pvs.wait_until_ready().await.is_ok()),
    ] {
        if !ready {
            warn!(what, "informer never became ready");
        }
    }
    info!(driver = %cfg.driver_name, grace_s = cfg.grace.as_secs(), "rescheduler running");

    controller
        // A node or CSINode change re-evaluates the PVCs that selected it.
        .watches(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            {
                let c = ctx.clone();
                move |n: Node| pvcs_selecting(&c, &n.name_any())
            },
        )
        .watches(
            Api::<CSINode>::all(client.clone()),
            watcher::Config::default(),
            {
                let c = ctx.clone();
                move |n: CSINode| pvcs_selecting(&c, &n.name_any())
            },
        )
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|_| async {})
        .await;
}

/// PVCs whose selected node is `node`.
fn pvcs_selecting(ctx: &Ctx, node: &str) -> Vec<ObjectRef<PersistentVolumeClaim>> {
    ctx.pvcs
        .state()
        .iter()
        .filter(|p| {
            p.annotations()
                .get(SELECTED_NODE)
                .is_some_and(|n| n == node)
        })
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

fn observe(ctx: &Ctx, pvc: &PersistentVolumeClaim) -> Observed {
    let node_name = pvc.annotations().get(SELECTED_NODE).cloned();
    let node = node_name
        .as_ref()
        .and_then(|n| ctx.nodes.get(&ObjectRef::new(n)));
    let csinode = node_name
        .as_ref()
        .and_then(|n| ctx.csinodes.get(&ObjectRef::new(n)));
    let class_provisioner = pvc
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_ref())
        .and_then(|c| ctx.classes.get(&ObjectRef::new(c)))
        .map(|c| c.provisioner.clone());
    let uid = pvc.uid().unwrap_or_default();
    let pv_bound = ctx.pvs.state().iter().any(|pv| {
        pv.spec
            .as_ref()
            .and_then(|s| s.claim_ref.as_ref())
            .is_some_and(|r| r.uid.as_deref() == Some(uid.as_str()))
    });
    Observed {
        pvc: pvc.clone(),
        class_provisioner,
        node_exists: node.is_some(),
        node_labels: node
            .as_ref()
            .map(|n| n.labels().clone())
            .unwrap_or_default(),
        driver_registered: csinode
            .is_some_and(|c| c.spec.drivers.iter().any(|d| d.name == ctx.cfg.driver_name)),
        node_not_ready_for: node.as_deref().and_then(not_ready_for),
        pv_bound,
    }
}

/// How long the node's Ready condition has been other than True (zero when
/// the transition time is missing or in the future); `None` while Ready or
/// before kubelet first reported.
fn not_ready_for(node: &Node) -> Option<Duration> {
    let ready = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    if ready.status == "True" {
        return None;
    }
    let since = ready.last_transition_time.as_ref().map(|t| t.0);
    let now = k8s_openapi::jiff::Timestamp::now();
    Some(
        since
            .and_then(|t| now.duration_since(t).try_into().ok())
            .unwrap_or_default(),
    )
}

async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    let ns = pvc.namespace().unwrap_or_default();
    let name = pvc.name_any();
    let span = tracing::info_span!("reschedule", pvc = %format!("{ns}/{name}"));
    // Instrumented, not entered: the span must not stay entered on this
    // thread while the future waits on the API.
    reconcile_in_span(pvc, ctx).instrument(span).await
}

async fn reconcile_in_span(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    let observed = observe(&ctx, &pvc);
    let node = observed
        .pvc
        .annotations()
        .get(SELECTED_NODE)
        .cloned()
        .unwrap_or_default();
    let key = (pvc.uid().unwrap_or_default(), node.clone());
    let first = {
        let mut seen = ctx.first_seen.lock().unwrap_or_else(|p| p.into_inner());
        *seen.entry(key.clone()).or_insert_with(Instant::now)
    };
    match decide(&ctx.cfg, &observed, first.elapsed()) {
        Decision::Ignore => {
            ctx.first_seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
            Ok(Action::requeue(ctx.cfg.resync))
        }
        Decision::Wait(remaining) => Ok(Action::requeue(remaining.min(ctx.cfg.resync))),
        Decision::Reschedule { reason, message } => {
            match clear_selected_node(&ctx.client, &pvc).await? {
                Cleared::Yes => {}
                Cleared::Conflict => {
                    info!("PVC changed concurrently; looking again");
                    return Ok(Action::requeue(Duration::from_millis(200)));
                }
            }
            ctx.first_seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
            *ctx.actions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(reason)
                .or_default() += 1;
            crate::metrics::global()
                .rescheduler_actions
                .get_or_create(&crate::metrics::Reason {
                    reason: reason.to_string(),
                })
                .inc();
            warn!(node = %node, reason, "cleared selected-node: {message}");
            let event = Event {
                type_: EventType::Warning,
                reason: "ProvisioningFailed".into(),
                note: Some(message),
                action: "Reschedule".into(),
                secondary: None,
            };
            if let Err(e) = ctx.recorder.publish(&event, &pvc.object_ref(&())).await {
                warn!(error = %e, "could not record the event");
            }
            Ok(Action::await_change())
        }
    }
}

/// Whether the optimistic patch won.
#[derive(Debug, PartialEq, Eq)]
pub enum Cleared {
    Yes,
    /// The PVC changed (or vanished) since it was observed; nothing was done.
    Conflict,
}

/// Removes the selected-node annotation from `pvc` as observed: the patch
/// carries its resourceVersion, so any change since makes it a 409.
pub async fn clear_selected_node(
    client: &Client,
    pvc: &PersistentVolumeClaim,
) -> Result<Cleared, kube::Error> {
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": pvc.resource_version().unwrap_or_default(),
            "annotations": { SELECTED_NODE: null }
        }
    });
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(client.clone(), &pvc.namespace().unwrap_or_default());
    let params = kube::api::PatchParams::default();
    match api
        .patch(&pvc.name_any(), &params, &kube::api::Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(Cleared::Yes),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(Cleared::Conflict),
        Err(e) => Err(e),
    }
}

fn error_policy(_pvc: Arc<PersistentVolumeClaim>, err: &ReconcileError, _ctx: Arc<Ctx>) -> Action {
    warn!(error = %err, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}
