//! The rootless tier: both CSI services in process, over temporary roots,
//! with the fake mounter and no API server, driven through the same trait
//! methods tonic calls. It runs the CSI cases whose answer is the driver's
//! logic (refusals, idempotency, read-only, subPath, each kind of work
//! CreateVolume does) as tables, in seconds and without root; the root
//! suite (`tests/it`) keeps what only the real kernel shows (EROFS, mount
//! options as the kernel reports them, loop devices, XFS).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::{Code, Request, Status};

use crate::cache::{Backend, Roots};
use crate::config::Config;
use crate::context::Context;
use crate::controller::ControllerService;
use crate::csi::controller_server::Controller;
use crate::csi::node_server::Node;
use crate::csi::*;
use crate::mount::fake::FakeMounter;
use crate::node::{NodeOps, NodeService};
use crate::provision::Provisioner;
use crate::requests::*;

struct Driver {
    dir: tempfile::TempDir,
    ctl: ControllerService,
    node: NodeService,
    fake: Arc<FakeMounter>,
    roots: Roots,
}

impl Driver {
    fn start() -> Driver {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Arc::new(Config {
            node_id: Some("node-1".into()),
            state_dir: dir.path().join("state"),
            shared_paths: vec![dir.path().join("shared")],
            backends: vec![Backend::Local, Backend::Shared],
            ..Config::default()
        });
        std::fs::create_dir_all(dir.path().join("shared")).unwrap();
        let ctx = Context::standalone(cfg.clone());
        let fake = Arc::new(FakeMounter::default());
        let ops = Arc::new(NodeOps::with_mounter(cfg, fake.clone()));
        Driver {
            ctl: ControllerService::new(Arc::new(Provisioner::new(&ctx))),
            node: NodeService::new(ops),
            fake,
            roots: ctx.roots,
            dir,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    async fn create(&self, req: CreateVolumeRequest) -> Result<Volume, Status> {
        let r = self.ctl.create_volume(Request::new(req)).await?;
        Ok(r.into_inner().volume.expect("a created volume"))
    }

    async fn delete(&self, volume_id: &str) -> Result<(), Status> {
        let req = DeleteVolumeRequest {
            volume_id: volume_id.into(),
            ..Default::default()
        };
        self.ctl.delete_volume(Request::new(req)).await.map(drop)
    }

    async fn seal(&self, volume_id: &str) -> Result<(), Status> {
        let req = ControllerModifyVolumeRequest {
            volume_id: volume_id.into(),
            mutable_parameters: map(&[("sealed", "true")]),
            ..Default::default()
        };
        self.ctl
            .controller_modify_volume(Request::new(req))
            .await
            .map(drop)
    }

    async fn list(&self) -> Vec<String> {
        let r = self
            .ctl
            .list_volumes(Request::new(ListVolumesRequest::default()))
            .await
            .unwrap();
        r.into_inner()
            .entries
            .into_iter()
            .filter_map(|e| e.volume.map(|v| v.volume_id))
            .collect()
    }

    async fn stage_req(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        self.node
            .node_stage_volume(Request::new(req))
            .await
            .map(drop)
    }

    async fn stage(&self, id: &str, staging: &Path, mode: Mode) -> Result<(), Status> {
        self.stage_req(stage_req(id, staging, mount_cap(mode, &[])))
            .await
    }

    async fn publish_req(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        self.node
            .node_publish_volume(Request::new(req))
            .await
            .map(drop)
    }

    async fn publish(
        &self,
        id: &str,
        staging: &Path,
        target: &Path,
        mode: Mode,
        readonly: bool,
    ) -> Result<(), Status> {
        let cap = mount_cap(mode, &[]);
        self.publish_req(publish_req(id, staging, target, cap, readonly))
            .await
    }

    async fn unpublish(&self, id: &str, target: &Path) -> Result<(), Status> {
        let req = NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: path_str(target),
        };
        self.node
            .node_unpublish_volume(Request::new(req))
            .await
            .map(drop)
    }

    async fn unstage(&self, id: &str, staging: &Path) -> Result<(), Status> {
        let req = NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: path_str(staging),
        };
        self.node
            .node_unstage_volume(Request::new(req))
            .await
            .map(drop)
    }

    /// The data directory of a volume's source, in whichever root has it.
    fn data_of(&self, v: &Volume) -> PathBuf {
        let sid = &v.volume_context["source"];
        let id = crate::cache::VolumeId::parse(&v.volume_id).unwrap();
        self.roots.for_id(&id).unwrap().source(sid).data()
    }

    /// A source volume on `backend`, filled with a small model and sealed.
    async fn sealed_source(&self, name: &str, backend: &str) -> Volume {
        let v = self
            .create(create_req(name, &[("backend", backend)], WRITER))
            .await
            .unwrap();
        write_tree(&self.data_of(&v));
        self.seal(&v.volume_id).await.unwrap();
        v
    }

    /// Nothing this driver mounted is still mounted.
    fn assert_nothing_mounted(&self) {
        let left = self.fake.under(self.dir.path());
        assert!(left.is_empty(), "{left:#?}");
    }
}

/// A model tree: two files at the top, a tokenizer two levels down.
fn write_tree(dir: &Path) {
    for (p, body) in [
        ("config.json", "{}"),
        ("model.safetensors", "weights"),
        ("tokenizer/vocab/vocab.txt", "a\nb\n"),
    ] {
        let p = dir.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
}

/// A model the puller can fetch, as a `file://` URI.
fn file_model(d: &Driver, name: &str) -> String {
    let dir = d.path(&format!("models/{name}"));
    write_tree(&dir);
    format!("file://{}", dir.display())
}

use crate::csi::volume_capability::access_mode::Mode;

#[tokio::test]
async fn every_missing_or_malformed_field_is_named_with_invalid_argument() {
    let d = Driver::start();
    let src = d.sealed_source("pvc-src", "local").await;
    let id = src.volume_id.as_str();
    let (staging, target) = (d.path("staging"), d.path("target"));
    let cap = || mount_cap(READER, &[]);
    let no_caps = CreateVolumeRequest {
        volume_capabilities: vec![],
        ..create_req("pvc-no-caps", &[], WRITER)
    };
    let mut no_mode = create_req("pvc-no-mode", &[], WRITER);
    no_mode.volume_capabilities[0].access_mode = None;
    let mut stage_no_cap = stage_req(id, &staging, cap());
    stage_no_cap.volume_capability = None;
    let mut publish_no_cap = publish_req(id, &staging, &target, cap(), true);
    publish_no_cap.volume_capability = None;
    let validate = ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        ..Default::default()
    };
    let cases: Vec<(&str, Result<(), Status>)> = vec![
        (
            "name",
            d.create(create_req("", &[], WRITER)).await.map(drop),
        ),
        ("volume_capabilities", d.create(no_caps).await.map(drop)),
        (
            "volume_capabilities[0].access_mode",
            d.create(no_mode).await.map(drop),
        ),
        ("volume_id", d.delete("").await),
        ("volume_id", d.seal("").await),
        (
            "volume_capabilities",
            d.ctl
                .validate_volume_capabilities(Request::new(validate))
                .await
                .map(drop),
        ),
        (
            "volume_id",
            d.stage_req(stage_req("", &staging, cap())).await,
        ),
        (
            "staging_target_path",
            d.stage_req(stage_req(id, "".as_ref(), cap())).await,
        ),
        (
            "staging_target_path",
            d.stage_req(stage_req(id, "relative/dir".as_ref(), cap()))
                .await,
        ),
        ("volume_capability", d.stage_req(stage_no_cap).await),
        (
            "target_path",
            d.publish_req(publish_req(id, &staging, "".as_ref(), cap(), true))
                .await,
        ),
        (
            "staging_target_path",
            d.publish_req(publish_req(id, "".as_ref(), &target, cap(), true))
                .await,
        ),
        ("volume_capability", d.publish_req(publish_no_cap).await),
        ("target_path", d.unpublish(id, "".as_ref()).await),
        ("volume_id", d.unstage("", &staging).await),
        (
            "volume_capability.mount.mount_flags",
            d.publish_req(publish_req(
                id,
                &staging,
                &target,
                mount_cap(READER, &["nosuid", "exec"]),
                true,
            ))
            .await,
        ),
        (
            "parameters.backend",
            d.create(create_req("pvc-odd", &[("backend", "tape")], WRITER))
                .await
                .map(drop),
        ),
    ];
    for (field, r) in cases {
        assert_code(r, Code::InvalidArgument, field);
    }
    d.assert_nothing_mounted();
    assert_eq!(d.list().await, std::slice::from_ref(&src.volume_id));
}

#[tokio::test]
async fn unknown_volumes_are_not_found_and_steps_out_of_order_are_refused() {
    let d = Driver::start();
    let src = d.sealed_source("pvc-order", "local").await;
    let (staging, target) = (d.path("staging"), d.path("target"));
    let unknown = src
        .volume_id
        .replace(src.volume_id.rsplit('.').next().unwrap(), &"f".repeat(32));
    let cases: Vec<(Code, &str, Result<(), Status>)> = vec![
        (
            Code::FailedPrecondition,
            "NodeStageVolume first",
            d.publish(&src.volume_id, &staging, &target, READER, true)
                .await,
        ),
        (
            Code::NotFound,
            &unknown,
            d.stage(&unknown, &staging, READER).await,
        ),
        (Code::NotFound, &unknown, d.seal(&unknown).await),
        (
            Code::NotFound,
            "volume_content_source.volume.volume_id",
            d.create(clone_req("pvc-of-nothing", &[], &unknown, READER))
                .await
                .map(drop),
        ),
        (
            Code::NotFound,
            "not-a-volume-id",
            d.stage("not-a-volume-id", &staging, READER).await,
        ),
    ];
    for (code, fragment, r) in cases {
        assert_code(r, code, fragment);
    }
    assert!(!target.exists(), "a refused publish made its target");
    d.assert_nothing_mounted();
}

/// Every kind of work CreateVolume does, on both directory backends: a new
/// source, a clone of a sealed one, a pull from a model URI. Each is
/// idempotent on its name and refuses the name with other arguments.
#[tokio::test]
async fn each_kind_of_create_is_idempotent_and_conflicts_are_refused() {
    let d = Driver::start();
    for backend in ["local", "shared"] {
        let src = d.sealed_source(&format!("src-{backend}"), backend).await;
        let uri = file_model(&d, backend);
        let kinds = [
            create_req(&format!("new-{backend}"), &[("backend", backend)], WRITER),
            clone_req(&format!("clone-{backend}"), &[], &src.volume_id, READER),
            create_req(
                &format!("pull-{backend}"),
                &[("source", &uri), ("backend", backend)],
                READER,
            ),
        ];
        for req in kinds {
            let first = d.create(req.clone()).await.unwrap();
            let again = d.create(req.clone()).await.unwrap();
            assert_eq!(
                first, again,
                "{}: a retry answers the same volume",
                req.name
            );
            let mut other = req.clone();
            other
                .parameters
                .insert("subPath".into(), "tokenizer".into());
            assert_code(d.create(other).await, Code::AlreadyExists, &req.name);
            assert!(d.list().await.contains(&first.volume_id));
            d.delete(&first.volume_id).await.unwrap();
            d.delete(&first.volume_id).await.unwrap();
            assert!(!d.list().await.contains(&first.volume_id));
        }
    }
    // A clone of a source still being written is refused, and says why.
    let open = d
        .create(create_req("open", &[("backend", "local")], WRITER))
        .await
        .unwrap();
    assert_code(
        d.create(clone_req("clone-open", &[], &open.volume_id, READER))
            .await,
        Code::FailedPrecondition,
        "seal",
    );
}

/// Stage and publish twice mount once; unpublish and unstage twice succeed;
/// a cache volume is bound read-only even for a writer that asked for
/// readonly=false, and a source's writer is not.
#[tokio::test]
async fn node_calls_are_idempotent_mount_once_and_caches_are_read_only() {
    let d = Driver::start();
    let src = d.sealed_source("pvc-src", "local").await;
    let cache = d
        .create(clone_req("pvc-cache", &[], &src.volume_id, WRITER))
        .await
        .unwrap();
    let open = d
        .create(create_req("pvc-open", &[("backend", "shared")], WRITER))
        .await
        .unwrap();
    for (v, read_only) in [(&cache, true), (&open, false)] {
        let id = &v.volume_id;
        let (staging, target) = (d.path(&format!("s-{id}")), d.path(&format!("t-{id}")));
        let before = d.fake.made();
        d.stage(id, &staging, WRITER).await.unwrap();
        let staged = d.fake.made();
        d.stage(id, &staging, WRITER).await.unwrap();
        assert_eq!(d.fake.made(), staged, "{id}: a second stage mounted again");
        assert!(staged > before);
        d.publish(id, &staging, &target, WRITER, false)
            .await
            .unwrap();
        let published = d.fake.made();
        d.publish(id, &staging, &target, WRITER, false)
            .await
            .unwrap();
        assert_eq!(
            d.fake.made(),
            published,
            "{id}: a second publish mounted again"
        );
        let m = d.fake.at(&target).expect("published");
        assert_eq!(m.is_readonly(), read_only, "{id}: {m:#?}");
        assert!(m.has_option("nosuid") && m.has_option("nodev"), "{m:#?}");
        for _ in 0..2 {
            d.unpublish(id, &target).await.unwrap();
        }
        for _ in 0..2 {
            d.unstage(id, &staging).await.unwrap();
        }
    }
    d.assert_nothing_mounted();
}

/// subPath: only that directory is bound; a path that leaves the source, a
/// file or a missing directory is refused at create, and nothing is left.
#[tokio::test]
async fn sub_path_binds_only_its_directory_and_never_leaves_the_source() {
    let d = Driver::start();
    let src = d.sealed_source("pvc-src", "local").await;
    std::os::unix::fs::symlink("/etc", d.data_of(&src).join("escape")).ok();
    let cache = d
        .create(clone_req(
            "pvc-sub",
            &[("subPath", "tokenizer/vocab")],
            &src.volume_id,
            READER,
        ))
        .await
        .unwrap();
    assert_eq!(cache.volume_context["subPath"], "tokenizer/vocab");
    let (staging, target) = (d.path("staging"), d.path("target"));
    d.stage(&cache.volume_id, &staging, READER).await.unwrap();
    d.publish(&cache.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let m = d.fake.at(&target).expect("published");
    assert!(m.root.ends_with("data/tokenizer/vocab"), "{m:#?}");
    d.unpublish(&cache.volume_id, &target).await.unwrap();
    d.unstage(&cache.volume_id, &staging).await.unwrap();

    for bad in [
        "../x",
        "/etc",
        "tokenizer/../..",
        "a//b",
        "config.json",
        "nope",
        "escape",
    ] {
        let r = d
            .create(clone_req(
                "pvc-bad",
                &[("subPath", bad)],
                &src.volume_id,
                READER,
            ))
            .await;
        assert_code(r, Code::InvalidArgument, "parameters.subPath");
    }
    assert_eq!(d.list().await.len(), 2);
    d.assert_nothing_mounted();
}
