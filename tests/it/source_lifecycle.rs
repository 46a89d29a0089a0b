//! A source volume from creation to deletion: written through a pod's
//! mount, sealed only once no node writes it, read back through a cache
//! volume that is a view of it (never a copy), and deleted only once no
//! cache volume reads it.

use std::fs;

use crate::support::harness::*;
use tonic::Code;

/// The whole life of a source on a directory backend (local or shared).
async fn source_lifecycle(backend: &str) {
    let d = Driver::start().await;
    let src = d
        .create_source(&format!("pvc-{backend}-src"), backend)
        .await;
    let id = &src.volume_id;
    assert!(id.starts_with(&format!("{backend}.")), "{id}");
    assert_eq!(src.volume_context["role"], "source");
    let (staging, target) = (d.staging("src"), d.target("writer"));

    // A Job's pod writes the model through its writable mount.
    d.stage(id, &staging, WRITER).await.unwrap();
    d.publish(id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    // Writable, but never for device files: the node adds nodev to every mount.
    assert_mount_options(&single_mount(&content(&staging)), &["rw", "nodev"]);
    assert_mount_options(&single_mount(&target), &["rw", "nodev"]);
    let model = write_model(&target, 2);

    // Neither a seal nor a clone may see a source that can still change.
    let st = assert_code(d.seal(id).await, Code::FailedPrecondition, NODE);
    assert!(st.message().contains("staged writable"), "{}", st.message());
    let st = assert_code(
        d.create_cache("pvc-early", id, &[]).await,
        Code::FailedPrecondition,
        "not sealed",
    );
    assert!(st.message().contains(id.as_str()), "{}", st.message());

    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();
    d.seal(id).await.unwrap();

    let cache = d.create_cache("pvc-cache", id, &[]).await.unwrap();
    assert_eq!(cache.volume_context["role"], "cache");
    // A view of the source, not a copy of it.
    assert_eq!(cache.volume_context["source"], src.volume_context["source"]);
    let (cstaging, ctarget) = (d.staging("cache"), d.target("reader"));
    d.stage(&cache.volume_id, &cstaging, READER).await.unwrap();
    d.publish(&cache.volume_id, &cstaging, &ctarget, READER, true)
        .await
        .unwrap();
    assert_model(&ctarget, &model);
    assert_erofs(&ctarget.join("config.json"));

    // Once sealed, the source itself stages read-only, even for a writer.
    d.stage(id, &staging, WRITER).await.unwrap();
    assert_mount_options(&single_mount(&content(&staging)), &["ro"]);
    assert_erofs(&content(&staging).join("config.json"));
    assert_erofs(&content(&staging).join("new-file"));
    d.publish(id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    assert_mount_options(&single_mount(&target), &["ro"]);
    assert_erofs(&target.join("model.safetensors"));
    assert_model(&target, &model);

    for (vol, t, s) in [
        (id, &target, &staging),
        (&cache.volume_id, &ctarget, &cstaging),
    ] {
        d.unpublish(vol, t).await.unwrap();
        d.unstage(vol, s).await.unwrap();
    }
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
}

#[tokio::test]
async fn source_lifecycle_local() {
    source_lifecycle("local").await;
}

#[tokio::test]
async fn source_lifecycle_shared() {
    source_lifecycle("shared").await;
}

#[tokio::test]
async fn source_in_use_cannot_be_deleted() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-del-src", "local").await;
    let id = &src.volume_id;
    let sid = &src.volume_context["source"];
    let source_dir = d.source_dir("local", sid);
    assert!(source_dir.join("data").is_dir());

    // Staged writable on this node: deleting would pull it from under the writer.
    let staging = d.staging("del");
    d.stage(id, &staging, WRITER).await.unwrap();
    assert!(source_dir.join("writers").join(NODE).exists());
    assert_code(d.delete(id).await, Code::FailedPrecondition, NODE);
    fs::write(content(&staging).join("weights.bin"), b"w").unwrap();
    d.unstage(id, &staging).await.unwrap();
    assert!(!source_dir.join("writers").join(NODE).exists());
    d.seal(id).await.unwrap();

    let a = d.create_cache("pvc-reader-a", id, &[]).await.unwrap();
    let b = d.create_cache("pvc-reader-b", id, &[]).await.unwrap();
    let st = assert_code(d.delete(id).await, Code::FailedPrecondition, "pvc-reader-a");
    assert!(st.message().contains("pvc-reader-b"), "{}", st.message());
    assert!(source_dir.is_dir());

    d.delete(&a.volume_id).await.unwrap();
    assert_code(d.delete(id).await, Code::FailedPrecondition, "pvc-reader-b");
    d.delete(&b.volume_id).await.unwrap();
    d.delete(id).await.unwrap();
    assert!(!source_dir.exists(), "{} survived", source_dir.display());
    assert!(!d.record_path("local", id).exists());
    // Nothing is left of it in the store, not even in the trash.
    let left: Vec<_> = fs::read_dir(d.state_dir.join("local/sources"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(d.list_all(0).await.is_empty());
}

/// role=source with a content source: a writable copy, the one case where
/// bytes are duplicated. Two copies of one sealed source are written side
/// by side on this node, one is sealed while the other is still being
/// written, and neither write reaches the original.
async fn writable_copies(backend: &str) {
    let d = Driver::start().await;
    let src = d
        .create_source(&format!("pvc-{backend}-orig"), backend)
        .await;
    let staging = d.staging("orig");
    d.stage(&src.volume_id, &staging, WRITER).await.unwrap();
    let model = write_model(&content(&staging), 9);
    d.unstage(&src.volume_id, &staging).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();

    let mut copies = Vec::new();
    for name in ["copy-a", "copy-b"] {
        let req = clone_req(name, &[("role", "source")], &src.volume_id, WRITER);
        let copy = d.create(req).await.unwrap();
        assert_eq!(copy.volume_context["role"], "source");
        assert_ne!(copy.volume_context["source"], src.volume_context["source"]);
        let s = d.staging(name);
        d.stage(&copy.volume_id, &s, WRITER).await.unwrap();
        assert_mount_options(&single_mount(&content(&s)), &["rw"]);
        assert_model(&content(&s), &model);
        fs::write(
            content(&s).join("config.json"),
            format!("{{\"copy\": \"{name}\"}}"),
        )
        .unwrap();
        copies.push((copy.volume_id, s));
    }

    // copy-b is sealed while copy-a is still staged writable on this node.
    let (b, sb) = &copies[1];
    d.unstage(b, sb).await.unwrap();
    d.seal(b).await.unwrap();
    let (a, sa) = &copies[0];
    assert_code(d.seal(a).await, Code::FailedPrecondition, NODE);

    for (from, expect, name) in [
        (&src.volume_id, &model.files[0].1[..], "orig"),
        (b, &b"{\"copy\": \"copy-b\"}"[..], "b"),
    ] {
        let cache = d
            .create_cache(&format!("pvc-read-{name}"), from, &[])
            .await
            .unwrap();
        let (cs, ct) = (d.staging(&format!("read-{name}")), d.target(name));
        d.stage(&cache.volume_id, &cs, READER).await.unwrap();
        d.publish(&cache.volume_id, &cs, &ct, READER, true)
            .await
            .unwrap();
        assert_eq!(fs::read(ct.join("config.json")).unwrap(), expect, "{name}");
        assert_eq!(
            fs::read(ct.join("model.safetensors")).unwrap(),
            model.files[1].1,
            "{name}"
        );
        d.unpublish(&cache.volume_id, &ct).await.unwrap();
        d.unstage(&cache.volume_id, &cs).await.unwrap();
    }
    d.unstage(a, sa).await.unwrap();
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
}

#[tokio::test]
async fn writable_copies_local() {
    writable_copies("local").await;
}

#[tokio::test]
async fn writable_copies_xfs() {
    writable_copies("xfs").await;
}
