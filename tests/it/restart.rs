//! kill -9 with live mounts: pods keep reading, and a restarted driver
//! learns what is mounted from the kernel's mount table (nothing about
//! mounts is persisted), while writer leases, which are persisted next to
//! the source, keep fencing the seal.

use std::time::Duration;

use crate::support::harness::*;
use modelcache_csi::mount::loopdev::devices_backed_by;
use tonic::Code;

/// Stage and publish a cache volume on `backend`, kill -9 the driver, and
/// tear everything down through the restarted driver.
async fn cache_survives_kill_9(backend: &str) {
    let mut d = Driver::start().await;
    let src = d
        .create_source(&format!("pvc-{backend}-src"), backend)
        .await;
    let (wstaging, wtarget) = (d.staging("src"), d.target("writer"));
    d.stage(&src.volume_id, &wstaging, WRITER).await.unwrap();
    d.publish(&src.volume_id, &wstaging, &wtarget, WRITER, false)
        .await
        .unwrap();
    let model = write_model(&wtarget, 6);
    d.unpublish(&src.volume_id, &wtarget).await.unwrap();
    d.unstage(&src.volume_id, &wstaging).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();

    let cache = d
        .create_cache(&format!("pvc-{backend}-cache"), &src.volume_id, &[])
        .await
        .unwrap();
    let id = &cache.volume_id;
    let (staging, target) = (d.staging("cache"), d.target("reader"));
    d.stage(id, &staging, READER).await.unwrap();
    d.publish(id, &staging, &target, READER, true)
        .await
        .unwrap();
    let before = (single_mount(&content(&staging)), single_mount(&target));

    d.kill_9();
    // The pod does not notice: its mount belongs to the kernel.
    assert_model(&target, &model);
    assert_eq!(
        (single_mount(&content(&staging)), single_mount(&target)),
        before
    );

    d.restart().await;
    // Retries of the calls kubelet may have had in flight find the mounts
    // already there and add none.
    d.stage(id, &staging, READER).await.unwrap();
    d.publish(id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert_eq!(
        (single_mount(&content(&staging)), single_mount(&target)),
        before
    );

    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
    assert!(!target.exists());
    if backend == "xfs" {
        let image = d
            .source_dir("xfs", &src.volume_context["source"])
            .join("image.xfs");
        assert!(
            eventually(Duration::from_secs(2), || devices_backed_by(&image)
                .unwrap()
                .is_empty()),
            "{:?}",
            devices_backed_by(&image)
        );
    }
}

#[tokio::test]
async fn local_cache_survives_kill_9() {
    cache_survives_kill_9("local").await;
}

#[tokio::test]
async fn xfs_cache_survives_kill_9() {
    cache_survives_kill_9("xfs").await;
}

#[tokio::test]
async fn writer_lease_survives_kill_9() {
    let mut d = Driver::start().await;
    let src = d.create_source("pvc-lease", "local").await;
    let id = &src.volume_id;
    let lease = d
        .source_dir("local", &src.volume_context["source"])
        .join("writers")
        .join(NODE);
    let staging = d.staging("lease");
    d.stage(id, &staging, WRITER).await.unwrap();
    assert!(lease.exists());

    d.kill_9();
    // The writer keeps writing while no driver runs.
    std::fs::write(
        content(&staging).join("late.bin"),
        b"written after the crash",
    )
    .unwrap();
    d.restart().await;

    assert!(lease.exists());
    assert_code(d.seal(id).await, Code::FailedPrecondition, NODE);
    assert_code(
        d.create_cache("pvc-lease-cache", id, &[]).await,
        Code::FailedPrecondition,
        "not sealed",
    );
    // A retried stage keeps the one lease and the one mount.
    d.stage(id, &staging, WRITER).await.unwrap();
    assert_mount_options(&single_mount(&content(&staging)), &["rw"]);

    d.unstage(id, &staging).await.unwrap();
    assert!(!lease.exists());
    d.seal(id).await.unwrap();
    let cache = d.create_cache("pvc-lease-cache", id, &[]).await.unwrap();
    let (cs, ct) = (d.staging("lease-cache"), d.target("lease-cache"));
    d.stage(&cache.volume_id, &cs, READER).await.unwrap();
    d.publish(&cache.volume_id, &cs, &ct, READER, true)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(ct.join("late.bin")).unwrap(),
        b"written after the crash"
    );
    d.unpublish(&cache.volume_id, &ct).await.unwrap();
    d.unstage(&cache.volume_id, &cs).await.unwrap();
}
