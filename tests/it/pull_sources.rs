//! The driver pulling the real all-MiniLM-L6-v2 model through every source
//! but S3 (that is `pull_s3.rs`): CreateVolume with `parameters.source` an
//! http(s) manifest or file, an `hf://` repo, a `model-registry://` version,
//! or an `oci://` artifact or modelcar, served by the fixtures or a real
//! registry; then NodeStage, a read-only NodePublish, and the model read
//! back through the mount. A second volume of a model must cost no
//! download; a failed pull must say why with a clear code and seal nothing;
//! a stall or a 503 that passes must not fail the pull.

use crate::support::fixtures;
use crate::support::registry;

use std::fs;
use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::harness::*;
use fixtures::{FileServer, HUB_LFS_MIN, HUB_REPO, HUB_SHA, HubServer, RegistryServer};
use modelcache_csi::csi::Volume;
use modelcache_csi::puller::engine::EngineConfig;
use registry::Registry;
use serde_json::Value;
use tonic::Code;

const CHUNK_MIB: u64 = 8;

/// A model file: '/'-separated path, size, sha256.
type FileSum = (String, u64, String);

/// The real model's files, hashed once.
fn model() -> &'static [FileSum] {
    static SUMS: OnceLock<Vec<FileSum>> = OnceLock::new();
    SUMS.get_or_init(|| {
        let sums = sums_under(&fixtures::model_dir());
        // README, configs, tokenizer, vocab, weights and 1_Pooling/config.json.
        assert_eq!(sums.len(), 12, "{sums:?}");
        assert!(sums.iter().any(|(p, _, _)| p == "1_Pooling/config.json"));
        sums
    })
}

fn model_file(path: &str) -> &'static FileSum {
    model()
        .iter()
        .find(|(p, _, _)| p == path)
        .unwrap_or_else(|| panic!("the model has no {path}"))
}

/// Every regular file under `dir`, hashed.
fn sums_under(dir: &Path) -> Vec<FileSum> {
    fixtures::tree_files(dir)
        .into_iter()
        .map(|(p, size)| {
            let sha = fixtures::sha256_file(&dir.join(&p));
            (p, size, sha)
        })
        .collect()
}

async fn driver(extra: &[&str]) -> Driver {
    let chunk = CHUNK_MIB.to_string();
    let mut args = vec!["--pull-chunk-mib", &chunk, "--pull-connections", "2"];
    args.extend_from_slice(extra);
    Driver::start_with(&args).await
}

/// CreateVolume of a read-only cache volume on the local backend.
async fn create(d: &Driver, name: &str, params: &[(&str, &str)]) -> Result<Volume, tonic::Status> {
    let mut all = vec![("backend", "local")];
    all.extend_from_slice(params);
    d.create(create_req(name, &all, READER)).await
}

#[track_caller]
fn created(r: Result<Volume, tonic::Status>) -> Volume {
    r.unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()))
}

/// The volume names the model it was pulled from and the revision sealed.
#[track_caller]
fn assert_context(v: &Volume, model: &str, revision_prefix: &str) {
    let ctx = &v.volume_context;
    assert_eq!(ctx.get("model").map(String::as_str), Some(model), "{ctx:?}");
    let revision = ctx.get("revision").expect("volume_context.revision");
    assert!(
        revision.starts_with(revision_prefix) && revision.len() > 8,
        "revision {revision:?}, expected {revision_prefix:?}…"
    );
    assert!(!ctx["source"].is_empty());
}

/// The 8-byte little-endian header length, then a JSON header naming the
/// tensors with offsets inside the file.
#[track_caller]
fn assert_safetensors(path: &Path) {
    let mut f = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file_len = f.metadata().unwrap().len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let header_len = u64::from_le_bytes(len);
    assert!(header_len < file_len - 8, "header of {header_len} bytes");
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).unwrap();
    let header: Value = serde_json::from_slice(&header).expect("the safetensors header is JSON");
    let tensors: Vec<(&String, &Value)> = header
        .as_object()
        .expect("the header is an object")
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .collect();
    assert!(
        tensors
            .iter()
            .any(|(k, _)| *k == "embeddings.word_embeddings.weight"),
        "{tensors:?}"
    );
    let data_len = file_len - 8 - header_len;
    for (name, t) in tensors {
        let end = t["data_offsets"][1].as_u64().expect("data_offsets");
        assert!(end <= data_len, "{name} ends at {end}, past {data_len}");
        assert!(
            t["dtype"].is_string() && t["shape"].is_array(),
            "{name}: {t}"
        );
    }
}

/// Stages `v`, publishes it read-only, and checks through the mount that it
/// holds exactly `want`, byte for byte, with a parseable safetensors header
/// when it has weights, and refuses writes with EROFS. Unmounts after.
async fn assert_served(d: &Driver, v: &Volume, want: &[FileSum]) {
    let key = uuid_of(&v.volume_id);
    let (staging, target) = (d.staging(key), d.target(key));
    d.stage(&v.volume_id, &staging, READER)
        .await
        .expect("NodeStageVolume");
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .expect("NodePublishVolume");
    assert!(single_mount(&target).is_readonly());
    assert_eq!(sums_under(&target), want, "{} differs", v.volume_id);
    if let Some((weights, _, _)) = want
        .iter()
        .find(|(p, _, _)| p.ends_with("model.safetensors"))
    {
        assert_safetensors(&target.join(weights));
    }
    assert_erofs(&target.join(&want[0].0));
    assert_erofs(&target.join("written-by-a-pod"));
    d.unpublish(&v.volume_id, &target).await.expect("unpublish");
    d.unstage(&v.volume_id, &staging).await.expect("unstage");
    let left = mounts_below(&d.dir);
    assert!(left.is_empty(), "mounts left: {left:#?}");
}

/// Every model visible in the local root, sealed or not; a pull's hidden
/// work dir does not count. A create may answer before its model's seal:
/// wait for the seal (`Driver::wait_sealed`) before counting what it made.
fn sealed_sources(d: &Driver) -> Vec<String> {
    let Ok(entries) = fs::read_dir(d.state_dir.join("local/sources")) else {
        return Vec::new();
    };
    entries
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect()
}

/// GETs of model files (not of manifests or API documents).
fn file_gets(server: &FileServer) -> usize {
    model().iter().map(|(p, _, _)| server.gets(p)).sum()
}

/// The one-byte reads a requester's access check makes (`Source::authorize`):
/// one of the first file listed and one of the largest.
fn access_probes(server: &FileServer) -> Vec<String> {
    server
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.header("range") == Some("bytes=0-0"))
        .map(|r| r.raw_path.clone())
        .collect()
}

/// GETs of model files from the Hub: `resolve/`, and for LFS files also
/// the CDN it redirects to.
fn hub_file_gets(hub: &HubServer) -> usize {
    model()
        .iter()
        .map(|(p, size, sha)| {
            let cdn = if *size >= HUB_LFS_MIN {
                hub.gets(&format!("cdn-lfs/{sha}"))
            } else {
                0
            };
            hub.gets(&format!("{HUB_REPO}/resolve/{HUB_SHA}/{p}")) + cdn
        })
        .sum()
}

/// Ranged GETs one full download of `size` bytes makes.
fn chunks(size: u64) -> usize {
    size.div_ceil(CHUNK_MIB << 20).max(1) as usize
}

/// Ranged GETs one full download of the model makes.
fn planned_gets() -> usize {
    model().iter().map(|(_, size, _)| chunks(*size)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_manifest_and_single_file_are_pulled_once_and_served_byte_for_byte() {
    let dir = fixtures::model_dir();
    let files = FileServer::start(&dir).await;
    files.put("manifest.json", fixtures::manifest_for(&dir, true));
    let d = driver(&[]).await;

    let uri = format!("{}#manifest", files.url("manifest.json"));
    let v = created(create(&d, "pvc-manifest", &[("source", &uri)]).await);
    assert_context(&v, &uri, "manifest:");
    assert_eq!(file_gets(&files), planned_gets());
    assert_served(&d, &v, model()).await;

    // Another volume of the model: the manifest is read again (it names
    // the revision), the files are not.
    let before = file_gets(&files);
    let again = created(create(&d, "pvc-manifest-2", &[("source", &uri)]).await);
    assert_eq!(file_gets(&files), before, "a cache hit downloaded files");
    assert_eq!(again.volume_context["source"], v.volume_context["source"]);
    assert_ne!(again.volume_id, v.volume_id);
    assert_served(&d, &again, model()).await;

    // One file: resolved by a HEAD (ETag), fetched by one GET.
    let config = model_file("config.json");
    let uri = files.url("config.json");
    let before = files.gets("config.json");
    let one = created(create(&d, "pvc-config", &[("source", &uri)]).await);
    assert_context(&one, &uri, "etag:");
    assert_eq!(files.gets("config.json"), before + 1);
    assert_served(&d, &one, std::slice::from_ref(config)).await;
    let again = created(create(&d, "pvc-config-2", &[("source", &uri)]).await);
    assert_eq!(
        files.gets("config.json"),
        before + 1,
        "a cache hit downloaded"
    );
    assert_eq!(again.volume_context["source"], one.volume_context["source"]);
    assert_ne!(one.volume_context["source"], v.volume_context["source"]);
    d.wait_sealed(
        &[&v.volume_context["source"], &one.volume_context["source"]],
        SEAL_BOUND,
    )
    .await;
    assert_eq!(sealed_sources(&d).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_repo_at_main_and_at_its_commit_share_one_pull() {
    let hub = HubServer::start(fixtures::model_dir()).await;
    let endpoint = hub.endpoint();
    let d = driver(&[]).await;
    let uri = "hf://org/minilm";

    let v = created(create(&d, "pvc-hf", &[("source", uri), ("hfEndpoint", &endpoint)]).await);
    assert_context(&v, "hf://org/minilm", HUB_SHA);
    let pulled = hub_file_gets(&hub);
    let redirected: usize = model()
        .iter()
        .filter(|(_, size, _)| *size >= HUB_LFS_MIN)
        .map(|(_, size, _)| chunks(*size))
        .sum();
    assert_eq!(pulled, planned_gets() + redirected);
    assert_served(&d, &v, model()).await;

    // The same URI again, then pinned to the commit `main` resolved to:
    // the API is asked again, the files are not fetched again.
    let pinned = format!("{uri}@{HUB_SHA}");
    for (name, uri) in [("pvc-hf-2", uri), ("pvc-hf-sha", &pinned)] {
        let params = [("source", uri), ("hfEndpoint", &endpoint)];
        let again = created(create(&d, name, &params).await);
        assert_eq!(hub_file_gets(&hub), pulled, "{uri}: a cache hit downloaded");
        assert_eq!(again.volume_context["source"], v.volume_context["source"]);
        assert_context(&again, "hf://org/minilm", HUB_SHA);
    }
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    assert_eq!(sealed_sources(&d).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_registry_version_shares_the_cache_entry_of_its_artifact() {
    let dir = fixtures::model_dir();
    let files = FileServer::start(&dir).await;
    files.put("manifest.json", fixtures::manifest_for(&dir, true));
    let artifact = format!("{}#manifest", files.url("manifest.json"));
    let mr = RegistryServer::start("minilm", &[("v1", &artifact)]).await;
    let url = mr.url();
    let d = driver(&[]).await;
    // The artifact is on another host than the registry: the class says a
    // registry may answer with it.
    let allowed = format!("{}/", files.base());
    let params = [
        ("source", "model-registry://minilm/v1"),
        ("modelRegistryURL", url.as_str()),
        ("allowedSources", allowed.as_str()),
    ];

    let v = created(create(&d, "pvc-mr", &params).await);
    let pulled = file_gets(&files);
    // The registry's answer is pulled as a tenant's URI is: its requester
    // proves its access before anything else, the same whether the model
    // is sealed, arriving or neither, so that the answer tells nothing of
    // what others pull.
    let probes = access_probes(&files);
    assert_eq!(probes.len(), 2, "{probes:?}");
    assert_eq!(pulled, planned_gets() + probes.len());
    assert!(!mr.requests().is_empty());
    // The model is the artifact: the registry only named it.
    assert_context(&v, &artifact, "manifest:");
    assert_served(&d, &v, model()).await;

    let again = created(create(&d, "pvc-mr-2", &params).await);
    assert_eq!(again.volume_context["source"], v.volume_context["source"]);
    assert_eq!(file_gets(&files), pulled, "a cache hit downloaded");
    // The class's own URI presents other credentials (the driver's) than
    // the registry's answer (none): its hit first proves it may read the
    // content, with one byte. A hit of the sealed model: the creates above
    // may have answered before the seal.
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    let seen = files.requests().len();
    let direct = created(create(&d, "pvc-artifact", &[("source", &artifact)]).await);
    assert_eq!(direct.volume_context["source"], v.volume_context["source"]);
    let probes: Vec<_> = files.requests()[seen..]
        .iter()
        .filter(|r| r.method == "GET" && !r.raw_path.ends_with("manifest.json"))
        .map(|r| r.header("range").unwrap_or("whole").to_string())
        .collect();
    // One byte of the first file listed and one of the largest.
    assert_eq!(probes, ["bytes=0-0", "bytes=0-0"], "a cache hit downloaded");
    assert_served(&d, &direct, model()).await;
    assert_eq!(sealed_sources(&d).len(), 1);
}

/// Whoever registers a model version chooses its artifact URI, so a
/// registry's answer to the class's own `model-registry://` source is held
/// to the class like a tenant's URI: within `allowedSources` (without it,
/// only the registry's own host), through the egress guard, and with the
/// class's credentials only within `artifactCredentials`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_registry_answer_is_held_to_the_class() {
    let dir = fixtures::model_dir();
    let files = FileServer::start(&dir).await;
    files.put("a.json", fixtures::manifest_for(&dir, true));
    files.put("b.json", fixtures::manifest_for(&dir, false));
    let node_dir = format!("file://{}", dir.display());
    let (a, b) = (
        format!("{}#manifest", files.url("a.json")),
        format!("{}#manifest", files.url("b.json")),
    );
    let mr = RegistryServer::start(
        "m",
        &[
            ("node", node_dir.as_str()),
            ("a", a.as_str()),
            ("b", b.as_str()),
        ],
    )
    .await;
    let (url, http_prefix) = (mr.url(), format!("{}/", files.base()));
    let d = driver(&[]).await;
    let class = |version: &str, extra: &[(&'static str, &str)]| {
        let mut p = vec![
            (
                "source".to_string(),
                format!("model-registry://m/{version}"),
            ),
            ("modelRegistryURL".to_string(), url.clone()),
        ];
        p.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        p
    };
    let create_with = |name: &'static str, params: Vec<(String, String)>| {
        let d = &d;
        async move {
            let mut all = vec![("backend", "local")];
            all.extend(params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let mut r = create_req(name, &all, READER);
            r.secrets = map(&[("httpBearerToken", "class-token")]);
            d.create(r).await
        }
    };

    // A node directory, even where the class lists only http prefixes.
    for (name, extra) in [
        ("mr-node", vec![]),
        (
            "mr-node-http",
            vec![("allowedSources", http_prefix.as_str())],
        ),
    ] {
        let e = assert_code(
            create_with(name, class("node", &extra)).await,
            Code::PermissionDenied,
            "artifact URI",
        );
        assert!(e.message().contains("allowedSources"), "{}", e.message());
    }
    // Another host than the registry's, with no allowedSources: refused,
    // naming the parameter, before any request reaches it.
    let e = assert_code(
        create_with("mr-elsewhere", class("a", &[])).await,
        Code::PermissionDenied,
        "not on the registry's own host",
    );
    assert!(e.message().contains("allowedSources"), "{}", e.message());
    assert!(files.requests().is_empty(), "{:?}", files.requests());
    assert!(sealed_sources(&d).is_empty());

    // Allowed: pulled through the guard, without the class's token.
    created(
        create_with(
            "mr-a",
            class("a", &[("allowedSources", http_prefix.as_str())]),
        )
        .await,
    );
    let auth: Vec<_> = files
        .requests()
        .iter()
        .filter_map(|r| r.header("authorization").map(str::to_string))
        .collect();
    assert!(
        auth.is_empty(),
        "the class token followed a registry's answer: {auth:?}"
    );
    // Within artifactCredentials the class's token goes along.
    let before = files.requests().len();
    created(
        create_with(
            "mr-b",
            class(
                "b",
                &[
                    ("allowedSources", http_prefix.as_str()),
                    ("artifactCredentials", http_prefix.as_str()),
                ],
            ),
        )
        .await,
    );
    let sent = files.requests()[before..]
        .iter()
        .filter(|r| r.header("authorization") == Some("Bearer class-token"))
        .count();
    assert!(
        sent > 0,
        "artifactCredentials did not scope the class token to the artifact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_artifact_is_pulled_once_by_tag_or_digest() {
    let reg = Registry::start().await;
    let pushed = reg
        .push_artifact("models/minilm:v1", &fixtures::model_dir())
        .await;
    let d = driver(&[]).await;
    let uri = reg.uri("models/minilm:v1");

    let before = reg.settled_blob_gets().await;
    let params = [("source", uri.as_str()), ("ociPlainHTTP", "true")];
    let v = created(create(&d, "pvc-oci", &params).await);
    assert_context(&v, &reg.uri("models/minilm"), &pushed.digest);
    let pulled = reg.settled_blob_gets().await;
    assert_eq!(pulled - before, planned_gets());
    assert_served(&d, &v, model()).await;

    let by_digest = reg.uri(&format!("models/minilm@{}", pushed.digest));
    for (name, uri) in [("pvc-oci-2", &uri), ("pvc-oci-digest", &by_digest)] {
        let params = [("source", uri.as_str()), ("ociPlainHTTP", "true")];
        let again = created(create(&d, name, &params).await);
        assert_eq!(again.volume_context["source"], v.volume_context["source"]);
        assert_eq!(
            reg.settled_blob_gets().await,
            pulled,
            "{uri}: a cache hit downloaded"
        );
    }
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    assert_eq!(sealed_sources(&d).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_modelcar_is_unpacked_and_served_from_its_models_dir() {
    let reg = Registry::start().await;
    let pushed = reg
        .push_modelcar("models/minilm:v1", &fixtures::model_dir())
        .await;
    let d = driver(&[]).await;
    let uri = reg.uri("models/minilm:v1");
    let base = [("source", uri.as_str()), ("ociPlainHTTP", "true")];

    let before = reg.settled_blob_gets().await;
    let image = created(create(&d, "pvc-car", &base).await);
    assert_context(&image, &reg.uri("models/minilm"), &pushed.digest);
    let pulled = reg.settled_blob_gets().await;
    let planned: usize = pushed.layers.iter().map(|l| chunks(l.size)).sum();
    assert_eq!(pulled - before, planned);
    // The whole image: the model under models/.
    let under_models: Vec<FileSum> = model()
        .iter()
        .map(|(p, s, h)| (format!("models/{p}"), *s, h.clone()))
        .collect();
    assert_served(&d, &image, &under_models).await;

    // subPath: models exposes the model itself, from the same sealed copy.
    let mut sub = base.to_vec();
    sub.push(("subPath", "models"));
    let v = created(create(&d, "pvc-car-models", &sub).await);
    assert_eq!(v.volume_context["source"], image.volume_context["source"]);
    assert_eq!(v.volume_context["subPath"], "models");
    assert_eq!(
        reg.settled_blob_gets().await,
        pulled,
        "a cache hit downloaded"
    );
    assert_served(&d, &v, model()).await;
    d.wait_sealed(&[&image.volume_context["source"]], SEAL_BOUND)
        .await;
    assert_eq!(sealed_sources(&d).len(), 1);
}

/// The xfs backend sizes a pull's image from the bytes it fetches. A gzip
/// layer of 360 MiB of zeros is well under a megabyte, so its image starts
/// at the 300 MiB minimum, which the layer overflows: the image grows and
/// the layer unpacks again, and the model is served whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_larger_than_its_xfs_image_grows_the_image() {
    let reg = Registry::start().await;
    let zeros = vec![0u8; 360 << 20];
    let config = b"{\"hidden_size\": 384}".to_vec();
    let want: Vec<FileSum> = vec![
        (
            "models/config.json".into(),
            config.len() as u64,
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&config)),
        ),
        (
            "models/weights.bin".into(),
            zeros.len() as u64,
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&zeros)),
        ),
    ];
    let layer = registry::tar_gz(&[
        registry::Entry::Dir("models".into()),
        registry::Entry::File("models/config.json".into(), config),
        registry::Entry::File("models/weights.bin".into(), zeros),
    ]);
    let pushed = reg
        .push_image("models/zeros:v1", vec![layer], "amd64")
        .await;
    assert!(pushed.layers[0].size < 4 << 20, "{:?}", pushed.layers);
    let d = driver(&[]).await;
    let uri = reg.uri("models/zeros:v1");
    let v = created(
        d.create(create_req(
            "pvc-zeros",
            &[
                ("backend", "xfs"),
                ("source", uri.as_str()),
                ("ociPlainHTTP", "true"),
            ],
            READER,
        ))
        .await,
    );
    assert_served(&d, &v, &want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_pulls_have_clear_codes_and_seal_nothing() {
    let dir = fixtures::model_dir();
    let files = FileServer::start(&dir).await;
    let reg = Registry::start().await;
    reg.push_image("evil/slip:v1", vec![registry::tar_slip_layer()], "amd64")
        .await;
    reg.push_image(
        "evil/symlink:v1",
        vec![registry::symlink_escape_layer()],
        "amd64",
    )
    .await;

    // A manifest promising the wrong sha256 for the weights.
    let mut corrupt: Value = serde_json::from_slice(&fixtures::manifest_for(&dir, true)).unwrap();
    for f in corrupt["files"].as_array_mut().unwrap() {
        if f["path"] == "model.safetensors" {
            let sha = f["sha256"].as_str().unwrap();
            let flipped = if sha.starts_with('0') { "1" } else { "0" };
            f["sha256"] = Value::from(format!("{flipped}{}", &sha[1..]));
        }
    }
    files.put("corrupt.json", serde_json::to_vec(&corrupt).unwrap());
    // A manifest listing a file the server does not have.
    let (_, size, sha) = model_file("config.json");
    let missing = serde_json::json!({"files": [
        {"path": "config.json", "size": size, "sha256": sha},
        {"path": "weights/missing.safetensors"},
    ]});
    files.put("missing.json", serde_json::to_vec(&missing).unwrap());
    // A file whose every GET sends 1000 bytes, then nothing (at its own
    // path: the manifests above list vocab.txt too).
    files.put(
        "stalled/vocab.txt",
        fs::read(dir.join("vocab.txt")).unwrap(),
    );
    files.stall("stalled/vocab.txt", 1000);

    let d = driver(&["--pull-stall-seconds", "1"]).await;
    let nothing_sealed = |case: &str| {
        assert_eq!(
            sealed_sources(&d),
            Vec::<String>::new(),
            "{case} sealed something"
        );
    };

    // The stalled pull uses up its retry budget while the others run.
    let stalled = async {
        let started = Instant::now();
        let r = create(
            &d,
            "pvc-stalled",
            &[("source", &files.url("stalled/vocab.txt"))],
        )
        .await;
        (r, started.elapsed())
    };
    let others = async {
        let layers = [
            ("pvc-slip", "evil/slip:v1", "\"../evil\""),
            ("pvc-symlink", "evil/symlink:v1", "\"link\""),
        ];
        for (name, tag, entry) in layers {
            let r = create(
                &d,
                name,
                &[("source", &reg.uri(tag)), ("ociPlainHTTP", "true")],
            )
            .await;
            let s = assert_code(r, Code::FailedPrecondition, entry);
            assert!(s.message().contains("refused"), "{tag}: {}", s.message());
            nothing_sealed(tag);
        }
        let uri = format!("{}#manifest", files.url("corrupt.json"));
        let r = create(&d, "pvc-corrupt", &[("source", &uri)]).await;
        let s = assert_code(r, Code::FailedPrecondition, "failed verification");
        assert!(s.message().contains("model.safetensors"), "{}", s.message());
        nothing_sealed("a corrupted object");

        let uri = format!("{}#manifest", files.url("missing.json"));
        let r = create(&d, "pvc-missing", &[("source", &uri)]).await;
        assert_code(r, Code::NotFound, "weights/missing.safetensors");
        nothing_sealed("a missing object");
    };
    let ((stalled, took), ()) = tokio::join!(stalled, others);
    let s = assert_code(stalled, Code::Unavailable, "stalled");
    assert!(s.message().contains("vocab.txt"), "{}", s.message());
    let attempts = EngineConfig::default().attempts as usize;
    assert_eq!(
        files.gets("stalled/vocab.txt"),
        attempts,
        "one GET per attempt"
    );
    assert!(
        took >= Duration::from_secs(attempts as u64),
        "gave up after {took:?}: the watchdog fired early"
    );
    nothing_sealed("a stalled download");

    // Nothing landed outside a model, and /etc was not written through the link.
    let escaped: Vec<_> = walk(&d.dir)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "evil" || n == "passwd"))
        .collect();
    assert!(escaped.is_empty(), "{escaped:?}");
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    assert!(!passwd.contains("root::0:0::/:/bin/sh"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalls_and_retry_after_are_survived() {
    let dir = fixtures::model_dir();
    let files = FileServer::start(&dir).await;
    files.put("manifest.json", fixtures::manifest_for(&dir, true));
    // The first two GETs of the weights send 1 MiB each, then go silent.
    files.stall_times("model.safetensors", 1 << 20, 2);
    // The first two GETs of another file are refused with 503, Retry-After: 1.
    let (_, vocab_size, vocab_sha) = model_file("vocab.txt");
    files.put("busy/vocab.txt", fs::read(dir.join("vocab.txt")).unwrap());
    files.unavailable_gets("busy/vocab.txt", 2, Some("1"));
    let d = driver(&["--pull-stall-seconds", "1"]).await;

    let stalled = async {
        let started = Instant::now();
        let uri = format!("{}#manifest", files.url("manifest.json"));
        let v = created(create(&d, "pvc-stalls", &[("source", &uri)]).await);
        (v, started.elapsed())
    };
    let busy = async {
        let started = Instant::now();
        let uri = files.url("busy/vocab.txt");
        let v = created(create(&d, "pvc-busy", &[("source", &uri)]).await);
        (v, started.elapsed())
    };
    let ((stalled, stalled_took), (busy, busy_took)) = tokio::join!(stalled, busy);

    // The watchdog dropped two silent connections and asked again: two
    // GETs on top of the planned ones, and the sealed weights are intact.
    let weights = model_file("model.safetensors");
    assert_eq!(files.gets("model.safetensors"), chunks(weights.1) + 2);
    // The two stalled requests may run side by side on parallel
    // connections: at least one stall timeout must have passed.
    assert!(stalled_took >= Duration::from_secs(1), "{stalled_took:?}");
    assert_served(&d, &stalled, model()).await;

    assert_eq!(files.gets("busy/vocab.txt"), 3);
    assert!(
        busy_took >= Duration::from_secs(2),
        "Retry-After: 1, twice, but done in {busy_took:?}"
    );
    let want = [("vocab.txt".to_string(), *vocab_size, vocab_sha.clone())];
    assert_served(&d, &busy, &want).await;
}

/// Every path under `dir`, not following symlinks.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// A pull outlives the CreateVolume that started it: a call that reaches
/// its deadline answers "still pulling" with the progress, the transfer
/// goes on, and each retry joins it, so nothing is fetched twice and the
/// volume is ready within moments of the last byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_outlives_its_callers_deadline_and_retries_join_it() {
    let dir = tempfile::tempdir().unwrap();
    let size: usize = 24 << 20;
    let weights: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(dir.path().join("weights.bin"), &weights).unwrap();
    let files = FileServer::start(dir.path()).await;
    // Two connections at 2 MiB/s each: about 6 s for the whole file.
    files.throttle(2 << 20);
    let d = driver(&[]).await;
    let uri = files.url("weights.bin");

    let started = Instant::now();
    let mut attempts = 0;
    let v = loop {
        attempts += 1;
        let mut req = tonic::Request::new(create_req(
            "pvc-big",
            &[("backend", "local"), ("source", &uri)],
            READER,
        ));
        req.set_timeout(Duration::from_secs(3));
        match d.client.clone().controller.create_volume(req).await {
            Ok(r) => break r.into_inner().volume.unwrap(),
            Err(s) => {
                assert_eq!(s.code(), Code::Unavailable, "{s:?}");
                assert!(s.message().contains("still pulling"), "{}", s.message());
            }
        }
        assert!(attempts < 60, "the pull never finished");
    };
    let took = started.elapsed();
    assert!(
        attempts >= 2,
        "the pull should need several calls: {attempts}"
    );
    assert_eq!(
        files.gets("weights.bin"),
        chunks(size as u64),
        "a range was fetched again: the pull restarted with a call"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let (staging, target) = (d.staging("big"), d.target("big"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert!(fs::read(target.join("weights.bin")).unwrap() == weights);
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
}

/// A restart resumes the pulls that were running, without waiting for a
/// call: the driver recorded which volumes wanted them. The transfer goes
/// on from where it was, and the provisioner's next call finds the volume
/// ready at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_a_wanted_pull_without_a_new_call() {
    let dir = tempfile::tempdir().unwrap();
    let size: usize = 24 << 20;
    let weights: Vec<u8> = (0..size).map(|i| (i * 13 % 251) as u8).collect();
    fs::write(dir.path().join("weights.bin"), &weights).unwrap();
    let files = FileServer::start(dir.path()).await;
    files.throttle(2 << 20);
    let mut d = driver(&[]).await;
    let uri = files.url("weights.bin");
    let call = |timeout: Duration| {
        let mut req = tonic::Request::new(create_req(
            "pvc-resumed",
            &[("backend", "local"), ("source", &uri)],
            READER,
        ));
        req.set_timeout(timeout);
        req
    };
    let e = d
        .client
        .clone()
        .controller
        // Four seconds leave the answer 400 ms to come back (`rpc::budget`)
        // on a loaded machine.
        .create_volume(call(Duration::from_secs(4)))
        .await
        .expect_err("6 s of transfer cannot fit a 4 s call");
    assert!(e.message().contains("still pulling"), "{}", e.message());
    d.kill_9();
    let gets_before = files.gets("weights.bin");
    d.restart().await;
    // No call: the restarted driver fetches the rest on its own, and the
    // operator sees the model sealed.
    let finished = d
        .sealed_within(Duration::from_secs(30), |m| m.len() == 1)
        .await;
    assert!(
        finished.is_ok(),
        "the pull did not finish after the restart without a call ({} GETs after the kill): {finished:?}",
        files.gets("weights.bin") - gets_before
    );
    let (t, asked) = (Instant::now(), files.requests().len());
    // The restarted driver's own resume may still hold the volume's
    // operation for a moment after the seal: the call is then Aborted and
    // tried again, as external-provisioner does.
    let v = d
        .create_until_done(
            &call(Duration::ZERO).into_inner(),
            Some(Duration::from_secs(5)),
            Duration::from_secs(10),
        )
        .await
        .expect("the volume is ready once the resume lets go of it");
    // Ready at once: a hit of the sealed model, which fetches nothing (at
    // most a byte proving access). Its time is the machine's, printed; the
    // call's own 5 s deadline bounds it.
    eprintln!("the call after the seal answered in {:?}", t.elapsed());
    let fetched = fixtures::requested_bytes(&files.requests()[asked..], dir.path());
    assert!(
        fetched <= 1,
        "the call after the seal fetched {fetched} bytes of the model"
    );
    assert!(
        files.gets("weights.bin") <= chunks(size as u64) + 4,
        "{} GETs for {} chunks: the restart started over",
        files.gets("weights.bin"),
        chunks(size as u64)
    );
    let (staging, target) = (d.staging("resumed"), d.target("resumed"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert!(fs::read(target.join("weights.bin")).unwrap() == weights);
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    // Nothing is left recorded as wanted once the volume exists.
    assert!(
        fs::read_dir(d.state_dir.join("wanted"))
            .into_iter()
            .flatten()
            .flatten()
            .next()
            .is_none(),
        "a wanted record outlived its pull"
    );
}

/// A pull with its class's provisioner secret writes no secret: it is
/// recorded for a restart to resume only when the driver, reading the
/// secret again the way external-provisioner did (the PVC's class, its
/// `provisioner-secret-name`/`-namespace`), gets exactly what CreateVolume
/// carried. Against a real kube-apiserver: with the class's secret as
/// passed, a kill -9 mid-pull is resumed with no new call; with the
/// Secret changed since, nothing is recorded, and the restarted driver
/// leaves the pull to the provisioner's next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_secret_pull_is_resumed_only_when_the_secret_read_again_is_the_one_passed() {
    use crate::support::apiserver::ApiServer;
    let api = ApiServer::start().expect("start apiserver");
    let apply = |yaml: &str| {
        let out = api.kubectl_stdin(&["apply", "-f", "-"], yaml);
        assert!(
            out.status.success(),
            "kubectl apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let secret = |token: &str| {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: origin-token, namespace: creds}}\nstringData: {{httpBearerToken: {token}}}\n"
        )
    };
    apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: creds}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: team}}\n---\n{}---\napiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: tokened}}\nprovisioner: modelcache.csi.io\nparameters:\n  csi.storage.k8s.io/provisioner-secret-name: origin-token\n  csi.storage.k8s.io/provisioner-secret-namespace: creds\n",
        secret("GOODTOKEN")
    ));
    for pvc in ["same", "changed"] {
        apply(&format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {pvc}, namespace: team}}\nspec:\n  storageClassName: tokened\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n"
        ));
    }
    let mut d = Driver::start_against(&api, &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let size: usize = 16 << 20;
    for (i, name) in ["same.bin", "changed.bin"].iter().enumerate() {
        let bytes: Vec<u8> = (0..size).map(|j| (j * (7 + i) % 251) as u8).collect();
        fs::write(dir.path().join(name), &bytes).unwrap();
    }
    let files = FileServer::start(dir.path()).await;
    // About 4 s a file: a 1 s call ends long before its pull.
    files.throttle(2 << 20);
    let wanted = |d: &Driver| {
        fs::read_dir(d.state_dir.join("wanted"))
            .into_iter()
            .flatten()
            .flatten()
            .count()
    };
    let sealed = |d: &Driver| {
        fs::read_dir(d.state_dir.join("local/sources"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("seal.json").exists())
            .count()
    };
    let call = |pvc: &str| {
        let uri = files.url(&format!("{pvc}.bin"));
        let mut r = create_req(
            &format!("pvc-{pvc}"),
            &[
                ("csi.storage.k8s.io/pvc/name", pvc),
                ("csi.storage.k8s.io/pvc/namespace", "team"),
                ("csi.storage.k8s.io/pv/name", &format!("pvc-{pvc}")),
                ("backend", "local"),
                ("source", &uri),
            ],
            READER,
        );
        r.secrets = [("httpBearerToken".to_string(), "GOODTOKEN".to_string())].into();
        let mut req = tonic::Request::new(r);
        req.set_timeout(Duration::from_secs(1));
        req
    };

    // The secret read again is the one passed: recorded, and resumed.
    let e = d
        .client
        .clone()
        .controller
        .create_volume(call("same"))
        .await
        .expect_err("4 s of transfer cannot fit a 1 s call");
    assert!(e.message().contains("still pulling"), "{}", e.message());
    assert_eq!(wanted(&d), 1, "the pull was not recorded for a restart");
    d.kill_9();
    d.restart().await;
    let resumed = d
        .sealed_within(Duration::from_secs(30), |m| m.len() == 1)
        .await;
    assert!(
        resumed.is_ok(),
        "the pull was not resumed after the restart: {resumed:?}"
    );
    let sent: Vec<String> = files
        .requests()
        .iter()
        .filter_map(|r| r.header("authorization").map(str::to_string))
        .collect();
    assert!(
        !sent.is_empty() && sent.iter().all(|a| a == "Bearer GOODTOKEN"),
        "the origin saw {sent:?}"
    );
    // The resumed pull's record goes after its seal, not with it: wait for
    // that before counting the records the next create leaves.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while wanted(&d) != 0 {
        assert!(
            std::time::Instant::now() < until,
            "the resumed pull's record was still there 10 s after its seal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Changed since the create: nothing recorded, nothing resumed.
    apply(&secret("NEWTOKEN"));
    let e = d
        .client
        .clone()
        .controller
        .create_volume(call("changed"))
        .await
        .expect_err("4 s of transfer cannot fit a 1 s call");
    assert!(e.message().contains("still pulling"), "{}", e.message());
    assert!(
        d.log_text().contains("secret read now differs"),
        "the driver did not say why the pull is not recorded"
    );
    assert_eq!(wanted(&d), 0, "a pull whose secret changed was recorded");
    d.kill_9();
    d.restart().await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        sealed(&d),
        1,
        "a pull nobody may resume was resumed without a call"
    );
}

/// A class leaves out what it names with the Hub's file filters, through
/// CreateVolume: on a repo shaped like a Llama Instruct one (safetensors
/// shards beside an `original/` checkpoint), `hfIgnorePatterns:
/// original/*` never requests `original/`, and `hfAllowPatterns` pulls only
/// its globs, as another model. A bad glob is refused naming the
/// parameter. Before, the class parser refused every value but
/// "true"/"false", so no class could set them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_leaves_out_what_its_hub_patterns_name() {
    let dir = tempfile::tempdir().unwrap();
    let files: &[(&str, usize)] = &[
        ("config.json", 600),
        ("generation_config.json", 180),
        ("model-00001-of-00002.safetensors", 3 << 20),
        ("model-00002-of-00002.safetensors", 2 << 20),
        ("model.safetensors.index.json", 2000),
        ("tokenizer.json", 9000),
        ("tokenizer_config.json", 5000),
        ("special_tokens_map.json", 300),
        ("LICENSE", 7000),
        ("README.md", 4000),
        ("original/consolidated.00.pth", 4 << 20),
        ("original/params.json", 200),
        ("original/tokenizer.model", 2 << 20),
    ];
    for (i, (path, size)) in files.iter().enumerate() {
        let at = dir.path().join(path);
        fs::create_dir_all(at.parent().unwrap()).unwrap();
        fs::write(at, fixtures::pseudo_random(900 + i as u64, *size)).unwrap();
    }
    let hub = HubServer::start(dir.path()).await;
    let endpoint = hub.endpoint();
    let d = driver(&[]).await;
    let uri = "hf://org/minilm";

    let ignored = created(
        create(
            &d,
            "pvc-no-original",
            &[
                ("source", uri),
                ("hfEndpoint", &endpoint),
                ("hfIgnorePatterns", "original/*"),
            ],
        )
        .await,
    );
    let asked: Vec<String> = hub
        .requests()
        .iter()
        .map(|r| r.raw_path.clone())
        .filter(|p| p.contains("/resolve/") || p.contains("cdn-lfs"))
        .collect();
    assert!(!asked.is_empty());
    assert!(
        !asked.iter().any(|p| p.contains("original")),
        "original/ was requested: {asked:?}"
    );
    let sid = ignored.volume_context["source"].clone();
    d.wait_sealed(&[&sid], SEAL_BOUND).await;
    let data = d.source_dir("local", &sid).join("data");
    assert!(!data.join("original").exists());
    assert!(data.join("model-00002-of-00002.safetensors").is_file());

    let allowed = created(
        create(
            &d,
            "pvc-weights-only",
            &[
                ("source", uri),
                ("hfEndpoint", &endpoint),
                ("hfAllowPatterns", "*.safetensors,*.json"),
            ],
        )
        .await,
    );
    let only = allowed.volume_context["source"].clone();
    assert_ne!(only, sid, "another subset of the repo is another model");
    d.wait_sealed(&[&only], SEAL_BOUND).await;
    let mut got: Vec<String> = fixtures::tree_files(&d.source_dir("local", &only).join("data"))
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "config.json",
            "generation_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "original/params.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    );

    let bad = create(
        &d,
        "pvc-bad-glob",
        &[
            ("source", uri),
            ("hfEndpoint", &endpoint),
            ("hfAllowPatterns", "model-["),
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(
        bad.message().contains("parameters.hfAllowPatterns"),
        "{bad:?}"
    );
}

/// A Hub repo of 10,000 small files in 97 directories against the same
/// files by `#manifest` (with their sha256), each pulled by a fresh driver:
/// the time to the create's answer and to the seal, printed. Run alone:
/// `cargo test --test it -- --ignored --nocapture many_small_files`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: docs/benchmarks.md, many small files"]
async fn many_small_files() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("repo");
    let files = std::env::var("BENCH_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000usize);
    small_files(&root, files);
    let hub = HubServer::start(&root).await;
    hub.page_size(1000);
    let origin = FileServer::start(&root).await;
    origin.put("m.json", fixtures::manifest_for(&root, true));
    let endpoint = hub.endpoint();
    let manifest = format!("{}#manifest", origin.url("m.json"));
    for (what, params) in [
        (
            "hf://",
            vec![
                ("source", format!("hf://{HUB_REPO}@{HUB_SHA}")),
                ("hfEndpoint", endpoint.clone()),
            ],
        ),
        ("#manifest", vec![("source", manifest.clone())]),
    ] {
        let d = driver(&[]).await;
        let refs: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let t0 = std::time::Instant::now();
        let v = created(create(&d, "pvc-many", &refs).await);
        let answered = t0.elapsed();
        d.wait_sealed(
            &[v.volume_context["source"].as_str()],
            Duration::from_secs(900),
        )
        .await;
        eprintln!(
            "{what}: {files} files answered in {:.1}s, sealed in {:.1}s",
            answered.as_secs_f64(),
            t0.elapsed().as_secs_f64()
        );
    }
}

/// `n` files of 0.5 to 4 KiB in 97 directories.
fn small_files(root: &Path, n: usize) {
    for i in 0..n {
        let dir = root.join(format!("d{:02}", i % 97));
        fs::create_dir_all(&dir).unwrap();
        let size = 512 + (i * 7919) % 3584;
        fs::write(
            dir.join(format!("f{i:05}.json")),
            fixtures::pseudo_random(i as u64 + 1, size),
        )
        .unwrap();
    }
}

/// A Hub repo of many small files is pulled at the pace of its transfers:
/// a file that ends early does not hold its transfer slot until the
/// create answers (which needs every file's verdict, so files queued
/// behind the slots came a wave every 10 s: 300 files took about 6
/// minutes). Bound: 60 s, for what takes about a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_repo_of_many_small_files_is_not_paced_by_its_answer() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("repo");
    small_files(&root, 300);
    let hub = HubServer::start(&root).await;
    hub.page_size(1000);
    let endpoint = hub.endpoint();
    let source = format!("hf://{HUB_REPO}@{HUB_SHA}");
    let d = driver(&[]).await;
    let params = [
        ("source", source.as_str()),
        ("hfEndpoint", endpoint.as_str()),
    ];
    let v = tokio::time::timeout(Duration::from_secs(60), create(&d, "pvc-many", &params))
        .await
        .expect("300 small files not answered within 60 s");
    let v = created(v);
    d.wait_sealed(&[v.volume_context["source"].as_str()], SEAL_BOUND)
        .await;
    assert_eq!(fixtures::tree_files(&root).len(), 300);
    let sid = v.volume_context["source"].clone();
    for (path, _) in fixtures::tree_files(&root) {
        assert_eq!(
            fs::read(d.source_dir("local", &sid).join("data").join(&path)).unwrap(),
            fs::read(root.join(&path)).unwrap(),
            "{path}"
        );
    }
}
