//! A ModelPrefetch's summary against a real kube-apiserver: the controller
//! (`--summarize-prefetches`) counts the nodes the object selects among
//! those whose CSINode lists the driver, and those of them Ready, and keeps
//! a `Ready` condition that `kubectl wait` waits on. The nodes' own lines
//! are written here as node drivers write them (each its own field
//! manager, on the status subresource); e2e/run-deployed's prefetch flow
//! waits on the same condition with real nodes pulling.

use std::path::Path;

use crate::support::apiserver::ApiServer;
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

/// A Node (no kubelet behind it) and its CSINode listing the driver.
fn node(api: &ApiServer, name: &str, pool: &str) {
    apply(
        api,
        serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"pool": pool}},
        }),
    );
    apply(
        api,
        serde_json::json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": name},
            "spec": {"drivers": [{"name": "modelcache.csi.io", "nodeID": name}]},
        }),
    );
}

/// Writes `node`'s line of the status as its driver does: server-side
/// apply of its own list entry, as its own field manager.
fn line(api: &ApiServer, node: &str, phase: &str, message: &str) {
    let patch = serde_json::json!({
        "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
        "metadata": {"name": "warm"},
        "status": {"nodes": [{"node": node, "phase": phase, "message": message}]},
    });
    let out = api.kubectl_stdin(
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
    );
    assert!(out.status.success(), "{out:?}");
}

/// Waits until `jsonpath` of the ModelPrefetch reads `value`.
fn wait_for(api: &ApiServer, jsonpath: &str, value: &str) {
    let out = api.kubectl(&[
        "wait",
        &format!("--for=jsonpath={jsonpath}={value}"),
        "modelprefetch/warm",
        WAIT,
    ]);
    assert!(
        out.status.success(),
        "{jsonpath} never read {value}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        ok(api, &["get", "modelprefetch", "warm", "-o", "yaml"])
    );
}

/// The Ready condition's message.
fn ready_message(api: &ApiServer) -> String {
    ok(
        api,
        &[
            "get",
            "modelprefetch",
            "warm",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].message}",
        ],
    )
}

const READY_REASON: &str = "{.status.conditions[?(@.type==\"Ready\")].reason}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_waits_for_a_prefetch_to_be_ready_on_every_selected_node() {
    let api = ApiServer::start().expect("start apiserver");
    let crd =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/csi-driver/base/crd-modelprefetch.yaml");
    ok(&api, &["apply", "-f", crd.to_str().unwrap()]);
    ok(
        &api,
        &[
            "wait",
            "--for=condition=Established",
            "crd/modelprefetches.modelcache.csi.io",
            WAIT,
        ],
    );
    for (n, pool) in [("gpu-1", "gpu"), ("gpu-2", "gpu"), ("cpu-1", "cpu")] {
        node(&api, n, pool);
    }
    apply(
        &api,
        serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
            "metadata": {"name": "warm"},
            "spec": {"storageClassName": "llama", "nodeSelector": {"matchLabels": {"pool": "gpu"}}},
        }),
    );
    let d = Driver::start_against(&api, &["--summarize-prefetches"]).await;

    // Nobody has written a line yet: two selected nodes, none Ready.
    wait_for(&api, READY_REASON, "Pulling");
    wait_for(&api, "{.status.desiredNodes}", "2");
    wait_for(&api, "{.status.readyNodes}", "0");

    line(&api, "gpu-1", "Ready", "");
    line(&api, "gpu-2", "Pulling", "");
    wait_for(&api, "{.status.readyNodes}", "1");
    let message = ready_message(&api);
    assert!(message.contains("waiting for gpu-2"), "{message}");

    // A failed node is named with its reason.
    line(
        &api,
        "gpu-2",
        "Failed",
        "not enough free storage on /var/lib",
    );
    wait_for(&api, READY_REASON, "Failed");
    let message = ready_message(&api);
    assert!(
        message.contains("gpu-2: not enough free storage"),
        "{message}"
    );

    // Both Ready: what an admin waits for.
    line(&api, "gpu-2", "Ready", "");
    ok(
        &api,
        &["wait", "--for=condition=Ready", "modelprefetch/warm", WAIT],
    );
    let table = ok(&api, &["get", "modelprefetch", "warm"]);
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&row[..5], ["warm", "llama", "2", "2", "Ready"], "{table}");
    // The nodes' lines are theirs: the summary left them as they were.
    let nodes = ok(
        &api,
        &[
            "get",
            "modelprefetch",
            "warm",
            "-o",
            "jsonpath={.status.nodes[*].node}",
        ],
    );
    assert_eq!(nodes.split_whitespace().count(), 2, "{nodes}");

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
    drop(d);
}
