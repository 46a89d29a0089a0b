//! The writable copy of a directory source (CreateVolume `role: source`
//! from a volume): files, directories and symlinks, nothing else.
//!
//! A source that was never sealed was written by a tenant's pod, possibly
//! as root, so it may hold what a model never needs and a host must never
//! get from a tenant: device nodes, fifos, sockets, setuid and setgid
//! programs. The copy refuses the first three, naming the entry, and drops
//! the setuid, setgid and sticky bits; it never runs `cp -a`, which would
//! recreate all of them as root. Files are reflinked where the filesystem
//! can, and keep their owner, mode and modification time.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, IoContext, Result};

/// Mode bits a copy keeps: permissions only.
const KEPT_MODE: u32 = 0o777;

/// Copies the tree at `from` into `to`, which must not exist yet.
pub fn copy_tree(from: &Path, to: &Path, shown_as: &Path) -> Result<()> {
    // `from` is the caller's own (confined) descriptor path: followed.
    let meta = fs::metadata(from).ctx("stat", shown_as)?;
    if !meta.is_dir() {
        return Err(Error::Precondition(format!(
            "{} is not a directory",
            shown_as.display()
        )));
    }
    fs::create_dir(to).ctx("create", to)?;
    let mut stack = vec![std::path::PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = from.join(&rel);
        let mut entries: Vec<_> = fs::read_dir(&dir)
            .ctx("read directory", &shown_as.join(&rel))?
            .collect::<io::Result<_>>()
            .ctx("read directory", &shown_as.join(&rel))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let rel = rel.join(entry.file_name());
            let (src, dst) = (from.join(&rel), to.join(&rel));
            let meta = fs::symlink_metadata(&src).ctx("stat", &shown_as.join(&rel))?;
            let ft = meta.file_type();
            if ft.is_dir() {
                fs::create_dir(&dst).ctx("create", &dst)?;
                stack.push(rel);
            } else if ft.is_symlink() {
                let target = fs::read_link(&src).ctx("read link", &shown_as.join(&rel))?;
                std::os::unix::fs::symlink(&target, &dst).ctx("create symlink", &dst)?;
            } else if ft.is_file() {
                copy_file(&src, &dst).ctx("copy", &shown_as.join(&rel))?;
            } else {
                let kind = if ft.is_block_device() || ft.is_char_device() {
                    "a device node"
                } else if ft.is_fifo() {
                    "a fifo"
                } else {
                    "a socket"
                };
                return Err(Error::Precondition(format!(
                    "cannot copy {}: it is {kind}, and a copy holds only files, directories \
                     and symlinks; remove it from the source first",
                    shown_as.join(&rel).display()
                )));
            }
            keep_attributes(&dst, &meta)?;
        }
    }
    keep_attributes(to, &meta)
}

/// Owner, permission bits (never setuid, setgid or sticky) and times.
fn keep_attributes(dst: &Path, meta: &fs::Metadata) -> Result<()> {
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid())).ctx("chown", dst)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    // chown clears setuid/setgid by itself on files; mode is set after it
    // so nothing can put them back.
    fs::set_permissions(dst, fs::Permissions::from_mode(meta.mode() & KEPT_MODE))
        .ctx("chmod", dst)?;
    let mtime = filetime(meta.mtime(), meta.mtime_nsec());
    let times = [filetime(meta.atime(), meta.atime_nsec()), mtime];
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        dst,
        &times[0],
        &times[1],
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| Error::io("set times of", dst, e.into()))
}

fn filetime(secs: i64, nsec: i64) -> nix::sys::time::TimeSpec {
    nix::sys::time::TimeSpec::new(secs, nsec)
}

/// Reflinks (FICLONE) where the filesystem can, otherwise copies.
fn copy_file(src: &Path, dst: &Path) -> io::Result<()> {
    let from = File::open(src)?;
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    // SAFETY: FICLONE takes the source fd as its argument; both fds are open.
    let cloned = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) } == 0;
    if !cloned {
        let mut from = from;
        let mut to = to;
        io::copy(&mut from, &mut to)?;
        to.sync_all()?;
    } else {
        to.sync_all()?;
    }
    Ok(())
}

use std::os::unix::fs::OpenOptionsExt;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_files_dirs_links_and_drops_special_bits() {
        let d = tempfile::tempdir().unwrap();
        let from = d.path().join("from");
        fs::create_dir_all(from.join("sub")).unwrap();
        fs::write(from.join("sub/a"), b"hello").unwrap();
        fs::write(from.join("suid"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(from.join("suid"), fs::Permissions::from_mode(0o6755)).unwrap();
        fs::set_permissions(from.join("sub"), fs::Permissions::from_mode(0o3775)).unwrap();
        std::os::unix::fs::symlink("sub/a", from.join("link")).unwrap();
        let to = d.path().join("to");
        copy_tree(&from, &to, &from).unwrap();
        assert_eq!(fs::read(to.join("sub/a")).unwrap(), b"hello");
        assert_eq!(fs::read_link(to.join("link")).unwrap(), Path::new("sub/a"));
        let mode = |p: &str| fs::metadata(to.join(p)).unwrap().mode() & 0o7777;
        assert_eq!(mode("suid"), 0o755);
        assert_eq!(mode("sub"), 0o775);
    }

    #[test]
    fn refuses_fifos_naming_them() {
        let d = tempfile::tempdir().unwrap();
        let from = d.path().join("from");
        fs::create_dir_all(from.join("x")).unwrap();
        nix::unistd::mkfifo(&from.join("x/pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = copy_tree(&from, &d.path().join("to"), Path::new("/shown"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/shown/x/pipe") && err.contains("a fifo"),
            "{err}"
        );
    }
}
