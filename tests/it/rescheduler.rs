//! The rescheduler against a real kube-apiserver and etcd, running as the
//! least-privileged identity that deploy/csi-driver's RBAC grants: every
//! decision path, the optimistic 409, and two replicas making exactly one
//! patch and one event.

use crate::support::apiserver;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use modelcache_csi::metrics::Metrics;
use modelcache_csi::rescheduler::{self, Cleared, SELECTED_NODE};

const DRIVER: &str = "modelcache.csi.io";

async fn client(api: &apiserver::ApiServer, context: &str) -> Client {
    let kc = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let opts = kube::config::KubeConfigOptions {
        context: Some(context.into()),
        ..Default::default()
    };
    Client::try_from(
        kube::Config::from_custom_kubeconfig(kc, &opts)
            .await
            .unwrap(),
    )
    .unwrap()
}

fn apply(api: &apiserver::ApiServer, yaml: &str) {
    let out = api.kubectl_stdin(&["apply", "-f", "-"], yaml);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Cluster objects every test here shares.
fn setup(api: &apiserver::ApiServer) {
    let root = env!("CARGO_MANIFEST_DIR");
    for f in ["namespace.yaml", "rbac-rescheduler.yaml"] {
        let path = format!("{root}/deploy/csi-driver/base/{f}");
        let out = api.kubectl(&["apply", "-f", &path]);
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The test's `rescheduler` identity gets exactly the deployed role.
    apply(
        api,
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: test-rescheduler-user}
subjects: [{kind: User, name: rescheduler, apiGroup: rbac.authorization.k8s.io}]
roleRef: {kind: ClusterRole, name: modelcache-csi-rescheduler, apiGroup: rbac.authorization.k8s.io}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: mc-local}
provisioner: modelcache.csi.io
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: other}
provisioner: other.csi.io
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: Node
metadata: {name: node-ok, labels: {kubernetes.io/os: linux}}
---
apiVersion: storage.k8s.io/v1
kind: CSINode
metadata: {name: node-ok}
spec:
  drivers:
    - {name: modelcache.csi.io, nodeID: node-ok, topologyKeys: [topology.modelcache.csi.io/node]}
---
apiVersion: v1
kind: Node
metadata: {name: node-nodriver, labels: {kubernetes.io/os: linux}}
---
apiVersion: storage.k8s.io/v1
kind: CSINode
metadata: {name: node-nodriver}
spec:
  drivers:
    - {name: other.csi.io, nodeID: node-nodriver, topologyKeys: []}
---
apiVersion: v1
kind: Node
metadata: {name: node-unlabelled}
"#,
    );
}

fn pvc_yaml(ns: &str, name: &str, class: &str, node: &str, extra: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {name}
  namespace: {ns}
  annotations:
    {SELECTED_NODE}: {node}
spec:
  storageClassName: {class}
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
{extra}
"#
    )
}

fn namespace(api: &apiserver::ApiServer, ns: &str) {
    apply(
        api,
        &format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}}}\n"),
    );
}

fn cfg(grace: Duration) -> rescheduler::Config {
    rescheduler::Config {
        driver_name: DRIVER.into(),
        node_selector: BTreeMap::from([("kubernetes.io/os".into(), "linux".into())]),
        grace,
        resync: Duration::from_millis(500),
        instance: None,
    }
}

fn spawn(client: Client, grace: Duration) -> (tokio::task::JoinHandle<()>, Arc<Metrics>) {
    let metrics: Arc<Metrics> = Default::default();
    let h = tokio::spawn(rescheduler::run(client, cfg(grace), metrics.clone()));
    (h, metrics)
}

async fn selected(c: &Client, ns: &str, name: &str) -> Option<String> {
    let pvc = Api::<PersistentVolumeClaim>::namespaced(c.clone(), ns)
        .get(name)
        .await
        .unwrap();
    pvc.annotations().get(SELECTED_NODE).cloned()
}

async fn wait_cleared(c: &Client, ns: &str, name: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if selected(c, ns, name).await.is_none() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn events_for(c: &Client, ns: &str, name: &str) -> Vec<Event> {
    Api::<Event>::namespaced(c.clone(), ns)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_decision_path_against_a_real_apiserver() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    setup(&api);
    let admin = client(&api, "admin").await;
    let ns = "paths";
    namespace(&api, ns);
    let bound_extra = "  volumeName: some-pv";
    apply(
        &api,
        &pvc_yaml(ns, "bound", "mc-local", "node-gone", bound_extra),
    );
    apply(
        &api,
        &pvc_yaml(ns, "other-driver", "other", "node-gone", ""),
    );
    apply(&api, &pvc_yaml(ns, "registered", "mc-local", "node-ok", ""));
    apply(
        &api,
        &pvc_yaml(ns, "node-deleted", "mc-local", "node-gone", ""),
    );
    apply(
        &api,
        &pvc_yaml(ns, "unlabelled", "mc-local", "node-unlabelled", ""),
    );
    apply(
        &api,
        &pvc_yaml(ns, "grace", "mc-local", "node-nodriver", ""),
    );

    let grace = Duration::from_secs(6);
    let started = Instant::now();
    let (task, actions) = spawn(client(&api, "rescheduler").await, grace);

    assert!(
        wait_cleared(&admin, ns, "node-deleted", Duration::from_secs(20)).await,
        "deleted node not rescheduled"
    );
    assert!(
        wait_cleared(&admin, ns, "unlabelled", Duration::from_secs(20)).await,
        "unlabelled node not rescheduled"
    );
    // Before the grace period ends, the node that should get a driver keeps its PVC.
    if started.elapsed() < grace - Duration::from_secs(2) {
        assert_eq!(
            selected(&admin, ns, "grace").await.as_deref(),
            Some("node-nodriver")
        );
    }
    assert!(
        wait_cleared(&admin, ns, "grace", Duration::from_secs(20)).await,
        "grace never expired"
    );
    assert!(
        started.elapsed() >= grace,
        "rescheduled before the grace period: {:?}",
        started.elapsed()
    );
    // Untouched: bound, another driver's, and a registered driver's.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        selected(&admin, ns, "bound").await.as_deref(),
        Some("node-gone")
    );
    assert_eq!(
        selected(&admin, ns, "other-driver").await.as_deref(),
        Some("node-gone")
    );
    assert_eq!(
        selected(&admin, ns, "registered").await.as_deref(),
        Some("node-ok")
    );

    // One ProvisioningFailed warning each, naming the node and the reason.
    for (pvc, words) in [
        ("node-deleted", ["node-gone", "does not exist"]),
        ("unlabelled", ["node-unlabelled", "kubernetes.io/os=linux"]),
        ("grace", ["node-nodriver", "has not been registered"]),
    ] {
        let evs = events_for(&admin, ns, pvc).await;
        assert_eq!(evs.len(), 1, "{pvc}: {evs:?}");
        let e = &evs[0];
        assert_eq!(e.reason.as_deref(), Some("ProvisioningFailed"));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        let note = e.note.clone().unwrap_or_default();
        assert!(words.iter().all(|w| note.contains(w)), "{pvc}: {note}");
    }
    assert!(events_for(&admin, ns, "registered").await.is_empty());
    assert_eq!(actions.reschedules("node-missing"), 1);
    assert_eq!(actions.reschedules("node-not-selected"), 1);
    assert_eq!(actions.reschedules("driver-missing"), 1);
    assert_eq!(actions.reschedules_in_all(), 3);
    task.abort();

    // Least privilege: the identity can do what it needs and nothing more.
    for (verb, resource, allowed) in [
        ("patch", "persistentvolumeclaims", "yes"),
        ("delete", "persistentvolumeclaims", "no"),
        ("update", "nodes", "no"),
        ("get", "secrets", "no"),
        ("create", "events.events.k8s.io", "yes"),
    ] {
        let out = api.kubectl(&[
            "--context",
            "rescheduler",
            "auth",
            "can-i",
            verb,
            resource,
            "-A",
        ]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            allowed,
            "{verb} {resource}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_change_makes_the_patch_conflict() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    setup(&api);
    let admin = client(&api, "admin").await;
    namespace(&api, "race");
    apply(&api, &pvc_yaml("race", "p", "mc-local", "node-gone", ""));
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(admin.clone(), "race");
    let observed = pvcs.get("p").await.unwrap();
    // Someone changes the PVC after the rescheduler looked at it.
    pvcs.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    let me = client(&api, "rescheduler").await;
    assert_eq!(
        rescheduler::clear_selected_node(&me, &observed)
            .await
            .unwrap(),
        Cleared::Conflict
    );
    assert_eq!(
        selected(&admin, "race", "p").await.as_deref(),
        Some("node-gone")
    );
    // With the fresh object it succeeds.
    let fresh = pvcs.get("p").await.unwrap();
    assert_eq!(
        rescheduler::clear_selected_node(&me, &fresh).await.unwrap(),
        Cleared::Yes
    );
    assert_eq!(selected(&admin, "race", "p").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_make_exactly_one_patch_and_one_event() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    setup(&api);
    let admin = client(&api, "admin").await;
    namespace(&api, "replicas");
    let (a, acts_a) = spawn(client(&api, "rescheduler").await, Duration::from_secs(300));
    let (b, acts_b) = spawn(client(&api, "rescheduler").await, Duration::from_secs(300));
    // Both are watching before the PVC appears, so they race for it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..5 {
        apply(
            &api,
            &pvc_yaml("replicas", &format!("p{i}"), "mc-local", "node-gone", ""),
        );
    }
    for i in 0..5 {
        assert!(
            wait_cleared(
                &admin,
                "replicas",
                &format!("p{i}"),
                Duration::from_secs(20)
            )
            .await
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (in_a, in_b) = (acts_a.reschedules_in_all(), acts_b.reschedules_in_all());
    assert_eq!(in_a + in_b, 5, "a: {in_a} b: {in_b}");
    for i in 0..5 {
        let evs = events_for(&admin, "replicas", &format!("p{i}")).await;
        assert_eq!(evs.len(), 1, "p{i}: {evs:?}");
    }
    a.abort();
    b.abort();
}
