//! A ModelPrefetch's summary against a real kube-apiserver: the controller
//! (`--summarize-prefetches`) counts the nodes the object selects among
//! those whose CSINode lists the driver, those of them warm for its class
//! (the label a node's driver sets once it holds the model) and those whose
//! line says they failed, and keeps a `Ready` condition that `kubectl wait`
//! waits on. The nodes' labels and failure lines are written here as node
//! drivers write them (a line: each its own field manager, on the status
//! subresource); e2e/run-deployed's prefetch flow waits on the same
//! condition with real nodes pulling.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::apiserver::ApiServer;
use crate::support::fleet::Served;
use crate::support::harness::*;

const WAIT: &str = "--timeout=60s";

fn ok(api: &ApiServer, args: &[&str]) -> String {
    let out = api.kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn apply(api: &ApiServer, manifest: serde_json::Value) {
    let out = api.kubectl_stdin(&["apply", "-f", "-"], &manifest.to_string());
    assert!(out.status.success(), "{out:?}");
}

/// Nodes (no kubelet behind them) and their CSINodes listing the driver,
/// each `(name, pool)`, in one apply.
fn nodes(api: &ApiServer, which: &[(&str, &str)]) {
    let items: Vec<serde_json::Value> = which
        .iter()
        .flat_map(|(name, pool)| {
            [
                serde_json::json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {"pool": pool}},
                }),
                serde_json::json!({
                    "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
                    "metadata": {"name": name},
                    "spec": {"drivers": [{"name": "modelcache.csi.io", "nodeID": name}]},
                }),
            ]
        })
        .collect();
    apply(
        api,
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}),
    );
}

/// What `node`'s driver does once it holds class `class`'s model.
fn warm(api: &ApiServer, node: &str, class: &str) {
    ok(
        api,
        &[
            "label",
            "node",
            node,
            &format!("warm.modelcache.csi.io/{class}=true"),
        ],
    );
}

/// Writes `node`'s line of the status as its driver does when its pull
/// failed: server-side apply of its own list entry, as its own field
/// manager.
fn line(api: &ApiServer, node: &str, phase: &str, message: &str) {
    line_of(api, "warm", node, phase, message, &now());
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// `line`, on ModelPrefetch `object`, written at `updated`.
fn line_of(api: &ApiServer, object: &str, node: &str, phase: &str, message: &str, updated: &str) {
    let out = try_line(api, object, node, phase, message, Some(updated));
    assert!(out.status.success(), "{out:?}");
}

/// Applies `node`'s line on `object` as that node's driver would, with
/// kubectl, and says how it went.
fn try_line(
    api: &ApiServer,
    object: &str,
    node: &str,
    phase: &str,
    message: &str,
    updated: Option<&str>,
) -> std::process::Output {
    let patch = serde_json::json!({
        "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
        "metadata": {"name": object},
        "status": {"nodes": [{"node": node, "phase": phase, "message": message, "updated": updated}]},
    });
    api.kubectl_stdin(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--subresource=status",
            &format!("--field-manager=modelcache.csi.io/{node}"),
            "-f",
            "-",
        ],
        &patch.to_string(),
    )
}

/// A line from each of `nodes` on `object`, all at once, each as its own
/// node's driver writes it.
async fn lines_at_once(api: &ApiServer, object: &str, nodes: &[String], phase: &str) {
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path()))
        .await
        .expect("client");
    let objects = kube::Api::<modelcache_csi::prefetch::resource::ModelPrefetch>::all(client);
    let writes = nodes.iter().map(|n| {
        let objects = objects.clone();
        let patch = serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
            "metadata": {"name": object},
            "status": {"nodes": [{"node": n, "phase": phase, "message": "no space", "updated": now()}]},
        });
        async move {
            objects
                .patch_status(
                    object,
                    &kube::api::PatchParams::apply(&format!("modelcache.csi.io/{n}")).force(),
                    &kube::api::Patch::Apply(&patch),
                )
                .await
                .expect("a node's line")
        }
    });
    futures::future::join_all(writes).await;
}

/// Waits until `jsonpath` of ModelPrefetch `object` reads `value`.
fn wait_on(api: &ApiServer, object: &str, jsonpath: &str, value: &str) {
    let out = api.kubectl(&[
        "wait",
        &format!("--for=jsonpath={jsonpath}={value}"),
        &format!("modelprefetch/{object}"),
        WAIT,
    ]);
    assert!(
        out.status.success(),
        "{jsonpath} of {object} never read {value}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        ok(api, &["get", "modelprefetch", object, "-o", "yaml"])
    );
}

/// Waits until `jsonpath` of the ModelPrefetch reads `value`.
fn wait_for(api: &ApiServer, jsonpath: &str, value: &str) {
    wait_on(api, "warm", jsonpath, value);
}

/// The Ready condition's message.
fn ready_message(api: &ApiServer) -> String {
    read(
        api,
        "warm",
        "{.status.conditions[?(@.type==\"Ready\")].message}",
    )
}

fn crd_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/csi-driver/base/crd-modelprefetch.yaml")
}

/// `jsonpath` of ModelPrefetch `object`, now.
fn read(api: &ApiServer, object: &str, jsonpath: &str) -> String {
    ok(
        api,
        &[
            "get",
            "modelprefetch",
            object,
            "-o",
            &format!("jsonpath={jsonpath}"),
        ],
    )
}

/// An apiserver serving the ModelPrefetch CRD of deploy/.
fn with_crd() -> ApiServer {
    let api = ApiServer::start().expect("start apiserver");
    ok(&api, &["apply", "-f", crd_path().to_str().unwrap()]);
    ok(
        &api,
        &[
            "wait",
            "--for=condition=Established",
            "crd/modelprefetches.modelcache.csi.io",
            WAIT,
        ],
    );
    api
}

const READY_REASON: &str = "{.status.conditions[?(@.type==\"Ready\")].reason}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_waits_for_a_prefetch_to_be_ready_on_every_selected_node() {
    let api = with_crd();
    nodes(
        &api,
        &[("gpu-1", "gpu"), ("gpu-2", "gpu"), ("cpu-1", "cpu")],
    );
    apply(
        &api,
        serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
            "metadata": {"name": "warm"},
            "spec": {"storageClassName": "llama", "nodeSelector": {"matchLabels": {"pool": "gpu"}}},
        }),
    );
    let d = Driver::start_against(&api, &["--summarize-prefetches"]).await;

    // No node holds the model yet: two selected nodes, none Ready.
    wait_for(&api, READY_REASON, "Pulling");
    wait_for(&api, "{.status.desiredNodes}", "2");
    wait_for(&api, "{.status.readyNodes}", "0");

    // A node that holds the model is labelled warm for the class by its
    // driver, and has no line.
    warm(&api, "gpu-1", "llama");
    // Another class's label is not this one's.
    warm(&api, "gpu-2", "mistral");
    wait_for(&api, "{.status.readyNodes}", "1");
    let message = ready_message(&api);
    assert!(message.contains("waiting for gpu-2"), "{message}");

    // A failed node is named with its reason, and counted.
    line(
        &api,
        "gpu-2",
        "Failed",
        "not enough free storage on /var/lib",
    );
    wait_for(&api, READY_REASON, "Failed");
    wait_for(&api, "{.status.failedNodes}", "1");
    let message = ready_message(&api);
    assert!(
        message.contains("gpu-2: not enough free storage"),
        "{message}"
    );

    // Both warm: what an admin waits for.
    warm(&api, "gpu-2", "llama");
    ok(
        &api,
        &["wait", "--for=condition=Ready", "modelprefetch/warm", WAIT],
    );
    wait_for(&api, "{.status.failedNodes}", "0");
    let table = ok(&api, &["get", "modelprefetch", "warm"]);
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&row[..5], ["warm", "llama", "2", "2", "Ready"], "{table}");
    // The nodes' lines are theirs: the summary left them as they were.
    let lines = read(&api, "warm", "{.status.nodes[*].node}");
    assert_eq!(lines.split_whitespace().collect::<Vec<_>>(), ["gpu-2"]);
    // A node that left the cluster cannot take its line out: the
    // controller does, once the line is old enough not to be a node the
    // informers have not seen yet.
    line_of(
        &api,
        "warm",
        "ghost",
        "Failed",
        "gone since",
        "2020-01-01T00:00:00Z",
    );
    wait_on(&api, "warm", "{.status.nodes[*].node}", "gpu-2");

    // A node joins the pool: not Ready until it holds the model too.
    ok(&api, &["label", "node", "cpu-1", "pool=gpu", "--overwrite"]);
    wait_for(&api, "{.status.desiredNodes}", "3");
    ok(
        &api,
        &[
            "wait",
            "--for=condition=Ready=false",
            "modelprefetch/warm",
            WAIT,
        ],
    );
    // A node whose driver is gone (its CSINode no longer lists it) is not
    // waited for.
    ok(&api, &["delete", "csinode", "cpu-1"]);
    ok(
        &api,
        &["wait", "--for=condition=Ready", "modelprefetch/warm", WAIT],
    );

    rollout_is_written_a_few_times_not_once_a_node(&api).await;
    older_drivers_lines_past_the_bound_go(&api).await;
    drop(d);
}

/// An object from before the CRD bounded its lines, with a Ready line from
/// each of 70 nodes (as 0.2.0 drivers wrote them): past the bound no line
/// can change, not even to go, so the controller takes them out.
async fn older_drivers_lines_past_the_bound_go(api: &ApiServer) {
    let crd = std::fs::read_to_string(crd_path()).expect("the CRD");
    let unbounded = crd.replace("maxItems: 64", "");
    let out = api.kubectl_stdin(&["apply", "-f", "-"], &unbounded);
    assert!(out.status.success(), "{out:?}");
    prefetch(api, "old", "llama", &["old"]);
    let old: Vec<String> = (0..70).map(|i| format!("old-{i:02}")).collect();
    let pairs: Vec<(&str, &str)> = old.iter().map(|n| (n.as_str(), "old")).collect();
    nodes(api, &pairs);
    lines_at_once(api, "old", &old, "Ready").await;
    let out = api.kubectl_stdin(&["apply", "-f", "-"], &crd);
    assert!(out.status.success(), "{out:?}");
    // Lines that land after the controller's clean-up stay (each node
    // takes its own out once it runs this version): the object is back
    // under the bound, where lines can change again.
    let start = Instant::now();
    loop {
        let lines = read(api, "old", "{.status.nodes[*].node}");
        let n = lines.split_whitespace().count();
        if n <= modelcache_csi::prefetch::resource::LINES_AT_MOST {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "older drivers' {n} lines were never taken out"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    wait_on(api, "old", "{.status.desiredNodes}", "70");
}

/// Sixty nodes turning warm one after another, a tenth of a second apart:
/// the summary follows them in a few writes (one each `WRITE_GAP`, 5 s,
/// and the turn to Ready), not one write a node, which every node's watch
/// would carry.
async fn rollout_is_written_a_few_times_not_once_a_node(api: &ApiServer) {
    const WAVE: usize = 60;
    let names: Vec<String> = (0..WAVE).map(|i| format!("wave-{i:02}")).collect();
    let pairs: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "wave")).collect();
    nodes(api, &pairs);
    apply(
        api,
        serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
            "metadata": {"name": "wave"},
            "spec": {"storageClassName": "llama", "nodeSelector": {"matchLabels": {"pool": "wave"}}},
        }),
    );
    let wave = |jsonpath: &str, value: &str| wait_on(api, "wave", jsonpath, value);
    wave("{.status.desiredNodes}", "60");
    wave("{.status.readyNodes}", "0");
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path()))
        .await
        .expect("client");
    let nodes_api = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client);
    let before = Served::settled_of(api, "modelprefetches");
    let t0 = Instant::now();
    for n in &names {
        let patch =
            serde_json::json!({"metadata": {"labels": {"warm.modelcache.csi.io/llama": "true"}}});
        nodes_api
            .patch(
                n,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("label");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wave("{.status.readyNodes}", "60");
    let took = t0.elapsed();
    let writes = Served::settled_of(api, "modelprefetches")
        .since(&before)
        .verb("APPLY")
        .0;
    // The first change at once, then one each gap, and the turn to Ready.
    let most = (took.as_secs_f64() / 5.0).ceil() + 2.0;
    assert!(
        writes <= most,
        "{writes} summary writes while {WAVE} nodes turned warm in {took:?}: at most {most} \
         expected"
    );
    assert!(writes >= 2.0, "the rollout was never written: {writes}");
}

/// A StorageClass of the driver whose `source` is `source`.
fn class(api: &ApiServer, name: &str, source: &str) {
    apply(
        api,
        serde_json::json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": "modelcache.csi.io",
            "parameters": {"backend": "local", "source": source},
        }),
    );
}

fn prefetch(api: &ApiServer, name: &str, class: &str, pools: &[&str]) {
    apply(
        api,
        serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
            "metadata": {"name": name},
            "spec": {"storageClassName": class, "nodeSelector": {"matchExpressions": [
                {"key": "pool", "operator": "In", "values": pools}]}},
        }),
    );
}

/// A node's driver (`--prefetch`) against the real apiserver: it warms the
/// model it is asked for and says so with its label alone; a failed pull
/// is its line, with the field and the fix; once the status lists
/// `LISTED_FAILURES` other failed nodes, its failure is in its log only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_warms_its_model_by_label_and_lists_only_a_failure() {
    let api = with_crd();
    let d = Driver::start_against(&api, &["--prefetch", "--summarize-prefetches"]).await;
    let me = d.node_id.clone();
    nodes(&api, &[(me.as_str(), "gpu")]);
    let model = d.dir.join("llama");
    write_model(&model, 41);
    class(&api, "llama", &format!("file://{}", model.display()));

    prefetch(&api, "good", "llama", &["gpu"]);
    ok(
        &api,
        &["wait", "--for=condition=Ready", "modelprefetch/good", WAIT],
    );
    wait_on(&api, "good", "{.status.readyNodes}", "1");
    let labels = ok(
        &api,
        &["get", "node", &me, "-o", "jsonpath={.metadata.labels}"],
    );
    assert!(
        labels.contains("\"warm.modelcache.csi.io/llama\":\"true\""),
        "{labels}"
    );
    let lines = read(&api, "good", "{.status.nodes}");
    assert_eq!(lines.trim(), "", "a warm node wrote a line");

    // A class that does not exist: the node's own line says which field.
    prefetch(&api, "missing", "nope", &["gpu"]);
    wait_on(&api, "missing", "{.status.nodes[0].phase}", "Failed");
    let why = read(&api, "missing", "{.status.nodes[0].message}");
    assert!(
        why.contains("spec.storageClassName") && why.contains("StorageClass nope does not exist"),
        "{why}"
    );
    wait_on(&api, "missing", READY_REASON, "Failed");

    // The status lists 32 failed nodes already; then this node is selected
    // too, and fails: it says so in its log, not in the object.
    let crowd: Vec<String> = (0..modelcache_csi::prefetch::LISTED_FAILURES)
        .map(|i| format!("crowd-{i:02}"))
        .collect();
    let pairs: Vec<(&str, &str)> = crowd.iter().map(|n| (n.as_str(), "crowd")).collect();
    nodes(&api, &pairs);
    prefetch(&api, "crowded", "nope", &["crowd"]);
    lines_at_once(&api, "crowded", &crowd, "Failed").await;
    prefetch(&api, "crowded", "nope", &["crowd", "gpu"]);
    let start = Instant::now();
    while !d
        .log_text()
        .contains("the status lists enough failed nodes already")
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the node never told its log of the failure it could not list"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let listed = read(&api, "crowded", "{.status.nodes[*].node}");
    assert!(!listed.split_whitespace().any(|n| n == me), "{listed}");
    assert_eq!(listed.split_whitespace().count(), crowd.len(), "{listed}");
    wait_on(&api, "crowded", "{.status.desiredNodes}", "33");
    let message = read(
        &api,
        "crowded",
        "{.status.conditions[?(@.type==\"Ready\")].message}",
    );
    assert!(
        message.starts_with("at least 32 of 33 selected nodes failed"),
        "{message}"
    );

    // Whatever a node writes (any node may write any line), the apiserver
    // keeps the object bounded: 64 lines, the 65th refused, and no
    // message past 1,024 characters.
    let more: Vec<String> = (crowd.len()..modelcache_csi::prefetch::resource::LINES_AT_MOST)
        .map(|i| format!("crowd-{i:02}"))
        .collect();
    lines_at_once(&api, "crowded", &more, "Failed").await;
    let refused = |node: &str, message: &str| {
        let out = try_line(&api, "crowded", node, "Failed", message, None);
        assert!(!out.status.success(), "{node}'s line was taken");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let why = refused("hostile-65", "no space");
    assert!(why.contains("must have at most 64 items"), "{why}");
    let why = refused("crowd-00", &"x".repeat(1025));
    assert!(why.contains("1024"), "{why}");

    // The one volume this node made (the warm model's) goes with its
    // declaration.
    assert_eq!(d.list_all(0).await.len(), 1, "the prefetch's volume");
    ok(&api, &["delete", "modelprefetch", "good"]);
    let start = Instant::now();
    while !d.list_all(0).await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "the deleted prefetch's volume was never released"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(d);
}
