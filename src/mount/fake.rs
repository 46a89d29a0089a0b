//! A mount table kept in memory, for testing node logic without root: it
//! checks what the kernel would (the target exists, an unmount finds a
//! mount), records every flag asked for, and can be told to fail an
//! operation once.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::mounter::Mounter;
use super::{MountEntry, MountFlags};

#[derive(Default)]
pub struct FakeMounter {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u32,
    mounts: Vec<Mounted>,
    /// Operations told to fail the next time they run.
    fail: HashMap<&'static str, i32>,
    /// Mount calls that succeeded.
    made: usize,
    /// Loop devices attached by `mount_image`, by device name: the file
    /// held open as the kernel holds it, and its name at attach time.
    loops: HashMap<PathBuf, (File, PathBuf)>,
    next_loop: u32,
}

struct Mounted {
    entry: MountEntry,
    /// The real directory whose files this mount shows.
    shows: PathBuf,
    /// For a tmpfs: what its directory held before, the rest being the
    /// tmpfs's own files, which go with it at unmount.
    before: Option<Vec<std::ffi::OsString>>,
}

fn canonical(p: &Path) -> io::Result<PathBuf> {
    std::fs::canonicalize(p)
}

impl FakeMounter {
    /// The next `op` ("bind", "mount_device", "mount_tmpfs", "unmount")
    /// fails with `errno`.
    pub fn fail_next(&self, op: &'static str, errno: i32) {
        self.lock().fail.insert(op, errno);
    }

    /// Loop devices still attached.
    pub fn loops(&self) -> usize {
        self.lock().loops.len()
    }

    /// How many mounts have been made, unmounted ones included.
    pub fn made(&self) -> usize {
        self.lock().made
    }

    /// The topmost mount at `path`, if any.
    pub fn at(&self, path: &Path) -> Option<MountEntry> {
        let p = canonical(path).ok()?;
        let table = self.table().ok()?;
        super::mount_at(&table, &p).cloned()
    }

    /// Every mount at or below `dir`.
    pub fn under(&self, dir: &Path) -> Vec<MountEntry> {
        let table = self.table().unwrap_or_default();
        super::mounts_under(&table, dir)
            .into_iter()
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(
        &self,
        op: &'static str,
        dst: &Path,
        make: impl FnOnce(&State) -> io::Result<(MountEntry, PathBuf)>,
    ) -> io::Result<()> {
        let mut st = self.lock();
        if let Some(errno) = st.fail.remove(op) {
            return Err(io::Error::from_raw_os_error(errno));
        }
        if !dst.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        let (mut entry, shows) = make(&st)?;
        st.next_id += 1;
        entry.mount_id = st.next_id;
        entry.mount_point = canonical(dst)?;
        entry.parent_id = st
            .mounts
            .iter()
            .rev()
            .find(|m| entry.mount_point.starts_with(&m.entry.mount_point))
            .map_or(0, |m| m.entry.mount_id);
        st.made += 1;
        let before = (op == "mount_tmpfs").then(|| names_in(&entry.mount_point));
        st.mounts.push(Mounted {
            entry,
            shows,
            before,
        });
        Ok(())
    }
}

fn entry(fs_type: &str, source: String, root: PathBuf, options: Vec<String>) -> MountEntry {
    MountEntry {
        mount_id: 0,
        parent_id: 0,
        major: 0,
        minor: 0,
        root,
        mount_point: PathBuf::new(),
        mount_options: options,
        fs_type: fs_type.into(),
        source,
        super_options: Vec::new(),
    }
}

fn options(readonly: bool, f: MountFlags) -> Vec<String> {
    let mut o = vec![if readonly { "ro" } else { "rw" }.to_string()];
    for (on, name) in [
        (f.nosuid, "nosuid"),
        (f.nodev, "nodev"),
        (f.noexec, "noexec"),
        (f.noatime, "noatime"),
        (f.nodiratime, "nodiratime"),
        (f.relatime, "relatime"),
        (f.strictatime, "strictatime"),
    ] {
        if on {
            o.push(name.into());
        }
    }
    o
}

fn names_in(dir: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

/// The mount that `path` lies in, deepest first.
fn covering<'a>(mounts: &'a [Mounted], path: &Path) -> Option<&'a Mounted> {
    mounts
        .iter()
        .rev()
        .filter(|m| path.starts_with(&m.entry.mount_point))
        .max_by_key(|m| m.entry.mount_point.components().count())
}

/// `path` made canonical as far as it exists: beneath a mount point the
/// fake did not fill, the rest of the path names what it would show.
fn canonical_prefix(path: &Path) -> Option<PathBuf> {
    let mut rest = Vec::new();
    let mut at = path;
    loop {
        if let Ok(c) = canonical(at) {
            return Some(rest.iter().rev().fold(c, |acc, part| acc.join(part)));
        }
        rest.push(at.file_name()?);
        at = at.parent()?;
    }
}

fn view_in(mounts: &[Mounted], path: &Path) -> PathBuf {
    let Some(p) = canonical_prefix(path) else {
        return path.to_path_buf();
    };
    match covering(mounts, &p) {
        Some(m) => {
            let rel = p
                .strip_prefix(&m.entry.mount_point)
                .unwrap_or(Path::new(""));
            if rel.as_os_str().is_empty() {
                m.shows.clone()
            } else {
                m.shows.join(rel)
            }
        }
        None => p,
    }
}

impl Mounter for FakeMounter {
    fn table(&self) -> io::Result<Vec<MountEntry>> {
        Ok(self.lock().mounts.iter().map(|m| m.entry.clone()).collect())
    }

    fn bind(&self, src: &Path, dst: &Path, readonly: bool, flags: MountFlags) -> io::Result<()> {
        self.add("bind", dst, |st| {
            let shows = canonical(&view_in(&st.mounts, src))?;
            if !shows.is_dir() {
                return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
            }
            // A bind inherits a read-only source, as the kernel's does, and
            // shows the superblock it was taken from, as the kernel's table
            // does: a bind of an image's mount names its loop device and
            // filesystem.
            let under = canonical(src).ok().and_then(|s| covering(&st.mounts, &s));
            let ro = readonly || under.is_some_and(|m| m.entry.is_readonly());
            let e = match under {
                Some(m) => {
                    let mut e = entry(
                        &m.entry.fs_type,
                        m.entry.source.clone(),
                        shows.clone(),
                        options(ro, flags),
                    );
                    e.super_options = m.entry.super_options.clone();
                    e
                }
                None => entry(
                    "fakefs",
                    shows.display().to_string(),
                    shows.clone(),
                    options(ro, flags),
                ),
            };
            Ok((e, shows))
        })
    }

    fn mount_device(
        &self,
        dev: &Path,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()> {
        self.add("mount_device", dst, |_| {
            let flags = MountFlags {
                nosuid: true,
                nodev: true,
                ..MountFlags::default()
            };
            let mut e = entry(
                fstype,
                dev.display().to_string(),
                "/".into(),
                options(readonly, flags),
            );
            e.super_options = data
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            Ok((e, canonical(dst)?))
        })
    }

    /// The device is named `/dev/fakeloopN` and shows nothing of the
    /// image: the fake cannot read a filesystem. It is detached when its
    /// mount goes, as autoclear would.
    fn mount_image(
        &self,
        image: File,
        dst: &Path,
        fstype: &str,
        readonly: bool,
        data: &str,
    ) -> io::Result<()> {
        if !image.metadata()?.is_file() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let name = std::fs::read_link(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&image)
        ))?;
        let dev = {
            let mut st = self.lock();
            st.next_loop += 1;
            PathBuf::from(format!("/dev/fakeloop{}", st.next_loop))
        };
        self.mount_device(&dev, dst, fstype, readonly, data)?;
        self.lock().loops.insert(dev, (image, name));
        Ok(())
    }

    fn loop_backing(&self, dev: &Path) -> io::Result<Option<PathBuf>> {
        let st = self.lock();
        let Some((file, name)) = st.loops.get(dev) else {
            return Ok(None);
        };
        if file.metadata()?.nlink() == 0 {
            let mut deleted = name.clone().into_os_string();
            deleted.push(" (deleted)");
            return Ok(Some(deleted.into()));
        }
        Ok(Some(name.clone()))
    }

    fn mount_tmpfs(&self, dst: &Path, _size_bytes: u64) -> io::Result<()> {
        self.add("mount_tmpfs", dst, |_| {
            let flags = MountFlags {
                nosuid: true,
                nodev: true,
                noexec: true,
                ..MountFlags::default()
            };
            let e = entry("tmpfs", "tmpfs".into(), "/".into(), options(false, flags));
            Ok((e, canonical(dst)?))
        })
    }

    /// A FUSE server needs a kernel connection; nothing here fakes one.
    fn mount_fuse(&self, dst: &Path, _name: &str) -> io::Result<std::os::fd::OwnedFd> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{}: FUSE mounts need the kernel; the fake mounter has none",
                dst.display()
            ),
        ))
    }

    fn unmount(&self, dst: &Path) -> io::Result<bool> {
        let mut st = self.lock();
        if let Some(errno) = st.fail.remove("unmount") {
            return Err(io::Error::from_raw_os_error(errno));
        }
        let Ok(p) = canonical(dst) else {
            return Ok(false);
        };
        let Some(top) = super::mount_at(
            &st.mounts
                .iter()
                .map(|m| m.entry.clone())
                .collect::<Vec<_>>(),
            &p,
        )
        .map(|e| e.mount_id) else {
            return Ok(false);
        };
        if st
            .mounts
            .iter()
            .any(|m| m.entry.parent_id == top && m.entry.mount_point != p)
        {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        if let Some(i) = st.mounts.iter().position(|m| m.entry.mount_id == top) {
            let gone = st.mounts.remove(i);
            st.loops.remove(Path::new(&gone.entry.source));
            if let Some(before) = &gone.before {
                for name in names_in(&p).into_iter().filter(|n| !before.contains(n)) {
                    let _ = std::fs::remove_dir_all(p.join(name));
                }
            }
        }
        Ok(true)
    }

    fn view(&self, path: &Path) -> PathBuf {
        view_in(&self.lock().mounts, path)
    }
}
