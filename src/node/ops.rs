//! The node's domain: stage a source once per volume, publish it (or a
//! subPath of it) read-only into pods, and tear both down again.
//!
//! Nothing about mounts is remembered here: the kernel's mount table is the
//! truth, so a plugin killed with live mounts picks up where it was.
//! Writer leases are the one thing written, next to the source, because the
//! controller on another node must see them before it seals, and another
//! node must see them before it writes (`cache::lease`).
//!
//! What is mounted comes from records a shared root holds, which other
//! nodes (or anyone who writes that filesystem) wrote: it is opened beneath
//! the root with no symlink on the way and mounted through its descriptor,
//! so a forged record or link can never bind a host path. Every mount is
//! nosuid and nodev, writable ones included.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::layout::ConfinedSource;
use crate::cache::lease;
use crate::cache::store::identity;
use crate::cache::{self, External, Role, Root, Roots, Seal, Verify, VolumeRecord};
use crate::capability::MountRequest;
use crate::config::Config;
use crate::csi::volume_capability::access_mode::Mode;
use crate::error::{Error, IoContext, Result};
use crate::lock::KeyedMutex;
use crate::mount::{self, MountFlags, mountinfo};

pub struct NodeOps {
    pub cfg: Arc<Config>,
    pub roots: Roots,
    /// Serialises loop-device reuse for one source within this process.
    sources: KeyedMutex,
    /// `verify: full` rehashes, bounded by each NodeStage's deadline.
    verifier: super::verify::Verifier,
}

/// What a staged volume's condition says.
pub struct Condition {
    pub abnormal: bool,
    pub message: String,
}

pub use crate::offload::blocking;

fn node_id(cfg: &Config) -> Result<String> {
    cfg.node_id.clone().ok_or_else(|| {
        Error::FailedPrecondition("this process serves no node: start it with --node-id".into())
    })
}

fn mount_entry(path: &Path) -> Result<Option<mountinfo::MountEntry>> {
    let table = mountinfo::read_table().ctx("read mount table for", path)?;
    let canonical = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("resolve", path, e)),
    };
    Ok(mountinfo::mount_at(&table, &canonical).cloned())
}

/// Unmounts everything stacked on `path`.
fn unmount_all(path: &Path) -> Result<()> {
    while mount_entry(path)?.is_some() {
        mount::unmount(path).ctx("unmount", path)?;
    }
    Ok(())
}

/// The directory beneath a staging path that holds the volume.
///
/// The staging path itself is a tmpfs of its own. kubelet does not unstage
/// (UnmountDevice) a staging path while another mount shows the same root of
/// the same filesystem (GetDeviceMountRefs), and two volumes of one model on
/// a node are two mounts of one tree: each waited for the other forever, and
/// both stayed mounted after their pods were gone. No other mount shares a
/// tmpfs's root.
const CONTENT: &str = mount::STAGING_CONTENT;
const WRAPPER_BYTES: u64 = 64 * 1024;

/// The content mount of a staging path and where it is. A volume staged by
/// an older driver has its content on the staging path itself (a bind or an
/// XFS mount, never the root of a tmpfs).
fn staged(staging: &Path) -> Result<Option<(PathBuf, mountinfo::MountEntry)>> {
    let inner = staging.join(CONTENT);
    if let Some(e) = mount_entry(&inner)? {
        return Ok(Some((inner, e)));
    }
    Ok(match mount_entry(staging)? {
        Some(e) if !(e.fs_type == "tmpfs" && e.root == Path::new("/")) => {
            Some((staging.to_path_buf(), e))
        }
        _ => None,
    })
}

/// The wrapper tmpfs on `staging`, and the empty directory for the content.
fn wrap(staging: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(staging).ctx("create staging path", staging)?;
    if mount_entry(staging)?.is_none() {
        mount::mount_tmpfs(staging, WRAPPER_BYTES).ctx("mount the staging tmpfs on", staging)?;
    }
    let inner = staging.join(CONTENT);
    match std::fs::create_dir(&inner) {
        Ok(()) => Ok(inner),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(inner),
        Err(e) => Err(Error::io("create", &inner, e)),
    }
}

/// Unmounts a staging path: its content, then the wrapper (or the content
/// an older driver mounted on the path itself).
fn unmount_staging(staging: &Path) -> Result<()> {
    unmount_all(&staging.join(CONTENT))?;
    unmount_all(staging)
}

impl NodeOps {
    pub fn new(cfg: Arc<Config>) -> NodeOps {
        let roots = cfg.roots();
        NodeOps {
            cfg,
            roots,
            sources: KeyedMutex::default(),
            verifier: Default::default(),
        }
    }

    /// Stages the volume; a `verify: full` rehash that outlasts `budget`
    /// answers UNAVAILABLE and goes on (see `verify`).
    pub async fn stage(
        &self,
        volume_id: &str,
        staging: PathBuf,
        req: MountRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<()> {
        let (root, rec) = cache::lookup(&self.roots, volume_id)?;
        if let Some(ext) = rec.external.clone() {
            // `lookup` admits external records only from this node's own
            // local root (see VolumeRecord::check).
            return blocking(move || stage_external(&ext, &staging)).await;
        }
        let seal = cache::read_seal(&root, &rec.source)?;
        // Sealed means read-only, for a source volume as for its caches.
        let writable = rec.role == Role::Source && seal.is_none();
        if !writable && seal.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "source {} of volume {volume_id} is not sealed",
                rec.source
            )));
        }
        if writable && !req.is_writer() {
            // Mounting it read-only would show bytes a writer can still
            // change: on another node, through an XFS log this mount would
            // not replay, or later, after this check.
            return Err(Error::FailedPrecondition(format!(
                "source volume {volume_id} is not sealed yet, and a read-only stage ({}) would \
                 show bytes its writer can still change; seal it first (mutable parameter \
                 sealed=true), then read it through cache volumes",
                req.mode.as_str_name()
            )));
        }
        let node = node_id(&self.cfg)?;
        let _g = self.sources.lock(&rec.source).await;
        let src = {
            let (r, sid) = (root.clone(), rec.source.clone());
            Arc::new(blocking(move || r.open_source(&sid)).await?)
        };
        let share = root
            .backend
            .store()
            .share(req.mode == Mode::MultiNodeMultiWriter);
        let new_lease = if writable {
            let (r, s, sid, n, st) = (
                root.clone(),
                src.clone(),
                rec.source.clone(),
                node.clone(),
                staging.clone(),
            );
            blocking(move || lease::acquire(&r, &s, &sid, &n, &st, share)).await?
        } else {
            false
        };
        if cache::evict::is_model(&rec.source) {
            // Best effort: a read-only shared root must not block a stage.
            let _ = cache::evict::touch_confined(&src);
        }
        let full = (rec.verify == Verify::Full).then(|| seal.clone()).flatten();
        let (r, s, st) = (root.clone(), src.clone(), staging.clone());
        let mut result = blocking(move || stage_blocking(&r, &s, &st, writable, seal)).await;
        if result.is_ok()
            && let Some(seal) = full
        {
            result = match self
                .verifier
                .verify(&seal, staging.join(CONTENT), budget)
                .await
            {
                // Still hashing: the mount stays for the retry to join.
                Err(e @ Error::Unavailable(_)) => Err(e),
                Err(e) => {
                    let st = staging.clone();
                    let _ = blocking(move || unmount_staging(&st)).await;
                    Err(e)
                }
                Ok(()) => Ok(()),
            };
        }
        if result.is_err() && new_lease {
            // Only a lease this call took goes; an earlier staging keeps its own.
            let _ = lease::release(&root, &src, &node, &staging);
        }
        result
    }

    pub async fn unstage(&self, volume_id: &str, staging: PathBuf) -> Result<()> {
        {
            let staging = staging.clone();
            blocking(move || unmount_staging(&staging)).await?;
        }
        // The volume may be gone already, or live in a root this node does
        // not serve; either way there is no lease of ours to drop.
        if let Ok((root, rec)) = cache::lookup(&self.roots, volume_id)
            && rec.role == Role::Source
        {
            let node = node_id(&self.cfg)?;
            blocking(move || match root.open_source(&rec.source) {
                Ok(src) => lease::release(&root, &src, &node, &staging),
                Err(Error::NotFound(_)) => Ok(()),
                Err(e) => Err(e),
            })
            .await?;
        }
        Ok(())
    }

    pub async fn publish(
        &self,
        volume_id: &str,
        staging: PathBuf,
        target: PathBuf,
        req: MountRequest,
        readonly: bool,
    ) -> Result<()> {
        let (root, rec) = cache::lookup(&self.roots, volume_id)?;
        let sealed = cache::read_seal(&root, &rec.source)?.is_some();
        let immutable = rec.role == Role::Cache || sealed;
        if immutable && req.ro_flag == Some(false) {
            return Err(Error::invalid(
                "volume_capability.mount.mount_flags",
                "\"rw\" cannot be honoured: this volume is sealed and always read-only",
            ));
        }
        let ro = immutable || readonly || req.ro_flag == Some(true) || !req.is_writer();
        blocking(move || publish_blocking(&rec, &staging, &target, req.flags, ro)).await
    }

    pub async fn unpublish(&self, target: PathBuf) -> Result<()> {
        blocking(move || {
            unmount_all(&target)?;
            match std::fs::remove_dir(&target) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(Error::io("remove target", &target, e)),
            }
        })
        .await
    }

    /// Usage of a mounted volume path, and whether it is healthy.
    /// `staging`, when the CO passes it, is checked too: a publish can
    /// outlive a staging mount that was torn away underneath it.
    pub async fn stats(
        &self,
        volume_id: &str,
        path: PathBuf,
        staging: Option<PathBuf>,
    ) -> Result<(nix::sys::statvfs::Statvfs, Condition)> {
        let lookup = cache::lookup(&self.roots, volume_id);
        let vid = volume_id.to_string();
        blocking(move || {
            let Some(entry) = mount_entry(&path)? else {
                return Err(Error::NotFound(format!(
                    "volume {vid} is not mounted at {}",
                    path.display()
                )));
            };
            let st = nix::sys::statvfs::statvfs(&path)
                .map_err(|e| Error::io("statfs", &path, e.into()))?;
            let condition = match lookup {
                Err(e) => Condition {
                    abnormal: true,
                    message: format!("volume record unavailable: {e}"),
                },
                Ok((root, rec)) => check_condition(&root, &rec, &entry, staging.as_deref()),
            };
            Ok((st, condition))
        })
        .await
    }
}

/// Another PV's bytes, read-only in place: no seal to check, so the mount
/// itself is the only guarantee.
fn stage_external(ext: &External, staging: &Path) -> Result<()> {
    let flags = MountFlags {
        nosuid: true,
        nodev: true,
        ..MountFlags::default()
    };
    if let Some((content, existing)) = staged(staging)? {
        let same = match ext {
            External::Dir { path } => identity(&content)? == identity(Path::new(path))?,
            External::XfsBlock { device } => {
                std::fs::canonicalize(device).is_ok_and(|d| Path::new(&existing.source) == d)
            }
        };
        if same && existing.is_readonly() {
            return Ok(());
        }
        return Err(Error::AlreadyExists(format!(
            "staging path {} already holds a different mount ({} from {}); unstage it first",
            staging.display(),
            existing.fs_type,
            existing.source
        )));
    }
    let content = wrap(staging)?;
    let mounted = match ext {
        External::Dir { path } => mount::bind_readonly(Path::new(path), &content, flags)
            .ctx("bind-mount read-only", Path::new(path)),
        External::XfsBlock { device } => mount::mount_device(
            Path::new(device),
            &content,
            "xfs",
            true,
            cache::xfs::READER_OPTIONS,
        )
        .ctx("mount read-only", Path::new(device)),
    };
    if mounted.is_err() {
        let _ = unmount_staging(staging);
    }
    mounted
}

fn stage_blocking(
    root: &Root,
    src: &ConfinedSource,
    staging: &Path,
    writable: bool,
    seal: Option<Seal>,
) -> Result<()> {
    if let Some((content, existing)) = staged(staging)? {
        let same = root.backend.store().shows(src, &content, &existing)?;
        if same && existing.is_readonly() != writable {
            return Ok(());
        }
        return Err(Error::AlreadyExists(format!(
            "staging path {} already holds a different mount ({} from {}); unstage it first",
            staging.display(),
            existing.fs_type,
            existing.source
        )));
    }
    // A source is a model: nothing in it is a device or a setuid program,
    // whether it is still being written or not.
    let base = MountFlags {
        nosuid: true,
        nodev: true,
        ..MountFlags::default()
    };
    let content = wrap(staging)?;
    let mounted = root.backend.store().mount(src, &content, writable, base);
    if let Err(e) = mounted {
        let _ = unmount_staging(staging);
        return Err(e);
    }
    if let Some(seal) = seal {
        // Checked through the mount itself: what pods will read is what is
        // verified. Sizes here; a full rehash is the caller's, within its
        // deadline (`super::verify`).
        if let Err(e) = cache::manifest::verify(&content, &seal, false) {
            let _ = unmount_staging(staging);
            return Err(e);
        }
    }
    Ok(())
}

fn publish_blocking(
    rec: &VolumeRecord,
    staging: &Path,
    target: &Path,
    flags: MountFlags,
    ro: bool,
) -> Result<()> {
    let Some((content, _)) = staged(staging)? else {
        return Err(Error::FailedPrecondition(format!(
            "volume {} is not staged at {}: call NodeStageVolume first",
            rec.id,
            staging.display()
        )));
    };
    // The subPath is opened beneath the staged root and mounted through its
    // descriptor, so a symlink swapped in afterwards cannot redirect it.
    let sub_fd = match &rec.sub_path {
        Some(sub) => Some(mount::subpath::open_beneath(&content, sub).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound(format!(
                    "subPath {sub:?} does not exist in volume {}",
                    rec.id
                ))
            } else {
                Error::invalid("subPath", format!("{sub:?} cannot be used: {e}"))
            }
        })?),
        None => None,
    };
    let src: PathBuf = match &sub_fd {
        Some(fd) => mount::subpath::proc_path(fd),
        None => content.clone(),
    };
    if let Some(existing) = mount_entry(target)? {
        if identity(target)? == identity(&src)? && existing.is_readonly() == ro {
            return Ok(());
        }
        return Err(Error::AlreadyExists(format!(
            "target {} already holds a different mount of {} (read-only: {}); unpublish it first",
            target.display(),
            existing.source,
            existing.is_readonly()
        )));
    }
    std::fs::create_dir_all(target).ctx("create target", target)?;
    // Writable or not, a pod never gets setuid programs or device files
    // through a model volume.
    let flags = MountFlags {
        nosuid: true,
        nodev: true,
        ..flags
    };
    if ro {
        mount::bind_readonly(&src, target, flags).ctx("bind-mount read-only onto", target)
    } else {
        mount::bind_writable(&src, target, flags).ctx("bind-mount onto", target)
    }
}

fn check_condition(
    root: &Root,
    rec: &VolumeRecord,
    entry: &mountinfo::MountEntry,
    staging: Option<&Path>,
) -> Condition {
    if let Some(ext) = &rec.external {
        let path = match ext {
            External::Dir { path } => path,
            External::XfsBlock { device } => device,
        };
        return if Path::new(path).exists() {
            Condition {
                abnormal: false,
                message: format!("volume is mounted; {path} is present"),
            }
        } else {
            Condition {
                abnormal: true,
                message: format!("{path} behind this volume is gone"),
            }
        };
    }
    let sp = root.source(&rec.source);
    let abnormal = |m: String| Condition {
        abnormal: true,
        message: m,
    };
    if let Some(gone) = root.backend.store().gone(&sp, entry) {
        return abnormal(gone);
    }
    let seal = cache::read_seal(root, &rec.source).ok().flatten();
    if rec.role == Role::Cache && seal.is_none() {
        return abnormal(format!("the seal of source {} is missing", rec.source));
    }
    if let Some(staging) = staging {
        let content = match staged(staging) {
            Ok(Some((content, _))) => content,
            _ => {
                return abnormal(format!(
                    "the staging mount at {} is missing",
                    staging.display()
                ));
            }
        };
        if let Some(seal) = &seal
            && let Err(e) = cache::manifest::verify(&content, seal, false)
        {
            return abnormal(e.to_string());
        }
    }
    Condition {
        abnormal: false,
        message: "volume is mounted and its source is present".into(),
    }
}
