//! subPath: a cache volume may expose one directory of its source, and
//! nothing may lead it outside the source: not the parameter's spelling,
//! not a symlink in the model, not a tampered volume record.

use std::os::unix::fs::symlink;

use crate::support::harness::*;
use tonic::Code;

/// A sealed local source holding a model plus two symlinked directories
/// that leave it: `escape -> /etc` and `up -> ../../..`.
async fn sealed_source(d: &Driver) -> (String, Model) {
    let src = d.create_source("pvc-sub-src", "local").await;
    let (staging, target) = (d.staging("sub-src"), d.target("sub-writer"));
    d.stage(&src.volume_id, &staging, WRITER).await.unwrap();
    d.publish(&src.volume_id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    let model = write_model(&target, 4);
    symlink("/etc", target.join("escape")).unwrap();
    symlink("../../..", target.join("tokenizer/up")).unwrap();
    d.unpublish(&src.volume_id, &target).await.unwrap();
    d.unstage(&src.volume_id, &staging).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();
    (src.volume_id, model)
}

#[tokio::test]
async fn sub_path_publishes_only_that_directory() {
    let d = Driver::start().await;
    let (src, model) = sealed_source(&d).await;
    let cache = d
        .create_cache("pvc-sub", &src, &[("subPath", "tokenizer/vocab")])
        .await
        .unwrap();
    assert_eq!(cache.volume_context["subPath"], "tokenizer/vocab");
    let (staging, target) = (d.staging("sub"), d.target("sub"));
    d.stage(&cache.volume_id, &staging, READER).await.unwrap();
    d.publish(&cache.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();

    let m = single_mount(&target);
    assert!(m.root.ends_with("data/tokenizer/vocab"), "{m:#?}");
    assert_mount_options(&m, &["ro", "nosuid", "nodev"]);
    let (_, vocab) = model
        .files
        .iter()
        .find(|(p, _)| p == "tokenizer/vocab/vocab.txt")
        .unwrap();
    assert_eq!(&std::fs::read(target.join("vocab.txt")).unwrap(), vocab);
    let names: Vec<_> = std::fs::read_dir(&target)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["vocab.txt"]);
    assert!(!target.join("config.json").exists());
    assert_erofs(&target.join("vocab.txt"));

    d.unpublish(&cache.volume_id, &target).await.unwrap();
    d.unstage(&cache.volume_id, &staging).await.unwrap();
}

#[tokio::test]
async fn sub_path_outside_the_source_is_refused_at_create() {
    let d = Driver::start().await;
    let (src, _) = sealed_source(&d).await;
    for bad in ["../x", "/etc", "tokenizer/../..", "a//b"] {
        let r = d
            .create_cache("pvc-bad-sub", &src, &[("subPath", bad)])
            .await;
        assert_code(r, Code::InvalidArgument, "parameters.subPath");
    }
    // Symlinks are not directories of the seal's manifest, wherever they point.
    for link in ["escape", "tokenizer/up"] {
        let r = d
            .create_cache("pvc-link-sub", &src, &[("subPath", link)])
            .await;
        let st = assert_code(r, Code::InvalidArgument, "parameters.subPath");
        assert!(
            st.message()
                .contains(&format!("{link:?} is not a directory of the source")),
            "{}",
            st.message()
        );
    }
    // A file is not a directory either; a missing directory neither.
    for not_dir in ["config.json", "nope"] {
        let r = d
            .create_cache("pvc-file-sub", &src, &[("subPath", not_dir)])
            .await;
        assert_code(r, Code::InvalidArgument, "is not a directory of the source");
    }
    // None of the refusals left a volume behind.
    assert_eq!(d.list_all(0).await.len(), 1);
}

/// The node trusts neither the record nor the model: a record that names a
/// symlink (as if tampered with) is resolved beneath the staged source by
/// the kernel, which refuses to leave it, and nothing is mounted.
#[tokio::test]
async fn node_refuses_a_tampered_sub_path() {
    let d = Driver::start().await;
    let (src, _) = sealed_source(&d).await;
    let cache = d
        .create_cache("pvc-tamper", &src, &[("subPath", "1_Pooling")])
        .await
        .unwrap();
    let id = &cache.volume_id;
    let record = d.record_path("local", id);
    let (staging, target) = (d.staging("tamper"), d.target("tamper"));
    d.stage(id, &staging, READER).await.unwrap();

    for link in ["escape", "tokenizer/up"] {
        let mut rec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        assert_eq!(rec["sub_path"], "1_Pooling", "{rec}");
        rec["sub_path"] = link.into();
        std::fs::write(&record, serde_json::to_vec(&rec).unwrap()).unwrap();

        let r = d.publish(id, &staging, &target, READER, true).await;
        let st = assert_code(r, Code::InvalidArgument, "escapes the source");
        assert!(st.message().contains(link), "{}", st.message());
        assert_not_mounted(&target);
        assert!(!target.exists(), "{} was created", target.display());

        rec["sub_path"] = "1_Pooling".into();
        std::fs::write(&record, serde_json::to_vec(&rec).unwrap()).unwrap();
    }

    // Untampered, the same call mounts the directory it names.
    d.publish(id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert!(single_mount(&target).root.ends_with("data/1_Pooling"));
    assert!(target.join("config.json").is_file());
    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();
}
