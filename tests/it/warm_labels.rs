//! Steering pods to warm nodes, against a real kube-apiserver: a node's
//! driver (`--label-warm-nodes`) labels its Node
//! `warm.modelcache.csi.io/<class>: "true"` once the model of a class's own
//! `source` is sealed there, and removes the label when the model is
//! evicted or the class is deleted. A tenant-named source earns its class
//! no label. Each state is waited for on the Node, as a user (or the
//! scheduler) sees it.

use std::time::{Duration, Instant};

use crate::kube_sources::apply;
use crate::support::apiserver::ApiServer;
use crate::support::harness::*;

const BOUND: Duration = Duration::from_secs(60);
const WARM: &str = "warm.modelcache.csi.io/";

/// The Node's warm labels (class -> value) now.
fn warm_labels(api: &ApiServer, node: &str) -> Vec<(String, String)> {
    let out = api.kubectl(&["get", "node", node, "-o", "jsonpath={.metadata.labels}"]);
    assert!(out.status.success(), "{out:?}");
    let labels: std::collections::BTreeMap<String, String> =
        serde_json::from_slice(&out.stdout).unwrap_or_default();
    labels
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix(WARM).map(|c| (c.to_string(), v)))
        .collect()
}

/// Waits, within `BOUND`, until the Node's warm labels are `want`.
async fn wait_warm(api: &ApiServer, node: &str, want: &[&str], why: &str) {
    let want: Vec<(String, String)> = want
        .iter()
        .map(|c| (c.to_string(), "true".to_string()))
        .collect();
    let start = Instant::now();
    loop {
        let now = warm_labels(api, node);
        if now == want {
            return;
        }
        assert!(
            start.elapsed() < BOUND,
            "{why}: the Node's warm labels are {now:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn class(name: &str, params: &[(&str, &str)]) -> String {
    let params: String = params
        .iter()
        .map(|(k, v)| format!("  {k}: \"{v}\"\n"))
        .collect();
    format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {name}}}\nprovisioner: modelcache.csi.io\nparameters:\n{params}"
    )
}

fn claim(name: &str, class: &str, annotations: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: team\n  annotations: {{{annotations}}}\nspec:\n  storageClassName: {class}\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n"
    )
}

/// A create as the node's external-provisioner sends it for claim `pvc`
/// of a class with `params`.
fn request(
    name: &str,
    pvc: &str,
    params: &[(&str, &str)],
) -> modelcache_csi::csi::CreateVolumeRequest {
    let mut all = vec![
        ("csi.storage.k8s.io/pvc/name", pvc),
        ("csi.storage.k8s.io/pvc/namespace", "team"),
        ("backend", "local"),
    ];
    all.extend_from_slice(params);
    create_req(name, &all, READER)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_labelled_warm_while_it_holds_a_class_model() {
    let api = ApiServer::start().expect("start apiserver");
    let d = Driver::start_against(&api, &["--label-warm-nodes"]).await;
    apply(
        &api,
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: team}}\n---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  labels: {{pool: gpu}}\n",
            d.node_id
        ),
    );
    let (llama, mistral, tenant) = (d.dir.join("llama"), d.dir.join("mistral"), d.dir.join("t"));
    write_model(&llama, 31);
    write_model(&mistral, 32);
    write_model(&tenant, 33);
    let llama_src = format!("file://{}", llama.display());
    let mistral_src = format!("file://{}", mistral.display());
    let allowed = format!("file://{}/", d.dir.display());
    let open = [("allowedSources", allowed.as_str())];
    apply(&api, &class("llama", &[("source", &llama_src)]));
    apply(&api, &class("mistral", &[("source", &mistral_src)]));
    apply(&api, &class("open", &open));
    apply(
        &api,
        &claim(
            "mine",
            "open",
            &format!("modelcache.csi.io/source: \"file://{}\"", tenant.display()),
        ),
    );
    apply(&api, &claim("llama", "llama", ""));
    apply(&api, &claim("llama2", "llama", ""));

    // A tenant's own model earns its class nothing.
    let v = d
        .create(request("pvc-t", "mine", &open))
        .await
        .expect("the tenant's create");
    d.wait_sealed(&[v.volume_context["source"].as_str()], BOUND)
        .await;
    // The class's own model: labelled once sealed; a class none of whose
    // volumes is on this node (mistral) is not.
    let v = d
        .create(request("pvc-l", "llama", &[("source", &llama_src)]))
        .await
        .expect("the class's create");
    let sid = v.volume_context["source"].clone();
    wait_warm(&api, &d.node_id, &["llama"], "the class's model was sealed").await;
    let out = api.kubectl(&[
        "get",
        "node",
        &d.node_id,
        "-o",
        "jsonpath={.metadata.labels.pool}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "gpu",
        "another label was touched"
    );

    // The volume deleted, the model stays sealed: still warm. Evicted: not.
    d.delete(&v.volume_id).await.expect("delete");
    let r = d.cli(&["evict", &sid]);
    assert!(r.ok, "evict: {}", r.stderr);
    wait_warm(&api, &d.node_id, &[], "the class's model was evicted").await;

    // Pulled again, then the class deleted: the label goes with it.
    let v = d
        .create(request("pvc-l2", "llama2", &[("source", &llama_src)]))
        .await
        .expect("the class's create, again");
    wait_warm(
        &api,
        &d.node_id,
        &["llama"],
        "the class's model was sealed again",
    )
    .await;
    let out = api.kubectl(&["delete", "storageclass", "llama"]);
    assert!(out.status.success(), "{out:?}");
    wait_warm(&api, &d.node_id, &[], "the class was deleted").await;
    // Recreated naming another model: the one held here is not its, while
    // a class whose model is pulled now is warm.
    apply(&api, &class("llama", &[("source", &mistral_src)]));
    apply(&api, &claim("mistral", "mistral", ""));
    d.create(request("pvc-m", "mistral", &[("source", &mistral_src)]))
        .await
        .expect("the other class's create");
    wait_warm(
        &api,
        &d.node_id,
        &["mistral"],
        "another class's model was sealed, and llama now names it, not the model llama pulled",
    )
    .await;
    drop(v);
}
