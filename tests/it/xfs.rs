//! Backend xfs: a source is a filesystem image, written through its own
//! read-write loop device, then shared by every cache volume on the node
//! through ONE read-only loop device, mounted `ro,norecovery,nouuid`; the
//! device goes away with its last mount.

use std::path::Path;
use std::time::Duration;

use crate::support::fixtures;
use crate::support::harness::*;
use modelcache_csi::mount::loopdev::devices_backed_by;

#[track_caller]
fn assert_released(image: &Path) {
    assert!(
        eventually(Duration::from_secs(2), || devices_backed_by(image)
            .unwrap()
            .is_empty()),
        "loop devices still attached to {}: {:?}",
        image.display(),
        devices_backed_by(image)
    );
}

#[tokio::test]
async fn sealed_image_is_shared_read_only_through_one_loop_device() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-xfs-src", "xfs").await;
    let id = &src.volume_id;
    assert!(id.starts_with("xfs."), "{id}");
    assert_eq!(src.capacity_bytes, XFS_BYTES);
    let image = d
        .source_dir("xfs", &src.volume_context["source"])
        .join("image.xfs");
    // Sparse: the 300 MiB are not allocated up front.
    let blocks = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&image).unwrap());
    assert!(blocks * 512 < XFS_BYTES as u64 / 4, "{blocks} blocks");

    // Written through a read-write device of its own.
    let (staging, target) = (d.staging("xfs-src"), d.target("xfs-writer"));
    d.stage(id, &staging, WRITER).await.unwrap();
    let m = single_mount(&content(&staging));
    assert_eq!(m.fs_type, "xfs", "{m:#?}");
    assert_mount_options(&m, &["rw", "nodev"]);
    let devices = devices_backed_by(&image).unwrap();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0].0.to_str(), Some(m.source.as_str()));
    assert!(!devices[0].1, "the writer's device is read-only");
    d.publish(id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    assert_mount_options(&single_mount(&target), &["rw", "nodev"]);
    let model = write_model(&target, 5);
    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();
    assert_not_mounted(&staging);
    assert_released(&image);

    d.seal(id).await.unwrap();
    assert_released(&image);

    let clones = [
        d.create_cache("pvc-xfs-a", id, &[]).await.unwrap(),
        d.create_cache("pvc-xfs-b", id, &[]).await.unwrap(),
    ];
    let mut mounted = Vec::new();
    for (i, c) in clones.iter().enumerate() {
        let (s, t) = (
            d.staging(&format!("xfs-{i}")),
            d.target(&format!("xfs-{i}")),
        );
        d.stage(&c.volume_id, &s, READER).await.unwrap();
        d.publish(&c.volume_id, &s, &t, READER, true).await.unwrap();
        mounted.push((c.volume_id.clone(), s, t));
    }

    let devices = devices_backed_by(&image).unwrap();
    assert_eq!(
        devices.len(),
        1,
        "one device per image per node: {devices:?}"
    );
    let (dev, read_only) = &devices[0];
    assert!(read_only, "{} is writable", dev.display());
    for (_, s, t) in &mounted {
        let m = single_mount(&content(s));
        assert_eq!(m.fs_type, "xfs", "{m:#?}");
        assert_eq!(m.source, dev.to_str().unwrap(), "{m:#?}");
        assert_mount_options(&m, &["ro", "nosuid", "nodev"]);
        for o in ["ro", "norecovery", "nouuid"] {
            assert!(m.has_option(o), "staging mount lacks {o}: {m:#?}");
        }
        let pm = single_mount(t);
        assert_mount_options(&pm, &["ro", "nosuid", "nodev"]);
        assert_model(t, &model);
        assert_erofs(&t.join("config.json"));
        assert_erofs(&content(s).join("config.json"));
    }

    // The device outlives the first unstage and goes with the last.
    for (i, (v, s, t)) in mounted.iter().enumerate() {
        d.unpublish(v, t).await.unwrap();
        d.unstage(v, s).await.unwrap();
        assert_not_mounted(s);
        if i == 0 {
            assert_eq!(devices_backed_by(&image).unwrap(), devices);
        }
    }
    assert_released(&image);
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
}

/// Reading a model through a sealed image caches it once, under the XFS
/// mount, and not a second time under the image file: the read-only loop
/// device reads its backing file with direct I/O. Without it the image's
/// pages held every byte read again.
#[tokio::test]
async fn reading_a_sealed_image_caches_the_model_once() {
    const WEIGHTS: usize = 64 << 20;
    let d = Driver::start().await;
    let src = d.create_source("pvc-xfs-once", "xfs").await;
    let id = &src.volume_id;
    let image = d
        .source_dir("xfs", &src.volume_context["source"])
        .join("image.xfs");
    let (staging, target) = (d.staging("once-src"), d.target("once-writer"));
    d.stage(id, &staging, WRITER).await.unwrap();
    d.publish(id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    let weights: Vec<u8> = (0..WEIGHTS).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(target.join("model.safetensors"), &weights).unwrap();
    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();
    d.seal(id).await.unwrap();

    // The writer's device went through the page cache; start from none.
    let f = std::fs::File::open(&image).unwrap();
    f.sync_all().unwrap();
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
    let before = fixtures::resident_bytes(&image);

    let cache = d.create_cache("pvc-xfs-once-a", id, &[]).await.unwrap();
    let (s, t) = (d.staging("once-a"), d.target("once-a"));
    d.stage(&cache.volume_id, &s, READER).await.unwrap();
    d.publish(&cache.volume_id, &s, &t, READER, true)
        .await
        .unwrap();
    let read = std::fs::read(t.join("model.safetensors")).unwrap();
    assert!(read == weights, "the model read back differs");
    let under_mount = fixtures::resident_bytes(&t.join("model.safetensors"));
    let under_image = fixtures::resident_bytes(&image).saturating_sub(before);
    assert!(
        under_mount >= WEIGHTS as u64 / 2,
        "the read left {under_mount} bytes of the file cached under the mount; the check \
         below means nothing without them"
    );
    assert!(
        under_image <= WEIGHTS as u64 / 20,
        "reading {WEIGHTS} bytes through the volume cached {under_image} bytes of the image \
         file too (before: {before}): the model is in memory twice"
    );

    d.unpublish(&cache.volume_id, &t).await.unwrap();
    d.unstage(&cache.volume_id, &s).await.unwrap();
    assert_released(&image);
}
