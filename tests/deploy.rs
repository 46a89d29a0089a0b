//! deploy/csi-driver is valid Kubernetes: applied to a real kube-apiserver,
//! first as a server-side dry run (full schema and admission checks, no
//! guessing), then for real, and read back.

#[path = "support/apiserver.rs"]
mod apiserver;

fn kubectl_ok(api: &apiserver::ApiServer, args: &[&str]) -> String {
    let out = api.kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn manifests_apply_to_a_real_apiserver() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let root = env!("CARGO_MANIFEST_DIR");
    let base = format!("{root}/deploy/csi-driver/base");
    let examples = format!("{root}/deploy/csi-driver/examples");
    // The namespace must exist before namespaced objects can be dry-run.
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    let dry = kubectl_ok(&api, &["apply", "--dry-run=server", "-k", &base]);
    assert!(dry.contains("(server dry run)"), "{dry}");
    kubectl_ok(&api, &["apply", "-k", &base]);
    kubectl_ok(&api, &["apply", "--dry-run=server", "-k", &examples]);
    kubectl_ok(&api, &["apply", "-k", &examples]);

    let driver = kubectl_ok(
        &api,
        &["get", "csidriver", "modelcache.csi.io", "-o", "json"],
    );
    let driver: serde_json::Value = serde_json::from_str(&driver).unwrap();
    assert_eq!(driver["spec"]["attachRequired"], false);
    assert_eq!(driver["spec"]["storageCapacity"], true);
    for (kind, name) in [
        ("daemonset", "modelcache-csi-node"),
        ("deployment", "modelcache-csi-controller"),
        ("deployment", "modelcache-csi-rescheduler"),
    ] {
        kubectl_ok(&api, &["-n", "modelcache-csi", "get", kind, name]);
    }
    let classes = kubectl_ok(&api, &["get", "storageclass", "-o", "name"]);
    for sc in [
        "modelcache-source-local",
        "modelcache-cache-local",
        "modelcache-minilm-s3",
        "modelcache-shared",
        "modelcache-xfs-shared",
    ] {
        assert!(classes.contains(sc), "{sc} missing: {classes}");
    }
    kubectl_ok(&api, &["get", "volumeattributesclass", "modelcache-sealed"]);
    let clone = kubectl_ok(
        &api,
        &[
            "get",
            "pvc",
            "minilm-cache",
            "-o",
            "jsonpath={.spec.dataSource.name}",
        ],
    );
    assert_eq!(clone, "minilm-source");
    // Only the node plugin is privileged; the rescheduler runs as non-root.
    let ds = kubectl_ok(
        &api,
        &[
            "-n",
            "modelcache-csi",
            "get",
            "daemonset",
            "modelcache-csi-node",
            "-o",
            "json",
        ],
    );
    let ds: serde_json::Value = serde_json::from_str(&ds).unwrap();
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    let privileged: Vec<_> = containers
        .iter()
        .filter(|c| c["securityContext"]["privileged"] == true)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(privileged, vec!["driver"]);
}

/// The shipped manifests bound the driver's disk use: a cap on pulled
/// models per backend, and a reserve the driver never eats into.
#[test]
fn manifests_bound_disk_use() {
    let root = env!("CARGO_MANIFEST_DIR");
    for (file, backends) in [
        ("node.yaml", &["local", "xfs"][..]),
        ("controller.yaml", &["shared", "xfs"][..]),
    ] {
        let text =
            std::fs::read_to_string(format!("{root}/deploy/csi-driver/base/{file}")).unwrap();
        for b in backends {
            assert!(
                text.contains(&format!("- --cache-capacity={b}=")),
                "{file} sets no --cache-capacity for {b}"
            );
        }
        assert!(text.contains("- --min-free="), "{file} sets no --min-free");
    }
}
