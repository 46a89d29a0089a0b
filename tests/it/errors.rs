//! Refusals: each names the field that is wrong and what would be accepted,
//! with the code a CO acts on, and leaves nothing behind.

use crate::support::harness::*;
use modelcache_csi::csi::volume_content_source::{SnapshotSource, Type as ContentType};
use modelcache_csi::csi::*;
use tonic::Code;

#[tokio::test]
async fn missing_fields_are_named() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-err-src", "local").await;
    let id = src.volume_id.as_str();
    let (staging, target) = (d.staging("err"), d.target("err"));

    let mut req = create_req("", &[], WRITER);
    assert_code(d.create(req.clone()).await, Code::InvalidArgument, "name");
    req.name = "pvc-no-caps".into();
    req.volume_capabilities.clear();
    assert_code(
        d.create(req).await,
        Code::InvalidArgument,
        "volume_capabilities",
    );
    let mut req = create_req("pvc-no-mode", &[], WRITER);
    req.volume_capabilities[0].access_mode = None;
    assert_code(
        d.create(req).await,
        Code::InvalidArgument,
        "volume_capabilities[0].access_mode",
    );

    assert_code(d.delete("").await, Code::InvalidArgument, "volume_id");
    assert_code(d.seal("").await, Code::InvalidArgument, "volume_id");
    let req = ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        ..Default::default()
    };
    let r = d
        .client
        .clone()
        .controller
        .validate_volume_capabilities(req)
        .await;
    assert_code(r, Code::InvalidArgument, "volume_capabilities");

    let cap = || mount_cap(WRITER, &[]);
    let r = d.stage_req(stage_req("", &staging, cap())).await;
    assert_code(r, Code::InvalidArgument, "volume_id");
    let r = d.stage_req(stage_req(id, "".as_ref(), cap())).await;
    assert_code(r, Code::InvalidArgument, "staging_target_path");
    let r = d
        .stage_req(stage_req(id, "relative/dir".as_ref(), cap()))
        .await;
    assert_code(r, Code::InvalidArgument, "staging_target_path");
    let mut req = stage_req(id, &staging, cap());
    req.volume_capability = None;
    assert_code(
        d.stage_req(req).await,
        Code::InvalidArgument,
        "volume_capability",
    );

    let r = d
        .publish_req(publish_req(id, &staging, "".as_ref(), cap(), false))
        .await;
    assert_code(r, Code::InvalidArgument, "target_path");
    let r = d
        .publish_req(publish_req(id, "".as_ref(), &target, cap(), false))
        .await;
    assert_code(r, Code::InvalidArgument, "staging_target_path");
    let mut req = publish_req(id, &staging, &target, cap(), false);
    req.volume_capability = None;
    assert_code(
        d.publish_req(req).await,
        Code::InvalidArgument,
        "volume_capability",
    );
    assert_code(
        d.unpublish(id, "".as_ref()).await,
        Code::InvalidArgument,
        "target_path",
    );
    assert_code(
        d.unstage("", &staging).await,
        Code::InvalidArgument,
        "volume_id",
    );

    // Nothing was staged, mounted, or leased by any of it.
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
    let writers = d
        .source_dir("local", &src.volume_context["source"])
        .join("writers");
    assert!(!writers.exists() || std::fs::read_dir(&writers).unwrap().count() == 0);
    assert_eq!(d.list_all(0).await.len(), 1);
}

#[tokio::test]
async fn steps_out_of_order_and_unknown_volumes() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-order", "local").await;
    let (staging, target) = (d.staging("order"), d.target("order"));

    let r = d
        .publish(&src.volume_id, &staging, &target, WRITER, false)
        .await;
    assert_code(r, Code::FailedPrecondition, "NodeStageVolume first");
    assert_not_mounted(&target);

    let unknown = src
        .volume_id
        .replace(uuid_of(&src.volume_id), &"f".repeat(32));
    assert_code(
        d.stage(&unknown, &staging, READER).await,
        Code::NotFound,
        &unknown,
    );
    assert_code(d.seal(&unknown).await, Code::NotFound, &unknown);
    assert_code(
        d.create_cache("pvc-of-nothing", &unknown, &[]).await,
        Code::NotFound,
        "volume_content_source.volume.volume_id",
    );
    assert_code(
        d.stage("not-a-volume-id", &staging, READER).await,
        Code::NotFound,
        "not-a-volume-id",
    );
    assert!(
        mounts_below(&d.dir).is_empty(),
        "{:#?}",
        mounts_below(&d.dir)
    );
}

#[tokio::test]
async fn unsupported_requests_say_what_is_accepted() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-unsup-src", "local").await;
    let (staging, target) = (d.staging("unsup"), d.target("unsup"));

    let mut req = create_req("pvc-snap", &[], READER);
    req.volume_content_source = Some(VolumeContentSource {
        r#type: Some(ContentType::Snapshot(SnapshotSource {
            snapshot_id: "snap-1".into(),
        })),
    });
    let st = assert_code(d.create(req).await, Code::InvalidArgument, "snapshots");
    assert!(
        st.message().contains("volume_content_source.snapshot"),
        "{}",
        st.message()
    );

    let r = d
        .create(create_req("pvc-colour", &[("colour", "red")], WRITER))
        .await;
    let st = assert_code(r, Code::InvalidArgument, "parameters.colour");
    for known in ["backend", "subPath", "source"] {
        assert!(st.message().contains(known), "{known}: {}", st.message());
    }
    let r = d
        .create(create_req("pvc-nfs", &[("backend", "nfs")], WRITER))
        .await;
    assert_code(r, Code::InvalidArgument, "parameters.backend");
    let r = d
        .create(create_req(
            "pvc-s3",
            &[("source", "ftp://bucket/model")],
            READER,
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "parameters.source");
    let r = d
        .create(create_req(
            "pvc-verify",
            &[("source", "file:///m"), ("verify", "some")],
            READER,
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "parameters.verify");
    let modify = ControllerModifyVolumeRequest {
        volume_id: src.volume_id.clone(),
        mutable_parameters: map(&[("iops", "100")]),
        ..Default::default()
    };
    let r = d
        .client
        .clone()
        .controller
        .controller_modify_volume(modify)
        .await;
    assert_code(r, Code::InvalidArgument, "mutable_parameters.iops");

    // Block access, at every call that carries a capability.
    let mut req = create_req("pvc-block", &[], WRITER);
    req.volume_capabilities = vec![block_cap(WRITER)];
    assert_code(
        d.create(req).await,
        Code::InvalidArgument,
        "volume_capabilities[0].block",
    );
    let r = d
        .stage_req(stage_req(&src.volume_id, &staging, block_cap(WRITER)))
        .await;
    assert_code(r, Code::InvalidArgument, "volume_capability.block");
    d.stage(&src.volume_id, &staging, WRITER).await.unwrap();
    let r = d
        .publish_req(publish_req(
            &src.volume_id,
            &staging,
            &target,
            block_cap(WRITER),
            false,
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "volume_capability.block");
    assert_not_mounted(&target);
    d.unstage(&src.volume_id, &staging).await.unwrap();

    // None of the refused creates left a volume.
    assert_eq!(d.list_all(0).await.len(), 1);
}

#[tokio::test]
async fn disabled_backend_is_named() {
    let d = Driver::start_with(&["--backends", "local"]).await;
    let r = d
        .create(create_req("pvc-xfs-off", &[("backend", "xfs")], WRITER))
        .await;
    let st = assert_code(r, Code::InvalidArgument, "parameters.backend");
    assert!(st.message().contains("not enabled"), "{}", st.message());
    d.create_source("pvc-local-on", "local").await;
}
