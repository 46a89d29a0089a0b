//! The oci:// source and the layer unpacker against a real registry on
//! loopback, with the real all-MiniLM-L6-v2 model pushed as an ORAS-style
//! artifact and as a modelcar image.

use crate::support::fixtures::sha256_file;
use crate::support::reading::read_all;
use crate::support::registry;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use futures::StreamExt;
use modelcache_csi::error::Error;
use modelcache_csi::puller::oci::OciSource;
use modelcache_csi::puller::source::{Compression, RemoteFile, Source, Unpack};
use modelcache_csi::puller::unpack;
use registry::{Registry, files_under};
use sha2::{Digest, Sha256};

/// The model directory printed by `tests/scripts/deps/model.sh`.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/model.sh");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .expect("run model.sh");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        PathBuf::from(dir.lines().last().unwrap_or_default())
    })
}

fn source(reg: &Registry, rest: &str) -> OciSource {
    OciSource::new(&reg.uri(rest), &reg.options()).expect("valid source")
}

/// Streams a whole blob to `path` and returns its sha256.
async fn download(src: &OciSource, f: &RemoteFile, path: &Path) -> String {
    let mut out = fs::File::create(path).unwrap();
    let mut h = Sha256::new();
    let mut s = src.read(f, 0, None).await.expect("start read");
    while let Some(chunk) = s.next().await {
        let chunk = chunk.expect("read chunk");
        h.update(&chunk);
        out.write_all(&chunk).unwrap();
    }
    hex::encode(h.finalize())
}

#[tokio::test]
async fn artifact_resolves_to_model_files_and_reads_exact_ranges() {
    let model = model_dir();
    let reg = Registry::start().await;
    let pushed = reg.push_artifact("minilm:v1", model).await;

    let by_tag = source(&reg, "minilm:v1")
        .resolve()
        .await
        .expect("resolve by tag");
    assert_eq!(by_tag.uri, reg.uri("minilm"));
    assert_eq!(by_tag.revision, pushed.digest);
    let names = files_under(model);
    // README, configs, tokenizer, vocab, weights and 1_Pooling/config.json.
    assert_eq!(names.len(), 12, "{names:?}");
    assert!(names.iter().any(|n| n == "1_Pooling/config.json"));
    let listed: Vec<_> = by_tag.files.iter().map(|f| f.path.clone()).collect();
    assert_eq!(listed, names);
    for f in &by_tag.files {
        let local = model.join(&f.path);
        let sha = sha256_file(&local);
        assert_eq!(
            f.size,
            Some(fs::metadata(&local).unwrap().len()),
            "{}",
            f.path
        );
        assert_eq!(f.sha256.as_deref(), Some(sha.as_str()), "{}", f.path);
        assert_eq!(f.locator, format!("sha256:{sha}"), "{}", f.path);
        assert_eq!(f.unpack, Unpack::None, "{}", f.path);
    }

    let by_digest = source(&reg, &format!("minilm@{}", pushed.digest))
        .resolve()
        .await
        .expect("resolve by digest");
    assert_eq!(by_digest, by_tag);

    let src = source(&reg, "minilm:v1");
    let small = by_tag
        .files
        .iter()
        .find(|f| f.path == "1_Pooling/config.json")
        .unwrap();
    assert_eq!(
        read_all(&src, small, 0, None).await,
        fs::read(model.join(&small.path)).unwrap()
    );
    let big = by_tag
        .files
        .iter()
        .find(|f| f.path == "model.safetensors")
        .unwrap();
    let bytes = fs::read(model.join(&big.path)).unwrap();
    let size = bytes.len() as u64;
    let ranges = [
        (0, Some(10)),
        (1_000_003, Some(65_536)),
        (size - 100, None),
        (size - 1, Some(1)),
        (12_345_678, Some(3 << 20)),
    ];
    for (offset, len) in ranges {
        let got = read_all(&src, big, offset, len).await;
        let end = len.map_or(size, |l| offset + l) as usize;
        assert!(
            got == bytes[offset as usize..end],
            "range {offset}+{len:?} differs"
        );
    }
    // One ranged GET per read, never a whole-blob fallback.
    assert_eq!(
        reg.wait_blob_gets(&big.locator, ranges.len()).await,
        ranges.len()
    );
    assert!(read_all(&src, big, 5, Some(0)).await.is_empty());
}

#[tokio::test]
async fn modelcar_layers_unpack_to_the_model_byte_for_byte() {
    let model = model_dir();
    let reg = Registry::start().await;
    let amd = reg.push_modelcar("minilm-car:v1", model).await;
    let arm = reg
        .push_image("minilm-car:arm", vec![registry::tar_gz(&[])], "arm64")
        .await;
    reg.push_index("minilm-car:multi", &[(&arm, "arm64"), (&amd, "amd64")])
        .await;

    let src = source(&reg, "minilm-car:v1");
    let resolved = src.resolve().await.expect("resolve modelcar");
    assert_eq!(resolved.revision, amd.digest);
    assert_eq!(resolved.files.len(), 2);
    for (f, pushed) in resolved.files.iter().zip(&amd.layers) {
        assert_eq!(f.path, "");
        assert_eq!(f.unpack, Unpack::Tar(Compression::Gzip));
        assert_eq!(f.locator, pushed.digest);
        assert_eq!(f.size, Some(pushed.size));
    }

    // The index resolves to its linux/amd64 entry.
    let multi = source(&reg, "minilm-car:multi")
        .resolve()
        .await
        .expect("resolve index");
    assert_eq!(multi.revision, amd.digest);
    assert_eq!(multi.files, resolved.files);

    // As the engine does: each layer downloaded and verified, then
    // unpacked in manifest order into one directory.
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("model");
    let mut layers = Vec::new();
    for (i, f) in resolved.files.iter().enumerate() {
        let blob = tmp.path().join(format!("layer{i}.blob"));
        let sha = download(&src, f, &blob).await;
        assert_eq!(Some(sha.as_str()), f.sha256.as_deref());
        let dest = dest.clone();
        let entries = tokio::task::spawn_blocking(move || {
            unpack::extract(
                &blob,
                Compression::Gzip,
                &dest,
                &unpack::Budget::unlimited(),
            )
        })
        .await
        .unwrap()
        .expect("extract modelcar layer");
        layers.push(entries);
    }
    let entries = unpack::merge(&dest, layers).expect("merge layers");

    let names = files_under(model);
    let got: Vec<_> = entries.iter().map(|e| e.path.clone()).collect();
    let want: Vec<_> = names.iter().map(|n| format!("models/{n}")).collect();
    assert_eq!(got, want);
    for (e, n) in entries.iter().zip(&names) {
        let local = model.join(n);
        assert_eq!(e.sha256, sha256_file(&local), "{n}");
        assert_eq!(e.size, fs::metadata(&local).unwrap().len(), "{n}");
        assert!(
            fs::read(dest.join(&e.path)).unwrap() == fs::read(&local).unwrap(),
            "{n} differs"
        );
    }
}

#[tokio::test]
async fn malicious_layers_are_refused_and_write_nothing_outside() {
    let reg = Registry::start().await;
    reg.push_image("evil:slip", vec![registry::tar_slip_layer()], "amd64")
        .await;
    reg.push_image(
        "evil:symlink",
        vec![registry::symlink_escape_layer()],
        "amd64",
    )
    .await;
    let cases = [
        (
            "evil:slip",
            "layer entry \"../evil\" has a '..' component; refused",
        ),
        (
            "evil:symlink",
            "layer entry \"link\" is a symlink to an absolute path",
        ),
    ];
    for (tag, want) in cases {
        let src = source(&reg, tag);
        let resolved = src.resolve().await.expect("resolve");
        let layer = &resolved.files[0];
        assert_eq!(layer.unpack, Unpack::Tar(Compression::Gzip));
        let tmp = tempfile::tempdir().unwrap();
        let blob = tmp.path().join("layer.blob");
        download(&src, layer, &blob).await;
        let root = tmp.path().join("root");
        let dest = root.join("model");
        let err = unpack::extract(
            &blob,
            Compression::Gzip,
            &dest,
            &unpack::Budget::unlimited(),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Precondition(_)), "{tag}: {err:?}");
        assert!(err.to_string().contains(want), "{tag}: {err}");
        let beside: Vec<_> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, vec!["model"], "{tag} wrote outside the model");
        assert!(!tmp.path().join("evil").exists());
        assert!(!dest.join("link").exists());
    }
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    assert!(!passwd.contains("root::0:0::/:/bin/sh"));
}

#[tokio::test]
async fn missing_things_are_not_found() {
    let reg = Registry::start().await;
    let pushed = reg
        .push_image("present:v1", vec![registry::tar_gz(&[])], "amd64")
        .await;
    for rest in ["present:nope", "absent:v1"] {
        let err = source(&reg, rest).resolve().await.unwrap_err();
        assert!(matches!(err, Error::NotFound(_)), "{rest}: {err:?}");
        assert!(err.to_string().contains(&reg.uri(rest)), "{err}");
    }
    let src = source(&reg, "present:v1");
    let mut missing = src.resolve().await.unwrap().files.remove(0);
    assert_eq!(missing.locator, pushed.layers[0].digest);
    missing.locator = format!("sha256:{}", "0".repeat(64));
    let err = match src.read(&missing, 0, None).await {
        Ok(_) => panic!("read of a missing blob succeeded"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::NotFound(_)), "{err:?}");
}

#[tokio::test]
async fn stopped_registry_is_unavailable() {
    let mut reg = Registry::start().await;
    let pushed = reg
        .push_image("m:v1", vec![registry::tar_gz(&[])], "amd64")
        .await;
    let src = source(&reg, "m:v1");
    let file = src.resolve().await.unwrap().files.remove(0);
    assert_eq!(file.locator, pushed.layers[0].digest);
    reg.stop();
    let err = src.resolve().await.unwrap_err();
    assert!(matches!(err, Error::Transient(_)), "{err:?}");
    assert!(
        err.to_string().contains("cannot reach the registry"),
        "{err}"
    );
    let err = match src.read(&file, 0, None).await {
        Ok(_) => panic!("read from a stopped registry succeeded"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Transient(_)), "{err:?}");
}

#[tokio::test]
async fn credentials_come_from_secrets_and_rejections_name_them() {
    let reg = Registry::start_with_auth().await;
    let pushed = reg
        .push_image("private:v1", vec![registry::tar_gz(&[])], "amd64")
        .await;
    let resolved = source(&reg, "private:v1")
        .resolve()
        .await
        .expect("resolve with secrets");
    assert_eq!(resolved.revision, pushed.digest);

    let mut anonymous = reg.options();
    anonymous.secrets.clear();
    let mut wrong = reg.options();
    wrong
        .secrets
        .insert("ociPassword".into(), "not-the-password".into());
    for opts in [anonymous, wrong] {
        let src = OciSource::new(&reg.uri("private:v1"), &opts).unwrap();
        let err = src.resolve().await.unwrap_err();
        assert!(matches!(err, Error::Precondition(_)), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("ociUsername/ociPassword"), "{msg}");
        assert!(
            !msg.contains(registry::PASSWORD) && !msg.contains("not-the-password"),
            "{msg}"
        );
        let err = match src.read(&resolved.files[0], 0, None).await {
            Ok(_) => panic!("read without valid credentials succeeded"),
            Err(e) => e,
        };
        assert!(matches!(err, Error::Precondition(_)), "{err:?}");
    }
}

/// A tenant's oci:// pull: every request, blobs included, goes through the
/// egress guard, so the registry answers only when the class names it.
#[tokio::test]
async fn a_tenant_reaches_a_registry_only_when_the_class_names_it() {
    use modelcache_csi::trust::{AllowedSources, Tenant};
    let model = model_dir();
    let reg = Registry::start().await;
    let pushed = reg.push_artifact("minilm:v1", model).await;
    let uri = reg.uri("minilm:v1");
    let host = uri.trim_start_matches("oci://").split('/').next().unwrap();

    let named = AllowedSources::parse(&format!("oci://{host}/")).unwrap();
    let mut opts = reg.options();
    opts.tenant = Some(
        Tenant::admit(
            "annotation",
            &uri,
            Some(&named),
            &opts.params,
            &Default::default(),
            &Default::default(),
        )
        .await
        .unwrap(),
    );
    let src = modelcache_csi::puller::open(&uri, &opts).await.unwrap();
    let resolved = src.resolve().await.expect("through the guard");
    assert_eq!(resolved.revision, pushed.digest);
    let f = &resolved.files[0];
    let mut body = Vec::new();
    let mut s = src.read(f, 0, None).await.expect("blob through the guard");
    while let Some(chunk) = s.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(Some(body.len() as u64), f.size);
    let through = opts.tenant.as_ref().unwrap().guard.policy.connections();
    assert!(through > 0, "the pull bypassed the egress guard");

    // Any registry, but loopback is closed: refused before a request.
    let any = AllowedSources::parse("oci://").unwrap();
    // The admitted pull's access-log lines are all written before this.
    reg.settled_blob_gets().await;
    let before = reg.log_text().len();
    let mut opts = reg.options();
    opts.tenant = Some(
        Tenant::admit(
            "annotation",
            &uri,
            Some(&any),
            &opts.params,
            &Default::default(),
            &Default::default(),
        )
        .await
        .unwrap(),
    );
    let src = modelcache_csi::puller::open(&uri, &opts).await.unwrap();
    let e = src.resolve().await.unwrap_err();
    assert!(
        matches!(&e, Error::NotAllowed(m) if m.contains("loopback")),
        "{e:?}"
    );
    // Every earlier request's access-log line is written by then.
    reg.settled_blob_gets().await;
    assert!(
        !reg.log_text()[before..].contains("GET /v2/minilm"),
        "the registry was reached: {}",
        &reg.log_text()[before..]
    );
}
