//! The driver pulling the real all-MiniLM-L6-v2 model from a real MinIO:
//! CreateVolume with an `s3://` source, byte-for-byte checks through the
//! published read-only mount, one download for 20 concurrent volumes,
//! `kill -9` mid-pull then resume, and a full loop filesystem.

use crate::support::minio;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::harness::*;
use modelcache_csi::csi::CreateVolumeRequest;
use sha2::{Digest, Sha256};
use tonic::Code;

const CHUNK_MIB: u64 = 8;

/// The real model's directory, from tests/scripts/deps/model.sh.
fn real_model() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/model.sh");
        let out = std::process::Command::new("bash")
            .arg(script)
            .output()
            .expect("run model.sh");
        assert!(
            out.status.success(),
            "model.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(
            String::from_utf8(out.stdout)
                .unwrap()
                .trim()
                .lines()
                .last()
                .unwrap(),
        )
    })
}

fn files_of(dir: &Path) -> Vec<(String, u64, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.push((rel, bytes.len() as u64, hex::encode(Sha256::digest(&bytes))));
            }
        }
    }
    out.sort();
    out
}

/// The ranged GETs one full pull makes.
fn planned_gets(files: &[(String, u64, String)]) -> u64 {
    files
        .iter()
        .map(|(_, size, _)| size.div_ceil(CHUNK_MIB << 20).max(1))
        .sum()
}

fn s3_request(name: &str, s3: &minio::Minio, uri: &str) -> CreateVolumeRequest {
    let mut params: Vec<(String, String)> = s3.params().into_iter().collect();
    params.push(("backend".into(), "local".into()));
    params.push(("source".into(), uri.into()));
    let mut req = create_req(name, &[], READER);
    req.parameters = params.into_iter().collect();
    req.secrets = s3.secrets().into_iter().collect::<HashMap<_, _>>();
    req
}

async fn driver() -> Driver {
    Driver::start_with(&[
        "--pull-chunk-mib",
        &CHUNK_MIB.to_string(),
        "--pull-connections",
        "2",
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_model_is_pulled_once_and_served_read_only_byte_for_byte() {
    let s3 = minio::Minio::start();
    s3.create_bucket("models").await;
    s3.upload_dir("models", "minilm", real_model()).await;
    let want = files_of(real_model());
    let d = driver().await;

    // 20 concurrent volumes of one model: one download.
    let before = s3.get_object_count();
    let creates = (0..20).map(|i| {
        let req = s3_request(&format!("pvc-minilm-{i}"), &s3, "s3://models/minilm");
        let c = d.client.clone();
        tokio::spawn(async move { c.controller.clone().create_volume(req).await })
    });
    let mut vols = Vec::new();
    for r in futures::future::join_all(creates).await {
        vols.push(
            r.unwrap()
                .expect("CreateVolume")
                .into_inner()
                .volume
                .unwrap(),
        );
    }
    let gets = s3.get_object_count() - before;
    assert_eq!(
        gets,
        planned_gets(&want),
        "20 volumes must cost exactly one download"
    );
    let source = &vols[0].volume_context["source"];
    assert!(vols.iter().all(|v| &v.volume_context["source"] == source));
    assert!(!vols[0].volume_context["revision"].is_empty());
    assert_eq!(vols[0].volume_context["model"], "s3://models/minilm");

    // Served read-only, byte for byte, with a parseable safetensors header.
    let v = &vols[0];
    let (staging, target) = (d.staging("m"), d.target("m"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, false)
        .await
        .unwrap();
    assert_eq!(files_of(&target), want);
    let st = std::fs::read(target.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(&st[8..8 + header_len]).expect("safetensors header parses");
    assert!(
        header
            .as_object()
            .unwrap()
            .keys()
            .any(|k| k.contains("embeddings")),
        "{header}"
    );
    assert_erofs(&target.join("config.json"));

    // The seal matches the original files. (The operator sees it sealed
    // first: a create may answer once every file is verified, before the
    // seal.)
    d.wait_sealed(&[source], SEAL_BOUND).await;
    let seal: serde_json::Value = serde_json::from_slice(
        &std::fs::read(d.source_dir("local", source).join("seal.json")).unwrap(),
    )
    .unwrap();
    let sealed: Vec<(String, u64, String)> = seal["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().into(),
                f["size"].as_u64().unwrap(),
                f["sha256"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(sealed, want);
    assert!(
        !String::from_utf8_lossy(
            &std::fs::read(d.source_dir("local", source).join("seal.json")).unwrap()
        )
        .contains(minio::ROOT_PASSWORD)
    );
    assert!(
        !d.log_text().contains(minio::ROOT_PASSWORD),
        "a credential reached the log"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
}

/// A bucket encrypted with a KMS key (MinIO's auto-encryption): its
/// objects' ETags look like MD5s and are not. The origin's own bytes are
/// final (its ETag is checked only against bytes from peers), so the model
/// is pulled and sealed byte for byte, and no file is read back to hash it
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kms_encrypted_bucket_whose_etags_are_not_md5s_is_pulled() {
    let key = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        crate::support::fixtures::pseudo_random(77, 32),
    );
    let s3 = minio::Minio::start_with_env(&[
        ("MINIO_KMS_SECRET_KEY", &format!("e2e-key:{key}")),
        ("MINIO_KMS_AUTO_ENCRYPTION", "on"),
    ]);
    s3.create_bucket("models").await;
    s3.upload_dir("models", "minilm", real_model()).await;
    let want = files_of(real_model());
    let d = driver().await;
    let v = d
        .create(s3_request("pvc-kms", &s3, "s3://models/minilm"))
        .await
        .unwrap_or_else(|e| panic!("CreateVolume: {:?}: {}", e.code(), e.message()));
    let (staging, target) = (d.staging("kms"), d.target("kms"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, false)
        .await
        .unwrap();
    assert_eq!(files_of(&target), want);
    assert!(
        !d.log_text().contains("ETag says MD5"),
        "an origin's ETag was checked against its own bytes"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_killed_mid_download_resumes_and_never_shows_a_partial_model() {
    let s3 = minio::Minio::start();
    s3.create_bucket("big").await;
    // 256 MiB of pseudo-random bytes: long enough to be caught mid-pull.
    let mut blob = vec![0u8; 256 << 20];
    let mut x: u64 = 0x2545F4914F6CDD1D;
    for c in blob.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    let want = hex::encode(Sha256::digest(&blob));
    s3.put("big", "m/weights.bin", blob).await;
    let mut d = Driver::start_with(&["--pull-chunk-mib", "4", "--pull-connections", "1"]).await;
    let req = s3_request("pvc-big", &s3, "s3://big/m");
    let c = d.client.clone();
    let pending = tokio::spawn(async move { c.controller.clone().create_volume(req).await });
    // Wait until some chunks are durable, then kill -9.
    let sources = d.state_dir.join("local/sources");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let progressed = std::fs::read_dir(&sources)
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                let state = e.path().join("state");
                std::fs::read_dir(state)
                    .ok()
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|s| {
                        // Only records renamed into place count: a temporary
                        // file the kill interrupts was never durable progress.
                        !s.file_name().to_string_lossy().starts_with('.')
                            && std::fs::read_to_string(s.path())
                                .is_ok_and(|t| t.contains("\"done\": [\n    0,\n    1"))
                    })
            });
        if progressed {
            break;
        }
        assert!(Instant::now() < deadline, "the pull never made progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.kill_9();
    let _ = pending.await;
    // Nothing sealed is visible: only the hidden work directory.
    let visible: Vec<_> = std::fs::read_dir(&sources)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(visible.is_empty(), "{visible:?}");
    let sent_before = s3.sent_bytes();

    d.restart().await;
    let v = d
        .create_until_done(
            &s3_request("pvc-big", &s3, "s3://big/m"),
            None,
            Duration::from_secs(60),
        )
        .await
        .expect("retried CreateVolume");
    let resumed = s3.sent_bytes() - sent_before;
    // Chunks 0 and 1 (8 MiB) were durable before the kill: they must not be
    // fetched again. Besides chunks, the origin sends listings and the one
    // byte the resuming requester's access check reads.
    assert!(
        resumed <= (248 << 20) + (256 << 10),
        "the retry fetched {resumed} bytes of 256 MiB: not even the two durable chunks were resumed"
    );
    let data = d
        .source_dir("local", &v.volume_context["source"])
        .join("data/weights.bin");
    assert_eq!(
        hex::encode(Sha256::digest(std::fs::read(data).unwrap())),
        want
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_larger_than_the_cache_gets_resource_exhausted_and_nothing_is_sealed() {
    let s3 = minio::Minio::start();
    s3.create_bucket("models").await;
    s3.upload_dir("models", "minilm", real_model()).await;
    let d = driver().await;
    // A 64 MiB ext4 loop filesystem under the state dir: the 88 MiB model cannot fit.
    let image = d.dir.join("small.img");
    let f = std::fs::File::create(&image).unwrap();
    f.set_len(64 << 20).unwrap();
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local = d.state_dir.join("local");
    std::fs::create_dir_all(&local).unwrap();
    let lo = modelcache_csi::mount::loopdev::attach(&image, false).unwrap();
    modelcache_csi::mount::mount_device(lo.path(), &local, "ext4", false, "").unwrap();
    drop(lo);
    let before = s3.get_object_count();
    let err = d
        .create(s3_request("pvc-too-big", &s3, "s3://models/minilm"))
        .await;
    let status = assert_code(err, Code::ResourceExhausted, "bytes");
    assert!(
        status.message().contains("available"),
        "{}",
        status.message()
    );
    assert_eq!(
        s3.get_object_count(),
        before,
        "bytes were fetched for a model that cannot fit"
    );
    let sources: Vec<_> = std::fs::read_dir(local.join("sources"))
        .map(|r| r.count())
        .into_iter()
        .collect();
    assert!(
        sources.iter().all(|n| *n == 0),
        "something was written: {sources:?}"
    );

    // A configured capacity is honoured the same way, without a small disk.
    let capped = Driver::start_with(&["--cache-capacity", "local=50M"]).await;
    let err = capped
        .create(s3_request("pvc-capped", &s3, "s3://models/minilm"))
        .await;
    let status = assert_code(err, Code::ResourceExhausted, "capacity");
    assert!(
        status.message().contains("52428800"),
        "{}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_failures_are_clear() {
    let s3 = minio::Minio::start();
    s3.create_bucket("models").await;
    let d = driver().await;
    let missing = d
        .create(s3_request("pvc-404", &s3, "s3://models/nothing-here"))
        .await;
    assert_code(missing, Code::NotFound, "s3://models/nothing-here");
    let mut bad = s3_request("pvc-badcreds", &s3, "s3://models/minilm");
    bad.secrets
        .insert("awsSecretAccessKey".into(), "wrong-secret-value".into());
    let status = assert_code(d.create(bad).await, Code::FailedPrecondition, "credentials");
    assert!(!status.message().contains("wrong-secret-value"));
    let malformed = d.create(s3_request("pvc-bad-uri", &s3, "s3://")).await;
    assert_code(malformed, Code::InvalidArgument, "parameters.source");
    let unknown = d.create(s3_request("pvc-ftp", &s3, "ftp://x/y")).await;
    let status = assert_code(unknown, Code::InvalidArgument, "accepted forms");
    assert!(status.message().contains("s3://bucket/prefix"));
}
