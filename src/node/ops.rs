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
use crate::context::Context;
use crate::csi::volume_capability::access_mode::Mode;
use crate::error::{Error, IoContext, Result};
use crate::lock::KeyedMutex;
use crate::mount::{self, MountFlags, Mounter, mountinfo};

pub struct NodeOps {
    pub cfg: Arc<Config>,
    pub roots: Roots,
    /// The kernel, or a fake in tests.
    mounter: Arc<dyn Mounter>,
    /// Serialises loop-device reuse for one source within this process.
    sources: KeyedMutex,
    /// `verify: full` rehashes, bounded by each NodeStage's deadline.
    verifier: super::verify::Verifier,
    /// Progressive volumes' views served by this process.
    views: Arc<super::progressive::Views>,
}

/// What a staged volume's condition says.
#[derive(Debug)]
pub struct Condition {
    pub abnormal: bool,
    pub message: String,
}

pub use crate::offload::blocking;

fn node_id(cfg: &Config) -> Result<String> {
    cfg.node_id.clone().ok_or_else(|| {
        Error::Precondition("this process serves no node: start it with --node-id".into())
    })
}

fn mount_entry(m: &dyn Mounter, path: &Path) -> Result<Option<mountinfo::MountEntry>> {
    m.entry_at(path).ctx("look up the mount at", path)
}

/// Unmounts everything stacked on `path`.
fn unmount_all(m: &dyn Mounter, path: &Path) -> Result<()> {
    // The kernel answers "nothing mounted here" itself, and sooner than a
    // lookup would.
    while m.unmount(path).ctx("unmount", path)? {}
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
fn staged(m: &dyn Mounter, staging: &Path) -> Result<Option<(PathBuf, mountinfo::MountEntry)>> {
    let inner = staging.join(CONTENT);
    if let Some(e) = mount_entry(m, &inner)? {
        return Ok(Some((inner, e)));
    }
    Ok(match mount_entry(m, staging)? {
        Some(e) if !(e.fs_type == "tmpfs" && e.root == Path::new("/")) => {
            Some((staging.to_path_buf(), e))
        }
        _ => None,
    })
}

/// The wrapper tmpfs on `staging`, and the empty directory for the content.
fn wrap(m: &dyn Mounter, staging: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(staging).ctx("create staging path", staging)?;
    if mount_entry(m, staging)?.is_none() {
        m.mount_tmpfs(staging, WRAPPER_BYTES)
            .ctx("mount the staging tmpfs on", staging)?;
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
fn unmount_staging(m: &dyn Mounter, staging: &Path) -> Result<()> {
    unmount_all(m, &staging.join(CONTENT))?;
    unmount_all(m, staging)
}

impl NodeOps {
    /// The node side of `ctx`'s process: its roots, and so the pulls
    /// running in them, are the provisioner's.
    pub fn new(ctx: &Context) -> NodeOps {
        NodeOps::with_mounter(ctx, Arc::new(mount::Kernel))
    }

    pub fn with_mounter(ctx: &Context, mounter: Arc<dyn Mounter>) -> NodeOps {
        let (cfg, roots) = (ctx.cfg.clone(), ctx.roots.clone());
        let views = Arc::new(super::progressive::Views::new(
            &cfg.state_dir,
            cfg.fuse_keeper.as_deref(),
        ));
        NodeOps {
            cfg,
            roots,
            mounter,
            sources: KeyedMutex::default(),
            verifier: Default::default(),
            views,
        }
    }

    /// Takes over the progressive views a previous process served (see
    /// `super::progressive::Views::take_over`); run once, at start.
    pub async fn take_over_views(&self) {
        let (m, roots, views) = (self.mounter.clone(), self.roots.clone(), self.views.clone());
        let _ = blocking(move || {
            views.take_over(&*m, &roots);
            Ok(())
        })
        .await;
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
        let (root, rec, mut seal) = {
            let (roots, id) = (self.roots.clone(), volume_id.to_string());
            blocking(move || {
                let (root, rec) = cache::lookup(&roots, &id)?;
                let seal = match rec.external {
                    Some(_) => None,
                    None => cache::read_seal(&root, &rec.source)?,
                };
                Ok((root, rec, seal))
            })
            .await?
        };
        let m = self.mounter.clone();
        if rec.progressive {
            let (r, rc, mm, st, sealed, views) = (
                root.clone(),
                rec.clone(),
                m.clone(),
                staging.clone(),
                seal.is_some(),
                self.views.clone(),
            );
            match blocking(move || stage_progressive(&*mm, &views, &r, &rc, &st, sealed)).await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                // No pull to serve a view from: it may have sealed since
                // the seal was read (the seal is in place before the
                // pull's view goes), and then the volume stages as any.
                Err(e) if seal.is_none() => {
                    let (r, s) = (root.clone(), rec.source.clone());
                    seal = blocking(move || cache::read_seal(&r, &s)).await?;
                    if seal.is_none() {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(ext) = rec.external.clone() {
            // `lookup` admits external records only from this node's own
            // local root (see VolumeRecord::check).
            return blocking(move || stage_external(&*m, &ext, &staging)).await;
        }
        // Sealed means read-only, for a source volume as for its caches.
        let writable = rec.role == Role::Source && seal.is_none();
        if !writable && seal.is_none() {
            return Err(Error::Precondition(format!(
                "source {} of volume {volume_id} is not sealed",
                rec.source
            )));
        }
        if writable && !req.is_writer() {
            // Mounting it read-only would show bytes a writer can still
            // change: on another node, through an XFS log this mount would
            // not replay, or later, after this check.
            return Err(Error::Precondition(format!(
                "source volume {volume_id} is not sealed yet, and a read-only stage ({}) would \
                 show bytes its writer can still change; seal it first (mutable parameter \
                 sealed=true), then read it through cache volumes",
                req.mode.as_str_name()
            )));
        }
        let node = node_id(&self.cfg)?;
        let store = root.backend.store();
        // Only stages that share a loop device wait for each other; a burst
        // of a hundred bind-mount stages of one model runs at once.
        let _g = match store.one_mount_at_a_time() {
            true => Some(self.sources.lock(&rec.source).await),
            false => None,
        };
        let share = store.share(req.mode == Mode::MultiNodeMultiWriter);
        // A signed model on a shared root is only as good as the bytes
        // every writer of that filesystem leaves it: the signature was
        // checked against the seal, so the bytes are checked against the
        // seal at every stage (rehashed once per change of the files).
        let shared = root.node.is_none();
        let rehash = rec.verify == Verify::Full || (shared && rec.signed_by.is_some());
        let full = rehash.then(|| seal.clone()).flatten();
        // One trip off the runtime for the lease, the use and the mount.
        {
            let (r, sid, st, mm) = (root.clone(), rec.source.clone(), staging.clone(), m.clone());
            blocking(move || {
                let src = r.open_source(&sid)?;
                let new_lease = writable && lease::acquire(&r, &src, &sid, &node, &st, share)?;
                if sid.is_model() {
                    // Best effort: a read-only shared root must not block a stage.
                    let _ = cache::evict::touch_confined(&src);
                }
                let staged = stage_blocking(&*mm, &r, &src, &st, writable, seal);
                if staged.is_err() && new_lease {
                    // Only a lease this call took goes; an earlier staging
                    // keeps its own.
                    let _ = lease::release(&r, &src, &node, &st);
                }
                staged
            })
            .await?;
        }
        // Only a sealed source is rehashed, and a sealed one takes no lease.
        let Some(seal) = full else {
            return Ok(());
        };
        match self
            .verifier
            .verify(&seal, m.view(&staging.join(CONTENT)), budget, shared)
            .await
        {
            // Still hashing: the mount stays for the retry to join.
            Err(e @ Error::Transient(_)) => Err(e),
            Err(e) => {
                let _ = blocking(move || unmount_staging(&*m, &staging)).await;
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    }

    pub async fn unstage(&self, volume_id: &str, staging: PathBuf) -> Result<()> {
        {
            let (m, staging, views) = (self.mounter.clone(), staging.clone(), self.views.clone());
            blocking(move || {
                unmount_staging(&*m, &staging)?;
                views.forget(&staging.join(CONTENT));
                Ok(())
            })
            .await?;
        }
        // The volume may be gone already, or live in a root this node does
        // not serve; either way there is no lease of ours to drop.
        if let Ok((root, rec)) = cache::lookup_off_runtime(&self.roots, volume_id).await
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
        // One trip off the runtime: publish is the call every pod start
        // waits for, and each hop to the blocking pool costs a wake-up.
        let (roots, id, m) = (
            self.roots.clone(),
            volume_id.to_string(),
            self.mounter.clone(),
        );
        blocking(move || {
            let (root, rec) = cache::lookup(&roots, &id)?;
            // A cache volume is read-only whatever its source: no seal to read.
            let immutable =
                rec.role == Role::Cache || cache::read_seal(&root, &rec.source)?.is_some();
            if immutable && req.ro_flag == Some(false) {
                return Err(Error::invalid(
                    "volume_capability.mount.mount_flags",
                    "\"rw\" cannot be honoured: this volume is sealed and always read-only",
                ));
            }
            let ro = immutable || readonly || req.ro_flag == Some(true) || !req.is_writer();
            publish_blocking(&*m, &rec, &staging, &target, req.flags, ro)
        })
        .await
    }

    pub async fn unpublish(&self, target: PathBuf) -> Result<()> {
        let m = self.mounter.clone();
        blocking(move || {
            unmount_all(&*m, &target)?;
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
    /// A volume's root and record on this node: NotFound if it has none.
    pub async fn lookup(&self, volume_id: &str) -> Result<(Root, VolumeRecord)> {
        cache::lookup_off_runtime(&self.roots, volume_id).await
    }

    /// NodeExpandVolume: grows a writable source where this node has it
    /// mounted (the staging path kubelet names, else the published path),
    /// to `target` bytes (None: to its recorded size, e.g. after a crash
    /// between the bytes and the record). Returns the size recorded.
    pub async fn expand(
        &self,
        (root, rec): (Root, VolumeRecord),
        volume_path: PathBuf,
        staging: Option<PathBuf>,
        target: Option<i64>,
    ) -> Result<i64> {
        let store = root.backend.store();
        let _g = match store.one_mount_at_a_time() {
            true => Some(self.sources.lock(&rec.source).await),
            false => None,
        };
        let (vid, m) = (rec.id.clone(), self.mounter.clone());
        blocking(move || {
            let at = match staging.as_deref().map(|s| staged(&*m, s)).transpose()? {
                Some(Some(found)) => Some(found),
                _ => mount_entry(&*m, &volume_path)?.map(|e| (volume_path.clone(), e)),
            };
            let Some((content, entry)) = at else {
                return Err(Error::NotFound(format!(
                    "volume {vid} is not mounted at {}{}",
                    volume_path.display(),
                    staging
                        .as_deref()
                        .map(|s| format!(" nor staged at {}", s.display()))
                        .unwrap_or_default()
                )));
            };
            let src = root.open_source(&rec.source)?;
            if !store.shows(&*m, &src, &content, &entry)? {
                return Err(Error::Precondition(format!(
                    "{} does not show volume {vid}'s source; refusing to grow what is mounted there",
                    content.display()
                )));
            }
            let target = target.unwrap_or(rec.capacity_bytes);
            cache::grow::grow_staged(&root, &rec, &src, &content, target)
        })
        .await
    }

    pub async fn stats(
        &self,
        volume_id: &str,
        path: PathBuf,
        staging: Option<PathBuf>,
    ) -> Result<(nix::sys::statvfs::Statvfs, Condition)> {
        let lookup = cache::lookup_off_runtime(&self.roots, volume_id).await;
        let (vid, m) = (volume_id.to_string(), self.mounter.clone());
        blocking(move || {
            let Some(entry) = mount_entry(&*m, &path)? else {
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
                Ok((root, rec)) => check_condition(&*m, &root, &rec, &entry, staging.as_deref()),
            };
            Ok((st, condition))
        })
        .await
    }
}

/// Another PV's bytes, read-only in place: no seal to check, so the mount
/// itself is the only guarantee.
fn stage_external(m: &dyn Mounter, ext: &External, staging: &Path) -> Result<()> {
    if let Some((content, existing)) = staged(m, staging)? {
        if ext.shows(m, &content, &existing)? && existing.is_readonly() {
            return Ok(());
        }
        return Err(Error::Conflict(format!(
            "staging path {} already holds a different mount ({} from {}); unstage it first",
            staging.display(),
            existing.fs_type,
            existing.source
        )));
    }
    let content = wrap(m, staging)?;
    let mounted = ext.mount(m, &content);
    if mounted.is_err() {
        let _ = unmount_staging(m, staging);
    }
    mounted
}

/// Stages a progressive volume through its model's view while the model
/// is arriving (`super::progressive`). A view staged before the seal
/// stays: the pods reading it keep it. False: the model is sealed and
/// nothing is staged, so the volume is staged as any other.
fn stage_progressive(
    m: &dyn Mounter,
    views: &super::progressive::Views,
    root: &Root,
    rec: &VolumeRecord,
    staging: &Path,
    sealed: bool,
) -> Result<bool> {
    if let Some((_, existing)) = staged(m, staging)? {
        if super::progressive::is_view(&existing.fs_type) {
            return Ok(true);
        }
        if sealed {
            return Ok(false);
        }
        return Err(Error::Conflict(format!(
            "staging path {} already holds a different mount ({} from {}); unstage it first",
            staging.display(),
            existing.fs_type,
            existing.source
        )));
    }
    if sealed {
        return Ok(false);
    }
    let content = wrap(m, staging)?;
    let mounted = views.mount(m, root, &rec.id, &rec.source, &content);
    if mounted.is_err() {
        let _ = unmount_staging(m, staging);
    }
    mounted.map(|()| true)
}

fn stage_blocking(
    m: &dyn Mounter,
    root: &Root,
    src: &ConfinedSource,
    staging: &Path,
    writable: bool,
    seal: Option<Seal>,
) -> Result<()> {
    if let Some((content, existing)) = staged(m, staging)? {
        let same = root.backend.store().shows(m, src, &content, &existing)?;
        if same && existing.is_readonly() != writable {
            return Ok(());
        }
        return Err(Error::Conflict(format!(
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
    let content = wrap(m, staging)?;
    let mounted = root.backend.store().mount(m, src, &content, writable, base);
    if let Err(e) = mounted {
        let _ = unmount_staging(m, staging);
        return Err(e);
    }
    if let Some(seal) = seal {
        // Checked through the mount itself: what pods will read is what is
        // verified. Sizes here; a full rehash is the caller's, within its
        // deadline (`super::verify`).
        if let Err(e) = cache::manifest::verify(&m.view(&content), &seal, false) {
            let _ = unmount_staging(m, staging);
            return Err(e);
        }
    }
    Ok(())
}

fn publish_blocking(
    m: &dyn Mounter,
    rec: &VolumeRecord,
    staging: &Path,
    target: &Path,
    flags: MountFlags,
    ro: bool,
) -> Result<()> {
    let Some((content, _)) = staged(m, staging)? else {
        return Err(Error::Precondition(format!(
            "volume {} is not staged at {}: call NodeStageVolume first",
            rec.id,
            staging.display()
        )));
    };
    // The subPath is opened beneath the staged root and mounted through its
    // descriptor, so a symlink swapped in afterwards cannot redirect it.
    let sub_fd = match &rec.sub_path {
        Some(sub) => Some(
            mount::subpath::open_beneath(&m.view(&content), sub).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Error::NotFound(format!(
                        "subPath {sub:?} does not exist in volume {}",
                        rec.id
                    ))
                } else {
                    Error::invalid("subPath", format!("{sub:?} cannot be used: {e}"))
                }
            })?,
        ),
        None => None,
    };
    let src: PathBuf = match &sub_fd {
        Some(fd) => mount::subpath::proc_path(fd),
        None => content.clone(),
    };
    if let Some(existing) = mount_entry(m, target)? {
        if identity(&m.view(target))? == identity(&m.view(&src))? && existing.is_readonly() == ro {
            return Ok(());
        }
        return Err(Error::Conflict(format!(
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
    m.bind(&src, target, ro, flags).ctx(
        if ro {
            "bind-mount read-only onto"
        } else {
            "bind-mount onto"
        },
        target,
    )
}

fn check_condition(
    m: &dyn Mounter,
    root: &Root,
    rec: &VolumeRecord,
    entry: &mountinfo::MountEntry,
    staging: Option<&Path>,
) -> Condition {
    if let Some(ext) = &rec.external {
        return match ext.gone() {
            Some(gone) => Condition {
                abnormal: true,
                message: gone,
            },
            None => Condition {
                abnormal: false,
                message: format!("volume is mounted; {} is present", ext.path()),
            },
        };
    }
    if rec.progressive && cache::read_seal(root, &rec.source).ok().flatten().is_none() {
        return Condition {
            abnormal: false,
            message: format!(
                "model {} is still arriving; reads wait for each file's verified bytes",
                rec.source
            ),
        };
    }
    let sp = root.source(&rec.source);
    let abnormal = |m: String| Condition {
        abnormal: true,
        message: m,
    };
    if let Some(gone) = root.backend.store().gone(m, &sp, entry) {
        return abnormal(gone);
    }
    let seal = cache::read_seal(root, &rec.source).ok().flatten();
    if rec.role == Role::Cache && seal.is_none() {
        return abnormal(format!("the seal of source {} is missing", rec.source));
    }
    if let Some(staging) = staging {
        let content = match staged(m, staging) {
            Ok(Some((content, _))) => content,
            _ => {
                return abnormal(format!(
                    "the staging mount at {} is missing",
                    staging.display()
                ));
            }
        };
        if let Some(seal) = &seal
            && let Err(e) = cache::manifest::verify(&m.view(&content), seal, false)
        {
            return abnormal(e.to_string());
        }
    }
    Condition {
        abnormal: false,
        message: "volume is mounted and its source is present".into(),
    }
}

/// Node logic against a fake mount table (`mount::fake`), as any user: the
/// mounts are recorded, not made, and what a mount would show is read from
/// the directory behind it.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Backend, uuid_for_name};
    use crate::mount::fake::FakeMounter;

    struct Node {
        dir: tempfile::TempDir,
        ops: NodeOps,
        fake: Arc<FakeMounter>,
        root: Root,
    }

    fn node() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Arc::new(Config {
            node_id: Some("n1".into()),
            state_dir: dir.path().join("state"),
            backends: vec![Backend::Local],
            ..Config::default()
        });
        let fake = Arc::new(FakeMounter::default());
        let ops = NodeOps::with_mounter(&Context::standalone(cfg), fake.clone());
        let root = ops.roots.roots[0].clone();
        Node {
            dir,
            ops,
            fake,
            root,
        }
    }

    fn request(mode: Mode, ro_flag: Option<bool>) -> MountRequest {
        MountRequest {
            mode,
            flags: MountFlags::default(),
            ro_flag,
        }
    }

    fn reader() -> MountRequest {
        request(Mode::SingleNodeReaderOnly, None)
    }

    impl Node {
        fn path(&self, p: &str) -> PathBuf {
            let p = self.dir.path().join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            p
        }

        /// A source holding `files`, sealed when asked; returns its id and
        /// data directory.
        fn source(
            &self,
            name: &str,
            files: &[(&str, &str)],
            sealed: bool,
        ) -> (cache::SourceId, PathBuf) {
            let sid = cache::SourceId::parse(&uuid_for_name("modelcache.csi.io", name)).unwrap();
            cache::create_source(&self.root, &sid, 1 << 20).unwrap();
            let data = self.root.source(&sid).data();
            for (f, body) in files {
                let p = data.join(f);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(p, body).unwrap();
            }
            if sealed {
                cache::seal_source(&self.root, &sid, "test").unwrap();
            }
            (sid, data.canonicalize().unwrap())
        }

        /// A volume record over `sid`; returns its id.
        fn volume(
            &self,
            name: &str,
            sid: &cache::SourceId,
            role: Role,
            sub_path: Option<&str>,
        ) -> String {
            let uuid = uuid_for_name("modelcache.csi.io", name);
            let rec = VolumeRecord {
                id: self.root.volume_id(&uuid),
                name: name.into(),
                backend: Backend::Local,
                role,
                source: sid.clone(),
                sub_path: sub_path.map(String::from),
                verify: Verify::Size,
                capacity_bytes: 1 << 20,
                node: Some("n1".into()),
                model: None,
                revision: None,
                external: None,
                content_source: None,
                namespace: None,
                signed_by: None,
                progressive: false,
                request: String::new(),
                created_unix: 0,
            };
            cache::write_volume(&self.root, &rec).unwrap();
            rec.id
        }

        /// A sealed model and a cache volume over it.
        fn cache_volume(&self, sub_path: Option<&str>) -> (String, PathBuf) {
            let (sid, data) = self.source(
                "model",
                &[("config.json", "{}"), ("onnx/model.onnx", "weights")],
                true,
            );
            (self.volume("cache-1", &sid, Role::Cache, sub_path), data)
        }

        /// Stages `vid` for a reader.
        async fn stage(&self, vid: &str, staging: &Path) -> Result<()> {
            let staging = staging.to_path_buf();
            self.ops.stage(vid, staging, reader(), None).await
        }

        /// Publishes `vid` for a reader.
        async fn publish(&self, vid: &str, staging: &Path, target: &Path) -> Result<()> {
            let (staging, target) = (staging.to_path_buf(), target.to_path_buf());
            self.ops
                .publish(vid, staging, target, reader(), false)
                .await
        }

        fn mounted(&self, p: &Path) -> mountinfo::MountEntry {
            self.fake
                .at(p)
                .unwrap_or_else(|| panic!("nothing mounted at {}", p.display()))
        }
    }

    fn has(e: &mountinfo::MountEntry, opts: &[&str]) {
        for o in opts {
            assert!(e.has_option(o), "{o} missing from {:?}", e.mount_options);
        }
    }

    #[tokio::test]
    async fn stage_and_publish_show_the_sealed_source_read_only_once() {
        let n = node();
        let (vid, data) = n.cache_volume(None);
        let (staging, target) = (n.path("staging/v1"), n.path("pods/p1/v"));

        n.stage(&vid, &staging).await.unwrap();
        assert_eq!(n.mounted(&staging).fs_type, "tmpfs");
        let content = staging.join(CONTENT);
        has(&n.mounted(&content), &["ro", "nosuid", "nodev"]);
        assert_eq!(n.fake.view(&content), data);
        let after_stage = n.fake.made();
        assert_eq!(after_stage, 2, "a wrapper tmpfs and the content bind");
        n.stage(&vid, &staging).await.unwrap();
        assert_eq!(n.fake.made(), after_stage, "a second stage mounts nothing");

        for _ in 0..2 {
            n.publish(&vid, &staging, &target).await.unwrap();
        }
        assert_eq!(
            n.fake.made(),
            after_stage + 1,
            "a second publish mounts nothing"
        );
        has(&n.mounted(&target), &["ro", "nosuid", "nodev"]);
        assert_eq!(n.fake.view(&target.join("onnx")), data.join("onnx"));

        let (st, condition) = n
            .ops
            .stats(&vid, target.clone(), Some(staging.clone()))
            .await
            .unwrap();
        assert!(!condition.abnormal, "{}", condition.message);
        assert!(st.blocks() > 0);

        for _ in 0..2 {
            n.ops.unpublish(target.clone()).await.unwrap();
            n.ops.unstage(&vid, staging.clone()).await.unwrap();
        }
        assert!(!target.exists(), "the target directory is removed");
        assert!(n.fake.under(n.dir.path()).is_empty());
    }

    #[tokio::test]
    async fn publish_refuses_what_it_cannot_honour() {
        let n = node();
        let (vid, _) = n.cache_volume(None);
        let (staging, target) = (n.path("staging/v1"), n.path("pods/p1/v"));

        let e = n.publish(&vid, &staging, &target).await.unwrap_err();
        assert!(
            matches!(&e, Error::Precondition(m) if m.contains("NodeStageVolume")),
            "{e}"
        );

        n.stage(&vid, &staging).await.unwrap();
        let rw = request(Mode::SingleNodeReaderOnly, Some(false));
        let e = n
            .ops
            .publish(&vid, staging.clone(), target.clone(), rw, false)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Invalid { field, .. } if field == "volume_capability.mount.mount_flags"),
            "{e}"
        );

        // Something else already mounted where the pod's volume goes.
        let other = n.path("elsewhere");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::create_dir_all(&target).unwrap();
        n.fake
            .bind(&other, &target, true, MountFlags::default())
            .unwrap();
        let e = n.publish(&vid, &staging, &target).await.unwrap_err();
        assert!(
            matches!(&e, Error::Conflict(m) if m.contains("unpublish it first")),
            "{e}"
        );
        assert_eq!(n.fake.view(&target), other.canonicalize().unwrap());

        // A staging path someone else mounted is not taken over either.
        let foreign = n.path("staging/v2");
        std::fs::create_dir_all(foreign.join(CONTENT)).unwrap();
        n.fake
            .bind(&other, &foreign.join(CONTENT), true, MountFlags::default())
            .unwrap();
        let e = n.stage(&vid, &foreign).await.unwrap_err();
        assert!(matches!(&e, Error::Conflict(_)), "{e}");
    }

    #[tokio::test]
    async fn a_failed_stage_leaves_no_mount_behind() {
        let n = node();
        let (vid, data) = n.cache_volume(None);
        let staging = n.path("staging/v1");

        n.fake.fail_next("bind", libc::EPERM);
        let e = n.stage(&vid, &staging).await.unwrap_err();
        assert!(e.to_string().contains("bind-mount"), "{e}");
        assert!(n.fake.under(&staging).is_empty(), "the wrapper went too");

        // Bytes that no longer match the seal are never shown to a pod.
        std::fs::write(data.join("onnx/model.onnx"), "tampered, longer").unwrap();
        let e = n.stage(&vid, &staging).await.unwrap_err();
        assert!(e.to_string().contains("model.onnx"), "{e}");
        assert!(n.fake.under(&staging).is_empty());
    }

    #[tokio::test]
    async fn a_sub_path_is_opened_beneath_the_staged_source() {
        let n = node();
        let (vid, data) = n.cache_volume(Some("onnx"));
        let (staging, target) = (n.path("staging/v1"), n.path("pods/p1/v"));
        n.stage(&vid, &staging).await.unwrap();
        n.publish(&vid, &staging, &target).await.unwrap();
        assert_eq!(n.fake.view(&target), data.join("onnx"));

        let missing = n.volume(
            "cache-2",
            &n.source("model", &[], false).0,
            Role::Cache,
            Some("gone"),
        );
        let staging2 = n.path("staging/v2");
        n.stage(&missing, &staging2).await.unwrap();
        let e = n
            .publish(&missing, &staging2, &n.path("pods/p2/v"))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::NotFound(m) if m.contains("\"gone\"")),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_sub_path_through_a_link_out_of_the_source_is_refused() {
        let n = node();
        let (sid, data) = n.source("linked", &[("a", "x")], false);
        std::os::unix::fs::symlink(n.dir.path(), data.join("escape")).unwrap();
        cache::seal_source(&n.root, &sid, "test").unwrap();
        let vid = n.volume("cache-3", &sid, Role::Cache, Some("escape"));
        let staging = n.path("staging/v3");
        n.stage(&vid, &staging).await.unwrap();
        let target = n.path("pods/p3/v");
        let e = n.publish(&vid, &staging, &target).await.unwrap_err();
        assert!(
            matches!(&e, Error::Invalid { field, .. } if field == "subPath"),
            "{e}"
        );
        assert!(n.fake.at(&target).is_none());
    }

    #[tokio::test]
    async fn a_source_is_staged_writable_under_a_lease_or_not_at_all() {
        let n = node();
        let (sid, _) = n.source("writable", &[("a", "x")], false);
        let vid = n.volume("the-source", &sid, Role::Source, None);
        let staging = n.path("staging/src");

        let e = n.stage(&vid, &staging).await.unwrap_err();
        assert!(
            matches!(&e, Error::Precondition(m) if m.contains("seal it first")),
            "{e}"
        );

        n.fake.fail_next("bind", libc::EIO);
        let writer = request(Mode::SingleNodeWriter, None);
        let failed = n
            .ops
            .stage(&vid, staging.clone(), writer.clone(), None)
            .await;
        assert!(failed.is_err());
        assert!(
            cache::writers(&n.root, &sid).unwrap().is_empty(),
            "a failed stage keeps no lease"
        );

        n.ops
            .stage(&vid, staging.clone(), writer, None)
            .await
            .unwrap();
        has(
            &n.mounted(&staging.join(CONTENT)),
            &["rw", "nosuid", "nodev"],
        );
        assert_eq!(
            cache::writers(&n.root, &sid).unwrap(),
            vec!["n1".to_string()]
        );
        let e = cache::seal_source(&n.root, &sid, "test").unwrap_err();
        assert!(
            e.to_string().contains("n1"),
            "sealing waits for the writer: {e}"
        );

        n.ops.unstage(&vid, staging.clone()).await.unwrap();
        assert!(cache::writers(&n.root, &sid).unwrap().is_empty());
        cache::seal_source(&n.root, &sid, "test").unwrap();
    }

    #[tokio::test]
    async fn stats_see_a_staging_torn_away_under_a_publish() {
        let n = node();
        let (vid, _) = n.cache_volume(None);
        let (staging, target) = (n.path("staging/v1"), n.path("pods/p1/v"));
        n.stage(&vid, &staging).await.unwrap();
        n.publish(&vid, &staging, &target).await.unwrap();
        n.fake.unmount(&staging.join(CONTENT)).unwrap();
        let (_, condition) = n
            .ops
            .stats(&vid, target.clone(), Some(staging.clone()))
            .await
            .unwrap();
        assert!(condition.abnormal);
        assert!(
            condition.message.contains("staging mount"),
            "{}",
            condition.message
        );

        let e = n
            .ops
            .stats(&vid, n.path("pods/none"), None)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "{e}");
    }
}
