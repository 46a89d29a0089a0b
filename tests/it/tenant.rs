//! The tenant trust boundary (docs/security.md) against a real
//! kube-apiserver: PVCs written by a namespace user (RBAC `edit` in one
//! namespace) with hostile `modelcache.csi.io/source` annotations. Each is
//! refused with a reason on the PVC, no connection reaches a closed address,
//! no credential of the admin's follows a tenant's URI, a cached model is
//! served only to a tenant who can read it at its origin, and another
//! endpoint can never seal bytes under a real model's key.

use crate::support::apiserver;
use crate::support::fixtures;

use std::collections::HashMap;
use std::time::Duration;

use crate::support::harness::*;
use fixtures::{FileServer, HUB_REPO, HubServer, RegistryServer};
use modelcache_csi::csi::CreateVolumeRequest;
use tonic::Code;

const ANNOTATION: &str = "modelcache.csi.io/source";

struct Cluster {
    api: apiserver::ApiServer,
}

impl Cluster {
    fn admin(&self, yaml: &str) {
        let out = self.api.kubectl_stdin(&["apply", "-f", "-"], yaml);
        assert!(
            out.status.success(),
            "kubectl apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A PVC written by the tenant identity itself, as a namespace user would.
    fn tenant_pvc(&self, ns: &str, name: &str, annotations: &[(&str, &str)]) {
        let ann: Vec<String> = annotations
            .iter()
            .map(|(k, v)| format!("    {k}: {v:?}"))
            .collect();
        let yaml = format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: {ns}\n  annotations:\n{}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n",
            ann.join("\n")
        );
        let out = self
            .api
            .kubectl_stdin(&["--context", "tenant", "apply", "-f", "-"], &yaml);
        assert!(
            out.status.success(),
            "the tenant could not create PVC {ns}/{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The notes of Warning events on a PVC, waited for briefly (events are
    /// posted asynchronously).
    async fn warnings(&self, ns: &str, pvc: &str) -> String {
        for _ in 0..50 {
            let out = self.api.kubectl(&[
                "-n",
                ns,
                "get",
                "events.events.k8s.io",
                "--field-selector",
                &format!("regarding.name={pvc},type=Warning"),
                "-o",
                "jsonpath={.items[*].note}",
            ]);
            let notes = String::from_utf8_lossy(&out.stdout).into_owned();
            if !notes.is_empty() {
                return notes;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        String::new()
    }
}

fn request(
    name: &str,
    ns: &str,
    pvc: &str,
    params: &[(&str, &str)],
    secrets: &[(&str, &str)],
) -> CreateVolumeRequest {
    let mut all = vec![
        ("csi.storage.k8s.io/pvc/name", pvc),
        ("csi.storage.k8s.io/pvc/namespace", ns),
        ("backend", "local"),
    ];
    all.extend_from_slice(params);
    let mut r = create_req(name, &all, READER);
    r.secrets = secrets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect::<HashMap<_, _>>();
    r
}

fn authorizations(reqs: &[fixtures::Request]) -> Vec<String> {
    reqs.iter()
        .filter_map(|r| r.header("authorization").map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_reach_only_what_the_class_allows() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let kubeconfig = api.kubeconfig_path();
    let c = Cluster { api };
    // The tenant may edit team-a only, as a namespace user. (The built-in
    // `edit` role is filled by kube-controller-manager's aggregation, which
    // does not run here, so the same rights are spelled out.)
    c.admin(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team-a}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-b}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: tenant-edit, namespace: team-a}\nrules:\n  - apiGroups: [\"\"]\n    resources: [persistentvolumeclaims, pods, secrets, configmaps]\n    verbs: [get, list, watch, create, update, patch, delete]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: tenant-edit, namespace: team-a}\nsubjects: [{kind: User, name: tenant, apiGroup: rbac.authorization.k8s.io}]\nroleRef: {kind: Role, name: tenant-edit, apiGroup: rbac.authorization.k8s.io}\n",
    );
    let out = c.api.kubectl(&[
        "--context",
        "tenant",
        "auth",
        "can-i",
        "create",
        "persistentvolumeclaims",
        "-n",
        "team-b",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "no",
        "the tenant must be confined to team-a"
    );

    // The admin's credentials, in the driver's environment.
    let d = Driver::start_with_env(
        &[
            "--kube-api",
            "on",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        &[
            ("AWS_ACCESS_KEY_ID", "ENVKEYADMIN"),
            ("AWS_SECRET_ACCESS_KEY", "envsecretadmin"),
            ("HF_TOKEN", "envtokenadmin"),
        ],
    )
    .await;

    // Origins on loopback: the model server, one it redirects to, a Hub.
    let files = d.dir.join("served");
    let model = write_model(&files.join("m"), 21);
    let origin = FileServer::start(&files).await;
    let elsewhere = FileServer::start(&files).await;
    let hub_dir = d.dir.join("hub");
    let hub_model = write_model(&hub_dir, 22);
    let hub = HubServer::start(&hub_dir).await;
    let origin_host = origin.base().trim_start_matches("http://").to_string();

    // 1. Without allowedSources, a PVC may not name a source at all.
    c.tenant_pvc("team-a", "plain", &[(ANNOTATION, "hf://org/repo")]);
    let r = d
        .create(request("v-plain", "team-a", "plain", &[], &[]))
        .await;
    let s = assert_code(r, Code::InvalidArgument, "allowedSources");
    assert!(s.message().contains(ANNOTATION), "{}", s.message());
    let w = c.warnings("team-a", "plain").await;
    assert!(w.contains("allowedSources"), "no event on the PVC: {w:?}");

    // 2. Host files, other namespaces' claims and other schemes stay out of
    // reach of a class that allows only network sources.
    let class = [("allowedSources", "hf://,s3://models/,http://,https://")];
    for (i, uri) in [
        "file:///var/lib/kubelet/pki",
        "file:///var/run/secrets/kubernetes.io/serviceaccount",
        "pvc://team-b:weights",
        "pvc://weights/../x",
        "model-registry://m/1",
    ]
    .iter()
    .enumerate()
    {
        let pvc = format!("outside-{i}");
        c.tenant_pvc("team-a", &pvc, &[(ANNOTATION, uri)]);
        let r = d
            .create(request(&format!("v-out-{i}"), "team-a", &pvc, &class, &[]))
            .await;
        let s = r.expect_err(&format!("{uri} was accepted"));
        assert!(
            matches!(s.code(), Code::PermissionDenied | Code::InvalidArgument),
            "{uri}: {s:?}"
        );
        let w = c.warnings("team-a", &pvc).await;
        assert!(w.contains(ANNOTATION), "{uri}: no event: {w:?}");
    }

    // A secret reference is an object name, never a path into the API.
    c.tenant_pvc(
        "team-a",
        "secret-path",
        &[
            (ANNOTATION, "hf://org/repo"),
            (
                "modelcache.csi.io/source-secret",
                "../../../kube-system/secrets/admin",
            ),
        ],
    );
    let r = d
        .create(request(
            "v-secret-path",
            "team-a",
            "secret-path",
            &class,
            &[],
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "is not a Secret name");

    // 3. No SSRF: loopback by address and by name, link-local (cloud
    // metadata) — no request reaches them.
    for (i, uri) in [
        origin.url("m/config.json"),
        origin
            .url("m/config.json")
            .replace("127.0.0.1", "localhost"),
        "http://169.254.169.254/latest/meta-data/iam/config.json".to_string(),
        "http://[::ffff:127.0.0.1]:1/config.json".to_string(),
    ]
    .iter()
    .enumerate()
    {
        let pvc = format!("ssrf-{i}");
        c.tenant_pvc("team-a", &pvc, &[(ANNOTATION, uri)]);
        let r = d
            .create(request(&format!("v-ssrf-{i}"), "team-a", &pvc, &class, &[]))
            .await;
        let s = assert_code(r, Code::PermissionDenied, "reach it");
        assert!(
            s.message().contains("loopback") || s.message().contains("link-local"),
            "{uri}: {}",
            s.message()
        );
        let w = c.warnings("team-a", &pvc).await;
        assert!(w.contains("reach it"), "{uri}: no event: {w:?}");
    }
    assert!(
        origin.requests().is_empty(),
        "a request reached loopback: {:?}",
        origin.requests()
    );

    // 4. A class that names the origin explicitly admits it, and the pull
    // works through the egress guard.
    let named = format!("http://{origin_host}/m/");
    let named_class = [("allowedSources", named.as_str())];
    c.tenant_pvc(
        "team-a",
        "named",
        &[(ANNOTATION, &origin.url("m/config.json"))],
    );
    let v = d
        .create(request("v-named", "team-a", "named", &named_class, &[]))
        .await
        .expect("an origin the class names is reachable");
    let (staging, target) = (d.staging("named"), d.target("named"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let config = &model
        .files
        .iter()
        .find(|(p, _)| p == "config.json")
        .unwrap()
        .1;
    assert_eq!(&std::fs::read(target.join("config.json")).unwrap(), config);
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();

    // ... but not what it redirects to, nor what its manifest names.
    origin.redirect("m/moved.json", &elsewhere.url("m/config.json"));
    origin.put(
        "m/list.json",
        serde_json::to_vec(&serde_json::json!({"files": [
            {"path": "config.json", "url": elsewhere.url("m/config.json")}
        ]}))
        .unwrap(),
    );
    for (i, uri) in [
        origin.url("m/moved.json"),
        format!("{}#manifest", origin.url("m/list.json")),
    ]
    .iter()
    .enumerate()
    {
        let pvc = format!("follow-{i}");
        c.tenant_pvc("team-a", &pvc, &[(ANNOTATION, uri)]);
        let r = d
            .create(request(
                &format!("v-follow-{i}"),
                "team-a",
                &pvc,
                &named_class,
                &[],
            ))
            .await;
        assert_code(r, Code::PermissionDenied, "loopback");
    }
    assert!(
        elsewhere.requests().is_empty(),
        "a redirect or manifest entry reached a closed address: {:?}",
        elsewhere.requests()
    );

    // 5. A registry's artifact URI is checked against the class too.
    let registry = RegistryServer::start("bert", &[("v1", "file:///etc")]).await;
    c.tenant_pvc(
        "team-a",
        "registry",
        &[(ANNOTATION, "model-registry://bert/v1")],
    );
    let reg_url = registry.url();
    let r = d
        .create(request(
            "v-registry",
            "team-a",
            "registry",
            &[
                ("allowedSources", "model-registry://,hf://"),
                ("modelRegistryURL", &reg_url),
            ],
            &[],
        ))
        .await;
    let s = assert_code(r, Code::PermissionDenied, "artifact URI");
    assert!(!s.message().contains("/etc/"), "{}", s.message());

    // 6. The admin's credentials never follow a tenant's URI: not the
    // class's secret, not the driver's environment.
    let class_secrets = [
        ("httpBearerToken", "CLASSTOKEN"),
        ("awsAccessKeyID", "CLASSKEYADMIN"),
        ("awsSecretAccessKey", "classsecret"),
    ];
    let before = origin.requests().len();
    c.tenant_pvc(
        "team-a",
        "creds-http",
        &[(ANNOTATION, &origin.url("m/model.safetensors"))],
    );
    d.create(request(
        "v-creds-http",
        "team-a",
        "creds-http",
        &named_class,
        &class_secrets,
    ))
    .await
    .expect("tenant pull over http");
    let seen = authorizations(&origin.requests()[before..]);
    assert!(
        seen.is_empty(),
        "credentials reached a tenant's origin: {seen:?}"
    );
    // The class's own source does carry the class's token, so the check
    // above can see one.
    c.admin(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: admin-choice, namespace: team-a}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {requests: {storage: 1Gi}}\n",
    );
    let before = origin.requests().len();
    d.create(request(
        "v-admin-http",
        "team-a",
        "admin-choice",
        &[("source", &origin.url("m/tokenizer/vocab/vocab.txt"))],
        &class_secrets,
    ))
    .await
    .expect("the admin's own source");
    let seen = authorizations(&origin.requests()[before..]);
    assert!(
        seen.iter().any(|a| a.contains("CLASSTOKEN")),
        "the control case sent no token: {seen:?}"
    );

    // S3: unsigned for a tenant, signed with the class's key for the admin.
    let s3 = FileServer::start(d.dir.join("empty")).await;
    let s3_class = [
        ("allowedSources", "s3://models/"),
        ("s3Endpoint", &s3.base() as &str),
    ];
    c.tenant_pvc("team-a", "creds-s3", &[(ANNOTATION, "s3://models/bert")]);
    let _ = d
        .create(request(
            "v-creds-s3",
            "team-a",
            "creds-s3",
            &s3_class,
            &class_secrets,
        ))
        .await;
    let seen = authorizations(&s3.requests());
    assert!(!s3.requests().is_empty(), "the S3 request never arrived");
    assert!(
        seen.is_empty(),
        "a tenant's S3 request was signed: {seen:?}"
    );
    let _ = d
        .create(request(
            "v-admin-s3",
            "team-a",
            "admin-choice",
            &[("source", "s3://models/bert"), ("s3Endpoint", &s3.base())],
            &class_secrets,
        ))
        .await;
    let seen = authorizations(&s3.requests());
    assert!(
        seen.iter().any(|a| a.contains("CLASSKEYADMIN")),
        "the control case was not signed with the class key: {seen:?}"
    );

    // Hugging Face: the driver's HF_TOKEN never goes with a tenant's pull.
    let hub_uri = format!("hf://{HUB_REPO}");
    let hub_class = [
        ("allowedSources", "hf://"),
        ("hfEndpoint", &hub.endpoint() as &str),
    ];
    c.tenant_pvc("team-a", "creds-hf", &[(ANNOTATION, &hub_uri)]);
    let v = d
        .create(request("v-creds-hf", "team-a", "creds-hf", &hub_class, &[]))
        .await
        .expect("tenant pull from the Hub");
    let seen = authorizations(&hub.requests());
    assert!(
        seen.is_empty(),
        "the driver's HF_TOKEN reached the Hub: {seen:?}"
    );
    let hub_sid = v.volume_context["source"].clone();
    let n = hub.requests().len();
    d.create(request(
        "v-admin-hf",
        "team-a",
        "admin-choice",
        &[("source", &hub_uri), ("hfEndpoint", &hub.endpoint())],
        &[],
    ))
    .await
    .expect("the admin's own Hub source");
    let seen = authorizations(&hub.requests()[n..]);
    assert!(
        seen.iter().any(|a| a.contains("envtokenadmin")),
        "the control case sent no HF_TOKEN: {seen:?}"
    );

    // 7. A cache hit is authorised: a gated copy is served only to a
    // tenant whose own token the origin accepts.
    let gated_dir = d.dir.join("gated");
    write_model(&gated_dir, 23);
    let gated = HubServer::start(&gated_dir).await;
    gated.gate("good");
    let gated_class = [
        ("allowedSources", "hf://"),
        ("hfEndpoint", &gated.endpoint() as &str),
    ];
    c.admin(
        "apiVersion: v1\nkind: Secret\nmetadata: {name: hf, namespace: team-a}\nstringData: {hfToken: good}\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: hf, namespace: team-b}\nstringData: {hfToken: stolen-guess}\n",
    );
    c.tenant_pvc(
        "team-a",
        "gated-ok",
        &[
            (ANNOTATION, &hub_uri),
            ("modelcache.csi.io/source-secret", "hf"),
        ],
    );
    let first = d
        .create(request(
            "v-gated-ok",
            "team-a",
            "gated-ok",
            &gated_class,
            &[],
        ))
        .await
        .expect("the token holder pulls the gated model");
    // The tries below are hits of the sealed copy (the create may answer
    // before the seal).
    d.wait_sealed(&[&first.volume_context["source"]], SEAL_BOUND)
        .await;
    c.admin(&format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: gated-b\n  namespace: team-b\n  annotations: {{{ANNOTATION}: \"{hub_uri}\", modelcache.csi.io/source-secret: hf}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: gated-none\n  namespace: team-b\n  annotations: {{{ANNOTATION}: \"{hub_uri}\"}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n"
    ));
    for pvc in ["gated-b", "gated-none"] {
        let r = d
            .create(request(
                &format!("v-{pvc}"),
                "team-b",
                pvc,
                &gated_class,
                &[],
            ))
            .await;
        assert_code(r, Code::FailedPrecondition, "gated repo");
    }

    // 8. The cache key holds the endpoint: another Hub answering for the
    // same repo at the same commit seals its own copy, never the first's.
    assert_ne!(
        first.volume_context["source"], hub_sid,
        "two endpoints' bytes share one cache key"
    );
    let _ = hub_model;
}
