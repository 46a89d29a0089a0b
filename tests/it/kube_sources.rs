//! Per-PVC sources against a real kube-apiserver: the PVC annotation
//! overriding the StorageClass source, pull events on the PVC, secrets from
//! the PVC's own namespace only, and `pvc://` claims of this driver, of
//! hostPath PVs and of block-mode XFS local PVs, all exposed read-only in place.

use crate::support::apiserver;

use std::path::Path;

use crate::support::harness::*;
use modelcache_csi::csi::CreateVolumeRequest;
use tonic::Code;

pub(crate) fn apply(api: &apiserver::ApiServer, yaml: &str) {
    let out = api.kubectl_stdin(&["apply", "-f", "-"], yaml);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// No controller-manager runs here, so binding is done by hand, as the PV
/// controller would.
fn bind(api: &apiserver::ApiServer, ns: &str, pvc: &str, pv: &str, spec: &str) {
    apply(
        api,
        &format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {pv}}}\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadOnlyMany]\n  claimRef: {{namespace: {ns}, name: {pvc}}}\n{spec}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {pvc}, namespace: {ns}}}\nspec:\n  accessModes: [ReadOnlyMany]\n  volumeName: {pv}\n  storageClassName: \"\"\n  resources: {{requests: {{storage: 1Gi}}}}\n"
        ),
    );
    let out = api.kubectl(&[
        "-n",
        ns,
        "patch",
        "pvc",
        pvc,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Bound"}}"#,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The events.k8s.io events of `ns` (with `selector`) as `jsonpath`
/// prints them, once `done` holds or after 5 s.
pub(crate) async fn events_until(
    api: &apiserver::ApiServer,
    ns: &str,
    selector: Option<&str>,
    jsonpath: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let jsonpath = format!("jsonpath={jsonpath}");
    let mut args = vec!["-n", ns, "get", "events.events.k8s.io", "-o", &jsonpath];
    if let Some(sel) = selector {
        args.extend(["--field-selector", sel]);
    }
    let mut out = String::new();
    for _ in 0..50 {
        out = String::from_utf8_lossy(&api.kubectl(&args).stdout).into_owned();
        if done(&out) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    out
}

fn request(name: &str, ns: &str, pvc: &str, params: &[(&str, &str)]) -> CreateVolumeRequest {
    let mut all = vec![
        ("csi.storage.k8s.io/pvc/name", pvc),
        ("csi.storage.k8s.io/pvc/namespace", ns),
        ("backend", "local"),
    ];
    all.extend_from_slice(params);
    create_req(name, &all, READER)
}

async fn read_through(
    d: &Driver,
    volume_id: &str,
    tag: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (staging, target) = (d.staging(tag), d.target(tag));
    d.stage(volume_id, &staging, READER).await.expect("stage");
    d.publish(volume_id, &staging, &target, WRITER, false)
        .await
        .expect("publish");
    (staging, target)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_pvc_sources_and_pvc_claims() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let d = Driver::start_against(&api, &[]).await;
    apply(
        &api,
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: team}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n",
    );

    // 1. The PVC's annotation overrides the StorageClass source, and the
    // pull is narrated on the PVC.
    let model = d.dir.join("model-a");
    let m = write_model(&model, 11);
    let class_model = d.dir.join("model-class");
    write_model(&class_model, 12);
    apply(
        &api,
        &format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: minilm\n  namespace: team\n  annotations: {{modelcache.csi.io/source: \"file://{}\"}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n",
            model.display()
        ),
    );
    // A pod waiting for the claim (nothing schedules it here) hears why.
    apply(
        &api,
        "apiVersion: v1\nkind: Pod\nmetadata: {name: reader, namespace: team}\nspec:\n  containers: [{name: c, image: busybox}]\n  volumes: [{name: m, persistentVolumeClaim: {claimName: minilm}}]\n",
    );
    let class_source = format!("file://{}", class_model.display());
    // PVCs may name their own source only within what the class allows.
    let allowed = format!("file://{}/", d.dir.display());
    let v = d
        .create(request(
            "pvc-a",
            "team",
            "minilm",
            &[("source", &class_source), ("allowedSources", &allowed)],
        ))
        .await
        .expect("create from the PVC annotation");
    assert_eq!(
        v.volume_context["model"],
        format!("file://{}", model.display())
    );
    let (staging, target) = read_through(&d, &v.volume_id, "a").await;
    assert_model(&target, &m);
    assert_erofs(&target.join("config.json"));
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    let reasons = events_until(&api, "team", None, "{.items[*].reason}", |o| {
        o.contains("ModelSealed")
    })
    .await;
    assert!(
        reasons.contains("PullStarted") && reasons.contains("ModelSealed"),
        "{reasons:?}"
    );
    let on_pod = events_until(
        &api,
        "team",
        Some("regarding.name=reader"),
        "{range .items[*]}{.reason}: {.note}{\"\\n\"}{end}",
        |o| o.contains("ModelReady"),
    )
    .await;
    assert!(
        on_pod.contains("WaitingForModel: PVC minilm: pulling file://")
            && on_pod.contains("ModelReady: PVC minilm:"),
        "the waiting pod was not told why it waits: {on_pod}"
    );

    // 2. A pull secret is looked up in the PVC's own namespace only.
    apply(
        &api,
        "apiVersion: v1\nkind: Secret\nmetadata: {name: creds, namespace: other}\nstringData: {httpBearerToken: x}\n",
    );
    apply(
        &api,
        &format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: secretive\n  namespace: team\n  annotations: {{modelcache.csi.io/source: \"file://{}\", modelcache.csi.io/source-secret: creds}}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {{requests: {{storage: 1Gi}}}}\n",
            model.display()
        ),
    );
    let r = d
        .create(request(
            "pvc-s",
            "team",
            "secretive",
            &[("allowedSources", &allowed)],
        ))
        .await;
    assert_code(r, Code::NotFound, "Secret team/creds");
    // A malformed annotation names the annotation.
    apply(
        &api,
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: bad\n  namespace: team\n  annotations: {modelcache.csi.io/source: \"ftp://x\"}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {requests: {storage: 1Gi}}\n",
    );
    let r = d.create(request("pvc-bad", "team", "bad", &[])).await;
    assert_code(r, Code::InvalidArgument, "modelcache.csi.io/source");

    // A failed pull is narrated too, with its reason.
    apply(
        &api,
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: broken\n  namespace: team\n  annotations: {modelcache.csi.io/source: \"file:///nonexistent/model\"}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {requests: {storage: 1Gi}}\n",
    );
    let r = d
        .create(request(
            "pvc-broken",
            "team",
            "broken",
            &[("allowedSources", "file:///nonexistent/")],
        ))
        .await;
    assert_code(r, Code::NotFound, "/nonexistent/model");
    let notes = events_until(
        &api,
        "team",
        Some("regarding.name=broken,reason=PullFailed"),
        "{.items[*].note}",
        |o| !o.is_empty(),
    )
    .await;
    assert!(
        notes.contains("does not exist"),
        "no PullFailed event: {notes:?}"
    );

    // The PVC that asks for pvc:// sources below.
    apply(
        &api,
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: reader, namespace: team}\nspec:\n  accessModes: [ReadOnlyMany]\n  resources: {requests: {storage: 1Gi}}\n",
    );

    // 3. pvc:// naming a sealed source volume of this driver reads it in place.
    let src = d.create_source("source-vol", "local").await;
    let (s_staging, s_target) = (d.staging("src"), d.target("src"));
    d.stage(&src.volume_id, &s_staging, WRITER).await.unwrap();
    d.publish(&src.volume_id, &s_staging, &s_target, WRITER, false)
        .await
        .unwrap();
    let sm = write_model(&s_target.join("minilm"), 13);
    d.unpublish(&src.volume_id, &s_target).await.unwrap();
    d.unstage(&src.volume_id, &s_staging).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();
    bind(
        &api,
        "team",
        "models",
        "pv-models",
        &format!(
            "  csi: {{driver: modelcache.csi.io, volumeHandle: \"{}\"}}",
            src.volume_id
        ),
    );
    let v = d
        .create(request(
            "pvc-ours",
            "team",
            "reader",
            &[("source", "pvc://models/minilm")],
        ))
        .await
        .expect("pvc:// of our own volume");
    assert_eq!(
        v.volume_context["source"], src.volume_context["source"],
        "no copy: the same source"
    );
    assert_eq!(v.volume_context["subPath"], "minilm");
    let (staging, target) = read_through(&d, &v.volume_id, "ours").await;
    assert_model(&target, &sm);
    assert_erofs(&target.join("config.json"));
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();

    // 4. A hostPath PV's directory, read-only in place.
    let host = d.dir.join("hostdata");
    let hm = write_model(&host.join("m"), 14);
    bind(
        &api,
        "team",
        "hostclaim",
        "pv-host",
        &format!("  hostPath: {{path: \"{}\"}}", host.display()),
    );
    let v = d
        .create(request(
            "pvc-host",
            "team",
            "reader",
            &[("source", "pvc://hostclaim/m")],
        ))
        .await
        .expect("pvc:// of a hostPath PV");
    let (staging, target) = read_through(&d, &v.volume_id, "host").await;
    assert_model(&target, &hm);
    assert_erofs(&target.join("config.json"));
    assert!(
        std::fs::read(host.join("m/config.json")).is_ok(),
        "the original stays writable to its owner"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();

    // 5. A block-mode local PV holding XFS: mounted ro,norecovery,nouuid.
    let image = d.dir.join("block.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(XFS_BYTES as u64)
        .unwrap();
    assert!(
        std::process::Command::new("mkfs.xfs")
            .arg("-q")
            .arg(&image)
            .status()
            .unwrap()
            .success()
    );
    let fill = d.dir.join("fill");
    std::fs::create_dir_all(&fill).unwrap();
    let lo = modelcache_csi::mount::loopdev::attach(&image, false).unwrap();
    modelcache_csi::mount::mount_device(lo.path(), &fill, "xfs", false, "").unwrap();
    let bm = write_model(&fill, 15);
    modelcache_csi::mount::unmount(&fill).unwrap();
    drop(lo);
    let ro = modelcache_csi::mount::loopdev::attach(&image, true).unwrap();
    let dev = ro.path().to_path_buf();
    // Keep the device attached for the test: kernel autoclear would drop it.
    let holder = std::fs::File::open(&dev).unwrap();
    drop(ro);
    bind(
        &api,
        "team",
        "blockclaim",
        "pv-block",
        &format!(
            "  volumeMode: Block\n  local: {{path: \"{}\"}}\n  nodeAffinity: {{required: {{nodeSelectorTerms: [{{matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [{NODE}]}}]}}]}}}}",
            dev.display()
        ),
    );
    // Its users can still write the device: the node's kernel mounts it only
    // once an admin vouches for it.
    let r = d
        .create(request(
            "pvc-block-untrusted",
            "team",
            "reader",
            &[("source", "pvc://blockclaim")],
        ))
        .await;
    assert_code(
        r,
        Code::PermissionDenied,
        "modelcache.csi.io/trusted-filesystem",
    );
    assert!(mounts_below(&d.dir).iter().all(|m| m.fs_type != "xfs"));
    let out = api.kubectl(&[
        "annotate",
        "pv",
        "pv-block",
        "modelcache.csi.io/trusted-filesystem=true",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = d
        .create(request(
            "pvc-block",
            "team",
            "reader",
            &[("source", "pvc://blockclaim")],
        ))
        .await
        .expect("pvc:// of a block XFS PV an admin trusts");
    let (staging, target) = read_through(&d, &v.volume_id, "block").await;
    assert_model(&target, &bm);
    let m = single_mount(&content(&staging));
    assert_eq!(m.fs_type, "xfs");
    for o in ["ro", "norecovery", "nouuid"] {
        assert!(m.has_option(o), "block staging lacks {o}: {m:#?}");
    }
    assert_erofs(&target.join("config.json"));
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    drop(holder);

    // 6. Other namespaces are refused unless the class allows them; other
    // PV types get a list of what is supported.
    bind(
        &api,
        "other",
        "theirs",
        "pv-theirs",
        &format!("  hostPath: {{path: \"{}\"}}", host.display()),
    );
    let r = d
        .create(request(
            "pvc-x",
            "team",
            "reader",
            &[("source", "pvc://other:theirs")],
        ))
        .await;
    assert_code(r, Code::InvalidArgument, "allowCrossNamespacePVC");
    // The class allows it, but the claim's owner has not consented.
    let cross = [
        ("source", "pvc://other:theirs/m"),
        ("allowCrossNamespacePVC", "true"),
    ];
    let r = d.create(request("pvc-x2", "team", "reader", &cross)).await;
    let s = assert_code(r, Code::PermissionDenied, "does not consent");
    assert!(
        s.message().contains("modelcache.csi.io/shared-with"),
        "{}",
        s.message()
    );
    for (value, ok) in [("someone-else", false), ("x, team", true)] {
        let out = api.kubectl(&[
            "-n",
            "other",
            "annotate",
            "--overwrite",
            "pvc",
            "theirs",
            &format!("modelcache.csi.io/shared-with={value}"),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = d.create(request("pvc-x2", "team", "reader", &cross)).await;
        assert_eq!(r.is_ok(), ok, "shared-with {value:?}: {:?}", r.err());
    }
    bind(
        &api,
        "team",
        "nfsclaim",
        "pv-nfs",
        "  nfs: {server: 127.0.0.1, path: /exports}",
    );
    let r = d
        .create(request(
            "pvc-nfs",
            "team",
            "reader",
            &[("source", "pvc://nfsclaim")],
        ))
        .await;
    let s = assert_code(r, Code::InvalidArgument, "supported");
    assert!(s.message().contains("hostPath"), "{}", s.message());
    let r = d
        .create(request(
            "pvc-missing",
            "team",
            "reader",
            &[("source", "pvc://nothing")],
        ))
        .await;
    assert_code(r, Code::NotFound, "team/nothing");
    assert!(Path::new(&image).exists());
}
