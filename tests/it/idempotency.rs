//! The node must not stack a second mount on a retried stage or publish,
//! as the kernel's mount table shows. The controller's retries and
//! refusals are the rootless tier's (`rootless::calls`).

use crate::support::harness::*;
use tonic::Code;

#[tokio::test]
async fn node_calls_are_idempotent_and_mount_once() {
    let d = Driver::start().await;
    let model_dir = d.dir.join("models/m");
    let model = write_model(&model_dir, 1);
    let uri = format!("file://{}", model_dir.display());
    let vol = d
        .create(create_req("pvc-node-idem", &[("source", &uri)], READER))
        .await
        .unwrap();
    let id = &vol.volume_id;
    let staging = d.staging("idem");
    let target = d.target("idem");

    for _ in 0..2 {
        d.stage(id, &staging, READER).await.unwrap();
    }
    single_mount(&content(&staging));
    for _ in 0..2 {
        d.publish(id, &staging, &target, READER, true)
            .await
            .unwrap();
    }
    single_mount(&target);
    assert_model(&target, &model);

    // Another volume at the same paths is not a retry: refused, and the
    // mounts in place stay as they are.
    let other = d.create_source("pvc-node-other", "local").await;
    let before = (single_mount(&content(&staging)), single_mount(&target));
    let r = d.stage(&other.volume_id, &staging, WRITER).await;
    assert_code(r, Code::AlreadyExists, "different mount");
    // The refused stage gave back the writer lease it took.
    let lease = d
        .source_dir("local", &other.volume_context["source"])
        .join("writers")
        .join(NODE);
    assert!(!lease.exists());
    d.stage(&other.volume_id, &d.staging("other"), WRITER)
        .await
        .unwrap();
    let r = d
        .publish(
            &other.volume_id,
            &d.staging("other"),
            &target,
            WRITER,
            false,
        )
        .await;
    assert_code(r, Code::AlreadyExists, "different mount");
    assert_eq!(
        (single_mount(&content(&staging)), single_mount(&target)),
        before
    );
    d.unstage(&other.volume_id, &d.staging("other"))
        .await
        .unwrap();

    for _ in 0..2 {
        d.unpublish(id, &target).await.unwrap();
        assert_not_mounted(&target);
        assert!(!target.exists(), "NodeUnpublish left {}", target.display());
    }
    for _ in 0..2 {
        d.unstage(id, &staging).await.unwrap();
        assert_not_mounted(&staging);
    }
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
}
