//! Signed models (OpenSSF model signing): models are signed here, at test
//! time, by the real `model_signing` CLI (pinned; installed by
//! tests/scripts/deps/model-signing.sh) with keys and certificates openssl
//! makes. A class with `modelSignature` seals only what its policy
//! accepts and says why it refuses the rest; the signer shows in the
//! volume context and `cache ls`/`show`; a model sealed under another
//! policy (or none) is judged by the asking class from its seal, without
//! fetching the weights again.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::support::fixtures::{HUB_REPO, HUB_SHA, HubServer};
use crate::support::harness::*;
use modelcache_csi::csi::Volume;
use serde_json::Value;
use tonic::Code;

/// The pinned CLI, installed once per run.
fn model_signing() -> &'static Path {
    static CLI: OnceLock<PathBuf> = OnceLock::new();
    CLI.get_or_init(|| {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/model-signing.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run tests/scripts/deps/model-signing.sh");
        assert!(out.status.success(), "{} failed", script.display());
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

#[track_caller]
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn openssl(dir: &Path, args: &[&str]) -> String {
    run(Command::new("openssl").current_dir(dir).args(args))
}

/// An EC key pair made by openssl: (private key path, public key PEM).
fn key_pair(dir: &Path, name: &str, curve: &str) -> (PathBuf, String) {
    let private = dir.join(format!("{name}.key"));
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            curve,
            "-genkey",
            "-noout",
            "-out",
            &path_str(&private),
        ],
    );
    let public = openssl(dir, &["ec", "-in", &path_str(&private), "-pubout"]);
    (private, public)
}

/// What the driver names a key signer: the digest of its
/// SubjectPublicKeyInfo, as openssl computes it.
fn key_signer(dir: &Path, public_pem: &str) -> String {
    let pem = dir.join("fp.pem");
    fs::write(&pem, public_pem).unwrap();
    let der = dir.join("fp.der");
    openssl(
        dir,
        &[
            "pkey",
            "-pubin",
            "-in",
            &path_str(&pem),
            "-outform",
            "DER",
            "-out",
            &path_str(&der),
        ],
    );
    format!("key sha256:{}", crate::support::fixtures::sha256_file(&der))
}

/// A private CA (root, signing intermediate) and a code-signing leaf
/// under it: (root PEM, leaf key, leaf certificate, intermediate).
struct Pki {
    root: String,
    leaf_key: PathBuf,
    leaf: PathBuf,
    intermediate: PathBuf,
}

fn pki(dir: &Path, name: &str) -> Pki {
    let ext = dir.join("ext.cnf");
    fs::write(
        &ext,
        "[int]\nbasicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign\n\
         [leaf]\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n\
         extendedKeyUsage=codeSigning\nsubjectAltName=email:release@example.com\n",
    )
    .unwrap();
    let f = |s: &str| path_str(&dir.join(format!("{name}-{s}")));
    let (root_key, _) = key_pair(dir, &format!("{name}-root"), "secp384r1");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &path_str(&root_key),
            "-subj",
            &format!("/CN={name} Root CA"),
            "-days",
            "30",
            "-out",
            &f("root.pem"),
        ],
    );
    let (int_key, _) = key_pair(dir, &format!("{name}-int"), "prime256v1");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &path_str(&int_key),
            "-subj",
            &format!("/CN={name} Signing CA"),
            "-out",
            &f("int.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &f("int.csr"),
            "-CA",
            &f("root.pem"),
            "-CAkey",
            &path_str(&root_key),
            "-CAcreateserial",
            "-days",
            "30",
            "-extfile",
            &path_str(&ext),
            "-extensions",
            "int",
            "-out",
            &f("int.pem"),
        ],
    );
    let (leaf_key, _) = key_pair(dir, &format!("{name}-leaf"), "prime256v1");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &path_str(&leaf_key),
            "-subj",
            "/CN=release-bot",
            "-out",
            &f("leaf.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &f("leaf.csr"),
            "-CA",
            &f("int.pem"),
            "-CAkey",
            &path_str(&int_key),
            "-CAcreateserial",
            "-days",
            "30",
            "-extfile",
            &path_str(&ext),
            "-extensions",
            "leaf",
            "-out",
            &f("leaf.pem"),
        ],
    );
    Pki {
        root: fs::read_to_string(f("root.pem")).unwrap(),
        leaf_key,
        leaf: f("leaf.pem").into(),
        intermediate: f("int.pem").into(),
    }
}

/// `model_signing sign key`, the signature at `model/model.sig`.
fn sign_with_key(model: &Path, private: &Path) {
    run(Command::new(model_signing()).args([
        "sign",
        "key",
        &path_str(model),
        "--private_key",
        &path_str(private),
        "--signature",
        &path_str(&model.join("model.sig")),
    ]));
}

/// `model_signing sign certificate`, the signature at `model/model.sig`.
fn sign_with_certificate(model: &Path, pki: &Pki) {
    run(Command::new(model_signing()).args([
        "sign",
        "certificate",
        &path_str(model),
        "--private_key",
        &path_str(&pki.leaf_key),
        "--signing_certificate",
        &path_str(&pki.leaf),
        "--certificate_chain",
        &path_str(&pki.intermediate),
        "--signature",
        &path_str(&model.join("model.sig")),
    ]));
}

fn file_uri(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

async fn create(d: &Driver, name: &str, params: &[(&str, &str)]) -> Result<Volume, tonic::Status> {
    let mut all = vec![("backend", "local")];
    all.extend_from_slice(params);
    d.create(create_req(name, &all, READER)).await
}

/// CreateVolume of the model in `dir` under a class with
/// `modelSignature: mode` and `trust` (its parameter and value).
async fn create_under(
    d: &Driver,
    name: &str,
    dir: &Path,
    mode: &str,
    trust: (&str, &str),
) -> Result<Volume, tonic::Status> {
    let source = file_uri(dir);
    create(
        d,
        name,
        &[("source", &source), ("modelSignature", mode), trust],
    )
    .await
}

/// `create` with parameter values built at run time.
async fn create_owned(
    d: &Driver,
    name: &str,
    params: &[(&str, String)],
) -> Result<Volume, tonic::Status> {
    let params: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
    create(d, name, &params).await
}

/// Where a test keeps the keys and certificates it makes.
fn keys_dir(under: &Path) -> PathBuf {
    let keys = under.join("keys");
    fs::create_dir_all(&keys).unwrap();
    keys
}

#[track_caller]
fn created(r: Result<Volume, tonic::Status>) -> Volume {
    r.unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()))
}

fn signed_by(v: &Volume) -> Option<&str> {
    v.volume_context.get("signedBy").map(String::as_str)
}

#[tokio::test]
async fn models_signed_by_the_cli_seal_under_a_key_or_a_certificate_and_say_who_signed() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);

    // A key signature, P-384 as `model_signing sign key` accepts it.
    let (private, public) = key_pair(&keys, "publisher", "secp384r1");
    let by_key = d.dir.join("by-key");
    let model = write_model(&by_key, 1);
    sign_with_key(&by_key, &private);
    let v = created(
        create_under(
            &d,
            "pvc-key",
            &by_key,
            "required",
            ("signaturePublicKey", &public),
        )
        .await,
    );
    let signer = key_signer(&keys, &public);
    assert_eq!(
        signed_by(&v),
        Some(signer.as_str()),
        "{:?}",
        v.volume_context
    );
    // The pod reads the model, with its signature beside it (the CLI's
    // `verify` can check it there again).
    let staging = d.staging("pvc-key");
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    let target = d.target("pvc-key");
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert_model(&target, &model);
    assert!(target.join("model.sig").is_file());

    // A certificate under a private CA: the class trusts the root.
    let ca = pki(&keys, "example");
    let by_cert = d.dir.join("by-cert");
    write_model(&by_cert, 2);
    sign_with_certificate(&by_cert, &ca);
    let v = created(
        create_under(
            &d,
            "pvc-cert",
            &by_cert,
            "required",
            ("signatureCertificateChain", &ca.root),
        )
        .await,
    );
    let who = signed_by(&v).unwrap_or_default();
    assert!(
        who.starts_with("certificate \"CN=release-bot\" <release@example.com> issued by \"CN=example Signing CA\""),
        "{who}"
    );

    // Optional: an unsigned model seals, recorded as unsigned; a class
    // without the parameters never looks.
    let unsigned = d.dir.join("unsigned");
    write_model(&unsigned, 3);
    let v = created(
        create_under(
            &d,
            "pvc-optional",
            &unsigned,
            "optional",
            ("signaturePublicKey", &public),
        )
        .await,
    );
    assert_eq!(signed_by(&v), None);
    let plain = d.dir.join("plain");
    write_model(&plain, 4);
    let v = created(create(&d, "pvc-plain", &[("source", &file_uri(&plain))]).await);
    assert_eq!(signed_by(&v), None);

    // The operator sees who signed each sealed model. The plain class
    // answered once its model was verified; its seal follows (the signed
    // ones answered sealed).
    let models = d
        .wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    assert_eq!(models.len(), 4, "{models:#?}");
    let signers = |origin: &Path| -> Value {
        models
            .iter()
            .find(|m| m["origin"] == file_uri(origin).as_str())
            .map(|m| m["signed_by"].clone())
            .unwrap_or_else(|| panic!("{} is not sealed: {models:#?}", origin.display()))
    };
    assert_eq!(signers(&by_key), serde_json::json!([signer]));
    assert_eq!(signers(&by_cert).as_array().unwrap().len(), 1);
    assert_eq!(signers(&unsigned), serde_json::json!([]));
    let id = models
        .iter()
        .find(|m| m["origin"] == file_uri(&by_key).as_str())
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let shown = d.cli(&["show", &id]);
    assert!(shown.ok, "{}{}", shown.stdout, shown.stderr);
    let shown = shown.stdout;
    assert!(shown.contains(&format!("Signed by: {signer}")), "{shown}");
}

#[tokio::test]
async fn changed_added_removed_files_and_foreign_signatures_are_refused_and_nothing_is_sealed() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "prime256v1");
    let (other_private, _) = key_pair(&keys, "someone-else", "prime256v1");
    let ca = pki(&keys, "example");
    let stranger = pki(&keys, "stranger");

    // Each case: a model signed by the publisher, then changed as named.
    let signed = |name: &str, seed: u64| -> PathBuf {
        let dir = d.dir.join(name);
        write_model(&dir, seed);
        sign_with_key(&dir, &private);
        dir
    };
    let changed = signed("changed", 10);
    fs::write(changed.join("config.json"), b"{\"hidden_size\": 1}\n").unwrap();
    let added = signed("added", 11);
    fs::write(added.join("extra.pkl"), b"cos\nsystem\n").unwrap();
    let removed = signed("removed", 12);
    fs::remove_file(removed.join("tokenizer/vocab/vocab.txt")).unwrap();
    let edited = signed("edited", 13);
    edit_payload(&edited.join("model.sig"), "config.json");
    let foreign = d.dir.join("foreign");
    write_model(&foreign, 14);
    sign_with_key(&foreign, &other_private);
    let missing = d.dir.join("missing");
    write_model(&missing, 15);
    let untrusted = d.dir.join("untrusted-ca");
    write_model(&untrusted, 16);
    sign_with_certificate(&untrusted, &stranger);

    let key = [
        ("modelSignature", "required"),
        ("signaturePublicKey", public.as_str()),
    ];
    let optional = [
        ("modelSignature", "optional"),
        ("signaturePublicKey", public.as_str()),
    ];
    let chain = [
        ("modelSignature", "required"),
        ("signatureCertificateChain", ca.root.as_str()),
    ];
    for (name, dir, policy, why) in [
        (
            "changed",
            &changed,
            &key,
            "signs \"config.json\" with sha256",
        ),
        ("added", &added, &key, "does not sign \"extra.pkl\""),
        (
            "removed",
            &removed,
            &key,
            "signs \"tokenizer/vocab/vocab.txt\", which the model does not hold",
        ),
        ("edited", &edited, &key, "payload was changed after signing"),
        (
            "foreign",
            &foreign,
            &key,
            "is not signed by the class's key",
        ),
        (
            "foreign-optional",
            &foreign,
            &optional,
            "is not signed by the class's key",
        ),
        (
            "missing",
            &missing,
            &key,
            "signature model.sig: is not in the model",
        ),
        (
            "untrusted",
            &untrusted,
            &chain,
            "does not chain to the class's CAs",
        ),
    ] {
        let mut params = vec![("source", file_uri(dir))];
        params.extend(policy.iter().map(|(k, v)| (*k, v.to_string())));
        let params: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = create(&d, &format!("pvc-{name}"), &params).await;
        assert_code(r, Code::FailedPrecondition, why);
    }
    assert_eq!(
        d.models(),
        Vec::<Value>::new(),
        "a refused model was sealed"
    );

    // The publisher's own, untouched, seals under the same class.
    let good = file_uri(&signed("good", 17));
    let mut params = vec![("source", good.as_str())];
    params.extend_from_slice(&key);
    let v = created(create(&d, "pvc-good", &params).await);
    assert_eq!(signed_by(&v), Some(key_signer(&keys, &public).as_str()));
}

/// Rewrites the digest `path` has in the signed payload of `sig`, keeping
/// its signature: what an attacker who cannot sign would do.
fn edit_payload(sig: &Path, path: &str) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut bundle: Value = serde_json::from_slice(&fs::read(sig).unwrap()).unwrap();
    let mut statement: Value = serde_json::from_slice(
        &b64.decode(bundle["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap(),
    )
    .unwrap();
    for r in statement["predicate"]["resources"].as_array_mut().unwrap() {
        if r["name"] == path {
            r["digest"] = "0".repeat(64).into();
        }
    }
    bundle["dsseEnvelope"]["payload"] = b64.encode(serde_json::to_vec(&statement).unwrap()).into();
    fs::write(sig, serde_json::to_vec(&bundle).unwrap()).unwrap();
}

/// GETs of LFS bytes (the weights) from the hub fixture.
fn weight_gets(hub: &HubServer) -> usize {
    hub.requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path().starts_with("cdn-lfs/"))
        .count()
}

#[tokio::test]
async fn a_cache_hit_is_judged_by_the_asking_class_from_its_seal_without_fetching_the_weights() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "prime256v1");
    let (_, other_public) = key_pair(&keys, "someone-else", "prime256v1");
    let ca = pki(&keys, "example");
    let repo = d.dir.join("repo");
    write_model(&repo, 20);
    sign_with_key(&repo, &private);
    let hub = HubServer::start(&repo).await;
    let endpoint = hub.endpoint();
    let uri = format!("hf://{HUB_REPO}@{HUB_SHA}");
    let class = |policy: &[(&'static str, String)]| -> Vec<(&'static str, String)> {
        let mut p = vec![("source", uri.clone()), ("hfEndpoint", endpoint.clone())];
        p.extend_from_slice(policy);
        p
    };

    // Sealed by a class that checks nothing.
    let v = created(create_owned(&d, "pvc-plain", &class(&[])).await);
    assert_eq!(signed_by(&v), None);
    let fetched = weight_gets(&hub);
    assert!(fetched >= 1, "{:?}", hub.requests());

    // A class that requires the publisher's key: the seal's signature
    // file is checked; the weights are not fetched again.
    let required = |key: &str| {
        vec![
            ("modelSignature", "required".to_string()),
            ("signaturePublicKey", key.to_string()),
        ]
    };
    let v = created(create_owned(&d, "pvc-publisher", &class(&required(&public))).await);
    assert_eq!(signed_by(&v), Some(key_signer(&keys, &public).as_str()));
    // Someone else's key, or certificates under a CA: refused, though
    // the model is on the node.
    let r = create_owned(&d, "pvc-other", &class(&required(&other_public))).await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "is not signed by the class's key",
    );
    let r = create_owned(
        &d,
        "pvc-ca",
        &class(&[
            ("modelSignature", "required".to_string()),
            ("signatureCertificateChain", ca.root.clone()),
        ]),
    )
    .await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "carries no signing certificate",
    );
    assert_eq!(
        weight_gets(&hub),
        fetched,
        "a hit fetched the weights again"
    );

    // Both signers show where the operator looks.
    let models = d.models();
    assert_eq!(models.len(), 1, "{models:#?}");
    assert_eq!(
        models[0]["signed_by"],
        serde_json::json!([key_signer(&keys, &public)])
    );
}

#[tokio::test]
async fn a_listing_without_the_signature_is_refused_before_anything_is_fetched() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (_, public) = key_pair(&keys, "publisher", "prime256v1");
    let repo = d.dir.join("repo");
    write_model(&repo, 30);
    let hub = HubServer::start(&repo).await;
    let r = create(
        &d,
        "pvc-unsigned",
        &[
            ("source", &format!("hf://{HUB_REPO}@{HUB_SHA}")),
            ("hfEndpoint", &hub.endpoint()),
            ("modelSignature", "required"),
            ("signaturePublicKey", &public),
            ("signatureFile", "signatures/model.sig"),
        ],
    )
    .await;
    let s = assert_code(
        r,
        Code::FailedPrecondition,
        "signature signatures/model.sig: is not in the model",
    );
    assert!(
        s.message().contains("modelSignature: required"),
        "{}",
        s.message()
    );
    assert_eq!(weight_gets(&hub), 0, "{:?}", hub.requests());
    assert_eq!(d.models(), Vec::<Value>::new());
}

#[tokio::test]
async fn a_source_volume_a_tenant_filled_is_judged_like_a_pulled_model_when_cloned() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "prime256v1");
    let (_, other_public) = key_pair(&keys, "someone-else", "prime256v1");

    // A Job writes the model and its signature into a source volume,
    // which is then sealed.
    let src = d.create_source("pvc-src", "local").await;
    let id = src.volume_id.clone();
    let (staging, target) = (d.staging("src"), d.target("writer"));
    d.stage(&id, &staging, WRITER).await.unwrap();
    d.publish(&id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    write_model(&target, 40);
    sign_with_key(&target, &private);
    d.unpublish(&id, &target).await.unwrap();
    d.unstage(&id, &staging).await.unwrap();
    d.seal(&id).await.unwrap();

    let policy = |key: &str| {
        vec![
            ("modelSignature", "required".to_string()),
            ("signaturePublicKey", key.to_string()),
        ]
    };
    let clone = |name: &'static str, params: Vec<(&'static str, String)>| {
        let (d, id) = (&d, id.clone());
        async move {
            let params: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
            d.create_cache(name, &id, &params).await
        }
    };
    let v = created(clone("pvc-publisher", policy(&public)).await);
    assert_eq!(signed_by(&v), Some(key_signer(&keys, &public).as_str()));
    let r = clone("pvc-other", policy(&other_public)).await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "is not signed by the class's key",
    );
    // Without a policy a clone is what it always was.
    let v = created(clone("pvc-plain", vec![]).await);
    assert_eq!(signed_by(&v), None);
}

#[tokio::test]
async fn a_model_sealed_in_an_xfs_image_is_judged_through_a_read_only_view() {
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "secp521r1");
    let (_, other_public) = key_pair(&keys, "someone-else", "secp521r1");
    let dir = d.dir.join("model");
    write_model(&dir, 50);
    sign_with_key(&dir, &private);
    let uri = file_uri(&dir);
    let xfs = |name: &str, policy: &[(&str, &str)]| {
        let mut params = vec![("backend", "xfs"), ("source", uri.as_str())];
        params.extend_from_slice(policy);
        d.create(create_req(name, &params, READER))
    };
    let v = created(xfs("pvc-plain", &[]).await);
    assert!(v.volume_id.starts_with("xfs."), "{}", v.volume_id);
    assert_eq!(signed_by(&v), None);
    let v = created(
        xfs(
            "pvc-publisher",
            &[
                ("modelSignature", "required"),
                ("signaturePublicKey", &public),
            ],
        )
        .await,
    );
    assert_eq!(signed_by(&v), Some(key_signer(&keys, &public).as_str()));
    let r = xfs(
        "pvc-other",
        &[
            ("modelSignature", "required"),
            ("signaturePublicKey", &other_public),
        ],
    )
    .await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "is not signed by the class's key",
    );
    // The views the checks mounted are gone.
    let views: Vec<_> = mounts_below(&d.state_dir)
        .into_iter()
        .filter(|m| m.mount_point.to_string_lossy().contains("view-"))
        .collect();
    assert!(views.is_empty(), "{views:?}");
}

/// A tenant's PVC names its own model: the class's policy holds for it
/// all the same, and the PVC's events say who signed, or why not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_named_model_meets_the_class_policy_and_its_pvc_says_who_signed() {
    use crate::kube_sources::{apply, events_until};
    let api = crate::support::apiserver::ApiServer::start().expect("start apiserver");
    let d = Driver::start_against(&api, &[]).await;
    apply(
        &api,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team}\n",
    );
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "prime256v1");
    let models = d.dir.join("models");
    let signed = models.join("signed");
    write_model(&signed, 60);
    sign_with_key(&signed, &private);
    let unsigned = models.join("unsigned");
    write_model(&unsigned, 61);
    for (pvc, dir) in [("signed", &signed), ("unsigned", &unsigned)] {
        apply(
            &api,
            &format!(
                "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {pvc}\n  namespace: team\n  annotations: {{modelcache.csi.io/source: \"{}\"}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n",
                file_uri(dir)
            ),
        );
    }
    let allowed = format!("file://{}/", models.display());
    let class = |pvc: &'static str| {
        vec![
            ("csi.storage.k8s.io/pvc/name", pvc.to_string()),
            ("csi.storage.k8s.io/pvc/namespace", "team".to_string()),
            ("allowedSources", allowed.clone()),
            ("modelSignature", "required".to_string()),
            ("signaturePublicKey", public.clone()),
        ]
    };
    let v = created(create_owned(&d, "pvc-signed", &class("signed")).await);
    let signer = key_signer(&keys, &public);
    assert_eq!(signed_by(&v), Some(signer.as_str()));
    let r = create_owned(&d, "pvc-unsigned", &class("unsigned")).await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "signature model.sig: is not in the model",
    );

    let notes = events_until(
        &api,
        "team",
        None,
        "{range .items[*]}{.regarding.name} {.reason}: {.note}{\"\\n\"}{end}",
        |o| o.contains("ModelSealed") && o.contains("PullFailed"),
    )
    .await;
    assert!(
        notes.contains(&format!("signed ModelSealed: {}", file_uri(&signed)))
            && notes.contains(&format!("signed by {signer}")),
        "{notes}"
    );
    assert!(
        notes.lines().any(|l| l.starts_with("unsigned PullFailed:")
            && l.contains("model.sig: is not in the model")),
        "{notes}"
    );
}

/// A keyless (sigstore) signature over `model`, by `identity` from
/// `issuer`, made by a private sigstore instance
/// (tests/scripts/sigstore-instance.py: CA, CT log and transparency log in
/// one process) over the statement `model_signing sign key` writes; the
/// reference verifier (`model_signing verify sigstore --trust_config`)
/// must accept it before the driver is asked. Returns the trusted root.
fn sign_keyless(model: &Path, keys: &Path, identity: &str, issuer: &str) -> PathBuf {
    let (private, _) = key_pair(keys, "statement", "prime256v1");
    let statement = keys.join("statement.sig");
    run(Command::new(model_signing()).args([
        "sign",
        "key",
        &path_str(model),
        "--private_key",
        &path_str(&private),
        "--signature",
        &path_str(&statement),
    ]));
    let python = model_signing().with_file_name("python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/sigstore-instance.py");
    let (root, config) = (
        keys.join("trusted_root.json"),
        keys.join("trust_config.json"),
    );
    run(Command::new(python).args([
        &path_str(&script),
        &path_str(&statement),
        identity,
        issuer,
        &path_str(&model.join("model.sig")),
        &path_str(&root),
        &path_str(&config),
    ]));
    run(Command::new(model_signing()).args([
        "verify",
        "sigstore",
        "--trust_config",
        &path_str(&config),
        "--identity",
        identity,
        "--identity_provider",
        issuer,
        "--signature",
        &path_str(&model.join("model.sig")),
        &path_str(model),
    ]));
    root
}

#[tokio::test]
async fn keyless_signatures_verify_offline_against_the_trusted_root_for_the_class_identity() {
    let work = tempfile::tempdir().unwrap();
    let keys = keys_dir(work.path());
    let (identity, issuer) = ("release@example.com", "https://issuer.example.com");
    let model = work.path().join("model");
    write_model(&model, 70);
    let root = sign_keyless(&model, &keys, identity, issuer);
    // The same signed model with a file changed after signing.
    let tampered = work.path().join("tampered");
    run(Command::new("cp").arg("-a").arg(&model).arg(&tampered));
    fs::write(tampered.join("config.json"), b"{}\n").unwrap();

    let d = Driver::start_with(&["--sigstore-trust-root", &path_str(&root)]).await;
    let class = |identity: &str, issuer: &str, dir: &Path| {
        vec![
            ("source", file_uri(dir)),
            ("modelSignature", "required".to_string()),
            ("signatureIdentity", identity.to_string()),
            ("signatureIssuer", issuer.to_string()),
        ]
    };
    let r = create_owned(
        &d,
        "pvc-someone",
        &class("someone@example.com", issuer, &model),
    )
    .await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "does not hold for identity someone@example.com",
    );
    let r = create_owned(
        &d,
        "pvc-other-issuer",
        &class(identity, "https://accounts.example.org", &model),
    )
    .await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "from issuer https://accounts.example.org",
    );
    let v = created(create_owned(&d, "pvc-keyless", &class(identity, issuer, &model)).await);
    assert_eq!(
        signed_by(&v),
        Some(format!("sigstore {identity} (issuer {issuer})").as_str())
    );
    let r = create_owned(&d, "pvc-tampered", &class(identity, issuer, &tampered)).await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "signs \"config.json\" with sha256",
    );
    assert_eq!(d.models().len(), 1);
    drop(d);

    // The same signature, checked against sigstore's public-good root (the
    // default): this instance's CA and logs are unknown there.
    let d = Driver::start().await;
    let r = create(
        &d,
        "pvc-public-root",
        &[
            ("source", &file_uri(&model)),
            ("modelSignature", "required"),
            ("signatureIdentity", identity),
            ("signatureIssuer", issuer),
        ],
    )
    .await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "its sigstore signature does not hold",
    );
}

/// An OCI artifact (a file a layer, as ORAS pushes a model) carries its
/// signature as one more layer, through a real registry; and a tag moved
/// to a tampered push is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_artifact_carries_its_signature_as_a_layer() {
    let reg = crate::support::registry::Registry::start().await;
    let d = Driver::start().await;
    let keys = keys_dir(&d.dir);
    let (private, public) = key_pair(&keys, "publisher", "prime256v1");
    let model = d.dir.join("artifact");
    write_model(&model, 80);
    sign_with_key(&model, &private);
    reg.push_artifact("models/signed:v1", &model).await;
    let class = |tag: &str| {
        vec![
            ("source", reg.uri(tag)),
            ("ociPlainHTTP", "true".to_string()),
            ("modelSignature", "required".to_string()),
            ("signaturePublicKey", public.clone()),
        ]
    };
    let v = created(create_owned(&d, "pvc-oci", &class("models/signed:v1")).await);
    assert_eq!(signed_by(&v), Some(key_signer(&keys, &public).as_str()));

    // The same signature over weights someone else pushed.
    fs::write(
        model.join("model.safetensors"),
        b"not the weights that were signed",
    )
    .unwrap();
    reg.push_artifact("models/signed:v2", &model).await;
    let r = create_owned(&d, "pvc-oci-tampered", &class("models/signed:v2")).await;
    assert_code(
        r,
        Code::FailedPrecondition,
        "signs \"model.safetensors\" with sha256",
    );
    assert_eq!(d.models().len(), 1);
}
