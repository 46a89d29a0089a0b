//! How a source's bytes are held: a directory tree (`local`, `shared`) or
//! an XFS filesystem image (`xfs`). Each backend's way of creating,
//! copying, scanning, sealing, pulling into, mounting and checking a source
//! lives here behind `SourceStore`; everything else asks a root's backend
//! for its store (`Backend::store`) and never tells the backends apart.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::layout::{Backend, ConfinedSource, Root, SourceId, SourcePaths};
use super::lease::Share;
use super::manifest::{self, Tree};
use super::xfs;
use crate::error::{Error, IoContext, Result};
use crate::mount::{self, MountFlags, Mounter, mountinfo::MountEntry};

/// Where a pull writes a model's files, and the files still arriving:
/// on one filesystem, so that a finished file is renamed into place.
pub struct PullDirs {
    pub data: PathBuf,
    pub partial: PathBuf,
}

/// Files still arriving, when they live inside the model's own filesystem
/// (an image): a listing may never name it (`puller`'s listing check).
pub const PARTIAL_DIR: &str = ".modelcache-partial";

/// What growing a pull's area for one more layer came to.
pub enum Growth {
    /// The area grew from one size to another; unpack again.
    Grew { from: u64, to: u64 },
    /// It could grow, but the disk under it has no room.
    NoRoom { size: u64, free: u64 },
    /// This kind of area has no size of its own to grow.
    Fixed,
}

/// Disk kept free under a growing image: a loop device whose backing file
/// cannot grow fails writes with EIO.
pub const GROWTH_RESERVE: u64 = 64 << 20;

/// Where a backend's roots live.
pub struct Placement {
    /// A root in each node's state directory; new volumes go there unless
    /// the class asks for a shared one.
    pub on_node: bool,
    /// A root under every shared path, in this subdirectory ("" for the
    /// path itself).
    pub under_shared: Option<&'static str>,
}

pub trait SourceStore: Sync {
    /// Where this backend's roots live.
    fn placement(&self) -> Placement;
    /// Why this backend cannot work here, if so: a missing tool, a missing
    /// setting.
    fn unusable(&self, shared_paths: &[PathBuf]) -> Option<String>;
    /// Whether a node's own root of this backend may hold volumes over
    /// another driver's bytes (a host path exposed in place). Only a plain
    /// directory root that no other node writes can.
    fn holds_external(&self) -> bool;
    /// Bytes a new writable source needs at the least.
    fn min_source_bytes(&self) -> u64;
    /// The filesystem type a capability may name for it (besides none).
    fn fs_type(&self) -> Option<&'static str>;
    /// Whether several nodes may write one source at once.
    fn multi_node_writers(&self) -> bool;
    /// The lease a writable stage takes.
    fn share(&self, multi_node_multi_writer: bool) -> Share;
    /// Whether this node must make one source's mounts one at a time:
    /// images share a loop device, which two stages attaching at once
    /// would each attach again. Bind mounts of a directory need no turn.
    fn one_mount_at_a_time(&self) -> bool;

    /// An empty writable source of `capacity` bytes. Idempotent.
    fn create(&self, sp: &SourcePaths, capacity: u64) -> Result<()>;
    /// The path that holds a source's bytes; once it exists, a create or a
    /// copy is done.
    fn bytes_path(&self, sp: &SourcePaths) -> PathBuf;
    /// Copies a source's bytes to `tmp` (renamed to `bytes_path` after).
    fn copy(&self, src: &ConfinedSource, tmp: &Path) -> Result<()>;
    /// Refuses to delete a source this node still has attached.
    fn check_detached(&self, sid: &SourceId, sp: &SourcePaths) -> Result<()>;
    /// Every file, directory and link of a source, for its seal.
    fn scan(&self, root: &Root, src: &ConfinedSource, sp: &SourcePaths) -> Result<Tree>;
    /// After the seal: the bytes read-only on disk too, where that means
    /// something.
    fn make_immutable(&self, src: &ConfinedSource, sp: &SourcePaths) -> Result<()>;

    /// Prepares a pull's area (`pull::PullArea`) to be written, for about
    /// `need` bytes. Idempotent: a resumed pull finds what it left.
    fn open_pull(&self, area: &SourcePaths, need: Option<u64>) -> Result<PullDirs>;
    /// Grows a pull's area that a layer overflowed.
    fn grow_pull(&self, area: &SourcePaths) -> Result<Growth>;
    /// Undoes what `open_pull` set up to write the area (a mount), before
    /// it is sealed, discarded or left for a later attempt. Idempotent.
    fn release_pull(&self, area: &SourcePaths) -> Result<()>;

    /// Mounts a source's bytes on `content` through `m`, read-only unless
    /// `writable`.
    fn mount(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        content: &Path,
        writable: bool,
        base: MountFlags,
    ) -> Result<()>;
    /// Grows a writable source staged at `content` (its mount on this
    /// node) to `size` bytes, online, where a size means something.
    fn grow_staged(&self, src: &ConfinedSource, content: &Path, size: u64) -> Result<()>;
    /// Whether a mount found at `content` shows this source.
    fn shows(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        content: &Path,
        existing: &MountEntry,
    ) -> Result<bool>;
    /// Why a staged mount of this source no longer shows it, if so.
    fn gone(&self, m: &dyn Mounter, sp: &SourcePaths, entry: &MountEntry) -> Option<String>;
    /// A read-only view of a sealed source's data, open until dropped.
    fn open_sealed(&self, root: &Root, sid: &SourceId) -> Result<SealedView>;
    /// Runs `check` over a read-only view of a sealed source.
    fn view_sealed(&self, root: &Root, sid: &SourceId, check: &mut dyn FnMut(&Path)) -> Result<()> {
        let view = self.open_sealed(root, sid)?;
        check(view.path());
        Ok(())
    }
}

/// A sealed source's data, read-only, while this lives: the directory
/// itself, or the image mounted (`ro,norecovery,nouuid`) in the root's
/// scratch space and unmounted when dropped. Dropping it unmounts, which
/// blocks: drop it off the async runtime. A mount left by a crash is
/// removed by the root's sweep at the next start.
pub struct SealedView {
    path: PathBuf,
    mounted: bool,
}

impl SealedView {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SealedView {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = mount::unmount(&self.path) {
                tracing::warn!(at = %self.path.display(), error = %e, "could not unmount a view of a sealed image; the next start sweeps it");
                return;
            }
            let _ = fs::remove_dir(&self.path);
        }
    }
}

impl Backend {
    /// This backend's store.
    pub fn store(self) -> &'static dyn SourceStore {
        static LOCAL: DirStore = DirStore { shared: false };
        static SHARED: DirStore = DirStore { shared: true };
        static IMAGE: ImageStore = ImageStore;
        match self {
            Backend::Local => &LOCAL,
            Backend::Shared => &SHARED,
            Backend::Xfs => &IMAGE,
        }
    }
}

/// A directory tree, on the node (`local`) or on a filesystem every node
/// mounts (`shared`); bind-mounted to stage it.
pub struct DirStore {
    shared: bool,
}

/// An XFS filesystem image, attached through a loop device to stage it.
pub struct ImageStore;

/// Where a pull's image is mounted to be written.
fn pull_mount(area: &SourcePaths) -> PathBuf {
    area.dir.join("mnt")
}

/// (device, inode) of what a path shows: two mounts of one tree agree.
pub fn identity(path: &Path) -> Result<(u64, u64)> {
    let m = fs::metadata(path).ctx("stat", path)?;
    Ok((m.dev(), m.ino()))
}

impl SourceStore for DirStore {
    fn placement(&self) -> Placement {
        Placement {
            on_node: !self.shared,
            under_shared: self.shared.then_some(""),
        }
    }

    fn unusable(&self, shared_paths: &[PathBuf]) -> Option<String> {
        (self.shared && shared_paths.is_empty())
            .then(|| "backend shared needs --shared-path".into())
    }

    fn holds_external(&self) -> bool {
        !self.shared
    }

    fn min_source_bytes(&self) -> u64 {
        1
    }

    fn fs_type(&self) -> Option<&'static str> {
        None
    }

    fn multi_node_writers(&self) -> bool {
        true
    }

    fn one_mount_at_a_time(&self) -> bool {
        false
    }

    /// A directory on a network filesystem takes several writers, but only
    /// when the volume asked for it.
    fn share(&self, multi_node_multi_writer: bool) -> Share {
        if self.shared && multi_node_multi_writer {
            Share::MultiNode
        } else {
            Share::Exclusive
        }
    }

    fn create(&self, sp: &SourcePaths, _capacity: u64) -> Result<()> {
        let data = sp.data();
        if !data.is_dir() {
            // Built beside the final place and renamed: a crash leaves no
            // half-made source under the real name.
            let tmp = sp
                .dir
                .join(format!(".data-{}", uuid::Uuid::new_v4().simple()));
            fs::create_dir_all(&tmp).ctx("create", &tmp)?;
            fs::rename(&tmp, &data).ctx("rename into place", &data)?;
            crate::state::sync_dir(&sp.dir).ctx("sync", &sp.dir)?;
        }
        Ok(())
    }

    fn bytes_path(&self, sp: &SourcePaths) -> PathBuf {
        sp.data()
    }

    /// `copy::copy_tree` never recreates device nodes, fifos, sockets or
    /// setuid/setgid bits.
    fn copy(&self, src: &ConfinedSource, tmp: &Path) -> Result<()> {
        let data = src.data()?;
        super::copy::copy_tree(&mount::subpath::proc_path(&data), tmp, &src.real.data())
    }

    fn check_detached(&self, _sid: &SourceId, _sp: &SourcePaths) -> Result<()> {
        Ok(())
    }

    fn scan(&self, _root: &Root, src: &ConfinedSource, _sp: &SourcePaths) -> Result<Tree> {
        manifest::scan(&mount::subpath::proc_path(&src.data()?))
    }

    fn make_immutable(&self, _src: &ConfinedSource, _sp: &SourcePaths) -> Result<()> {
        Ok(())
    }

    fn open_pull(&self, area: &SourcePaths, _need: Option<u64>) -> Result<PullDirs> {
        let (data, partial) = (area.data(), area.dir.join("partial"));
        for d in [&data, &partial] {
            fs::create_dir_all(d).ctx("create", d)?;
        }
        Ok(PullDirs { data, partial })
    }

    fn grow_pull(&self, _area: &SourcePaths) -> Result<Growth> {
        Ok(Growth::Fixed)
    }

    fn release_pull(&self, _area: &SourcePaths) -> Result<()> {
        Ok(())
    }

    fn mount(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        content: &Path,
        writable: bool,
        base: MountFlags,
    ) -> Result<()> {
        let fd = src.data()?;
        let from = mount::subpath::proc_path(&fd);
        let data = src.real.data();
        m.bind(&from, content, !writable, base)
            .ctx("bind-mount", &data)
    }

    /// A directory has no size of its own: its record's is what counts.
    fn grow_staged(&self, _src: &ConfinedSource, _content: &Path, _size: u64) -> Result<()> {
        Ok(())
    }

    fn shows(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        content: &Path,
        _existing: &MountEntry,
    ) -> Result<bool> {
        let data = src.data()?;
        Ok(identity(&m.view(content))? == identity(&mount::subpath::proc_path(&data))?)
    }

    fn gone(&self, _m: &dyn Mounter, sp: &SourcePaths, _entry: &MountEntry) -> Option<String> {
        (!sp.data().is_dir())
            .then(|| format!("source directory {} is missing", sp.data().display()))
    }

    fn open_sealed(&self, root: &Root, sid: &SourceId) -> Result<SealedView> {
        Ok(SealedView {
            path: root.source(sid).data(),
            mounted: false,
        })
    }
}

impl SourceStore for ImageStore {
    /// On the node by default; `imageLocation: shared` puts the image
    /// under a shared path, still mounted by one node at a time.
    fn placement(&self) -> Placement {
        Placement {
            on_node: true,
            under_shared: Some("xfs"),
        }
    }

    fn unusable(&self, _shared_paths: &[PathBuf]) -> Option<String> {
        xfs::mkfs_path()
            .is_none()
            .then(|| "backend xfs needs mkfs.xfs: install xfsprogs".into())
    }

    fn holds_external(&self) -> bool {
        false
    }

    fn min_source_bytes(&self) -> u64 {
        xfs::MIN_IMAGE_BYTES
    }

    fn fs_type(&self) -> Option<&'static str> {
        Some("xfs")
    }

    /// XFS is a local filesystem: two read-write mounts of one image, on
    /// two nodes or through two loop devices, corrupt it.
    fn multi_node_writers(&self) -> bool {
        false
    }

    fn one_mount_at_a_time(&self) -> bool {
        true
    }

    fn share(&self, _multi_node_multi_writer: bool) -> Share {
        Share::Exclusive
    }

    fn create(&self, sp: &SourcePaths, capacity: u64) -> Result<()> {
        if !sp.image().exists() {
            xfs::create_image(&sp.image(), capacity)?;
        }
        Ok(())
    }

    fn bytes_path(&self, sp: &SourcePaths) -> PathBuf {
        sp.image()
    }

    /// One file, reflinked where the filesystem can, with a new UUID;
    /// whatever it holds is only ever mounted nosuid,nodev.
    fn copy(&self, src: &ConfinedSource, tmp: &Path) -> Result<()> {
        let image = src.image(false)?;
        crate::state::forget_cached_pages(&image);
        // cp opens the very file checked above, through this process's fd.
        let from = format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(&image)
        );
        let status = std::process::Command::new("cp")
            .args(["--reflink=auto", "--sparse=always"])
            .arg(&from)
            .arg(tmp)
            .status()
            .ctx("run cp from", &src.real.image())?;
        drop(image);
        if !status.success() {
            return Err(Error::Internal(format!(
                "copying {} to {} failed: cp {status}",
                src.real.image().display(),
                tmp.display()
            )));
        }
        // The copy must be writable even if the original was sealed (0444).
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(tmp, fs::Permissions::from_mode(0o644)).ctx("chmod", tmp)?;
        xfs::new_uuid(tmp)
    }

    fn check_detached(&self, sid: &SourceId, sp: &SourcePaths) -> Result<()> {
        let attached = mount::loopdev::devices_backed_by(&sp.image()).unwrap_or_default();
        match attached.first() {
            Some((dev, _)) => Err(Error::Precondition(format!(
                "source {sid} is still attached on this node as {}; unstage its volumes first",
                dev.display()
            ))),
            None => Ok(()),
        }
    }

    fn scan(&self, root: &Root, src: &ConfinedSource, sp: &SourcePaths) -> Result<Tree> {
        xfs::scan_image(src.image(true)?, &sp.image(), &root.tmp_dir())
    }

    fn make_immutable(&self, src: &ConfinedSource, sp: &SourcePaths) -> Result<()> {
        // Through a descriptor: chmod by path would follow a link.
        use std::os::unix::fs::PermissionsExt;
        src.image(false)?
            .set_permissions(fs::Permissions::from_mode(0o444))
            .ctx("chmod", &sp.image())
    }

    /// The image, sized from what the listing says, attached and mounted in
    /// the work directory: the model's files land in their filesystem.
    fn open_pull(&self, area: &SourcePaths, need: Option<u64>) -> Result<PullDirs> {
        let image = area.image();
        if !image.exists() {
            let need = need.unwrap_or(1 << 30);
            // Room for XFS metadata and layer unpacking on top of the model.
            let size = (need + need / 8 + (64 << 20)).max(xfs::MIN_IMAGE_BYTES);
            xfs::create_image(&image, size)?;
        }
        let mnt = pull_mount(area);
        fs::create_dir_all(&mnt).ctx("create", &mnt)?;
        if !mount::is_mount_point(&mnt).ctx("inspect", &mnt)? {
            let lo = mount::loopdev::attach(&image, false).ctx("attach loop device for", &image)?;
            mount::mount_device(lo.path(), &mnt, "xfs", false, "").ctx("mount", &image)?;
        }
        let partial = mnt.join(PARTIAL_DIR);
        fs::create_dir_all(&partial).ctx("create", &partial)?;
        Ok(PullDirs { data: mnt, partial })
    }

    /// Doubles the image, as far as the disk under it allows beyond
    /// [`GROWTH_RESERVE`].
    fn grow_pull(&self, area: &SourcePaths) -> Result<Growth> {
        let (work_dir, mnt, image) = (&area.dir, pull_mount(area), area.image());
        let size = fs::metadata(&image).ctx("stat", &image)?.len();
        let vfs = nix::sys::statvfs::statvfs(work_dir)
            .map_err(|e| Error::io("statfs", work_dir, e.into()))?;
        let free = (vfs.blocks_available() as u64 * vfs.fragment_size() as u64)
            .saturating_sub(GROWTH_RESERVE);
        let growth = size.min(free);
        if growth < GROWTH_RESERVE {
            return Ok(Growth::NoRoom { size, free });
        }
        xfs::grow_mounted(&image, &mnt, size + growth)?;
        Ok(Growth::Grew {
            from: size,
            to: size + growth,
        })
    }

    fn release_pull(&self, area: &SourcePaths) -> Result<()> {
        let mnt = pull_mount(area);
        if !mnt.exists() {
            return Ok(());
        }
        while mount::is_mount_point(&mnt).ctx("inspect", &mnt)? {
            mount::unmount(&mnt).ctx("unmount", &mnt)?;
        }
        match fs::remove_dir(&mnt) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", &mnt, e)),
            _ => Ok(()),
        }
    }

    fn mount(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        content: &Path,
        writable: bool,
        _base: MountFlags,
    ) -> Result<()> {
        let data = if writable { "" } else { xfs::READER_OPTIONS };
        m.mount_image(src.image(writable)?, content, "xfs", !writable, data)
            .ctx("attach and mount", &src.real.image())
    }

    fn grow_staged(&self, src: &ConfinedSource, content: &Path, size: u64) -> Result<()> {
        let image = src.image(true)?;
        xfs::grow_image(&image, &src.real.image(), content, size)
    }

    fn shows(
        &self,
        m: &dyn Mounter,
        src: &ConfinedSource,
        _content: &Path,
        existing: &MountEntry,
    ) -> Result<bool> {
        Ok(m.loop_backing(Path::new(&existing.source))
            .ok()
            .flatten()
            .is_some_and(|b| fs::canonicalize(src.via.image()).is_ok_and(|i| i == b)))
    }

    fn gone(&self, m: &dyn Mounter, _sp: &SourcePaths, entry: &MountEntry) -> Option<String> {
        match m.loop_backing(Path::new(&entry.source)) {
            Ok(Some(b)) if b.to_string_lossy().ends_with("(deleted)") => {
                Some(format!("the image behind {} was deleted", entry.source))
            }
            Ok(Some(_)) => None,
            _ => Some(format!("{} is not an attached loop device", entry.source)),
        }
    }

    /// Attached and mounted read-only (`ro,norecovery,nouuid`) in a scratch
    /// directory.
    fn open_sealed(&self, root: &Root, sid: &SourceId) -> Result<SealedView> {
        let image = root.source(sid).image();
        let tmp = root.tmp_dir();
        fs::create_dir_all(&tmp).ctx("create", &tmp)?;
        let mnt = tmp.join(format!("view-{}", uuid::Uuid::new_v4().simple()));
        fs::create_dir(&mnt).ctx("create a scratch dir", &mnt)?;
        let mounted = mount::loopdev::attach(&image, true)
            .ctx("attach", &image)
            .and_then(|dev| {
                mount::mount_device(dev.path(), &mnt, "xfs", true, xfs::READER_OPTIONS)
                    .ctx("mount", &image)
            });
        match mounted {
            Ok(()) => Ok(SealedView {
                path: mnt,
                mounted: true,
            }),
            Err(e) => {
                let _ = fs::remove_dir(&mnt);
                Err(e)
            }
        }
    }
}
