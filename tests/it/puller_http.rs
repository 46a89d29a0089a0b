//! The `http(s)://`, `hf://` and `model-registry://` sources against
//! loopback fixtures serving the real all-MiniLM-L6-v2 model: resolve,
//! full and ranged reads, revisions, manifests, and how each failure
//! (404, 503 + Retry-After, a cut or stalled body, a refused token)
//! reaches the caller.

use crate::support::fixtures;
use crate::support::reading::{read_all, sha256};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use fixtures::{FileServer, HUB_SHA, HubServer, RegistryServer};
use futures::StreamExt;
use modelcache_csi::error::Error;
use modelcache_csi::puller::SourceOptions;
use modelcache_csi::puller::hf::HfSource;
use modelcache_csi::puller::http::HttpSource;
use modelcache_csi::puller::registry;
use modelcache_csi::puller::source::{RemoteFile, Resolved, Source};

fn opts(params: &[(&str, &str)], secrets: &[(&str, &str)]) -> SourceOptions {
    let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    SourceOptions {
        params: map(params),
        secrets: map(secrets),
        ..SourceOptions::default()
    }
}

fn http(uri: &str) -> HttpSource {
    HttpSource::new(uri, &SourceOptions::default()).expect("valid http source")
}

fn file<'a>(r: &'a Resolved, path: &str) -> &'a RemoteFile {
    r.files
        .iter()
        .find(|f| f.path == path)
        .unwrap_or_else(|| panic!("{path} not in {:?}", r.files))
}

fn bytes_of(dir: &Path, path: &str) -> Vec<u8> {
    std::fs::read(dir.join(path)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_resolves_and_reads_full_and_ranged() {
    let model = fixtures::model_dir();
    let server = FileServer::start(&model).await;
    let src = http(&server.url("model.safetensors?sig=secret"));
    let r = src.resolve().await.expect("resolve");
    let real = bytes_of(&model, "model.safetensors");

    assert_eq!(
        r.uri,
        server.url("model.safetensors"),
        "no query in the uri"
    );
    assert!(r.revision.starts_with("etag:"), "{}", r.revision);
    assert_eq!(r.files.len(), 1);
    let f = &r.files[0];
    assert_eq!(f.path, "model.safetensors");
    assert_eq!(f.size, Some(real.len() as u64));
    assert_eq!(f.sha256, None);
    assert!(!f.locator.contains("secret"), "{}", f.locator);
    assert!(src.ranges());
    assert_eq!(server.heads("model.safetensors"), 1);

    let whole = read_all(&src, f, 0, None).await;
    assert_eq!(sha256(&whole), sha256(&real));
    let part = read_all(&src, f, 1_000_003, Some(4 << 20)).await;
    assert_eq!(part, real[1_000_003..1_000_003 + (4 << 20)]);
    let tail = read_all(&src, f, real.len() as u64 - 777, None).await;
    assert_eq!(tail, real[real.len() - 777..]);
    assert!(read_all(&src, f, real.len() as u64, None).await.is_empty());
    assert_eq!(server.gets("model.safetensors"), 3);

    // The same server without validators: a warning and a weak revision.
    let small = FileServer::start(&model).await;
    small.without_validators();
    let r = http(&small.url("config.json")).resolve().await.unwrap();
    assert_eq!(
        r.revision,
        format!("unversioned-{}", real_len(&model, "config.json"))
    );

    // #sha256= pins the content, whatever the server says.
    let hex = sha256(&bytes_of(&model, "config.json"));
    let r = http(&format!("{}#sha256={hex}", small.url("config.json")))
        .resolve()
        .await
        .unwrap();
    assert_eq!(r.revision, format!("sha256:{hex}"));
    assert_eq!(r.files[0].sha256.as_deref(), Some(hex.as_str()));
}

fn real_len(dir: &Path, path: &str) -> u64 {
    std::fs::metadata(dir.join(path)).unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_resolves_every_file_and_reads_them() {
    let model = fixtures::model_dir();
    let expected = fixtures::tree_files(&model);
    let server = FileServer::start(&model).await;
    let body = fixtures::manifest_for(&model, true);
    // Next to the model files: its relative URLs resolve against it.
    server.put("minilm.json", body.clone());
    let src = http(&format!("{}#manifest", server.url("minilm.json")));

    let r = src.resolve().await.expect("resolve manifest");
    assert_eq!(r.uri, format!("{}#manifest", server.url("minilm.json")));
    assert_eq!(r.revision, format!("manifest:{}", sha256(&body)));
    assert_eq!(r.files.len(), expected.len());
    assert_eq!(
        r.files.len(),
        12,
        "all-MiniLM-L6-v2 as packaged has 12 files"
    );
    for (path, size) in &expected {
        let f = file(&r, path);
        assert_eq!(f.size, Some(*size), "{path}");
        assert!(f.sha256.as_deref().is_some_and(|h| h.len() == 64), "{path}");
        assert_eq!(server.heads(path), 1, "{path} HEADed once");
    }
    assert!(src.ranges());
    for (path, _) in expected.iter().filter(|(_, s)| *s < (1 << 20)) {
        let f = file(&r, path);
        let got = read_all(&src, f, 0, None).await;
        assert_eq!(sha256(&got), f.sha256.clone().unwrap(), "{path}");
    }
    let f = file(&r, "model.safetensors");
    let real = bytes_of(&model, "model.safetensors");
    let part = read_all(&src, f, 50 << 20, Some(1 << 20)).await;
    assert_eq!(part, real[50 << 20..51 << 20]);

    // Without sha256 or sizes: HEAD fills the sizes, and the validators
    // of the unpinned files join the revision.
    let bare = serde_json::json!({"files": [
        {"path": "config.json"},
        {"path": "1_Pooling/config.json", "url": "1_Pooling/config.json"},
        {"path": "weights/model.safetensors", "url": server.url("model.safetensors")},
    ]});
    let bare_body = serde_json::to_vec(&bare).unwrap();
    server.put("bare.json", bare_body.clone());
    let src = http(&format!("{}#manifest", server.url("bare.json")));
    let r = src.resolve().await.expect("resolve bare manifest");
    assert!(r.revision.starts_with("manifest:"));
    assert_ne!(r.revision, format!("manifest:{}", sha256(&bare_body)));
    assert_eq!(r.files.len(), 3);
    assert!(r.files.iter().all(|f| f.sha256.is_none()));
    assert_eq!(
        file(&r, "weights/model.safetensors").size,
        Some(real.len() as u64)
    );
    let pooling = file(&r, "1_Pooling/config.json");
    assert_eq!(
        read_all(&src, pooling, 0, None).await,
        bytes_of(&model, "1_Pooling/config.json")
    );

    // Broken manifests are the user's to fix.
    server.put(
        "bad.json",
        br#"{"files": [{"path": "a", "sha265": "x"}]}"#.to_vec(),
    );
    let err = http(&format!("{}#manifest", server.url("bad.json")))
        .resolve()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err}");
}

#[tokio::test]
async fn missing_files_are_not_found() {
    let model = fixtures::model_dir();
    let server = FileServer::start(&model).await;
    server.not_found("config.json");
    let err = http(&server.url("config.json"))
        .resolve()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err}");
    let err = http(&server.url("no-such-file.bin"))
        .resolve()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err}");

    // A manifest naming a missing file fails at resolve, before any download.
    let m = serde_json::json!({"files": [{"path": "vocab.txt"}, {"path": "gone.bin"}]});
    server.put("m.json", serde_json::to_vec(&m).unwrap());
    let err = http(&format!("{}#manifest", server.url("m.json")))
        .resolve()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound(ref m) if m.contains("gone.bin")),
        "{err}"
    );
}

#[tokio::test]
async fn unavailable_with_retry_after_says_when() {
    let model = fixtures::model_dir();
    let server = FileServer::start(&model).await;
    let src = http(&server.url("vocab.txt"));

    server.unavailable("vocab.txt", 1, Some("7"));
    match src.resolve().await {
        Err(Error::RetryAfter { after, message }) => {
            assert_eq!(after, Duration::from_secs(7));
            assert!(message.contains("503"), "{message}");
        }
        other => panic!("expected RetryAfter, got {other:?}"),
    }
    // Served again once the 503s are used up.
    let r = src.resolve().await.expect("resolve after the 503");

    // An HTTP date, on a read.
    let at = fixtures::http_date(SystemTime::now() + Duration::from_secs(30));
    server.unavailable("vocab.txt", 1, Some(&at));
    match src.read(&r.files[0], 0, Some(10)).await {
        Err(Error::RetryAfter { after, .. }) => {
            assert!((27..=30).contains(&after.as_secs()), "{after:?}");
        }
        Err(e) => panic!("expected RetryAfter, got {e:?}"),
        Ok(_) => panic!("expected RetryAfter, got a stream"),
    }
    // Without Retry-After, plain Unavailable.
    server.unavailable("vocab.txt", 1, None);
    let err = src.resolve().await.unwrap_err();
    assert!(matches!(err, Error::Transient(_)), "{err}");
}

#[tokio::test]
async fn cut_and_ignored_ranges_are_never_taken_for_data() {
    let model = fixtures::model_dir();
    let real = bytes_of(&model, "tokenizer.json");
    let server = FileServer::start(&model).await;
    let src = http(&server.url("tokenizer.json"));
    let r = src.resolve().await.unwrap();
    let f = &r.files[0];

    // A body cut mid-way is an error, not a short file.
    server.truncate("tokenizer.json", 1000);
    let mut stream = src.read(f, 0, None).await.expect("headers arrive");
    let mut got = 0;
    let err = loop {
        match stream.next().await {
            Some(Ok(b)) => got += b.len(),
            Some(Err(e)) => break e,
            None => panic!("a truncated body ended cleanly after {got} bytes"),
        }
    };
    assert_eq!(got, 1000);
    assert!(matches!(err, Error::Transient(_)), "{err}");
    server.heal("tokenizer.json");

    // A server that ignores Range: the bytes are still exactly the range,
    // and the source stops claiming ranges.
    let plain = FileServer::start(&model).await;
    plain.ignore_ranges();
    let src = http(&plain.url("tokenizer.json"));
    let r = src.resolve().await.unwrap();
    assert!(!src.ranges());
    let got = read_all(&src, &r.files[0], 12_345, Some(6_789)).await;
    assert_eq!(got, real[12_345..12_345 + 6_789]);
}

#[tokio::test]
async fn a_stalled_body_is_a_stream_that_stops_yielding() {
    let model = fixtures::model_dir();
    let server = FileServer::start(&model).await;
    let src = http(&server.url("model.safetensors"));
    let r = src.resolve().await.unwrap();
    server.stall("model.safetensors", 64 << 10);

    let stream = tokio::time::timeout(Duration::from_secs(5), src.read(&r.files[0], 0, None))
        .await
        .expect("read() returns once headers arrive")
        .expect("read");
    // The bytes before the stall arrive; then the stream neither ends nor
    // fails: the engine's watchdog is what gives up.
    let mut stream = stream;
    let mut got = 0;
    while got < 64 << 10 {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("bytes before the stall arrive")
            .expect("not the end")
            .expect("not an error");
        got += chunk.len();
    }
    assert_eq!(got, 64 << 10);
    assert!(
        tokio::time::timeout(Duration::from_millis(700), stream.next())
            .await
            .is_err(),
        "a stalled body must neither end nor fail"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_resolves_the_commit_and_lfs_digests() {
    let model = fixtures::model_dir();
    let hub = HubServer::start(&model).await;
    let endpoint = hub.endpoint();
    let params = [("hfEndpoint", endpoint.as_str())];
    let src = HfSource::new("hf://org/minilm", &opts(&params, &[])).unwrap();
    let r = src.resolve().await.expect("resolve");

    assert_eq!(r.uri, "hf://org/minilm");
    assert_eq!(r.revision, HUB_SHA);
    let expected = fixtures::tree_files(&model);
    assert_eq!(r.files.len(), expected.len());
    for (path, size) in &expected {
        assert_eq!(file(&r, path).size, Some(*size), "{path}");
    }
    let st = file(&r, "model.safetensors");
    let real_sha = fixtures::sha256_file(&model.join("model.safetensors"));
    assert_eq!(st.sha256.as_deref(), Some(real_sha.as_str()));
    assert_eq!(file(&r, "config.json").sha256, None, "not an LFS file");

    // Reads go to the commit, through the LFS redirect, with ranges.
    let cfg = file(&r, "1_Pooling/config.json");
    assert_eq!(
        read_all(&src, cfg, 0, None).await,
        bytes_of(&model, "1_Pooling/config.json")
    );
    let real = bytes_of(&model, "model.safetensors");
    let part = read_all(&src, st, 7 << 20, Some(3 << 20)).await;
    assert_eq!(part, real[7 << 20..10 << 20]);
    assert_eq!(
        hub.gets(&format!("org/minilm/resolve/{HUB_SHA}/model.safetensors")),
        1
    );
    assert_eq!(hub.gets("org/minilm/resolve/main/model.safetensors"), 0);

    // The commit itself resolves to the same thing; unknown things fail well.
    let pinned = HfSource::new(&format!("hf://org/minilm@{HUB_SHA}"), &opts(&params, &[]))
        .unwrap()
        .resolve()
        .await
        .unwrap();
    assert_eq!(pinned, r);
    let err = HfSource::new("hf://org/minilm@nope", &opts(&params, &[]))
        .unwrap()
        .resolve()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound(_)), "{err}");
    let err = HfSource::new("hf://org/other", &opts(&params, &[]))
        .unwrap()
        .resolve()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Precondition(_)), "{err}");

    // A gated repo lists publicly, as the Hub's do, and serves its files
    // only with the token.
    hub.gate("hf_s3cr3t");
    let open = HfSource::new("hf://org/minilm", &opts(&params, &[])).unwrap();
    let listed = open
        .resolve()
        .await
        .expect("a gated repo's listing is public");
    let err = open.authorize(&listed).await.unwrap_err();
    assert!(
        matches!(err, Error::Precondition(ref m) if m.contains("gated repo")),
        "{err}"
    );
    // A private repo needs the token for everything, and the token never shows.
    hub.make_private("hf_s3cr3t");
    let err = HfSource::new("hf://org/minilm", &opts(&params, &[]))
        .unwrap()
        .resolve()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Precondition(ref m) if m.contains("hfToken")),
        "{err}"
    );
    let secrets = [("hfToken", "hf_wrong")];
    let err = HfSource::new("hf://org/minilm", &opts(&params, &secrets))
        .unwrap()
        .resolve()
        .await
        .unwrap_err();
    assert!(!err.to_string().contains("hf_wrong"), "{err}");
    let secrets = [("hfToken", "hf_s3cr3t")];
    let gated = HfSource::new("hf://org/minilm", &opts(&params, &secrets)).unwrap();
    let r = gated.resolve().await.expect("resolve with the token");
    assert_eq!(
        read_all(&gated, file(&r, "config.json"), 0, None).await,
        bytes_of(&model, "config.json")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_registry_resolves_to_the_artifact_uri() {
    let model = fixtures::model_dir();
    let files = FileServer::start(&model).await;
    files.put("minilm.json", fixtures::manifest_for(&model, false));
    let manifest = format!("{}#manifest", files.url("minilm.json"));
    let reg = RegistryServer::start(
        "minilm",
        &[
            ("v1", "s3://models/minilm/v1"),
            ("v2", manifest.as_str()),
            ("v3", "oci://registry.example/minilm:v3"),
            ("loop", "model-registry://minilm/v1"),
        ],
    )
    .await;
    let url = reg.url();
    let o = opts(&[("modelRegistryURL", url.as_str())], &[]);

    let (uri, base) = registry::resolve_artifact_uri("model-registry://minilm/v2", &o)
        .await
        .expect("resolve v2");
    assert_eq!(
        base.as_str().trim_end_matches('/'),
        url.trim_end_matches('/')
    );
    assert_eq!(uri, manifest);
    // The dispatcher then fetches that URI with its own source.
    let r = http(&uri).resolve().await.expect("the artifact resolves");
    assert_eq!(r.files.len(), fixtures::tree_files(&model).len());

    // KServe's form with the registry's host:port.
    let kserve = format!("model-registry://{}/minilm/v1", reg.authority());
    assert_eq!(
        registry::resolve_artifact_uri(&kserve, &o).await.unwrap().0,
        "s3://models/minilm/v1"
    );

    // Latest = the newest live version; the loop version is newest, and refused.
    let err = registry::resolve_artifact_uri("model-registry://minilm", &o)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err}");
    reg.archive("loop");
    assert_eq!(
        registry::resolve_artifact_uri("model-registry://minilm", &o)
            .await
            .unwrap()
            .0,
        "oci://registry.example/minilm:v3"
    );
    assert!(
        reg.requests().iter().any(|r| r.contains("nextPageToken=")),
        "paging was exercised: {:?}",
        reg.requests()
    );

    for missing in ["model-registry://minilm/v9", "model-registry://other/v1"] {
        let err = registry::resolve_artifact_uri(missing, &o)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotFound(_)), "{missing}: {err}");
    }

    reg.require_token("mr-token");
    let err = registry::resolve_artifact_uri("model-registry://minilm/v1", &o)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Precondition(_)), "{err}");
    let o = opts(
        &[("modelRegistryURL", url.as_str())],
        &[("modelRegistryToken", "mr-token")],
    );
    assert_eq!(
        registry::resolve_artifact_uri("model-registry://minilm/v1", &o)
            .await
            .unwrap()
            .0,
        "s3://models/minilm/v1"
    );
}

/// hfAllowPatterns and hfIgnorePatterns pick a subset of the repo, as
/// huggingface_hub's allow_patterns and ignore_patterns do (`*` crosses `/`),
/// and the subset is its own model: its URI carries the patterns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_patterns_pick_a_subset_that_is_its_own_model() {
    let model = fixtures::model_dir();
    let hub = HubServer::start(&model).await;
    let endpoint = hub.endpoint();
    let params = [
        ("hfEndpoint", endpoint.as_str()),
        ("hfAllowPatterns", " *.json, *.safetensors ,*.json"),
        ("hfIgnorePatterns", "1_Pooling/*"),
    ];
    let r = HfSource::new("hf://org/minilm", &opts(&params, &[]))
        .unwrap()
        .resolve()
        .await
        .expect("resolve");
    let want: Vec<String> = fixtures::tree_files(&model)
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| {
            (p.ends_with(".json") || p.ends_with(".safetensors")) && !p.starts_with("1_Pooling/")
        })
        .collect();
    let mut got: Vec<String> = r.files.iter().map(|f| f.path.clone()).collect();
    got.sort();
    assert_eq!(got, want);
    assert!(got.iter().any(|p| p == "model.safetensors"));
    assert!(!got.iter().any(|p| p == "vocab.txt"));
    assert_eq!(
        r.uri,
        "hf://org/minilm?allow=*.json,*.safetensors&ignore=1_Pooling/*"
    );

    // `*` crosses `/`: *.json alone keeps 1_Pooling/config.json.
    let r = HfSource::new(
        "hf://org/minilm",
        &opts(
            &[
                ("hfEndpoint", endpoint.as_str()),
                ("hfAllowPatterns", "*.json"),
            ],
            &[],
        ),
    )
    .unwrap()
    .resolve()
    .await
    .unwrap();
    assert!(r.files.iter().any(|f| f.path == "1_Pooling/config.json"));

    // A bad glob, and patterns that leave nothing, name the parameter.
    let err = HfSource::new(
        "hf://org/minilm",
        &opts(
            &[
                ("hfEndpoint", endpoint.as_str()),
                ("hfAllowPatterns", "model[.bin"),
            ],
            &[],
        ),
    )
    .err()
    .expect("a bad glob is refused");
    assert!(
        matches!(&err, Error::Invalid { field, message } if field == "parameters.hfAllowPatterns" && message.contains("not a glob")),
        "{err}"
    );
    let err = HfSource::new(
        "hf://org/minilm",
        &opts(
            &[
                ("hfEndpoint", endpoint.as_str()),
                ("hfAllowPatterns", "*.gguf"),
            ],
            &[],
        ),
    )
    .unwrap()
    .resolve()
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::Invalid { field, message } if field == "parameters.hfAllowPatterns" && message.contains("leave none")),
        "{err}"
    );
}

/// Even a source an admin chose never reaches cloud metadata: a redirect,
/// a manifest entry or a name pointing at a link-local address is refused
/// (PermissionDenied, not retried), before any connection is made.
#[tokio::test]
async fn no_source_reaches_link_local_metadata() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("w.bin"), b"weights").unwrap();
    let files = FileServer::start(dir.path()).await;
    files.redirect(
        "moved.bin",
        "http://169.254.169.254/latest/meta-data/iam/w.bin",
    );
    files.put(
        "list.json",
        serde_json::to_vec(&serde_json::json!({"files": [
            {"path": "w.bin", "url": "http://169.254.169.254/latest/w.bin"}
        ]}))
        .unwrap(),
    );
    for uri in [
        files.url("moved.bin"),
        format!("{}#manifest", files.url("list.json")),
        "http://169.254.169.254/latest/w.bin".to_string(),
        "http://[fe80::1]/w.bin".to_string(),
    ] {
        let src = http(&uri);
        let e = match src.resolve().await {
            Err(e) => e,
            Ok(r) => src
                .read(&r.files[0], 0, None)
                .await
                .err()
                .expect("a link-local read was started"),
        };
        assert!(
            matches!(&e, Error::NotAllowed(m) if m.contains("link-local")),
            "{uri}: {e:?}"
        );
    }
}

/// A sealed copy of a gated model is a cache hit only for a requester the
/// Hub would serve: its listing is public, so the engine reads a byte of
/// the content with each requester's own token before handing it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_hit_of_a_gated_repo_needs_the_requesters_own_access() {
    use modelcache_csi::config::Config;
    use modelcache_csi::puller::engine::{Engine, EngineConfig, NoProgress};
    let model = fixtures::model_dir();
    let hub = HubServer::start(&model).await;
    hub.gate("team-a-token");
    let state = tempfile::tempdir().unwrap();
    let root = modelcache_csi::cache::Roots::of(&Config::for_node("n", state.path()))
        .roots
        .remove(0);
    let engine = Engine::new(
        EngineConfig::default(),
        modelcache_csi::puller::extract_layer,
    );
    let endpoint = hub.endpoint();
    // Through `puller::open`, as the driver makes every source: it tells
    // requesters apart by the credentials they present.
    let source = |token: Option<&'static str>| {
        let secrets: Vec<(&str, &str)> = token.map(|t| ("hfToken", t)).into_iter().collect();
        let o = opts(&[("hfEndpoint", &endpoint)], &secrets);
        async move {
            modelcache_csi::puller::open("hf://org/minilm", &o)
                .await
                .unwrap()
        }
    };
    let first = engine
        .pull(&root, source(Some("team-a-token")).await, &NoProgress)
        .await
        .expect("the token holder pulls");
    assert!(!first.hit);
    for token in [None, Some("a-guess")] {
        let err = engine
            .pull(&root, source(token).await, &NoProgress)
            .await
            .err()
            .unwrap_or_else(|| panic!("{token:?}: a gated cache hit was served"));
        assert!(
            matches!(err, Error::Precondition(ref m) if m.contains("gated repo")),
            "{token:?}: {err}"
        );
    }
    // The token holder's own hit costs the origin nothing: its pull proved
    // its access. Only its own reads are counted: a refused requester's
    // second probe, dropped when the first was refused, may still reach
    // the Hub after its refusal was answered.
    let resolves = |h: &HubServer| {
        h.requests()
            .iter()
            .filter(|r| {
                r.raw_path.contains("/resolve/")
                    && r.header("authorization") == Some("Bearer team-a-token")
            })
            .count()
    };
    let before = resolves(&hub);
    let again = engine
        .pull(&root, source(Some("team-a-token")).await, &NoProgress)
        .await
        .expect("the token holder's hit");
    assert!(again.hit);
    assert_eq!(again.sid, first.sid);
    assert_eq!(
        resolves(&hub),
        before,
        "a proven requester's hit read content again"
    );
}

/// A Hub token Secret made for other tools works as is: `HF_TOKEN`,
/// `HUGGING_FACE_HUB_TOKEN` and `token` are taken as `hfToken` (the
/// walkthrough's F15: a Secret keyed `HF_TOKEN` was ignored, and the pull
/// of a gated repo failed with 401). An unknown key is still no token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_token_is_found_under_the_keys_other_tools_use() {
    use modelcache_csi::config::Config;
    use modelcache_csi::puller::engine::{Engine, EngineConfig, NoProgress};
    let model = fixtures::model_dir();
    let hub = HubServer::start(&model).await;
    hub.gate("the-token");
    let endpoint = hub.endpoint();
    for key in ["hfToken", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "token"] {
        let state = tempfile::tempdir().unwrap();
        let root = modelcache_csi::cache::Roots::of(&Config::for_node("n", state.path()))
            .roots
            .remove(0);
        let engine = Engine::new(
            EngineConfig::default(),
            modelcache_csi::puller::extract_layer,
        );
        let o = opts(&[("hfEndpoint", &endpoint)], &[(key, "the-token")]);
        let src = modelcache_csi::puller::open("hf://org/minilm", &o)
            .await
            .unwrap();
        engine
            .pull(&root, src, &NoProgress)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    let state = tempfile::tempdir().unwrap();
    let root = modelcache_csi::cache::Roots::of(&Config::for_node("n", state.path()))
        .roots
        .remove(0);
    let engine = Engine::new(
        EngineConfig::default(),
        modelcache_csi::puller::extract_layer,
    );
    let o = opts(&[("hfEndpoint", &endpoint)], &[("hf-token", "the-token")]);
    let src = modelcache_csi::puller::open("hf://org/minilm", &o)
        .await
        .unwrap();
    let e = engine
        .pull(&root, src, &NoProgress)
        .await
        .err()
        .expect("no token");
    assert!(e.to_string().contains("hfToken"), "{e}");
}
