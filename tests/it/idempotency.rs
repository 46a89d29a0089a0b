//! Every RPC a CO retries must give the same answer the second time, and
//! the node must not stack a second mount on a retried stage or publish.

use std::collections::HashSet;

use crate::support::harness::*;
use modelcache_csi::csi::*;
use tonic::Code;

#[tokio::test]
async fn controller_calls_are_idempotent() {
    let d = Driver::start().await;

    // CreateVolume twice: the same volume, id and context included.
    let req = create_req("pvc-idem", &[("backend", "local")], WRITER);
    let first = d.create(req.clone()).await.unwrap();
    let second = d.create(req.clone()).await.unwrap();
    assert_eq!(first, second);
    assert!(first.volume_id.starts_with("local."), "{first:?}");
    assert_eq!(first.volume_context["role"], "source");

    // The same name with other arguments is a different volume: refused.
    let mut bigger = req.clone();
    bigger.capacity_range = Some(CapacityRange {
        required_bytes: 5 << 30,
        limit_bytes: 0,
    });
    assert_code(d.create(bigger).await, Code::AlreadyExists, "pvc-idem");
    let mut reader = req.clone();
    reader.volume_capabilities = vec![mount_cap(READER, &[])];
    assert_code(d.create(reader).await, Code::AlreadyExists, "pvc-idem");
    let mut elsewhere = req.clone();
    elsewhere.parameters = map(&[("backend", "shared")]);
    assert_code(
        d.create(elsewhere).await,
        Code::AlreadyExists,
        &first.volume_id,
    );
    // ...and the refusals changed nothing.
    assert_eq!(d.create(req.clone()).await.unwrap(), first);

    // Sealing twice: the second call finds the seal and succeeds.
    d.seal(&first.volume_id).await.unwrap();
    d.seal(&first.volume_id).await.unwrap();
    let unseal = ControllerModifyVolumeRequest {
        volume_id: first.volume_id.clone(),
        mutable_parameters: map(&[("sealed", "false")]),
        ..Default::default()
    };
    let r = d
        .client
        .clone()
        .controller
        .controller_modify_volume(unseal)
        .await;
    assert_code(r, Code::InvalidArgument, "mutable_parameters.sealed");

    // A cache volume created twice from the same source: one volume.
    let cache = d
        .create_cache("pvc-idem-cache", &first.volume_id, &[])
        .await
        .unwrap();
    let again = d
        .create_cache("pvc-idem-cache", &first.volume_id, &[])
        .await;
    assert_eq!(again.unwrap(), cache);
    assert_eq!(d.list_all(0).await.len(), 2);

    // DeleteVolume twice, cache first (the source is read by it).
    d.delete(&cache.volume_id).await.unwrap();
    d.delete(&cache.volume_id).await.unwrap();
    d.delete(&first.volume_id).await.unwrap();
    d.delete(&first.volume_id).await.unwrap();
    assert!(d.list_all(0).await.is_empty());
    // An id in this driver's root that names no volume is already deleted.
    let never = first
        .volume_id
        .replace(uuid_of(&first.volume_id), &"0".repeat(32));
    d.delete(&never).await.unwrap();
}

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

#[tokio::test]
async fn validate_volume_capabilities() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-val-src", "local").await;
    let validate = |caps: Vec<VolumeCapability>| {
        let req = ValidateVolumeCapabilitiesRequest {
            volume_id: src.volume_id.clone(),
            volume_capabilities: caps,
            ..Default::default()
        };
        let mut c = d.client.clone();
        async move { c.controller.validate_volume_capabilities(req).await }
    };
    for _ in 0..2 {
        let ok = validate(vec![mount_cap(WRITER, &["noatime"])])
            .await
            .unwrap()
            .into_inner();
        let confirmed = ok.confirmed.expect("confirmed");
        assert_eq!(
            confirmed.volume_capabilities,
            vec![mount_cap(WRITER, &["noatime"])]
        );
    }
    // A node-local volume cannot be read from many nodes: not confirmed,
    // with the reason, and not an error.
    let multi = modelcache_csi::csi::volume_capability::access_mode::Mode::MultiNodeReaderOnly;
    let no = validate(vec![mount_cap(multi, &[])])
        .await
        .unwrap()
        .into_inner();
    assert!(no.confirmed.is_none(), "{no:?}");
    assert!(no.message.contains("MULTI_NODE_READER_ONLY"), "{no:?}");

    let req = ValidateVolumeCapabilitiesRequest {
        volume_id: src
            .volume_id
            .replace(uuid_of(&src.volume_id), &"0".repeat(32)),
        volume_capabilities: vec![mount_cap(READER, &[])],
        ..Default::default()
    };
    let r = d
        .client
        .clone()
        .controller
        .validate_volume_capabilities(req)
        .await;
    assert_code(r, Code::NotFound, "does not exist");
}

#[tokio::test]
async fn list_volumes_pages_cover_every_volume_once() {
    let d = Driver::start().await;
    let mut created = HashSet::new();
    for (i, backend) in ["local", "shared", "local", "shared", "local"]
        .iter()
        .enumerate()
    {
        let v = d
            .create(create_req(
                &format!("pvc-list-{i}"),
                &[("backend", backend)],
                WRITER,
            ))
            .await
            .unwrap();
        created.insert(v.volume_id);
    }

    let paged = d.list_all(1).await;
    let ids: Vec<_> = paged.iter().map(|v| v.volume_id.clone()).collect();
    assert_eq!(ids.len(), created.len(), "{ids:#?}");
    assert_eq!(ids.iter().cloned().collect::<HashSet<_>>(), created);
    let whole: Vec<_> = d
        .list_all(0)
        .await
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    assert_eq!(whole, ids);
    let pairs: Vec<_> = d
        .list_all(2)
        .await
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    assert_eq!(pairs, ids);

    let bad = ListVolumesRequest {
        max_entries: 1,
        starting_token: "not-a-token".into(),
    };
    let r = d.client.clone().controller.list_volumes(bad).await;
    assert_code(r, Code::Aborted, "starting_token");
}
