//! Calls a CO sends at the same time: on one volume, one proceeds and the
//! other either finds its work done or is told the operation is pending
//! (Aborted); never a second mount, a second loop device, or a failure.

use std::sync::Arc;

use crate::support::harness::*;
use modelcache_csi::mount::loopdev::devices_backed_by;
use tonic::{Code, Status};

/// Each result is OK or Aborted ("in progress"), and at least one is OK.
#[track_caller]
fn assert_ok_or_pending<T: std::fmt::Debug>(results: &[Result<T, Status>]) {
    assert!(results.iter().any(|r| r.is_ok()), "{results:#?}");
    for r in results {
        if let Err(s) = r {
            assert_eq!(s.code(), Code::Aborted, "{s:?}");
            assert!(s.message().contains("in progress"), "{s:?}");
        }
    }
}

#[tokio::test]
async fn concurrent_stage_of_one_volume_mounts_once() {
    let d = Arc::new(Driver::start().await);
    let model_dir = d.dir.join("models/m");
    let model = write_model(&model_dir, 7);
    let uri = format!("file://{}", model_dir.display());
    // verify=full hashes the model at every stage: the calls overlap longer.
    let vol = d
        .create(create_req(
            "pvc-race",
            &[("source", &uri), ("verify", "full")],
            READER,
        ))
        .await
        .unwrap();
    let id = vol.volume_id;
    let staging = d.staging("race");

    for _ in 0..5 {
        let calls: Vec<_> = (0..2)
            .map(|_| {
                let (d, id, staging) = (d.clone(), id.clone(), staging.clone());
                tokio::spawn(async move { d.stage(&id, &staging, READER).await })
            })
            .collect();
        let mut results = Vec::new();
        for c in calls {
            results.push(c.await.unwrap());
        }
        assert_ok_or_pending(&results);
        let m = single_mount(&content(&staging));
        assert_mount_options(&m, &["ro"]);
        assert_model(&content(&staging), &model);
        d.unstage(&id, &staging).await.unwrap();
        assert_not_mounted(&staging);
    }
}

#[tokio::test]
async fn concurrent_stage_of_two_xfs_clones_shares_one_loop_device() {
    let d = Arc::new(Driver::start().await);
    let src = d.create_source("pvc-xfs-race-src", "xfs").await;
    let staging = d.staging("xfs-race-src");
    d.stage(&src.volume_id, &staging, WRITER).await.unwrap();
    let model = write_model(&content(&staging), 8);
    d.unstage(&src.volume_id, &staging).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();
    let image = d
        .source_dir("xfs", &src.volume_context["source"])
        .join("image.xfs");

    let mut clones = Vec::new();
    for name in ["pvc-xfs-race-a", "pvc-xfs-race-b", "pvc-xfs-race-c"] {
        clones.push(
            d.create_cache(name, &src.volume_id, &[])
                .await
                .unwrap()
                .volume_id,
        );
    }
    let calls: Vec<_> = clones
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (d, id, s) = (d.clone(), id.clone(), d.staging(&format!("xfs-race-{i}")));
            tokio::spawn(async move { d.stage(&id, &s, READER).await })
        })
        .collect();
    for c in calls {
        // Different volumes: nothing to abort, every call must succeed.
        c.await.unwrap().unwrap();
    }
    let devices = devices_backed_by(&image).unwrap();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert!(devices[0].1, "{devices:?}");
    for (i, id) in clones.iter().enumerate() {
        let s = d.staging(&format!("xfs-race-{i}"));
        assert_eq!(
            single_mount(&content(&s)).source,
            devices[0].0.to_str().unwrap()
        );
        assert_model(&content(&s), &model);
        d.unstage(id, &s).await.unwrap();
    }
}

#[tokio::test]
async fn concurrent_create_of_one_name_makes_one_volume() {
    let d = Arc::new(Driver::start().await);
    let src = d.create_source("pvc-create-race-src", "local").await;
    d.seal(&src.volume_id).await.unwrap();

    let calls: Vec<_> = (0..4)
        .map(|_| {
            let (d, from) = (d.clone(), src.volume_id.clone());
            tokio::spawn(async move { d.create_cache("pvc-create-race", &from, &[]).await })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    assert_ok_or_pending(&results);
    let ok: Vec<_> = results.into_iter().filter_map(Result::ok).collect();
    assert!(ok.windows(2).all(|w| w[0] == w[1]), "{ok:#?}");
    assert_eq!(d.list_all(0).await.len(), 2);

    // The one reference the source holds goes with the one volume.
    let refs = d
        .source_dir("local", &src.volume_context["source"])
        .join("refs");
    assert_eq!(std::fs::read_dir(&refs).unwrap().count(), 1);
    d.delete(&ok[0].volume_id).await.unwrap();
    d.delete(&src.volume_id).await.unwrap();
}

/// What kubelet's GetDeviceMountRefs finds for `path` (mount-utils'
/// SearchMountPoints): every other mount of the same filesystem root on the
/// same device, less the ones beneath the same plugin path (HasMountRefs).
/// kubelet will not unstage while this is non-empty.
fn kubelet_mount_refs(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    let path = std::fs::canonicalize(path).unwrap();
    let table = modelcache_csi::mount::read_table().unwrap();
    let Some(me) = table.iter().rev().find(|m| m.mount_point == path) else {
        return Vec::new();
    };
    table
        .iter()
        .filter(|m| m.mount_id != me.mount_id)
        .filter(|m| m.root == me.root && (m.major, m.minor) == (me.major, me.minor))
        .map(|m| m.mount_point.clone())
        .filter(|p| !p.starts_with(&path))
        .collect()
}

/// Two cache volumes of one source staged on one node: kubelet must be able
/// to unstage each while the other stays (it refused both forever when every
/// staging path was a mount of the same tree), on every backend.
#[tokio::test]
async fn two_volumes_of_one_source_never_block_each_others_unstage() {
    let d = Driver::start().await;
    for backend in ["local", "xfs"] {
        let src = d
            .create_source(&format!("pvc-refs-{backend}"), backend)
            .await;
        let staging = d.staging(&format!("refs-src-{backend}"));
        d.stage(&src.volume_id, &staging, WRITER).await.unwrap();
        let model = write_model(&content(&staging), 5);
        d.unstage(&src.volume_id, &staging).await.unwrap();
        d.seal(&src.volume_id).await.unwrap();
        let mut staged = Vec::new();
        for i in 0..2 {
            let id = d
                .create_cache(&format!("pvc-refs-{backend}-{i}"), &src.volume_id, &[])
                .await
                .unwrap()
                .volume_id;
            let s = d.staging(&format!("refs-{backend}-{i}"));
            d.stage(&id, &s, READER).await.unwrap();
            assert_model(&content(&s), &model);
            staged.push((id, s));
        }
        for (_, s) in &staged {
            let refs = kubelet_mount_refs(s);
            assert!(
                refs.is_empty(),
                "{backend}: kubelet would refuse to unstage {}: other references {refs:#?}",
                s.display()
            );
        }
        // One goes while the other stays and still reads.
        d.unstage(&staged[0].0, &staged[0].1).await.unwrap();
        assert_not_mounted(&staged[0].1);
        assert_model(&content(&staged[1].1), &model);
        d.unstage(&staged[1].0, &staged[1].1).await.unwrap();
        assert_not_mounted(&staged[1].1);
    }
}
