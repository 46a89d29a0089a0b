//! A cache volume is read-only whatever the request says: the kernel, not
//! the pod's good manners, refuses writes, and a request for a writable
//! mount is refused outright rather than quietly downgraded.

use std::fs;

use crate::support::harness::*;
use tonic::Code;

/// A cache volume over a `file://` model, and the model.
async fn cache_volume(d: &Driver, name: &str) -> (String, Model) {
    let model_dir = d.dir.join("models").join(name);
    let model = write_model(&model_dir, 3);
    let uri = format!("file://{}", model_dir.display());
    // Created for a writer: the capability is accepted, the mount is not writable.
    let vol = d
        .create(create_req(name, &[("source", &uri)], WRITER))
        .await
        .unwrap();
    assert_eq!(vol.volume_context["role"], "cache");
    (vol.volume_id, model)
}

#[tokio::test]
async fn cache_target_is_read_only_even_when_asked_for_writes() {
    let d = Driver::start().await;
    let (id, model) = cache_volume(&d, "pvc-ro").await;
    let (staging, target) = (d.staging("ro"), d.target("ro"));
    d.stage(&id, &staging, WRITER).await.unwrap();
    // readonly=false and SINGLE_NODE_WRITER: everything short of "rw".
    d.publish(&id, &staging, &target, WRITER, false)
        .await
        .unwrap();

    let m = single_mount(&target);
    assert_mount_options(&m, &["ro", "nosuid", "nodev"]);
    assert!(!m.mount_options.iter().any(|o| o == "rw"), "{m:#?}");
    assert_mount_options(
        &single_mount(&content(&staging)),
        &["ro", "nosuid", "nodev"],
    );

    // Overwriting, creating, and removing all fail with EROFS, and only EROFS
    // (EACCES or EPERM would mean a permission check, not a read-only mount).
    assert_erofs(&target.join("model.safetensors"));
    assert_erofs(&target.join("1_Pooling/new.json"));
    let err = fs::remove_file(target.join("config.json")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    let err = fs::create_dir(target.join("dir")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert_model(&target, &model);

    d.unpublish(&id, &target).await.unwrap();
    d.unstage(&id, &staging).await.unwrap();
}

#[tokio::test]
async fn rw_and_unknown_mount_flags_are_refused() {
    let d = Driver::start().await;
    let (id, _) = cache_volume(&d, "pvc-flags").await;
    let (staging, target) = (d.staging("flags"), d.target("flags"));
    d.stage(&id, &staging, READER).await.unwrap();

    let rw = publish_req(&id, &staging, &target, mount_cap(WRITER, &["rw"]), false);
    let st = assert_code(
        d.publish_req(rw).await,
        Code::InvalidArgument,
        "volume_capability.mount.mount_flags",
    );
    assert!(st.message().contains("read-only"), "{}", st.message());
    assert_not_mounted(&target);

    let odd = publish_req(
        &id,
        &staging,
        &target,
        mount_cap(READER, &["nosuid", "exec"]),
        true,
    );
    let st = assert_code(
        d.publish_req(odd).await,
        Code::InvalidArgument,
        "volume_capability.mount.mount_flags",
    );
    for fragment in ["\"exec\"", "accepted", "nosuid", "noexec", "noatime"] {
        assert!(
            st.message().contains(fragment),
            "{fragment}: {}",
            st.message()
        );
    }
    assert_not_mounted(&target);

    // The same holds when the volume is created.
    let uri = format!("file://{}", d.dir.join("models/pvc-flags").display());
    let mut req = create_req("pvc-flags-rw", &[("source", &uri)], WRITER);
    req.volume_capabilities = vec![mount_cap(WRITER, &["rw"])];
    assert_code(
        d.create(req).await,
        Code::InvalidArgument,
        "volume_capabilities[0].mount.mount_flags",
    );

    // Accepted flags reach the mount.
    let ok = publish_req(
        &id,
        &staging,
        &target,
        mount_cap(READER, &["ro", "noexec", "noatime"]),
        true,
    );
    d.publish_req(ok).await.unwrap();
    assert_mount_options(
        &single_mount(&target),
        &["ro", "nosuid", "nodev", "noexec", "noatime"],
    );
    d.unpublish(&id, &target).await.unwrap();
    d.unstage(&id, &staging).await.unwrap();
}
