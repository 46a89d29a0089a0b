//! The driver run in-process on a scratch directory, for the demo and the
//! benchmark: a private mount namespace, the real gRPC server on a Unix
//! socket, typed calls for the CSI steps, and a work directory that takes
//! every mount and file under it away when dropped.
//!
//! It must never leave a mount or a byte behind, whatever fails: every step
//! is undone by the caller's explicit teardown first, and by `WorkDir`'s
//! Drop as the last line.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cache::{self, Backend, Roots, Seal};
use crate::client::Client;
use crate::config::Config;
use crate::csi::volume_capability::access_mode::Mode as AccessMode;
use crate::csi::volume_content_source::{Type as ContentType, VolumeSource};
use crate::csi::*;
use crate::mount::{self, mountinfo};
use crate::server::{self, Mode};

/// Set in the environment of the re-executed child, so it does not re-exec again.
const PRIVATE_NS_ENV: &str = "MODELCACHE_PRIVATE_MOUNT_NS";

/// How the current process should go on.
pub enum Namespace {
    /// This process is in a private mount namespace: carry on.
    Private,
    /// Could not make one (no unshare, or not permitted): carry on, and rely
    /// on explicit teardown alone.
    Shared(String),
    /// A child ran the whole command in a private namespace and exited with this code.
    ChildExited(i32),
}

/// Runs this same command again in a new mount namespace with private
/// propagation, unless it already is in one. Mounts made there never
/// reach the host's table, and the kernel drops them when the namespace's
/// last process exits, even after SIGKILL.
///
/// An in-process `unshare(CLONE_NEWNS)` would fail: the process already
/// has threads (the runtime), and the call needs a single-threaded caller.
pub async fn enter_private_mount_namespace() -> anyhow::Result<Namespace> {
    if std::env::var_os(PRIVATE_NS_ENV).is_some() {
        return Ok(Namespace::Private);
    }
    let exe = std::env::current_exe().context("find this executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .env(PRIVATE_NS_ENV, "1");
    // SAFETY: the closure runs in the forked child before exec and makes only
    // raw syscalls and reads errno: no allocation, no locks.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = libc::MS_REC | libc::MS_PRIVATE;
            let none = std::ptr::null();
            if libc::mount(none, c"/".as_ptr(), none, flags, none.cast()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // The child cleans up on Ctrl-C; this parent must outlive it to pass on
    // its exit code, so it takes SIGINT over (and ignores it) while it waits.
    let _sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut child = match tokio::process::Command::from(cmd).spawn() {
        Ok(c) => c,
        Err(e) => {
            return Ok(Namespace::Shared(format!(
                "could not enter a private mount namespace ({e})"
            )));
        }
    };
    let status = child.wait().await?;
    Ok(Namespace::ChildExited(status.code().unwrap_or(1)))
}

pub fn require_root() -> anyhow::Result<()> {
    anyhow::ensure!(
        // SAFETY: geteuid cannot fail and touches no memory.
        unsafe { libc::geteuid() } == 0,
        "run as root: the driver bind-mounts volumes (try: sudo {})",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    Ok(())
}

/// A fresh directory that, when dropped, unmounts everything beneath it
/// and removes it with all its contents.
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    /// Creates `<parent>/<prefix>-<random>`.
    pub fn create(parent: &Path, prefix: &str) -> anyhow::Result<WorkDir> {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let path = parent.join(format!("{prefix}-{suffix}"));
        std::fs::create_dir(&path).with_context(|| format!("create {}", path.display()))?;
        let path = std::fs::canonicalize(&path)?;
        Ok(WorkDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unmounts what is left below the directory and removes it. Returns how
    /// many mounts had to be removed here.
    pub fn remove(mut self) -> anyhow::Result<usize> {
        let path = std::mem::take(&mut self.path);
        let swept = sweep_mounts(&path)?;
        let left = mounts_under(&path)?;
        anyhow::ensure!(
            left == 0,
            "{left} mount(s) under {} could not be removed",
            path.display()
        );
        std::fs::remove_dir_all(&path).with_context(|| format!("remove {}", path.display()))?;
        Ok(swept)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        if let Err(e) = sweep_mounts(&self.path) {
            eprintln!("warning: unmounting under {}: {e:#}", self.path.display());
        }
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            eprintln!("warning: removing {}: {e}", self.path.display());
        }
    }
}

/// Mounts at or below `dir` in this process's namespace.
pub fn mounts_under(dir: &Path) -> anyhow::Result<usize> {
    let table = mountinfo::read_table()?;
    Ok(mountinfo::mounts_under(&table, dir).len())
}

/// Unmounts everything at or below `dir`; how many mounts were removed.
pub fn sweep_mounts(dir: &Path) -> anyhow::Result<usize> {
    Ok(mount::sweep_under(dir)
        .with_context(|| format!("unmount what is under {}", dir.display()))?
        .len())
}

/// Bytes a tree occupies on disk, as `du -sx` counts them: allocated blocks,
/// each inode once, not crossing into other mounts.
pub fn disk_usage(dir: &Path) -> std::io::Result<u64> {
    let root_dev = std::fs::symlink_metadata(dir)?.dev();
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p)?;
        if m.dev() != root_dev || !seen.insert((m.dev(), m.ino())) {
            continue;
        }
        total += m.blocks() * 512;
        if m.is_dir() {
            for e in std::fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
    }
    Ok(total)
}

/// A filesystem capability for `mode`, as kubelet asks for it.
pub fn mount_capability(mode: AccessMode) -> VolumeCapability {
    crate::requests::mount_cap(mode, &[])
}

fn status(what: &str, s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{what}: {:?}: {}", s.code(), s.message())
}

/// The real driver (controller and node) served on `<dir>/csi.sock`, with
/// the local backend, node id `node`, and its state in `<dir>/state`.
pub struct InProcessDriver {
    /// None once stopped.
    client: Option<Client>,
    pub cfg: Arc<Config>,
    pub roots: Roots,
    /// What the driver counts: serve it to scrape it.
    pub metrics: Arc<crate::metrics::Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl InProcessDriver {
    pub async fn start(dir: &Path, node: &str) -> anyhow::Result<InProcessDriver> {
        let cfg = Arc::new(Config {
            driver_name: "modelcache.csi.io".into(),
            node_id: Some(node.into()),
            state_dir: dir.join("state"),
            shared_paths: vec![],
            backends: vec![Backend::Local],
            ..Config::default()
        });
        let socket = dir.join("csi.sock");
        // Bound before the server task starts, so the client cannot race it.
        let listener = tokio::net::UnixListener::bind(&socket)
            .with_context(|| format!("bind {}", socket.display()))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let task = tokio::spawn(server::serve_on(
            cfg.clone(),
            metrics.clone(),
            Mode::All,
            crate::uds::Bound::visible(listener),
            async {
                let _ = stopped.await;
            },
        ));
        let client = Client::connect(socket).await?;
        Ok(InProcessDriver {
            client: Some(client),
            roots: crate::cache::Roots::of(&cfg),
            cfg,
            metrics,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops the server and waits for it to finish its calls.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown().await
    }

    async fn shutdown(&mut self) -> anyhow::Result<()> {
        // Dropping our channel lets the graceful shutdown finish at once.
        self.client = None;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .context("the server did not stop within 10 s")??
                .context("server")?;
        }
        Ok(())
    }

    /// A client for the running driver.
    pub fn client(&self) -> Client {
        // Only `stop`, which consumes the driver, clears it.
        self.client.clone().expect("the driver is running")
    }

    pub async fn create_source(&self, name: &str) -> anyhow::Result<Volume> {
        self.create(name, "source", None, AccessMode::SingleNodeWriter)
            .await
    }

    pub async fn create_cache(&self, name: &str, source_id: &str) -> anyhow::Result<Volume> {
        self.create(
            name,
            "cache",
            Some(source_id),
            AccessMode::SingleNodeReaderOnly,
        )
        .await
    }

    async fn create(
        &self,
        name: &str,
        role: &str,
        from: Option<&str>,
        mode: AccessMode,
    ) -> anyhow::Result<Volume> {
        let req = CreateVolumeRequest {
            name: name.into(),
            parameters: HashMap::from([
                ("backend".into(), "local".into()),
                ("role".into(), role.into()),
            ]),
            volume_capabilities: vec![mount_capability(mode)],
            volume_content_source: from.map(|id| VolumeContentSource {
                r#type: Some(ContentType::Volume(VolumeSource {
                    volume_id: id.into(),
                })),
            }),
            ..Default::default()
        };
        let resp = self
            .client()
            .controller
            .create_volume(req)
            .await
            .map_err(|s| status(&format!("CreateVolume {name}"), s))?;
        resp.into_inner()
            .volume
            .ok_or_else(|| anyhow::anyhow!("CreateVolume {name}: no volume in the response"))
    }

    pub async fn seal(&self, volume_id: &str) -> anyhow::Result<()> {
        self.client()
            .controller
            .controller_modify_volume(ControllerModifyVolumeRequest {
                volume_id: volume_id.into(),
                mutable_parameters: HashMap::from([("sealed".into(), "true".into())]),
                ..Default::default()
            })
            .await
            .map_err(|s| {
                status(
                    &format!("ControllerModifyVolume {volume_id} sealed=true"),
                    s,
                )
            })?;
        Ok(())
    }

    pub async fn delete(&self, volume_id: &str) -> anyhow::Result<()> {
        self.client()
            .controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume_id.into(),
                ..Default::default()
            })
            .await
            .map_err(|s| status(&format!("DeleteVolume {volume_id}"), s))?;
        Ok(())
    }

    /// Stages read-write for an unsealed source, read-only otherwise: the
    /// driver decides from the volume, the capability only has to be valid.
    pub async fn stage(&self, volume_id: &str, staging: &Path) -> anyhow::Result<()> {
        self.client()
            .node
            .node_stage_volume(NodeStageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(mount_capability(AccessMode::SingleNodeWriter)),
                ..Default::default()
            })
            .await
            .map_err(|s| status(&format!("NodeStageVolume {volume_id}"), s))?;
        Ok(())
    }

    pub async fn unstage(&self, volume_id: &str, staging: &Path) -> anyhow::Result<()> {
        self.client()
            .node
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .map_err(|s| status(&format!("NodeUnstageVolume {volume_id}"), s))?;
        Ok(())
    }

    pub async fn publish(
        &self,
        volume_id: &str,
        staging: &Path,
        target: &Path,
        writable: bool,
    ) -> anyhow::Result<()> {
        let mode = if writable {
            AccessMode::SingleNodeWriter
        } else {
            AccessMode::SingleNodeReaderOnly
        };
        self.client()
            .node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume_id.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(mount_capability(mode)),
                readonly: !writable,
                ..Default::default()
            })
            .await
            .map_err(|s| status(&format!("NodePublishVolume {volume_id}"), s))?;
        Ok(())
    }

    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> anyhow::Result<()> {
        self.client()
            .node
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target.display().to_string(),
            })
            .await
            .map_err(|s| status(&format!("NodeUnpublishVolume {volume_id}"), s))?;
        Ok(())
    }

    /// The directory that holds a volume's source bytes in the store.
    pub fn source_data_dir(&self, v: &Volume) -> anyhow::Result<PathBuf> {
        let (root, rec) = cache::lookup(&self.roots, &v.volume_id)?;
        Ok(root.source(&rec.source).data())
    }

    /// The seal of the source a volume reads.
    pub fn seal_of(&self, v: &Volume) -> anyhow::Result<Seal> {
        let (root, rec) = cache::lookup(&self.roots, &v.volume_id)?;
        cache::read_seal(&root, &rec.source)?
            .ok_or_else(|| anyhow::anyhow!("source of {} is not sealed", v.volume_id))
    }
}

impl Drop for InProcessDriver {
    fn drop(&mut self) {
        // Without an explicit stop (an error or panic on the way), the task
        // is told to stop and left to the runtime.
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_a_work_dir_takes_its_mounts_and_files() {
        let parent = tempfile::tempdir().unwrap();
        let work = WorkDir::create(parent.path(), "t").unwrap();
        let path = work.path().to_path_buf();
        let (src, a, b) = (path.join("src"), path.join("a"), path.join("a/b"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), b"x").unwrap();
        std::fs::create_dir_all(&a).unwrap();
        // Stacked on one path, and nested beneath another mount.
        mount::bind(&src, &a).unwrap();
        mount::bind(&src, &a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        mount::bind(&src, &b).unwrap();
        // A busy mount too: an open file in it.
        let _open = std::fs::File::open(b.join("f")).unwrap();
        assert_eq!(mounts_under(&path).unwrap(), 3);
        drop(work);
        assert_eq!(mounts_under(&path).unwrap(), 0);
        assert!(!path.exists());
    }

    #[test]
    fn disk_usage_counts_each_inode_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), vec![1u8; 1 << 20]).unwrap();
        std::fs::hard_link(dir.path().join("f"), dir.path().join("g")).unwrap();
        let used = disk_usage(dir.path()).unwrap();
        assert!((1 << 20..2 << 20).contains(&used), "{used}");
    }
}
