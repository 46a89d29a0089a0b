//! XFS image sources: one filesystem per source in a sparse image file.
//!
//! Writers mount the image read-write through their own loop device; once
//! sealed, readers share one read-only loop device per node and mount it
//! `ro,norecovery,nouuid`, which lets several read-only mounts of one
//! filesystem coexist. Sealing mounts the image read-write once, so that a
//! log left dirty by a crashed writer is replayed before anyone reads it
//! with `norecovery`.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, IoContext, Result};
use crate::mount;

use super::manifest::{self, Tree};

/// mkfs.xfs refuses filesystems smaller than this.
pub const MIN_IMAGE_BYTES: u64 = 300 << 20;

/// The options every reader mounts with.
pub const READER_OPTIONS: &str = "norecovery,nouuid";

pub fn mkfs_path() -> Option<PathBuf> {
    tool_path("mkfs.xfs")
}

fn tool_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/sbin".into(), "/usr/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Makes a sparse image holding a fresh XFS filesystem, built under a
/// temporary name and renamed into place.
pub fn create_image(image: &Path, size: u64) -> Result<()> {
    let mkfs = mkfs_path().ok_or_else(|| {
        Error::Precondition("backend xfs needs mkfs.xfs on the controller; install xfsprogs".into())
    })?;
    let dir = image.parent().unwrap_or(Path::new("/"));
    fs::create_dir_all(dir).ctx("create", dir)?;
    let tmp = dir.join(format!(".image-{}", uuid::Uuid::new_v4().simple()));
    let result = (|| {
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .ctx("create image", &tmp)?;
        f.set_len(size.max(MIN_IMAGE_BYTES))
            .ctx("size image", &tmp)?;
        f.sync_all().ctx("sync image", &tmp)?;
        let out = Command::new(&mkfs)
            .arg("-q")
            .arg(&tmp)
            .output()
            .ctx("run mkfs.xfs on", &tmp)?;
        if !out.status.success() {
            return Err(Error::Internal(format!(
                "mkfs.xfs {} failed: {}",
                tmp.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        fs::rename(&tmp, image).ctx("rename into place", image)?;
        crate::state::sync_dir(dir).ctx("sync", dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Gives a copied image a filesystem UUID of its own: XFS refuses to mount a
/// UUID that is already mounted (only readers pass nouuid), so copies that
/// kept their original's UUID could not be written or sealed side by side.
pub fn new_uuid(image: &Path) -> Result<()> {
    run_tool("xfs_admin", &["-U", "generate"], image)
}

/// Runs an xfsprogs tool with `args` on `target`; a failure carries its
/// stderr.
fn run_tool(name: &str, args: &[&str], target: &Path) -> Result<()> {
    let tool = tool_path(name).ok_or_else(|| {
        Error::Precondition(format!(
            "backend xfs needs {name} on the controller; install xfsprogs"
        ))
    })?;
    let out = Command::new(&tool)
        .args(args)
        .arg(target)
        .output()
        .ctx(&format!("run {name} on"), target)?;
    if !out.status.success() {
        return Err(Error::Internal(format!(
            "{name} {} {} failed: {}",
            args.join(" "),
            target.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Mounts the image read-write in a private directory (replaying its log if
/// a writer crashed), hashes its tree, and unmounts it.
/// `backing` is the image, opened read-write beneath its root; `image`
/// names it in messages.
pub fn scan_image(backing: fs::File, image: &Path, tmp_root: &Path) -> Result<Tree> {
    let mnt = tmp_root.join(format!("seal-{}", uuid::Uuid::new_v4().simple()));
    fs::create_dir_all(&mnt).ctx("create", &mnt)?;
    let result = (|| {
        let lo =
            mount::loopdev::attach_file(backing, false).ctx("attach loop device for", image)?;
        mount::mount_device(lo.path(), &mnt, "xfs", false, "").ctx("mount", image)?;
        // The mount holds the loop device from here on; autoclear releases it
        // when we unmount.
        drop(lo);
        let tree = manifest::scan(&mnt);
        mount::unmount(&mnt).ctx("unmount", &mnt)?;
        tree
    })();
    if mount::is_mount_point(&mnt).unwrap_or(false) {
        let _ = mount::unmount(&mnt);
    }
    let _ = fs::remove_dir(&mnt);
    result
}

/// A sealed image is never opened for writing again by us; the mode makes a
/// mistake elsewhere visible too.
pub fn make_readonly(image: &Path) -> Result<()> {
    fs::set_permissions(image, fs::Permissions::from_mode(0o444)).ctx("chmod", image)
}

/// Grows the image mounted read-write at `mnt` to `size` bytes, online:
/// the sparse file first, then its loop device, then the filesystem. A
/// pull sizes its image from the bytes it will fetch; compressed layers
/// can unpack to more than that.
pub fn grow_mounted(image: &Path, mnt: &Path, size: u64) -> Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .open(image)
        .ctx("open image", image)?;
    grow_image(&f, image, mnt, size)
}

/// [`grow_mounted`] for an image already open for writing (`f`, at
/// `image`). Idempotent: a file, device or filesystem already that large is
/// left as it is.
pub fn grow_image(f: &File, image: &Path, mnt: &Path, size: u64) -> Result<()> {
    let devs: Vec<PathBuf> = mount::loopdev::devices_backed_by(image)
        .ctx("find the loop device of", image)?
        .into_iter()
        .filter_map(|(dev, ro)| (!ro).then_some(dev))
        .collect();
    if devs.is_empty() {
        return Err(Error::Internal(format!(
            "{} has no writable loop device to grow",
            image.display()
        )));
    }
    if f.metadata().ctx("stat", image)?.len() < size {
        f.set_len(size).ctx("grow image", image)?;
    }
    for dev in &devs {
        mount::loopdev::refresh_capacity(dev).ctx("resize loop device of", image)?;
    }
    run_tool("xfs_growfs", &["-d"], mnt)
}
