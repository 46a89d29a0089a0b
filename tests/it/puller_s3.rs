//! The `s3://` source against a real MinIO on loopback: listing, full and
//! ranged reads of the real all-MiniLM-L6-v2 model, revisions, version
//! pinning, and how each failure maps to a domain error.

use crate::support::minio;
use crate::support::reading::{read_all, sha256};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use futures::TryStreamExt;
use minio::Minio;
use modelcache_csi::error::Error;
use modelcache_csi::puller::SourceOptions;
use modelcache_csi::puller::s3::{self, S3Source};
use modelcache_csi::puller::source::{Source, Unpack};

fn model_dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/model.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("run model.sh");
    assert!(out.status.success(), "model.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn options(minio: &Minio) -> SourceOptions {
    SourceOptions {
        params: minio.params(),
        secrets: minio.secrets(),
        ..SourceOptions::default()
    }
}

fn source(minio: &Minio, uri: &str) -> S3Source {
    s3::new(uri, &options(minio)).expect("valid source")
}

/// Everything that needs the real model, on one upload of it.
#[tokio::test]
async fn real_model_lists_reads_and_pins_versions() {
    let model = model_dir();
    let minio = Minio::start();
    minio.create_bucket("models").await;
    let uploaded = minio.upload_dir("models", "models/minilm", &model).await;
    assert!(uploaded.iter().any(|(p, _)| p == "1_Pooling/config.json"));
    // A sibling whose name extends the prefix must not leak into the model.
    minio
        .put("models", "models/minilm-v2/x.bin", b"x".to_vec())
        .await;

    let src = source(&minio, "s3://models/models/minilm/");
    let resolved = src.resolve().await.expect("resolve");
    assert_eq!(resolved.uri, "s3://models/models/minilm");
    assert_eq!(resolved.revision.len(), 64, "{}", resolved.revision);
    let listed: Vec<(String, u64)> = resolved
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size.expect("size from the listing")))
        .collect();
    assert_eq!(listed, uploaded, "exactly the uploaded tree");
    for f in &resolved.files {
        assert_eq!(f.locator, format!("models/minilm/{}", f.path));
        assert_eq!(f.unpack, Unpack::None);
        assert_eq!(f.sha256, None, "object_store exposes no S3 checksum");
    }

    // Every file whole, byte for byte; one GET per read.
    for f in &resolved.files {
        let before = minio.get_object_count();
        let got = read_all(&src, f, 0, None).await;
        assert_eq!(minio.get_object_count(), before + 1, "{}", f.path);
        let want = std::fs::read(model.join(&f.path)).unwrap();
        assert_eq!(got.len(), want.len(), "{}", f.path);
        assert_eq!(sha256(&got), sha256(&want), "{}", f.path);
    }

    // Ranges inside the weights, bounded and to the end.
    let weights = resolved
        .files
        .iter()
        .find(|f| f.path == "model.safetensors")
        .unwrap();
    let want = std::fs::read(model.join("model.safetensors")).unwrap();
    let size = want.len() as u64;
    for (offset, len) in [
        (12_345_678u64, Some(1_000_003u64)),
        (size / 2, Some(1)),
        (size - 4096, None),
        (1, Some(size - 1)),
    ] {
        let before = minio.get_object_count_in("models");
        let got = read_all(&src, weights, offset, len).await;
        assert_eq!(minio.get_object_count_in("models"), before + 1);
        let end = len.map_or(size, |l| offset + l) as usize;
        assert_eq!(got, want[offset as usize..end], "range {offset}+{len:?}");
    }
    // An empty range needs no request; one past the end is a caller bug.
    assert!(read_all(&src, weights, size, None).await.is_empty());
    let err = src.read(weights, size - 1, Some(2)).await.err().unwrap();
    assert!(matches!(err, Error::Unsatisfiable(_)), "{err}");

    // The revision names exactly these object versions.
    let again = source(&minio, "s3://models/models/minilm")
        .resolve()
        .await
        .unwrap();
    assert_eq!(again.revision, resolved.revision);
    assert_eq!(again.files, resolved.files);
    // Identical bytes re-uploaded: S3 ETags are content hashes, same revision.
    let config = std::fs::read(model.join("config.json")).unwrap();
    minio
        .put("models", "models/minilm/config.json", config.clone())
        .await;
    assert_eq!(src.resolve().await.unwrap().revision, resolved.revision);

    // Overwritten mid-pull: a read pinned to the old version fails instead
    // of mixing versions, and the next resolve is a new revision.
    let pinned = src.resolve().await.unwrap();
    let file = pinned
        .files
        .iter()
        .find(|f| f.path == "config.json")
        .unwrap();
    let mut changed = config.clone();
    changed.extend_from_slice(b"\n");
    minio
        .put("models", "models/minilm/config.json", changed.clone())
        .await;
    let err = src
        .read(file, 0, Some(10))
        .await
        .err()
        .expect("read of a changed object");
    assert!(matches!(err, Error::Precondition(_)), "{err:?}");
    assert!(err.to_string().contains("changed during the pull"), "{err}");
    let changed_rev = src.resolve().await.unwrap();
    assert_ne!(changed_rev.revision, resolved.revision);
    let file = changed_rev
        .files
        .iter()
        .find(|f| f.path == "config.json")
        .unwrap();
    assert_eq!(file.size, Some(changed.len() as u64));
    assert_eq!(read_all(&src, file, 0, None).await, changed);
}

/// Prefix semantics: whole bucket, one object, directory markers, and what
/// is not there.
#[tokio::test]
async fn prefixes_markers_single_objects_and_not_found() {
    let minio = Minio::start();
    minio.create_bucket("tree").await;
    minio.put("tree", "m/a.txt", b"alpha".to_vec()).await;
    minio.put("tree", "m/sub/b.txt", b"beta".to_vec()).await;
    minio.put("tree", "m/empty.txt", Vec::new()).await;
    // Directory markers as consoles create them: `m/`, `m/sub/`, `m/void/`.
    for marker in ["m/", "m/sub/", "m/void/"] {
        minio.put_raw_key("tree", marker);
    }

    let resolved = source(&minio, "s3://tree/m").resolve().await.unwrap();
    let paths: Vec<(&str, Option<u64>)> = resolved
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    assert_eq!(
        paths,
        [
            ("a.txt", Some(5)),
            ("empty.txt", Some(0)),
            ("sub/b.txt", Some(4))
        ]
    );
    let src = source(&minio, "s3://tree/m");
    let resolved = src.resolve().await.unwrap();
    let empty = resolved
        .files
        .iter()
        .find(|f| f.path == "empty.txt")
        .unwrap();
    let before = minio.get_object_count();
    assert!(read_all(&src, empty, 0, None).await.is_empty());
    assert_eq!(minio.get_object_count(), before, "nothing to fetch");

    let whole = source(&minio, "s3://tree").resolve().await.unwrap();
    assert_eq!(whole.uri, "s3://tree");
    assert_eq!(whole.files.len(), 3);
    assert_eq!(whole.files[0].path, "m/a.txt");

    let single = source(&minio, "s3://tree/m/sub/b.txt");
    let one = single.resolve().await.unwrap();
    assert_eq!(one.files.len(), 1);
    assert_eq!(one.files[0].path, "b.txt");
    assert_eq!(one.files[0].locator, "m/sub/b.txt");
    assert_eq!(read_all(&single, &one.files[0], 0, None).await, b"beta");

    for (uri, what) in [
        ("s3://tree/nothing-here", "missing prefix"),
        ("s3://tree/m/void", "empty directory"),
        ("s3://no-such-bucket/m", "missing bucket"),
    ] {
        let err = source(&minio, uri).resolve().await.unwrap_err();
        assert!(matches!(err, Error::NotFound(_)), "{what}: {err:?}");
        assert!(err.to_string().contains(uri), "{what}: {err}");
    }
}

#[tokio::test]
async fn rejected_credentials_are_a_failed_precondition_without_the_secret() {
    let minio = Minio::start();
    minio.create_bucket("locked").await;
    minio.put("locked", "m/a.txt", b"alpha".to_vec()).await;
    let secret = "not-the-password-4f1c2a";
    for key_id in [minio::ROOT_USER, "nobody-at-all"] {
        let mut opts = options(&minio);
        opts.secrets
            .insert("awsAccessKeyID".into(), key_id.to_string());
        opts.secrets
            .insert("awsSecretAccessKey".into(), secret.to_string());
        let src = s3::new("s3://locked/m", &opts).unwrap();
        let err = src.resolve().await.unwrap_err();
        assert!(matches!(err, Error::Precondition(_)), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("credentials were rejected"), "{msg}");
        assert!(!msg.contains(secret) && !format!("{err:?}").contains(secret));
        assert!(!msg.contains(minio::ROOT_PASSWORD));
    }
}

#[tokio::test]
async fn a_stopped_object_store_is_unavailable() {
    let mut minio = Minio::start();
    minio.create_bucket("gone").await;
    minio.put("gone", "m/a.txt", b"alpha".to_vec()).await;
    let src = source(&minio, "s3://gone/m");
    let resolved = src.resolve().await.unwrap();
    minio.stop();

    let err = src.resolve().await.unwrap_err();
    assert!(matches!(err, Error::Transient(_)), "{err:?}");
    let err = src.read(&resolved.files[0], 0, None).await.err().unwrap();
    assert!(matches!(err, Error::Transient(_)), "{err:?}");
    assert!(!err.to_string().contains(minio::ROOT_PASSWORD));
}

/// A tenant's s3:// pull goes through the egress guard to the endpoint the
/// class chose, signed only with the PVC's own keys, never unsigned-by-luck
/// with the driver's: without keys it is anonymous, and a private bucket
/// refuses it.
#[tokio::test]
async fn a_tenant_pulls_through_the_guard_with_its_own_keys_only() {
    use modelcache_csi::trust::{AllowedSources, Tenant};
    let minio = Minio::start();
    minio.create_bucket("models").await;
    minio
        .put("models", "tenant/weights.bin", vec![7u8; 4096])
        .await;
    let uri = "s3://models/tenant";
    let allowed = AllowedSources::parse("s3://models/").unwrap();
    let tenant = |secrets: BTreeMap<String, String>| {
        let params = minio.params();
        let allowed = allowed.clone();
        async move {
            let t = Tenant::admit(
                "annotation",
                uri,
                Some(&allowed),
                &params,
                &Default::default(),
                &Default::default(),
            )
            .await
            .unwrap();
            SourceOptions {
                params,
                secrets,
                tenant: Some(t),
                ..SourceOptions::default()
            }
        }
    };

    let opts = tenant(minio.secrets()).await;
    let src = modelcache_csi::puller::open(uri, &opts).await.unwrap();
    let resolved = src.resolve().await.expect("the PVC's own keys");
    assert_eq!(resolved.files.len(), 1);
    let body: Vec<Bytes> = src
        .read(&resolved.files[0], 0, None)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(body.concat(), vec![7u8; 4096]);
    let through = opts.tenant.as_ref().unwrap().guard.policy.connections();
    assert!(through > 0, "the pull bypassed the egress guard");

    let opts = tenant(BTreeMap::new()).await;
    let src = modelcache_csi::puller::open(uri, &opts).await.unwrap();
    let e = src.resolve().await.unwrap_err();
    assert!(matches!(e, Error::Precondition(_)), "{e:?}");
}

/// S3 has the Hub's shape: a bucket policy may let anyone list a prefix
/// and read nothing. An admin's class pulls and seals the model with its
/// keys; a tenant's unsigned pull of the same URI lists it fine, so only a
/// read of its content proves access, and the cache hit is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listable_but_unreadable_bucket_gives_no_cache_hit() {
    use modelcache_csi::config::Config;
    use modelcache_csi::puller::engine::{Engine, EngineConfig, NoProgress};
    use modelcache_csi::trust::{AllowedSources, Tenant};
    let minio = Minio::start();
    minio.create_bucket("listable").await;
    minio
        .put("listable", "m/weights.bin", vec![5u8; 8192])
        .await;
    minio.set_policy(
        "listable",
        &serde_json::json!({
            "Version": "2012-10-17",
            "Statement": [{
                "Effect": "Allow",
                "Principal": {"AWS": ["*"]},
                "Action": ["s3:ListBucket"],
                "Resource": ["arn:aws:s3:::listable"],
            }],
        }),
    );
    let state = tempfile::tempdir().unwrap();
    let root = modelcache_csi::cache::Roots::of(&Config::for_node("n", state.path()))
        .roots
        .remove(0);
    let engine = Engine::new(
        EngineConfig::default(),
        modelcache_csi::puller::extract_layer,
    );
    let uri = "s3://listable/m";
    let admin = modelcache_csi::puller::open(uri, &options(&minio))
        .await
        .unwrap();
    let sealed = engine
        .pull(&root, admin, &NoProgress)
        .await
        .expect("the admin's pull");
    assert!(!sealed.hit);

    let allowed = AllowedSources::parse("s3://listable/").unwrap();
    let params = minio.params();
    let tenant = Tenant::admit(
        "annotation",
        uri,
        Some(&allowed),
        &params,
        &Default::default(),
        &Default::default(),
    )
    .await
    .unwrap();
    let opts = SourceOptions {
        params,
        tenant: Some(tenant),
        ..SourceOptions::default()
    };
    let src = modelcache_csi::puller::open(uri, &opts).await.unwrap();
    assert!(src.resolve().await.is_ok(), "the bucket lists for anyone");
    let err = engine
        .pull(&root, src, &NoProgress)
        .await
        .err()
        .expect("a tenant who may only list got the sealed copy");
    assert!(matches!(err, Error::Precondition(_)), "{err}");
}

/// An admin's S3 endpoint is the admin's choice, but never a metadata
/// service: the s3 client takes no resolver of ours, so it goes through a
/// guard that closes metadata addresses only.
#[tokio::test]
async fn an_admins_s3_endpoint_never_reaches_metadata() {
    let mut o = SourceOptions::default();
    for (k, v) in [
        ("s3Endpoint", "http://169.254.169.254"),
        ("s3PathStyle", "true"),
    ] {
        o.params.insert(k.into(), v.into());
    }
    let src = modelcache_csi::puller::open("s3://latest/meta-data", &o)
        .await
        .unwrap();
    let err = src.resolve().await.unwrap_err();
    assert!(
        matches!(err, Error::NotAllowed(ref m) if m.contains("metadata")),
        "{err}"
    );
}
