//! The controller's calls refused and retried: what a CO sends wrong is
//! named with the code it acts on and leaves nothing behind, and a call
//! sent again gives the same answer.

use std::collections::HashSet;

use crate::csi::volume_content_source::{SnapshotSource, Type as ContentType};

use super::*;

impl Driver {
    async fn validate(
        &self,
        volume_id: &str,
        caps: Vec<VolumeCapability>,
    ) -> Result<ValidateVolumeCapabilitiesResponse, Status> {
        let req = ValidateVolumeCapabilitiesRequest {
            volume_id: volume_id.into(),
            volume_capabilities: caps,
            ..Default::default()
        };
        let r = self.ctl.validate_volume_capabilities(Request::new(req));
        Ok(r.await?.into_inner())
    }

    async fn modify(&self, volume_id: &str, params: &[(&str, &str)]) -> Result<(), Status> {
        let req = ControllerModifyVolumeRequest {
            volume_id: volume_id.into(),
            mutable_parameters: map(params),
            ..Default::default()
        };
        self.ctl
            .controller_modify_volume(Request::new(req))
            .await
            .map(drop)
    }

    /// Every volume, through pages of `max_entries` (0: one page).
    async fn list_paged(&self, max_entries: i32) -> Vec<String> {
        let (mut out, mut token) = (Vec::new(), String::new());
        loop {
            let req = ListVolumesRequest {
                max_entries,
                starting_token: token,
            };
            let page = self
                .ctl
                .list_volumes(Request::new(req))
                .await
                .unwrap()
                .into_inner();
            out.extend(page.entries.into_iter().filter_map(|e| e.volume));
            if page.next_token.is_empty() {
                return out.into_iter().map(|v| v.volume_id).collect();
            }
            token = page.next_token;
        }
    }
}

#[tokio::test]
async fn what_is_not_offered_is_refused_naming_what_is() {
    let d = Driver::start();
    let src = d.sealed_source("pvc-unsup-src", "local").await;
    let (staging, target) = (d.path("staging"), d.path("target"));
    let mut snapshot = create_req("pvc-snap", &[], READER);
    snapshot.volume_content_source = Some(VolumeContentSource {
        r#type: Some(ContentType::Snapshot(SnapshotSource {
            snapshot_id: "snap-1".into(),
        })),
    });
    let mut block = create_req("pvc-block", &[], WRITER);
    block.volume_capabilities = vec![block_cap(WRITER)];
    let cases: Vec<(&str, Result<(), Status>)> = vec![
        (
            "volume_content_source.snapshot",
            d.create(snapshot).await.map(drop),
        ),
        (
            "parameters.source",
            d.create(create_req("pvc-ftp", &[("source", "ftp://b/m")], READER))
                .await
                .map(drop),
        ),
        (
            "parameters.verify",
            d.create(create_req(
                "pvc-verify",
                &[("source", "file:///m"), ("verify", "some")],
                READER,
            ))
            .await
            .map(drop),
        ),
        (
            "mutable_parameters.iops",
            d.modify(&src.volume_id, &[("iops", "100")]).await,
        ),
        (
            "mutable_parameters.sealed",
            d.modify(&src.volume_id, &[("sealed", "false")]).await,
        ),
        (
            "volume_capabilities[0].block",
            d.create(block).await.map(drop),
        ),
        (
            "volume_capability.block",
            d.stage_req(stage_req(&src.volume_id, &staging, block_cap(READER)))
                .await,
        ),
    ];
    for (field, r) in cases {
        assert_code(r, Code::InvalidArgument, field);
    }
    // An unknown parameter is named with those that are known.
    let r = d
        .create(create_req("pvc-colour", &[("colour", "red")], WRITER))
        .await;
    let st = assert_code(r, Code::InvalidArgument, "parameters.colour");
    for known in ["backend", "subPath", "source"] {
        assert!(st.message().contains(known), "{known}: {}", st.message());
    }
    // A block publish over a staged volume mounts nothing.
    d.stage(&src.volume_id, &staging, READER).await.unwrap();
    let r = d
        .publish_req(publish_req(
            &src.volume_id,
            &staging,
            &target,
            block_cap(READER),
            true,
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "volume_capability.block");
    d.unstage(&src.volume_id, &staging).await.unwrap();
    d.assert_nothing_mounted();
    assert_eq!(d.list().await, std::slice::from_ref(&src.volume_id));
}

#[tokio::test]
async fn a_backend_the_driver_does_not_offer_is_named() {
    let d = Driver::start_over(
        Arc::new(tempfile::tempdir().unwrap()),
        None,
        &[Backend::Local],
    );
    let r = d
        .create(create_req("pvc-xfs-off", &[("backend", "xfs")], WRITER))
        .await;
    let st = assert_code(r, Code::InvalidArgument, "parameters.backend");
    assert!(st.message().contains("not enabled"), "{}", st.message());
    d.create(create_req("pvc-local-on", &[("backend", "local")], WRITER))
        .await
        .unwrap();
}

/// The same name with other arguments is another volume, refused; a seal
/// or a delete sent again succeeds; an id of this driver that names no
/// volume is deleted already.
#[tokio::test]
async fn a_name_asked_again_with_other_arguments_is_refused_and_retries_succeed() {
    let d = Driver::start();
    let req = create_req("pvc-idem", &[("backend", "local")], WRITER);
    let first = d.create(req.clone()).await.unwrap();
    assert!(first.volume_id.starts_with("local."), "{first:?}");
    assert_eq!(first.volume_context["role"], "source");
    let mut bigger = req.clone();
    bigger.capacity_range = Some(CapacityRange {
        required_bytes: 5 << 30,
        limit_bytes: 0,
    });
    let mut reader = req.clone();
    reader.volume_capabilities = vec![mount_cap(READER, &[])];
    let mut elsewhere = req.clone();
    elsewhere.parameters = map(&[("backend", "shared")]);
    let cases = [
        ("pvc-idem", d.create(bigger).await),
        ("pvc-idem", d.create(reader).await),
        (first.volume_id.as_str(), d.create(elsewhere).await),
    ];
    for (fragment, r) in cases {
        assert_code(r, Code::AlreadyExists, fragment);
    }
    assert_eq!(
        d.create(req.clone()).await.unwrap(),
        first,
        "changed nothing"
    );
    d.seal(&first.volume_id).await.unwrap();
    d.seal(&first.volume_id).await.unwrap();
    let cache = clone_req("pvc-idem-cache", &[], &first.volume_id, READER);
    let made = d.create(cache.clone()).await.unwrap();
    assert_eq!(d.create(cache).await.unwrap(), made);
    assert_eq!(d.list().await.len(), 2);
    for id in [
        &made.volume_id,
        &made.volume_id,
        &first.volume_id,
        &first.volume_id,
    ] {
        d.delete(id).await.unwrap();
    }
    assert!(d.list().await.is_empty());
    let never = first
        .volume_id
        .replace(uuid_of(&first.volume_id), &"0".repeat(32));
    d.delete(&never).await.unwrap();
}

#[tokio::test]
async fn validate_confirms_what_a_volume_serves_and_says_why_not() {
    let d = Driver::start();
    let src = d
        .create(create_req("pvc-val-src", &[("backend", "local")], WRITER))
        .await
        .unwrap();
    for _ in 0..2 {
        let ok = d
            .validate(&src.volume_id, vec![mount_cap(WRITER, &["noatime"])])
            .await
            .unwrap();
        let confirmed = ok.confirmed.expect("confirmed");
        assert_eq!(
            confirmed.volume_capabilities,
            vec![mount_cap(WRITER, &["noatime"])]
        );
    }
    // A node-local volume cannot be read from many nodes: not confirmed,
    // with the reason, and not an error.
    let multi = Mode::MultiNodeReaderOnly;
    let no = d
        .validate(&src.volume_id, vec![mount_cap(multi, &[])])
        .await
        .unwrap();
    assert!(no.confirmed.is_none(), "{no:?}");
    assert!(no.message.contains("MULTI_NODE_READER_ONLY"), "{no:?}");
    let gone = src
        .volume_id
        .replace(uuid_of(&src.volume_id), &"0".repeat(32));
    let r = d.validate(&gone, vec![mount_cap(READER, &[])]).await;
    assert_code(r, Code::NotFound, "does not exist");
}

#[tokio::test]
async fn list_pages_cover_every_volume_once() {
    let d = Driver::start();
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
    let ids = d.list_paged(1).await;
    assert_eq!(ids.len(), created.len(), "{ids:#?}");
    assert_eq!(ids.iter().cloned().collect::<HashSet<_>>(), created);
    assert_eq!(d.list_paged(0).await, ids);
    assert_eq!(d.list_paged(2).await, ids);
    let bad = ListVolumesRequest {
        max_entries: 1,
        starting_token: "not-a-token".into(),
    };
    let r = d.ctl.list_volumes(Request::new(bad)).await;
    assert_code(r, Code::Aborted, "starting_token");
}
