//! The node's mounts as one seam: the kernel's, or (in tests) a fake that
//! keeps a mount table of its own, so node logic runs without root.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use super::{MountEntry, MountFlags};

/// What the node plugin does to mounts, and how it reads them back.
pub trait Mounter: Send + Sync {
    /// The mount table as this process sees it.
    fn table(&self) -> io::Result<Vec<MountEntry>>;
    /// The topmost mount at `path`; `None` when nothing is mounted there or
    /// the path is missing.
    fn entry_at(&self, path: &Path) -> io::Result<Option<MountEntry>> {
        super::lookup::in_table(path, || self.table())
    }
    /// Binds `src` onto `dst` with `flags`; read-only when asked, and
    /// always when `src` already is.
    fn bind(&self, src: &Path, dst: &Path, readonly: bool, flags: MountFlags) -> io::Result<()>;
    /// Mounts a block device (nosuid, nodev).
    fn mount_device(
        &self,
        dev: &Path,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()>;
    /// Attaches the open file `image` to a loop device of its own (read-only
    /// when asked) and mounts that device on `dst` (nosuid, nodev). The
    /// device goes away with the mount: nothing is left attached.
    fn mount_image(
        &self,
        image: File,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()>;
    /// The file behind the loop device `dev`, as the kernel names it (with
    /// ` (deleted)` once unlinked); `None` when `dev` is no loop device.
    fn loop_backing(&self, dev: &Path) -> io::Result<Option<PathBuf>>;
    /// A small tmpfs of its own on `dst`.
    fn mount_tmpfs(&self, dst: &Path, size_bytes: u64) -> io::Result<()>;
    /// Unmounts the topmost mount at `dst`; `Ok(false)` when there is none.
    fn unmount(&self, dst: &Path) -> io::Result<bool>;
    /// A read-only FUSE filesystem on `dst` named `fuse.<name>`, and the
    /// connection its server reads (`super::fuse`).
    fn mount_fuse(&self, dst: &Path, name: &str) -> io::Result<std::os::fd::OwnedFd>;
    /// The path through which the files `path` shows are read. For the
    /// kernel that is `path`; a fake, which mounts nothing, answers with
    /// the directory it would have shown there.
    fn view(&self, path: &Path) -> PathBuf {
        path.to_path_buf()
    }
}

/// The running kernel's mounts.
pub struct Kernel;

impl Mounter for Kernel {
    fn table(&self) -> io::Result<Vec<MountEntry>> {
        super::read_table()
    }

    /// Asked of the kernel for this one path: the cost does not grow with
    /// the node's mounts (`super::lookup`).
    fn entry_at(&self, path: &Path) -> io::Result<Option<MountEntry>> {
        super::lookup::entry_at(path)
    }

    fn bind(&self, src: &Path, dst: &Path, readonly: bool, flags: MountFlags) -> io::Result<()> {
        if readonly {
            super::bind_readonly(src, dst, flags)
        } else {
            super::bind_writable(src, dst, flags)
        }
    }

    fn mount_device(
        &self,
        dev: &Path,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()> {
        super::mount_device(dev, dst, fstype, readonly, data)
    }

    fn mount_image(
        &self,
        image: File,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()> {
        let lo = super::loopdev::attach_file(image, readonly)?;
        // The mount holds the device from here on; autoclear detaches it
        // when the mount goes.
        super::mount_device(lo.path(), dst, fstype, readonly, data)
    }

    fn loop_backing(&self, dev: &Path) -> io::Result<Option<PathBuf>> {
        super::loopdev::backing_file(dev)
    }

    fn mount_tmpfs(&self, dst: &Path, size_bytes: u64) -> io::Result<()> {
        super::mount_tmpfs(dst, size_bytes)
    }

    fn unmount(&self, dst: &Path) -> io::Result<bool> {
        super::unmount(dst)
    }

    fn mount_fuse(&self, dst: &Path, name: &str) -> io::Result<std::os::fd::OwnedFd> {
        super::fuse::mount_fuse(dst, name)
    }
}
