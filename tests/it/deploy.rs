//! deploy/csi-driver is valid Kubernetes: applied to a real kube-apiserver,
//! first as a server-side dry run (full schema and admission checks, no
//! guessing), then for real, and read back. Its RBAC is least privilege:
//! each service account's rights are checked with `kubectl auth can-i`
//! against a table of what it must and must not do, and the driver, run as
//! its own service account, reads a tenant's source secret only where the
//! tenant-source-secrets component grants it.

use crate::support::apiserver;

use std::path::Path;

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
    // The shared filesystem's install (components/shared under an NFS
    // overlay) is one the apiserver takes too.
    let shared = kubectl_ok(
        &api,
        &[
            "apply",
            "--dry-run=server",
            "-k",
            &format!("{examples}/shared"),
        ],
    );
    assert!(
        shared.contains("daemonset.apps/modelcache-csi-node configured (server dry run)"),
        "{shared}"
    );
    // So is a user's overlay with the sigstore trust root's component
    // (kustomize takes only relative paths).
    let overlay = tempfile::tempdir().unwrap();
    let rel = pathdiff(overlay.path(), std::path::Path::new(root)).join("deploy/csi-driver");
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "resources: [{0}/base]\ncomponents: [{0}/components/sigstore-trust-root]\n",
            rel.display()
        ),
    )
    .unwrap();
    let trust = kubectl_ok(
        &api,
        &[
            "apply",
            "--dry-run=server",
            "-k",
            overlay.path().to_str().unwrap(),
        ],
    );
    for workload in [
        "daemonset.apps/modelcache-csi-node",
        "deployment.apps/modelcache-csi-controller",
    ] {
        assert!(
            trust.contains(&format!("{workload} configured (server dry run)")),
            "{trust}"
        );
    }
    // The examples include a ModelPrefetch: its CRD must serve first.
    kubectl_ok(
        &api,
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/modelprefetches.modelcache.csi.io",
        ],
    );
    kubectl_ok(&api, &["apply", "--dry-run=server", "-k", &examples]);
    kubectl_ok(&api, &["apply", "-k", &examples]);

    let driver = kubectl_ok(
        &api,
        &["get", "csidriver", "modelcache.csi.io", "-o", "json"],
    );
    let driver: serde_json::Value = serde_json::from_str(&driver).unwrap();
    assert_eq!(driver["spec"]["attachRequired"], false);
    assert_eq!(driver["spec"]["storageCapacity"], true);
    // Inline volumes: the mode, and the pod's name for the pull's events.
    assert_eq!(
        driver["spec"]["volumeLifecycleModes"],
        serde_json::json!(["Persistent", "Ephemeral"])
    );
    assert_eq!(driver["spec"]["podInfoOnMount"], true);
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
        "modelcache-inline",
        "modelcache-signed",
    ] {
        assert!(classes.contains(sc), "{sc} missing: {classes}");
    }
    // Every example class is one the driver accepts, as the apiserver
    // hands it on (a PEM block scalar included).
    let all: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&api, &["get", "storageclass", "-o", "json"])).unwrap();
    for sc in all["items"].as_array().unwrap() {
        if sc["provisioner"] != "modelcache.csi.io" {
            continue;
        }
        let params: std::collections::BTreeMap<String, String> =
            serde_json::from_value(sc["parameters"].clone()).unwrap_or_default();
        let params = modelcache_csi::provision::params::class_parameters(Some(params));
        if let Err(e) = modelcache_csi::provision::params::Params::parse(&params) {
            panic!("StorageClass {}: {e}", sc["metadata"]["name"]);
        }
    }
    kubectl_ok(&api, &["get", "volumeattributesclass", "modelcache-sealed"]);
    kubectl_ok(&api, &["get", "modelprefetch", "minilm-on-gpus"]);
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

/// `to` as a path relative to `from` (both absolute, `from` a directory).
fn pathdiff(from: &std::path::Path, to: &std::path::Path) -> std::path::PathBuf {
    let (from, to): (Vec<_>, Vec<_>) = (from.components().collect(), to.components().collect());
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut out = std::path::PathBuf::new();
    for _ in common..from.len() {
        out.push("..");
    }
    out.extend(&to[common..]);
    out
}

/// The trust-root component names the variable the driver reads, in both
/// workloads, mounted where it points.
#[test]
fn the_trust_root_component_names_what_the_driver_reads() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!(
        "{root}/deploy/csi-driver/components/sigstore-trust-root/kustomization.yaml"
    ))
    .unwrap();
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--sigstore-trust-root")
            && help.contains("env: MODELCACHE_SIGSTORE_TRUST_ROOT"),
        "{help}"
    );
    let env =
        "{name: MODELCACHE_SIGSTORE_TRUST_ROOT, value: /etc/modelcache/sigstore/trusted_root.json}";
    let mount = "{name: sigstore, mountPath: /etc/modelcache/sigstore, readOnly: true}";
    assert_eq!(text.matches(env).count(), 2, "{text}");
    assert_eq!(text.matches(mount).count(), 2, "{text}");
}

/// The shipped manifests bound the driver's disk use: a cap on pulled
/// models per backend, and a reserve the driver never eats into.
#[test]
fn manifests_bound_disk_use() {
    let root = env!("CARGO_MANIFEST_DIR");
    for (file, backends, reserve) in [
        ("base/node.yaml", &["local", "xfs"][..], true),
        ("base/controller.yaml", &["xfs"][..], true),
        // The shared filesystem's cap comes with the filesystem; the
        // controller's reserve above covers it.
        (
            "components/shared/kustomization.yaml",
            &["shared"][..],
            false,
        ),
    ] {
        let text = std::fs::read_to_string(format!("{root}/deploy/csi-driver/{file}")).unwrap();
        for b in backends {
            assert!(
                text.contains(&format!("--cache-capacity={b}=")),
                "{file} sets no --cache-capacity for {b}"
            );
        }
        if reserve {
            assert!(text.contains("- --min-free="), "{file} sets no --min-free");
            assert!(
                text.contains("- --min-free-inodes="),
                "{file} sets no --min-free-inodes"
            );
        }
    }
}

const NS: &str = "modelcache-csi";
const NODE: &str = "modelcache-csi-node";
const CONTROLLER: &str = "modelcache-csi-controller";
const RESCHEDULER: &str = "modelcache-csi-rescheduler";
/// A tenant: `edit` in namespace team-a, nothing else.
const TENANT: &str = "tenant-a";
const VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];
/// `-A`: every namespace at once (a cluster-wide grant).
const ALL: &str = "*";

/// Exactly these verbs on PVs and PVCs, cluster-wide; every other verb of
/// VERBS is refused. Writes only where a sidecar or the rescheduler calls them.
const PV_PVC_VERBS: &[(&str, &str, &[&str])] = &[
    (
        NODE,
        "persistentvolumes",
        &["get", "list", "watch", "create", "delete", "patch"],
    ),
    (
        NODE,
        "persistentvolumeclaims",
        &["get", "list", "watch", "update"],
    ),
    (NODE, "persistentvolumeclaims/status", &[]),
    (
        CONTROLLER,
        "persistentvolumes",
        &["get", "list", "watch", "create", "delete", "patch"],
    ),
    (
        CONTROLLER,
        "persistentvolumeclaims",
        &["get", "list", "watch", "update"],
    ),
    (CONTROLLER, "persistentvolumeclaims/status", &["patch"]),
    (RESCHEDULER, "persistentvolumes", &["get", "list", "watch"]),
    (
        RESCHEDULER,
        "persistentvolumeclaims",
        &["get", "list", "watch", "patch"],
    ),
    (RESCHEDULER, "persistentvolumeclaims/status", &[]),
];

/// The base alone: (who, verb, resource, namespace or ALL, allowed).
const BASE_PROMISES: &[(&str, &str, &str, &str, bool)] = &[
    // No Secret of a tenant, and none cluster-wide.
    (NODE, "get", "secrets", "team-a", false),
    (NODE, "get", "secrets", ALL, false),
    (CONTROLLER, "get", "secrets", "team-a", false),
    (CONTROLLER, "get", "secrets", ALL, false),
    (RESCHEDULER, "get", "secrets", "team-a", false),
    (RESCHEDULER, "get", "secrets", NS, false),
    // The provisioner secrets and the peer token, by name, in the
    // driver's own namespace only; no other Secret there.
    (NODE, "get", "secrets", NS, false),
    (NODE, "get", "secrets=modelcache-credentials", NS, true),
    (NODE, "get", "secrets=modelcache-csi-peer-token", NS, true),
    (NODE, "get", "secrets=admin-token", NS, false),
    (NODE, "list", "secrets", NS, false),
    (CONTROLLER, "get", "secrets", NS, false),
    (
        CONTROLLER,
        "get",
        "secrets=modelcache-credentials",
        NS,
        true,
    ),
    (
        CONTROLLER,
        "get",
        "secrets=modelcache-csi-peer-token",
        NS,
        true,
    ),
    (CONTROLLER, "get", "secrets=admin-token", NS, false),
    (CONTROLLER, "watch", "secrets", NS, false),
    // Events: the sidecars write core events, the driver and rescheduler
    // events.k8s.io; nobody reads them.
    (NODE, "create", "events", "team-a", true),
    (NODE, "create", "events.events.k8s.io", "team-a", true),
    (NODE, "list", "events", ALL, false),
    (CONTROLLER, "patch", "events", "team-a", true),
    (CONTROLLER, "watch", "events", ALL, false),
    (
        RESCHEDULER,
        "create",
        "events.events.k8s.io",
        "team-a",
        true,
    ),
    (RESCHEDULER, "create", "events", "team-a", false),
    // Nothing to attach, nothing else to touch.
    (NODE, "list", "volumeattachments", ALL, false),
    (CONTROLLER, "list", "volumeattachments", ALL, false),
    (NODE, "get", "daemonsets.apps", NS, false),
    (NODE, "get", "pods", NS, true),
    (NODE, "get", "pods", "team-a", false),
    // Pods waiting for a PVC hear of its pull: found by listing.
    (NODE, "list", "pods", "team-a", true),
    (NODE, "watch", "pods", "team-a", false),
    (
        NODE,
        "create",
        "csistoragecapacities.storage.k8s.io",
        NS,
        true,
    ),
    (CONTROLLER, "list", "pods", ALL, true),
    (CONTROLLER, "update", "leases.coordination.k8s.io", NS, true),
    (NODE, "update", "leases.coordination.k8s.io", NS, false),
    // Peer fill: its Lease, the claims on pulls and the peer token's
    // Secret, in the driver's namespace only.
    (NODE, "patch", "leases.coordination.k8s.io", NS, true),
    (NODE, "patch", "leases.coordination.k8s.io", "team-a", false),
    (NODE, "delete", "leases.coordination.k8s.io", NS, true),
    (
        NODE,
        "delete",
        "leases.coordination.k8s.io",
        "team-a",
        false,
    ),
    // The peer token is the controller's to create, once; no node may
    // create a Secret (a service-account token among them).
    (NODE, "create", "secrets", NS, false),
    (NODE, "create", "secrets", "team-a", false),
    (NODE, "update", "secrets", NS, false),
    (CONTROLLER, "create", "secrets", NS, true),
    (CONTROLLER, "create", "secrets", "team-a", false),
    (CONTROLLER, "update", "secrets", NS, false),
    (RESCHEDULER, "update", "nodes", ALL, false),
    // Warm labels: the node patches Nodes (the admission policy narrows
    // that to its own, and to those labels), never updates or deletes one.
    (NODE, "patch", "nodes", ALL, true),
    (NODE, "update", "nodes", ALL, false),
    (NODE, "delete", "nodes", ALL, false),
    (NODE, "patch", "nodes/status", ALL, false),
    (CONTROLLER, "patch", "nodes", ALL, false),
    // A tenant with `edit` in team-a reads its own Secrets and claims,
    // nothing of the driver's and nothing of the cluster's.
    (TENANT, "get", "secrets", "team-a", true),
    (TENANT, "create", "persistentvolumeclaims", "team-a", true),
    (TENANT, "get", "secrets", NS, false),
    (TENANT, "get", "secrets", "team-b", false),
    (TENANT, "create", "pods", NS, false),
    (TENANT, "create", "serviceaccounts/token", NS, false),
    (
        TENANT,
        "create",
        "rolebindings.rbac.authorization.k8s.io",
        "team-a",
        false,
    ),
    (TENANT, "get", "persistentvolumes", ALL, false),
    // A node applies sealing classes to its own volumes: it reads the
    // class and records the outcome on the PV, which no tenant may write
    // (a forged "applied" would read as sealed).
    (
        NODE,
        "get",
        "volumeattributesclasses.storage.k8s.io",
        ALL,
        true,
    ),
    (
        NODE,
        "update",
        "volumeattributesclasses.storage.k8s.io",
        ALL,
        false,
    ),
    (TENANT, "patch", "persistentvolumes", ALL, false),
    // Prefetch: nodes read the declarations and write their status lines
    // only; declaring one is an admin's act.
    (
        NODE,
        "watch",
        "modelprefetches.modelcache.csi.io",
        ALL,
        true,
    ),
    (
        NODE,
        "patch",
        "modelprefetches.modelcache.csi.io/status",
        ALL,
        true,
    ),
    (
        NODE,
        "patch",
        "modelprefetches.modelcache.csi.io",
        ALL,
        false,
    ),
    (
        NODE,
        "create",
        "modelprefetches.modelcache.csi.io",
        ALL,
        false,
    ),
    (
        TENANT,
        "create",
        "modelprefetches.modelcache.csi.io",
        ALL,
        false,
    ),
    // The controller writes each declaration's summary, nothing else of it.
    (
        CONTROLLER,
        "watch",
        "modelprefetches.modelcache.csi.io",
        ALL,
        true,
    ),
    (
        CONTROLLER,
        "patch",
        "modelprefetches.modelcache.csi.io/status",
        ALL,
        true,
    ),
    (
        CONTROLLER,
        "patch",
        "modelprefetches.modelcache.csi.io",
        ALL,
        false,
    ),
];

/// With the component applied for team-a.
const GRANTED_PROMISES: &[(&str, &str, &str, &str, bool)] = &[
    // The default names one Secret, never the whole namespace.
    (NODE, "get", "secrets=modelcache-source", "team-a", true),
    (
        CONTROLLER,
        "get",
        "secrets=modelcache-source",
        "team-a",
        true,
    ),
    (NODE, "get", "secrets=admin-token", "team-a", false),
    (NODE, "get", "secrets", "team-a", false),
    (NODE, "list", "secrets", "team-a", false),
    (NODE, "get", "secrets", "team-b", false),
    (CONTROLLER, "get", "secrets", "team-b", false),
    (NODE, "get", "secrets", ALL, false),
    (RESCHEDULER, "get", "secrets", "team-a", false),
    (TENANT, "get", "secrets", NS, false),
];

fn identity(who: &str) -> String {
    match who {
        TENANT => TENANT.to_string(),
        sa => format!("system:serviceaccount:{NS}:{sa}"),
    }
}

/// `kubectl auth can-i` as `who`: "yes" or "no".
/// `resource` may be `kind/subresource`, or `kind=name` for one object.
fn can_i(api: &apiserver::ApiServer, who: &str, verb: &str, resource: &str, at: &str) -> bool {
    let named = resource.replacen('=', "/", 1);
    let (resource, sub) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(format!("--subresource={s}"))),
        None if resource.contains('=') => (named.as_str(), None),
        None => (resource, None),
    };
    let scope = match at {
        ALL => "--all-namespaces".to_string(),
        ns => format!("--namespace={ns}"),
    };
    let who = format!("--as={}", identity(who));
    let mut args = vec!["auth", "can-i", verb, resource, &scope, &who];
    args.extend(sub.as_deref());
    let out = api.kubectl(&args);
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => true,
        "no" => false,
        other => panic!(
            "kubectl {args:?}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Every row that does not hold, so one run reports them all.
fn broken(api: &apiserver::ApiServer, promises: &[(&str, &str, &str, &str, bool)]) -> Vec<String> {
    promises
        .iter()
        .filter(|(who, verb, res, at, may)| can_i(api, who, verb, res, at) != *may)
        .map(|(who, verb, res, at, may)| {
            format!(
                "{who} {} {verb} {res} in {at}",
                if *may { "cannot" } else { "can" }
            )
        })
        .collect()
}

/// `kubectl auth can-i --list` as `who` in namespace `ns`: the resources
/// it may touch there, cluster-wide rules included.
fn resources_listed(api: &apiserver::ApiServer, who: &str, ns: &str) -> Vec<String> {
    let out = kubectl_ok(
        api,
        &[
            "auth",
            "can-i",
            "--list",
            &format!("--namespace={ns}"),
            &format!("--as={}", identity(who)),
        ],
    );
    out.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

fn apply_tenant_grant(api: &apiserver::ApiServer, ns: &str) {
    let root = env!("CARGO_MANIFEST_DIR");
    let overlay = tempfile::tempdir().unwrap();
    // kustomize takes a component only by a relative path.
    let up = "../".repeat(overlay.path().components().count() - 1);
    let component = format!(
        "{up}{}/deploy/csi-driver/components/tenant-source-secrets",
        root.trim_start_matches('/')
    );
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {ns}\ncomponents:\n  - {component}\n"
        ),
    )
    .unwrap();
    let dir = overlay.path().to_str().unwrap();
    kubectl_ok(api, &["apply", "--dry-run=server", "-k", dir]);
    kubectl_ok(api, &["apply", "-k", dir]);
}

fn apply_yaml(api: &apiserver::ApiServer, yaml: &str) {
    let out = api.kubectl_stdin(&["apply", "-f", "-"], yaml);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Namespaces team-a and team-b, and user tenant-a with what the built-in
/// `edit` role aggregates (no controller-manager runs here to aggregate it)
/// in team-a only.
fn tenants(api: &apiserver::ApiServer) {
    apply_yaml(
        api,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-b}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: tenant-edit, namespace: team-a}\nsubjects: [{kind: User, name: tenant-a, apiGroup: rbac.authorization.k8s.io}]\nroleRef: {kind: ClusterRole, name: system:aggregate-to-edit, apiGroup: rbac.authorization.k8s.io}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: tenant-view, namespace: team-a}\nsubjects: [{kind: User, name: tenant-a, apiGroup: rbac.authorization.k8s.io}]\nroleRef: {kind: ClusterRole, name: system:aggregate-to-view, apiGroup: rbac.authorization.k8s.io}\n",
    );
}

/// RBAC lets the node plugin create and delete any PV (its
/// external-provisioner must); the shipped admission policy narrows that to
/// PVs of this driver, created for its own node.
#[test]
fn the_node_plugin_touches_only_its_drivers_pvs_on_its_own_node() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    kubectl_ok(&api, &["apply", "-k", &base]);
    let pv = |name: &str, source: &str, node: &str| {
        format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadOnlyMany]\n{source}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n        - matchExpressions:\n            - {{key: topology.modelcache.csi.io/node, operator: In, values: [{node}]}}\n"
        )
    };
    let ours = "  csi: {driver: modelcache.csi.io, volumeHandle: local-abc}";
    let host = "  hostPath: {path: /var/lib/kubelet/pki}";
    let other = "  csi: {driver: other.csi.io, volumeHandle: x}";
    // As the node plugin on node-a (its bound token's node name), or with
    // a token that carries none.
    let create = |yaml: &str, node: Option<&str>| {
        let who = format!("--as=system:serviceaccount:{NS}:{NODE}");
        let extra =
            node.map(|n| format!("--as-user-extra=authentication.kubernetes.io/node-name={n}"));
        let mut args = vec!["create", "--dry-run=server", "-f", "-", who.as_str()];
        args.extend(extra.as_deref());
        let out = api.kubectl_stdin(&args, yaml);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A policy takes a moment to be enforced after it is created.
    let start = std::time::Instant::now();
    while create(&pv("probe", host, "node-a"), Some("node-a")).0 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the admission policy never took effect"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for (yaml, node, ok, why) in [
        (pv("a", ours, "node-a"), Some("node-a"), true, ""),
        (
            pv("b", ours, "node-b"),
            Some("node-a"),
            false,
            "its own node",
        ),
        (
            pv("h", host, "node-a"),
            Some("node-a"),
            false,
            "of driver modelcache.csi.io",
        ),
        (
            pv("o", other, "node-a"),
            Some("node-a"),
            false,
            "of driver modelcache.csi.io",
        ),
        // A token that names no node (not a pod's bound token) writes
        // nothing.
        (pv("a2", ours, "node-b"), None, false, "bound token"),
        (pv("h2", host, "node-a"), None, false, "bound token"),
    ] {
        let (done, err) = create(&yaml, node);
        assert_eq!(done, ok, "{node:?}: {err}\n{yaml}");
        assert!(err.contains(why), "{err}");
    }
    // The admin is not narrowed by it.
    let out = api.kubectl_stdin(
        &["create", "--dry-run=server", "-f", "-"],
        &pv("h3", host, "x"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The steps of the security review's H-3, M-3 and M-4, run against the
/// real apiserver with the base applied, each as the account that would
/// take it: a node plugin (its bound token naming node-a) or the central
/// controller. Each is refused, by RBAC or by an admission policy, while
/// what each account must do still goes through.
#[test]
fn a_driver_account_reaches_nothing_beyond_its_own() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    kubectl_ok(&api, &["apply", "-k", &base]);
    tenants(&api);
    // As `sa` (with `node` as its bound token's node name): apply, create
    // or replace `yaml`, or run `args`, server-side.
    let run = |sa: &str, node: Option<&str>, args: &[&str], yaml: Option<&str>| {
        let who = format!("--as=system:serviceaccount:{NS}:{sa}");
        let extra =
            node.map(|n| format!("--as-user-extra=authentication.kubernetes.io/node-name={n}"));
        let mut all: Vec<&str> = args.to_vec();
        all.push(&who);
        all.extend(extra.as_deref());
        let out = match yaml {
            Some(y) => api.kubectl_stdin(&all, y),
            None => api.kubectl(&all),
        };
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let node = |args: &[&str], yaml: Option<&str>| run(NODE, Some("node-a"), args, yaml);
    let controller = |args: &[&str], yaml: Option<&str>| run(CONTROLLER, None, args, yaml);
    let create = ["create", "--dry-run=server", "-f", "-"];
    let replace = ["replace", "--dry-run=server", "-f", "-"];
    // The node patches PVs and Leases (RBAC grants it no update there).
    let patch = |kind: &str, name: &str, p: &str| {
        node(
            &[
                "-n",
                NS,
                "patch",
                kind,
                name,
                "--dry-run=server",
                "--type=merge",
                "-p",
                p,
            ],
            None,
        )
    };

    // What the admin made: a Secret that is not the peer token, a pending
    // claim of team-b, another node's PV, the resizer's leader Lease.
    // Created, not applied: `kubectl replace` below would rewrite an
    // applied object's last-applied annotation, which no provisioner does.
    let made = api.kubectl_stdin(
        &["create", "-f", "-"],
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: admin-token, namespace: {NS}}}\nstringData: {{token: admin}}\n---\n\
             apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: pending\n  namespace: team-b\n  annotations: {{modelcache.csi.io/source: 'hf://org/m', volume.kubernetes.io/selected-node: node-b}}\n  finalizers: [kubernetes.io/pvc-protection]\nspec: {{accessModes: [ReadOnlyMany], resources: {{requests: {{storage: 1Gi}}}}, storageClassName: modelcache-cache-local}}\n---\n\
             apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: unclaimed\n  namespace: team-b\nspec: {{accessModes: [ReadOnlyMany], resources: {{requests: {{storage: 1Gi}}}}, storageClassName: modelcache-cache-local}}\n---\n\
             apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: mine\n  namespace: team-b\n  annotations: {{volume.kubernetes.io/selected-node: node-a}}\nspec: {{accessModes: [ReadOnlyMany], resources: {{requests: {{storage: 1Gi}}}}, storageClassName: modelcache-cache-local}}\n---\n\
             apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: pv-node-b}}\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadOnlyMany]\n  csi: {{driver: modelcache.csi.io, volumeHandle: local-b}}\n  nodeAffinity: {{required: {{nodeSelectorTerms: [{{matchExpressions: [{{key: topology.modelcache.csi.io/node, operator: In, values: [node-b]}}]}}]}}}}\n---\n\
             apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: pv-node-a}}\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadOnlyMany]\n  csi: {{driver: modelcache.csi.io, volumeHandle: local-a}}\n  nodeAffinity: {{required: {{nodeSelectorTerms: [{{matchExpressions: [{{key: topology.modelcache.csi.io/node, operator: In, values: [node-a]}}]}}]}}}}\n---\n\
             apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: external-resizer-modelcache-csi-io, namespace: {NS}}}\nspec: {{holderIdentity: controller-0, leaseDurationSeconds: 15}}\n---\n\
             apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-peer-node-b, namespace: {NS}}}\nspec: {{holderIdentity: node-b, leaseDurationSeconds: 45}}\n---\n\
             apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-pull-mb, namespace: {NS}}}\nspec: {{holderIdentity: node-b, leaseDurationSeconds: 45}}\n"
        ),
    );
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // An object as the API holds it now, with `edit` applied to its JSON.
    let edited =
        |kind: &str, ns: Option<&str>, name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
            let mut args = vec!["get", kind, name, "-o", "json"];
            if let Some(ns) = ns {
                args.extend(["-n", ns]);
            }
            let mut v: serde_json::Value = serde_json::from_str(&kubectl_ok(&api, &args)).unwrap();
            edit(&mut v);
            v.to_string()
        };
    let sa_token_secret = |sa: &str| {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: mint\n  namespace: {NS}\n  annotations: {{kubernetes.io/service-account.name: {sa}}}\ntype: kubernetes.io/service-account-token\n"
        )
    };
    // A policy takes a moment to be enforced after it is created.
    let start = std::time::Instant::now();
    while patch(
        "pv",
        "pv-node-b",
        r#"{"metadata":{"annotations":{"probe":"x"}}}"#,
    )
    .0
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the admission policies never took effect"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    type Step<'a> = (&'a str, (bool, String), bool, &'a str);
    let steps: Vec<Step> = vec![
        // H-3: a token for another account, another Secret read.
        (
            "node mints a token for the controller's account",
            node(&create, Some(&sa_token_secret(CONTROLLER))),
            false,
            "forbidden",
        ),
        (
            "controller mints a token for itself",
            controller(&create, Some(&sa_token_secret(CONTROLLER))),
            false,
            "only create the peer token",
        ),
        (
            "controller creates another Secret",
            controller(
                &create,
                Some(&format!(
                    "apiVersion: v1\nkind: Secret\nmetadata: {{name: other, namespace: {NS}}}\nstringData: {{a: b}}\n"
                )),
            ),
            false,
            "only create the peer token",
        ),
        (
            "controller creates the peer token",
            controller(
                &create,
                Some(&format!(
                    "apiVersion: v1\nkind: Secret\nmetadata: {{name: modelcache-csi-peer-token, namespace: {NS}}}\ntype: Opaque\nstringData: {{token: 0123456789abcdef0123}}\n"
                )),
            ),
            true,
            "",
        ),
        (
            "node reads a Secret that is not the peer token",
            node(&["-n", NS, "get", "secret", "admin-token"], None),
            false,
            "forbidden",
        ),
        (
            "controller creates a hostPath PV",
            controller(
                &create,
                Some(
                    "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: h}\nspec:\n  capacity: {storage: 1Gi}\n  accessModes: [ReadWriteOnce]\n  hostPath: {path: /}\n",
                ),
            ),
            false,
            "of driver modelcache.csi.io",
        ),
        // M-3: another node's PV, a tenant's pending claim.
        (
            "node rebinds another node's PV",
            patch(
                "pv",
                "pv-node-b",
                r#"{"spec":{"claimRef":{"namespace":"team-a","name":"mine"}}}"#,
            ),
            false,
            "bound to its own node",
        ),
        (
            "node rebinds its own PV",
            patch(
                "pv",
                "pv-node-a",
                r#"{"spec":{"claimRef":{"namespace":"team-a","name":"mine"}}}"#,
            ),
            false,
            "never its spec",
        ),
        (
            "node annotates its own PV",
            patch(
                "pv",
                "pv-node-a",
                r#"{"metadata":{"annotations":{"modelcache.csi.io/applied":"x"}}}"#,
            ),
            true,
            "",
        ),
        (
            "node rewrites a pending claim's source",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "pending", &|v| {
                    v["metadata"]["annotations"]["modelcache.csi.io/source"] = "hf://evil/m".into()
                })),
            ),
            false,
            "never change another annotation",
        ),
        (
            "node forges shared-with consent",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "pending", &|v| {
                    v["metadata"]["annotations"]["modelcache.csi.io/shared-with"] = "*".into()
                })),
            ),
            false,
            "never change another annotation",
        ),
        (
            "node claims an unclaimed claim for itself (Immediate binding)",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "unclaimed", &|v| {
                    v["metadata"]["annotations"] =
                        serde_json::json!({"volume.kubernetes.io/selected-node": "node-a"})
                })),
            ),
            true,
            "",
        ),
        (
            "node claims an unclaimed claim for another node",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "unclaimed", &|v| {
                    v["metadata"]["annotations"] =
                        serde_json::json!({"volume.kubernetes.io/selected-node": "node-b"})
                })),
            ),
            false,
            "never change another annotation",
        ),
        (
            "node selects itself for a claim",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "pending", &|v| {
                    v["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] =
                        "node-a".into()
                })),
            ),
            false,
            "never change another annotation",
        ),
        (
            "node clears another node's claim's selected node",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "pending", &|v| {
                    v["metadata"]["annotations"]
                        .as_object_mut()
                        .unwrap()
                        .remove("volume.kubernetes.io/selected-node");
                })),
            ),
            false,
            "or clear its own claim",
        ),
        (
            "node clears its own claim's selected node",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "mine", &|v| {
                    v["metadata"]["annotations"]
                        .as_object_mut()
                        .unwrap()
                        .remove("volume.kubernetes.io/selected-node");
                })),
            ),
            true,
            "",
        ),
        (
            "node adds the clone-source finalizer",
            node(
                &replace,
                Some(&edited("pvc", Some("team-b"), "pending", &|v| {
                    v["metadata"]["finalizers"]
                        .as_array_mut()
                        .unwrap()
                        .push("provisioner.storage.kubernetes.io/cloning-protection".into())
                })),
            ),
            true,
            "",
        ),
        // M-4: Leases that are not this node's.
        (
            "node takes the resizer's leader Lease",
            patch(
                "lease",
                "external-resizer-modelcache-csi-io",
                r#"{"spec":{"holderIdentity":"node-a"}}"#,
            ),
            false,
            "only its own node's peer Lease",
        ),
        (
            "node rewrites another node's peer Lease",
            patch(
                "lease",
                "modelcache-peer-node-b",
                r#"{"metadata":{"annotations":{"modelcache.csi.io/peer-address":"10.0.0.66:7420"}}}"#,
            ),
            false,
            "Leases its own node holds",
        ),
        (
            "node deletes another node's claim",
            node(
                &[
                    "-n",
                    NS,
                    "delete",
                    "--dry-run=server",
                    "lease",
                    "modelcache-pull-mb",
                ],
                None,
            ),
            false,
            "Leases its own node holds",
        ),
        (
            "node publishes a second peer Lease, to be two peers",
            node(
                &create,
                Some(&format!(
                    "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-peer-node-z, namespace: {NS}}}\nspec: {{holderIdentity: node-a, leaseDurationSeconds: 45}}\n"
                )),
            ),
            false,
            "its own node's peer Lease",
        ),
        (
            "node publishes its own peer Lease",
            node(
                &create,
                Some(&format!(
                    "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-peer-node-a, namespace: {NS}}}\nspec: {{holderIdentity: node-a, leaseDurationSeconds: 45}}\n"
                )),
            ),
            true,
            "",
        ),
        (
            "node says it holds a model in another node's name",
            node(
                &create,
                Some(&format!(
                    "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-has-m0123456789abcdef0123456789abcde-node-b, namespace: {NS}}}\nspec: {{holderIdentity: node-a}}\n"
                )),
            ),
            false,
            "its own records",
        ),
        (
            "node publishes its own record of a model",
            node(
                &create,
                Some(&format!(
                    "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: modelcache-has-m0123456789abcdef0123456789abcde-node-a, namespace: {NS}}}\nspec: {{holderIdentity: node-a}}\n"
                )),
            ),
            true,
            "",
        ),
        (
            "node takes over a claim for itself",
            patch(
                "lease",
                "modelcache-pull-mb",
                r#"{"spec":{"holderIdentity":"node-a"}}"#,
            ),
            true,
            "",
        ),
    ];
    let wrong: Vec<String> = steps
        .iter()
        .filter(|(_, (ok, out), want, why)| ok != want || (!want && !out.contains(why)))
        .map(|(what, (ok, out), want, why)| {
            format!(
                "{what}: allowed {ok}, wanted {want} ({why}): {}",
                out.trim()
            )
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn rbac_is_least_privilege() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    kubectl_ok(&api, &["apply", "-k", &base]);
    tenants(&api);

    let mut wrong = Vec::new();
    for (who, resource, verbs) in PV_PVC_VERBS {
        let allowed: Vec<&str> = VERBS
            .into_iter()
            .filter(|v| can_i(&api, who, v, resource, ALL))
            .collect();
        let promised: Vec<&str> = VERBS.into_iter().filter(|v| verbs.contains(v)).collect();
        if allowed != promised {
            wrong.push(format!(
                "{who} on {resource}: {allowed:?}, promised {verbs:?}"
            ));
        }
    }
    wrong.extend(broken(&api, BASE_PROMISES));
    for who in [NODE, CONTROLLER, RESCHEDULER] {
        let listed = resources_listed(&api, who, "team-a");
        if listed.iter().any(|r| r.starts_with("secrets")) {
            wrong.push(format!("{who} may touch secrets in team-a: {listed:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "the base breaks its promises:\n{}",
        wrong.join("\n")
    );

    apply_tenant_grant(&api, "team-a");
    let mut wrong = broken(&api, GRANTED_PROMISES);
    for (who, ns, may) in [
        (NODE, "team-a", true),
        (NODE, "team-b", false),
        (CONTROLLER, "team-a", true),
        (RESCHEDULER, "team-a", false),
    ] {
        let listed = resources_listed(&api, who, ns);
        if listed.iter().any(|r| r.starts_with("secrets")) != may {
            wrong.push(format!(
                "{who} in {ns}: secrets listed {}: {listed:?}",
                !may
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "with the component for team-a:\n{}",
        wrong.join("\n")
    );
}

/// A kubeconfig for service account `sa`, with a TokenRequest token.
fn service_account_kubeconfig(
    api: &apiserver::ApiServer,
    sa: &str,
    dir: &Path,
) -> std::path::PathBuf {
    let token = kubectl_ok(api, &["-n", NS, "create", "token", sa, "--duration=1h"]);
    let path = dir.join(format!("{sa}.kubeconfig"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{}\", certificate-authority: \"{}\"}}\nusers:\n- name: {sa}\n  user: {{token: \"{}\"}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: {sa}}}\ncurrent-context: c\n",
            api.server(),
            api.ca_path().display(),
            token.trim()
        ),
    )
    .unwrap();
    path
}

fn events_on(api: &apiserver::ApiServer, ns: &str, pvc: &str) -> String {
    let selector = format!("regarding.name={pvc},type=Warning");
    for _ in 0..100 {
        let out = kubectl_ok(
            api,
            &[
                "-n",
                ns,
                "get",
                "events.events.k8s.io",
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={range .items[*]}{.reason}: {.note}{\"\\n\"}{end}",
            ],
        );
        if !out.trim().is_empty() {
            return out;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    String::new()
}

/// The driver, as the node plugin's service account with the base RBAC,
/// reads a PVC's source secret only where an admin applied the component;
/// elsewhere the PVC hears what to grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_secrets_need_the_tenant_grant() {
    use crate::support::harness::{Driver, READER, assert_code, create_req, write_model};
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    kubectl_ok(&api, &["apply", "-k", &base]);
    tenants(&api);
    apply_tenant_grant(&api, "team-a");
    let creds = tempfile::tempdir().unwrap();
    let kubeconfig = service_account_kubeconfig(&api, NODE, creds.path());
    let d = Driver::start_with(&[
        "--kube-api",
        "on",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ])
    .await;
    let model = d.dir.join("model");
    write_model(&model, 21);
    let source = format!("file://{}", model.display());

    for ns in ["team-a", "team-b"] {
        apply_yaml(
            &api,
            &format!(
                "apiVersion: v1\nkind: Secret\nmetadata: {{name: modelcache-source, namespace: {ns}}}\nstringData: {{httpBearerToken: x}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: model\n  namespace: {ns}\n  annotations: {{modelcache.csi.io/source-secret: modelcache-source}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n"
            ),
        );
    }
    let request = |name: &str, ns: &str| {
        create_req(
            name,
            &[
                ("csi.storage.k8s.io/pvc/name", "model"),
                ("csi.storage.k8s.io/pvc/namespace", ns),
                ("backend", "local"),
                ("source", &source),
            ],
            READER,
        )
    };

    // No grant in team-b: refused, and the PVC is told what to grant.
    let st = assert_code(
        d.create(request("pvc-b", "team-b")).await,
        tonic::Code::FailedPrecondition,
        "Secret team-b/modelcache-source",
    );
    for want in [
        "modelcache.csi.io/source-secret",
        "namespace team-b",
        "deploy/csi-driver/components/tenant-source-secrets",
        "system:serviceaccount:modelcache-csi:modelcache-csi-node",
    ] {
        assert!(
            st.message().contains(want),
            "{want:?} missing: {}",
            st.message()
        );
    }
    let events = events_on(&api, "team-b", "model");
    assert!(
        events.contains("PullFailed")
            && events.contains("Secret team-b/modelcache-source")
            && events.contains("tenant-source-secrets"),
        "no Warning event naming the grant on PVC team-b/model: {events:?}"
    );

    // Granted in team-a: the same request succeeds.
    let v = d
        .create(request("pvc-a", "team-a"))
        .await
        .expect("create with the source secret of team-a");
    assert_eq!(v.volume_context["model"], source);
}

/// deploy/csi-driver/base under another namespace (an overlay's
/// `namespace:`, as an admin renames it): every admission policy still
/// holds the driver's accounts, now named in that namespace, and nothing
/// in the rendered objects names the base's namespace. The policies once
/// named `system:serviceaccount:modelcache-csi:...`, so after a rename the
/// node plugin's account could create a hostPath PV.
#[test]
fn a_renamed_namespace_keeps_every_admission_policy_in_force() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let overlay = tempfile::tempdir().unwrap();
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    let ns = "models-system";
    // kustomize takes a base by relative path only: up to / from the
    // overlay, then down to the base.
    let up = "../".repeat(overlay.path().components().count() - 1);
    let base = format!("{up}{}", base.trim_start_matches('/'));
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {ns}\nresources:\n  - {base}\n"),
    )
    .unwrap();
    let rendered = kubectl_ok(&api, &["kustomize", overlay.path().to_str().unwrap()]);
    for stale in [
        format!("={NS}\n"),
        format!(":{NS}:"),
        format!("namespace: {NS}\n"),
    ] {
        assert!(
            !rendered.contains(&stale),
            "the renamed install still names {NS}: {stale:?}"
        );
    }
    kubectl_ok(&api, &["create", "namespace", ns]);
    let out = api.kubectl_stdin(&["apply", "-f", "-"], &rendered);
    assert!(out.status.success(), "{out:?}");
    let hostpath = "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: stolen}\nspec:\n  capacity: {storage: 1Gi}\n  accessModes: [ReadOnlyMany]\n  hostPath: {path: /var/lib/kubelet/pki}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n        - matchExpressions:\n            - {key: topology.modelcache.csi.io/node, operator: In, values: [node-a]}\n";
    let as_node = |yaml: &str| {
        let who = format!("--as=system:serviceaccount:{ns}:{NODE}");
        let out = api.kubectl_stdin(
            &[
                "create",
                "--dry-run=server",
                "-f",
                "-",
                &who,
                "--as-user-extra=authentication.kubernetes.io/node-name=node-a",
            ],
            yaml,
        );
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // RBAC lets the renamed node account create PVs; only the policy, once
    // enforced, stops a hostPath one.
    let start = std::time::Instant::now();
    let (mut done, mut err) = as_node(hostpath);
    while done {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the node plugin's account in {ns} created a hostPath PV: no policy holds it"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
        (done, err) = as_node(hostpath);
    }
    assert!(err.contains("of driver modelcache.csi.io"), "{err}");
    // The peer token is the one Secret the renamed accounts may create.
    let secret = "apiVersion: v1\nkind: Secret\nmetadata: {name: other}\ntype: Opaque\n";
    let out = api.kubectl_stdin(
        &[
            "-n",
            ns,
            "create",
            "--dry-run=server",
            "-f",
            "-",
            &format!("--as=system:serviceaccount:{ns}:modelcache-csi-controller"),
        ],
        secret,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may only create the peer token"),
        "{err}"
    );
}

/// RBAC lets the node plugin patch any Node (it labels its own warm); the
/// shipped admission policy narrows that to its own Node's
/// `warm.modelcache.csi.io/` labels, set to "true" or removed.
#[test]
fn the_node_plugin_labels_only_its_own_node_and_only_warm() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let base = format!("{}/deploy/csi-driver/base", env!("CARGO_MANIFEST_DIR"));
    kubectl_ok(&api, &["apply", "-f", &format!("{base}/namespace.yaml")]);
    kubectl_ok(&api, &["apply", "-k", &base]);
    for n in ["node-a", "node-b"] {
        let out = api.kubectl_stdin(
            &["create", "-f", "-"],
            &format!(
                "apiVersion: v1\nkind: Node\nmetadata:\n  name: {n}\n  labels: {{pool: gpu, warm.modelcache.csi.io/old: 'true'}}\n  annotations: {{note: admin}}\n"
            ),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // As the node plugin on node-a (or with a token naming no node).
    let patch = |node: &str, as_node: Option<&str>, p: &str| {
        let who = format!("--as=system:serviceaccount:{NS}:{NODE}");
        let extra =
            as_node.map(|n| format!("--as-user-extra=authentication.kubernetes.io/node-name={n}"));
        let mut args = vec![
            "patch",
            "node",
            node,
            "--dry-run=server",
            "--type=merge",
            "-p",
            p,
            who.as_str(),
        ];
        args.extend(extra.as_deref());
        let out = api.kubectl(&args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let warm = r#"{"metadata":{"labels":{"warm.modelcache.csi.io/llama":"true"}}}"#;
    // A policy takes a moment to be enforced after it is created.
    let start = std::time::Instant::now();
    while patch("node-b", Some("node-a"), warm).0 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the admission policy never took effect"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for (node, as_node, p, ok, why) in [
        ("node-a", Some("node-a"), warm, true, ""),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"labels":{"warm.modelcache.csi.io/old":null}}}"#,
            true,
            "",
        ),
        ("node-b", Some("node-a"), warm, false, "its own Node"),
        ("node-a", None, warm, false, "bound token"),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"labels":{"warm.modelcache.csi.io/llama":"false"}}}"#,
            false,
            "warm labels",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"labels":{"pool":"cpu"}}}"#,
            false,
            "never change another label",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"labels":{"pool":null}}}"#,
            false,
            "never change another label",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"labels":{"node-role.kubernetes.io/control-plane":""}}}"#,
            false,
            "never change another label",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"metadata":{"annotations":{"note":"mine"}}}"#,
            false,
            "annotations",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"spec":{"unschedulable":true}}"#,
            false,
            "spec",
        ),
        (
            "node-a",
            Some("node-a"),
            r#"{"spec":{"taints":[{"key":"k","effect":"NoSchedule"}]}}"#,
            false,
            "spec",
        ),
    ] {
        let (done, err) = patch(node, as_node, p);
        assert_eq!(done, ok, "{node} as {as_node:?}: {p}: {err}");
        assert!(err.contains(why), "{p}: {err}");
    }
}
