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
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{Instrument, info, warn};

pub use decide::{Decision, Observed, SELECTED_NODE, decide};

/// A claim with nothing to do is looked at again after this many resyncs.
const IGNORED_RESYNCS: u32 = 10;

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
    /// Where actions are counted, by reason.
    metrics: Arc<crate::metrics::Metrics>,
}

fn store<K>(api: Api<K>) -> (Store<K>, impl futures::Stream<Item = ()>)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    crate::kubeapi::informer(watcher(api, watcher::Config::default()))
}

/// Runs until the process ends, counting what it does into `metrics`.
pub async fn run(client: Client, cfg: Config, metrics: Arc<crate::metrics::Metrics>) {
    // Nodes and PVs are the fleet's and the cluster's size: kept slim.
    let (nodes, nodes_stream) =
        crate::kubeapi::slim_informer(Api::<Node>::all(client.clone()), crate::kubeapi::slim_node);
    let (csinodes, csinodes_stream) = store(Api::<CSINode>::all(client.clone()));
    let (classes, classes_stream) = store(Api::<StorageClass>::all(client.clone()));
    let (pvs, pvs_stream) = crate::kubeapi::slim_informer(
        Api::<PersistentVolume>::all(client.clone()),
        crate::kubeapi::slim_pv,
    );
    let (pvcs, pvc_stream) = crate::kubeapi::slim_pvcs(client.clone());
    let controller = Controller::for_stream(pvc_stream, pvcs.clone());
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
        metrics,
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
            // What would change this is an event of the claim, its node or
            // its node's CSINode, each of which looks again at once; the
            // rare look is for a StorageClass replaced under a claim.
            // Every claim of a large cluster at each resync would keep the
            // rescheduler busy, and a node's loss would wait behind it.
            Ok(Action::requeue(ctx.cfg.resync * IGNORED_RESYNCS))
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
            ctx.metrics.rescheduled(reason);
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

#[cfg(test)]
mod mock_tests {
    //! `reconcile` against kube-rs's mocked API (tower-test): the requests
    //! it makes and what it does with each answer, where a real server
    //! cannot be made to answer 409 on cue. tests/it/rescheduler.rs runs the
    //! whole rescheduler against a real kube-apiserver.

    use super::*;
    use http::{Method, Request, Response};
    use http_body_util::BodyExt;
    use kube::client::Body;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    const DRIVER: &str = "modelcache.csi.io";

    /// A pending claim of this driver whose selected node does not exist.
    fn pending(bound: bool) -> PersistentVolumeClaim {
        let mut pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": "llm",
                "namespace": "team-a",
                "uid": "u-1",
                "resourceVersion": "42",
                "annotations": {
                    "volume.kubernetes.io/storage-provisioner": DRIVER,
                    SELECTED_NODE: "gone"
                }
            },
            "spec": {"storageClassName": "models"},
            "status": {"phase": "Pending"}
        }))
        .unwrap();
        if bound {
            pvc.spec.as_mut().unwrap().volume_name = Some("pv-1".into());
        }
        pvc
    }

    /// A rescheduler with empty informers and no grace period, over `client`.
    fn ctx(client: Client) -> Arc<Ctx> {
        Arc::new(Ctx {
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: "modelcache.csi.io-rescheduler".into(),
                    instance: None,
                },
            ),
            client,
            cfg: Config {
                driver_name: DRIVER.into(),
                node_selector: BTreeMap::new(),
                grace: Duration::ZERO,
                resync: Duration::from_secs(60),
                instance: None,
            },
            nodes: kube::runtime::reflector::store().0,
            csinodes: kube::runtime::reflector::store().0,
            classes: kube::runtime::reflector::store().0,
            pvs: kube::runtime::reflector::store().0,
            pvcs: kube::runtime::reflector::store().0,
            first_seen: Mutex::new(HashMap::new()),
            metrics: Arc::default(),
        })
    }

    fn mocked() -> (Arc<Ctx>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (ctx(Client::new(service, "default")), handle)
    }

    async fn json_of(req: Request<Body>) -> serde_json::Value {
        let bytes = req.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    fn answer(status: u16, body: &serde_json::Value) -> Response<Body> {
        Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap()
    }

    /// The one patch: the annotation removed, guarded by the resourceVersion
    /// that was observed; then one Warning event on the claim.
    #[tokio::test]
    async fn a_claim_on_a_missing_node_is_patched_as_observed_and_told_why() {
        let (ctx, mut api) = mocked();
        let server = tokio::spawn(async move {
            let (req, send) = api.next_request().await.expect("a patch");
            assert_eq!(req.method(), Method::PATCH);
            assert_eq!(
                req.uri().path(),
                "/api/v1/namespaces/team-a/persistentvolumeclaims/llm"
            );
            assert_eq!(
                req.headers()["content-type"],
                "application/merge-patch+json"
            );
            let patch = json_of(req).await;
            assert_eq!(patch["metadata"]["resourceVersion"], "42", "{patch}");
            let annotations = patch["metadata"]["annotations"].as_object().unwrap();
            assert_eq!(annotations.len(), 1, "{patch}");
            assert!(annotations[SELECTED_NODE].is_null(), "{patch}");
            let mut cleared = pending(false);
            cleared.annotations_mut().remove(SELECTED_NODE);
            send.send_response(answer(200, &serde_json::to_value(&cleared).unwrap()));

            let (req, send) = api.next_request().await.expect("an event");
            assert_eq!(req.method(), Method::POST);
            assert_eq!(
                req.uri().path(),
                "/apis/events.k8s.io/v1/namespaces/team-a/events"
            );
            let event = json_of(req).await;
            assert_eq!(event["type"], "Warning", "{event}");
            assert_eq!(event["reason"], "ProvisioningFailed", "{event}");
            assert_eq!(event["regarding"]["name"], "llm", "{event}");
            let note = event["note"].as_str().unwrap_or_default();
            assert!(
                note.contains("node gone") && note.contains(SELECTED_NODE),
                "{event}"
            );
            send.send_response(answer(201, &event));
            api
        });
        let action = reconcile(Arc::new(pending(false)), ctx.clone())
            .await
            .unwrap();
        assert_eq!(action, Action::await_change());
        let mut api = server.await.unwrap();
        assert_eq!(ctx.metrics.reschedules("node-missing"), 1);
        drop(ctx);
        assert!(api.next_request().await.is_none(), "nothing else was asked");
    }

    /// Another replica (or the scheduler) changed the claim first: no event,
    /// no count, and a look again shortly.
    #[tokio::test]
    async fn a_claim_changed_since_it_was_observed_is_left_to_the_next_look() {
        let (ctx, mut api) = mocked();
        let server = tokio::spawn(async move {
            let (req, send) = api.next_request().await.expect("a patch");
            assert_eq!(req.method(), Method::PATCH);
            send.send_response(answer(
                409,
                &serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "Status",
                    "status": "Failure",
                    "message": "the object has been modified",
                    "reason": "Conflict",
                    "code": 409
                }),
            ));
            api
        });
        let action = reconcile(Arc::new(pending(false)), ctx.clone())
            .await
            .unwrap();
        assert_eq!(action, Action::requeue(Duration::from_millis(200)));
        let mut api = server.await.unwrap();
        assert_eq!(ctx.metrics.reschedules_in_all(), 0);
        drop(ctx);
        assert!(
            api.next_request().await.is_none(),
            "no event after a conflict"
        );
    }

    /// A bound claim is never touched: no request at all, and it is looked
    /// at again only after ten resyncs (its changes come as events).
    #[tokio::test]
    async fn a_bound_claim_costs_no_request() {
        let (ctx, mut api) = mocked();
        let action = reconcile(Arc::new(pending(true)), ctx.clone())
            .await
            .unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(600)));
        drop(ctx);
        assert!(api.next_request().await.is_none());
    }

    /// A server error is the controller's to retry, not a conflict.
    #[tokio::test]
    async fn a_server_error_is_retried_by_the_controller() {
        let (ctx, mut api) = mocked();
        let server = tokio::spawn(async move {
            let (_req, send) = api.next_request().await.expect("a patch");
            send.send_response(answer(
                500,
                &serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "Status",
                    "status": "Failure",
                    "message": "etcd is down",
                    "reason": "InternalError",
                    "code": 500
                }),
            ));
        });
        let result = reconcile(Arc::new(pending(false)), ctx.clone()).await;
        server.await.unwrap();
        assert!(matches!(result, Err(ReconcileError::Kube(_))), "{result:?}");
        assert_eq!(ctx.metrics.reschedules_in_all(), 0);
    }
}
