//! Growing a writable source (issue #27): ControllerExpandVolume checks
//! that it may grow and has the room; an XFS image grows on the node that
//! has it staged (NodeExpandVolume: the file, its loop device, the mounted
//! filesystem, online); a directory source's size is its record. Read-only
//! volumes (caches, sealed sources) refuse, naming why.

use std::path::Path;

use crate::support::harness::*;
use modelcache_csi::csi::{
    CapacityRange, ControllerExpandVolumeRequest, ControllerExpandVolumeResponse,
    NodeExpandVolumeRequest,
};
use tonic::{Code, Status};

async fn controller_expand(
    d: &Driver,
    id: &str,
    required: i64,
    limit: i64,
) -> Result<ControllerExpandVolumeResponse, Status> {
    d.client
        .clone()
        .controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

async fn node_expand(
    d: &Driver,
    id: &str,
    path: &Path,
    staging: &Path,
    required: i64,
) -> Result<i64, Status> {
    d.client
        .clone()
        .node
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.display().to_string(),
            staging_target_path: staging.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().capacity_bytes)
}

fn fs_bytes(p: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(p).unwrap();
    st.blocks() * st.fragment_size()
}

#[tokio::test]
async fn an_xfs_source_grows_online_on_its_node() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-grow-xfs", "xfs").await;
    let id = &src.volume_id;
    let (staging, target) = (d.staging("grow"), d.target("grow"));
    d.stage(id, &staging, WRITER).await.unwrap();
    d.publish(id, &staging, &target, WRITER, false)
        .await
        .unwrap();
    let model = write_model(&target, 3);
    let before = fs_bytes(&target);
    assert!(before <= XFS_BYTES as u64, "{before}");

    let big = 2 * XFS_BYTES;
    let r = controller_expand(&d, id, big, 0).await.unwrap();
    assert_eq!(r.capacity_bytes, big);
    assert!(
        r.node_expansion_required,
        "an image grows where it is mounted"
    );
    // The controller changed nothing yet: the filesystem is as it was.
    assert_eq!(fs_bytes(&target), before);

    let grown = node_expand(&d, id, &target, &staging, big).await.unwrap();
    assert_eq!(grown, big);
    let after = fs_bytes(&target);
    assert!(
        after > before + (XFS_BYTES as u64) / 2,
        "the mounted filesystem grew: {before} -> {after}"
    );
    let image = d
        .source_dir("xfs", &src.volume_context["source"])
        .join("image.xfs");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), big as u64);
    // What was written is still there, and there is more room free now
    // than the whole filesystem had before.
    assert_model(&target, &model);
    let st = nix::sys::statvfs::statvfs(&target).unwrap();
    assert!(st.blocks_available() * st.fragment_size() > before);

    // Idempotent, and never smaller.
    assert_eq!(
        node_expand(&d, id, &target, &staging, big).await.unwrap(),
        big
    );
    assert_eq!(
        node_expand(&d, id, &target, &staging, XFS_BYTES)
            .await
            .unwrap(),
        big
    );
    let listed = d.list_all(0).await;
    let rec = listed.iter().find(|v| &v.volume_id == id).unwrap();
    assert_eq!(rec.capacity_bytes, big, "the record says the new size");

    // Not where it is not mounted.
    let nowhere = d.target("nowhere");
    let st = node_expand(&d, id, &nowhere, &d.staging("nowhere"), 3 * XFS_BYTES)
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::NotFound, "{st:?}");

    d.unpublish(id, &target).await.unwrap();
    d.unstage(id, &staging).await.unwrap();

    // Sealed: immutable, and so is its size.
    d.seal(id).await.unwrap();
    let st = controller_expand(&d, id, 3 * XFS_BYTES, 0)
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("sealed"), "{st:?}");
    // A cache volume of it: read-only, the size of its model.
    let cache = d.create_cache("pvc-grow-cache", id, &[]).await.unwrap();
    let st = controller_expand(&d, &cache.volume_id, 3 * XFS_BYTES, 0)
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("allowVolumeExpansion"), "{st:?}");
}

#[tokio::test]
async fn a_directory_source_grows_in_its_record_within_the_room() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-grow-dir", "local").await;
    let id = &src.volume_id;
    let r = controller_expand(&d, id, src.capacity_bytes * 2, 0)
        .await
        .unwrap();
    assert_eq!(r.capacity_bytes, src.capacity_bytes * 2);
    assert!(
        !r.node_expansion_required,
        "a directory has no bytes to grow"
    );
    let listed = d.list_all(0).await;
    let rec = listed.iter().find(|v| &v.volume_id == id).unwrap();
    assert_eq!(rec.capacity_bytes, src.capacity_bytes * 2);

    // More than the disk has beyond --min-free: refused, naming the room.
    let st = controller_expand(&d, id, 1 << 60, 0).await.unwrap_err();
    assert_eq!(st.code(), Code::ResourceExhausted, "{st:?}");
    assert!(st.message().contains("bytes usable"), "{st:?}");

    // Bad ranges name the field.
    let st = controller_expand(&d, id, 0, 0).await.unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument, "{st:?}");
    assert!(st.message().contains("capacity_range"), "{st:?}");
    let st = controller_expand(&d, id, 10 << 20, 5 << 20)
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::OutOfRange, "{st:?}");
    let st = d
        .client
        .clone()
        .controller
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument, "{st:?}");

    // Another node's volume (a root this controller does not serve): its
    // node checks and grows it, at NodeExpandVolume.
    let elsewhere = format!("local.0123abcd.{}", "f".repeat(32));
    let r = controller_expand(&d, &elsewhere, 64 << 20, 0)
        .await
        .unwrap();
    assert!(r.node_expansion_required);
    assert_eq!(r.capacity_bytes, 64 << 20);
}
