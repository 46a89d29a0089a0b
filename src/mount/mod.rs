//! Mounts on the node: bind mounts into pods, block devices holding the cache, the loop devices
//! behind them, and the kernel's mount table.
//!
//! The kernel's mount table is the only truth: nothing here caches it. This module never binds
//! recursively, never detaches lazily outside tests, and never loosens a restriction (ro, nosuid,
//! nodev, noexec) that a bind inherits from its source. Every call blocks; run it in
//! `spawn_blocking`.

#[cfg(test)]
pub mod fake;
pub mod fuse;
pub mod lookup;
pub mod loopdev;
pub mod mounter;
pub mod mountinfo;
pub mod subpath;

pub use mounter::{Kernel, Mounter};
pub use mountinfo::{MountEntry, mount_at, mounts_under, read_table};

use std::fmt::Display;
use std::io;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sys::statvfs::{FsFlags, statvfs};

/// The directory beneath a staging path where the node plugin mounts the
/// volume (the staging path itself is a tmpfs of its own: `node::ops`).
pub const STAGING_CONTENT: &str = "volume";

/// Per-mount flags a CSI client may ask for in `VolumeCapability.mount.mount_flags`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountFlags {
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
    pub noatime: bool,
    pub nodiratime: bool,
    pub relatime: bool,
    pub strictatime: bool,
}

const ACCEPTED_FLAGS: &str =
    "ro, rw, nosuid, nodev, noexec, noatime, nodiratime, relatime, strictatime";

impl MountFlags {
    /// Parse CSI mount flags. "ro"/"rw" come back separately: `Some(true)` when "ro" was asked
    /// for, `Some(false)` for "rw", `None` for neither.
    pub fn parse(flags: &[String]) -> Result<(MountFlags, Option<bool>), String> {
        let mut f = MountFlags::default();
        let mut readonly = None;
        for flag in flags {
            match flag.as_str() {
                "ro" | "rw" => {
                    let ro = flag == "ro";
                    if readonly == Some(!ro) {
                        return Err("mount flags \"ro\" and \"rw\" contradict each other".into());
                    }
                    readonly = Some(ro);
                }
                "nosuid" => f.nosuid = true,
                "nodev" => f.nodev = true,
                "noexec" => f.noexec = true,
                "noatime" => f.noatime = true,
                "nodiratime" => f.nodiratime = true,
                "relatime" => f.relatime = true,
                "strictatime" => f.strictatime = true,
                other => {
                    return Err(format!(
                        "unsupported mount flag {other:?}; accepted: {ACCEPTED_FLAGS}"
                    ));
                }
            }
        }
        // The kernel silently lets one of these win; a request naming two is a mistake.
        if [f.noatime, f.relatime, f.strictatime]
            .into_iter()
            .filter(|&b| b)
            .count()
            > 1
        {
            return Err("mount flags noatime, relatime and strictatime exclude each other".into());
        }
        Ok((f, readonly))
    }

    fn ms_flags(self) -> MsFlags {
        [
            (self.nosuid, MsFlags::MS_NOSUID),
            (self.nodev, MsFlags::MS_NODEV),
            (self.noexec, MsFlags::MS_NOEXEC),
            (self.noatime, MsFlags::MS_NOATIME),
            (self.nodiratime, MsFlags::MS_NODIRATIME),
            (self.relatime, MsFlags::MS_RELATIME),
            (self.strictatime, MsFlags::MS_STRICTATIME),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .fold(MsFlags::empty(), |acc, (_, f)| acc | f)
    }
}

/// Bind-mount `src` onto the existing `dst`. Not recursive: mounts below `src` are not carried.
pub fn bind(src: &Path, dst: &Path) -> io::Result<()> {
    tracing::debug!(src = %src.display(), dst = %dst.display(), "bind mount");
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(|e| {
        with_context(
            e,
            format_args!("bind {} on {}", src.display(), dst.display()),
        )
    })
}

/// Bind-mount `src` onto `dst` read-only with `flags`. A bind cannot be made read-only in one
/// step, so it is remounted; if that fails the bind is undone.
pub fn bind_readonly(src: &Path, dst: &Path, flags: MountFlags) -> io::Result<()> {
    bind_and_remount(src, dst, flags.ms_flags() | MsFlags::MS_RDONLY)
}

/// Bind-mount `src` onto `dst` with `flags`, adding no read-only flag of its own (a read-only
/// source stays read-only); if applying the flags fails the bind is undone.
pub fn bind_writable(src: &Path, dst: &Path, flags: MountFlags) -> io::Result<()> {
    if flags == MountFlags::default() {
        bind(src, dst)
    } else {
        bind_and_remount(src, dst, flags.ms_flags())
    }
}

fn bind_and_remount(src: &Path, dst: &Path, add: MsFlags) -> io::Result<()> {
    bind(src, dst)?;
    // A kernel before 5.12, or a seccomp profile that refuses the newer
    // call: the remount, which needs the inherited flags read back.
    let remounted = set_attrs(dst, add).or_else(|e| {
        tracing::debug!(dst = %dst.display(), error = %e, "mount_setattr refused; remounting");
        inherited_restrictions(dst).and_then(|inherited| {
            let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | inherited | add;
            mount(None::<&str>, dst, None::<&str>, flags, None::<&str>).map_err(|e| {
                with_context(e, format_args!("remount {} with {flags:?}", dst.display()))
            })
        })
    });
    if remounted.is_err() {
        // The bind must not outlive a failed remount: it would expose the source with the
        // wrong flags.
        if let Err(e) = unmount(dst).or_else(|_| unmount_lazy(dst)) {
            tracing::warn!(dst = %dst.display(), error = %e, "could not undo bind mount");
        }
    }
    remounted
}

/// `struct mount_attr` from <linux/mount.h>.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Adds `add` to the mount at `dst` with mount_setattr(2), which changes only the attributes
/// it names: what the bind inherited stays without being read back first (a statvfs of a
/// FUSE or network filesystem is a round trip to its server, one per stage and publish on a
/// shared root).
fn set_attrs(dst: &Path, add: MsFlags) -> io::Result<()> {
    const RDONLY: u64 = 0x1;
    const NOSUID: u64 = 0x2;
    const NODEV: u64 = 0x4;
    const NOEXEC: u64 = 0x8;
    const ATIME_MASK: u64 = 0x70;
    const NOATIME: u64 = 0x10;
    const STRICTATIME: u64 = 0x20;
    const NODIRATIME: u64 = 0x80;
    let mut attr = MountAttr {
        attr_set: 0,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    for (ms, set) in [
        (MsFlags::MS_RDONLY, RDONLY),
        (MsFlags::MS_NOSUID, NOSUID),
        (MsFlags::MS_NODEV, NODEV),
        (MsFlags::MS_NOEXEC, NOEXEC),
        (MsFlags::MS_NODIRATIME, NODIRATIME),
    ] {
        if add.contains(ms) {
            attr.attr_set |= set;
        }
    }
    // The atime mode is one value under a mask: relatime is 0 within it.
    for (ms, set) in [
        (MsFlags::MS_NOATIME, NOATIME),
        (MsFlags::MS_STRICTATIME, STRICTATIME),
        (MsFlags::MS_RELATIME, 0),
    ] {
        if add.contains(ms) {
            attr.attr_clr |= ATIME_MASK;
            attr.attr_set |= set;
        }
    }
    let path = std::ffi::CString::new(dst.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a valid C string and a mount_attr of the size passed, both alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            0,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    Err(with_context(
        io::Error::last_os_error(),
        format_args!("mount_setattr {} with {add:?}", dst.display()),
    ))
}

/// The restricting flags the new bind inherited from its source. A bind remount replaces the
/// per-mount flags wholesale, so leaving these out would silently drop them (or fail with EPERM
/// where they are locked, as in a user namespace). Atime flags need no care: the kernel keeps
/// them when a remount names none.
fn inherited_restrictions(dst: &Path) -> io::Result<MsFlags> {
    let have = statvfs(dst)
        .map_err(|e| with_context(e, format_args!("statvfs {}", dst.display())))?
        .flags();
    Ok([
        (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
    ]
    .into_iter()
    .filter(|(st, _)| have.contains(*st))
    .fold(MsFlags::empty(), |acc, (_, ms)| acc | ms))
}

/// Mount the block device `dev` on `dst` as `fstype` with filesystem options `data`
/// (e.g. "norecovery,nouuid"), read-only when `readonly`. Always nosuid and nodev, like the
/// driver's bind mounts: a model filesystem holds neither setuid programs nor device files.
pub fn mount_device(
    dev: &Path,
    dst: &Path,
    fstype: &str,
    readonly: bool,
    data: &str,
) -> io::Result<()> {
    let flags = MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | if readonly {
            MsFlags::MS_RDONLY
        } else {
            MsFlags::empty()
        };
    tracing::debug!(dev = %dev.display(), dst = %dst.display(), fstype, readonly, data, "mount device");
    mount(
        Some(dev),
        dst,
        Some(fstype),
        flags,
        (!data.is_empty()).then_some(data),
    )
    .map_err(|e| {
        let mode = if readonly { "ro" } else { "rw" };
        with_context(
            e,
            format_args!(
                "mount {} on {} ({fstype}, {mode}, {data:?})",
                dev.display(),
                dst.display()
            ),
        )
    })
}

/// Mount a small tmpfs of its own on `dst` (nosuid, nodev, noexec, 0755): a filesystem root that
/// no other mount on the node shares.
pub fn mount_tmpfs(dst: &Path, size_bytes: u64) -> io::Result<()> {
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let data = format!("size={size_bytes},mode=0755");
    tracing::debug!(dst = %dst.display(), data, "mount tmpfs");
    mount(
        Some("tmpfs"),
        dst,
        Some("tmpfs"),
        flags,
        Some(data.as_str()),
    )
    .map_err(|e| with_context(e, format_args!("mount tmpfs on {}", dst.display())))
}

/// Unmount the topmost mount at `dst`. `Ok(false)` when `dst` is not a mount point or does not
/// exist, so callers can unmount until nothing is left.
pub fn unmount(dst: &Path) -> io::Result<bool> {
    unmount_with(dst, MntFlags::empty())
}

/// Detach the topmost mount at `dst` even while busy. For test cleanup only: a lazily detached
/// mount keeps its device busy for an unknown time.
pub fn unmount_lazy(dst: &Path) -> io::Result<bool> {
    unmount_with(dst, MntFlags::MNT_DETACH)
}

/// Unmounts everything at or below `dir`, deepest first, detaching lazily
/// what is busy: scratch-space teardown for the demo and the tests, never
/// for volumes. Returns the mount points removed.
pub fn sweep_under(dir: &Path) -> io::Result<Vec<std::path::PathBuf>> {
    let mut removed = Vec::new();
    // Stacked mounts need several passes; the bound stops a mount that keeps coming back.
    for _ in 0..16 {
        let table = read_table()?;
        let here: Vec<std::path::PathBuf> = mounts_under(&table, dir)
            .into_iter()
            .map(|m| m.mount_point.clone())
            .collect();
        if here.is_empty() {
            break;
        }
        for m in here {
            if unmount(&m).or_else(|_| unmount_lazy(&m))? {
                removed.push(m);
            }
        }
    }
    Ok(removed)
}

fn unmount_with(dst: &Path, flags: MntFlags) -> io::Result<bool> {
    tracing::debug!(dst = %dst.display(), ?flags, "unmount");
    match umount2(dst, flags) {
        Ok(()) => Ok(true),
        Err(Errno::EINVAL | Errno::ENOENT) => Ok(false),
        Err(Errno::EBUSY) => {
            // Logged, not answered: the answer reaches the pod's events,
            // and the processes of other pods are not a tenant's to see.
            tracing::warn!(dst = %dst.display(), holders = ?holders(dst), "unmount refused: busy");
            Err(with_context(
                Errno::EBUSY,
                format_args!("unmount {}", dst.display()),
            ))
        }
        Err(e) => Err(with_context(e, format_args!("unmount {}", dst.display()))),
    }
}

/// The processes of this mount namespace's view that keep `dir` busy:
/// a working directory, a root, an open file or a mapping under it, as
/// `pid N (comm)`, a few at most. Read only when an unmount is refused,
/// so that the refusal says who holds it.
fn holders(dir: &Path) -> Vec<String> {
    const AT_MOST: usize = 5;
    let under = |p: &Path| p.starts_with(dir);
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in procs.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let base = e.path();
        let links = ["cwd", "root"].into_iter().map(|l| base.join(l)).chain(
            std::fs::read_dir(base.join("fd"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|f| f.path()),
        );
        let mut holds = links
            .filter_map(|l| std::fs::read_link(l).ok())
            .any(|t| under(&t));
        if !holds && let Ok(maps) = std::fs::read_to_string(base.join("maps")) {
            holds = maps
                .lines()
                .filter_map(|l| l.split_once('/').map(|(_, p)| Path::new("/").join(p)))
                .any(|p| under(&p));
        }
        if holds {
            let comm = std::fs::read_to_string(base.join("comm")).unwrap_or_default();
            out.push(format!("pid {pid} ({})", comm.trim()));
            if out.len() == AT_MOST {
                break;
            }
        }
    }
    out
}

/// Whether `path` is a mount point; a missing path is not.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    lookup::is_mount_point(path)
}

/// Keep the error's kind (so callers can still tell NotFound from ReadOnlyFilesystem) and put
/// the operation and its paths in the message.
fn with_context(e: impl Into<io::Error>, what: impl Display) -> io::Error {
    let e = e.into();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;

    /// Unmounts everything stacked at its path when dropped, so a failing test leaves no mounts.
    pub struct MountGuard(pub PathBuf);

    impl Drop for MountGuard {
        fn drop(&mut self) {
            for _ in 0..16 {
                if !matches!(super::unmount_lazy(&self.0), Ok(true)) {
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::MountGuard;
    use super::*;
    use std::fs;
    use std::path::PathBuf;

    fn flags(v: &[&str]) -> Result<(MountFlags, Option<bool>), String> {
        MountFlags::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_mount_flags() {
        let (f, ro) = flags(&["ro", "nosuid", "nodev", "noatime", "nodiratime", "ro"]).unwrap();
        assert_eq!(ro, Some(true));
        assert!(f.nosuid && f.nodev && f.noatime && f.nodiratime && !f.noexec);
        assert_eq!(flags(&["rw"]).unwrap().1, Some(false));
        assert_eq!(flags(&[]).unwrap(), (MountFlags::default(), None));

        let err = flags(&["nosuid", "exec"]).unwrap_err();
        assert!(
            err.contains("\"exec\"") && err.contains(ACCEPTED_FLAGS),
            "{err}"
        );
        assert!(flags(&["ro", "rw"]).is_err());
        assert!(flags(&["noatime", "strictatime"]).is_err());
        assert!(flags(&["bind"]).is_err());
        assert!(flags(&[""]).is_err());
    }

    /// A temp dir holding `src/file` and an empty `dst`, both canonical.
    fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let base = fs::canonicalize(tmp.path()).unwrap();
        let (src, dst) = (base.join("src"), base.join("dst"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        fs::write(src.join("file"), b"model").unwrap();
        (tmp, src, dst)
    }

    /// A refused unmount finds who holds the mount: here, this process,
    /// through a file it keeps open under it.
    #[test]
    fn a_busy_unmount_says_who_holds_it() {
        let (_tmp, _src, dst) = dirs();
        mount_tmpfs(&dst, 1 << 20).unwrap();
        let _guard = MountGuard(dst.clone());
        let open = fs::File::create(dst.join("held")).unwrap();
        let e = unmount(&dst).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy, "{e}");
        let me = format!("pid {} (", std::process::id());
        let held = holders(&dst);
        assert!(held.iter().any(|h| h.starts_with(&me)), "{held:?}");
        drop(open);
        assert!(unmount(&dst).unwrap(), "free once the file is closed");
    }

    fn entry_at(path: &Path) -> MountEntry {
        mount_at(&read_table().unwrap(), path)
            .cloned()
            .unwrap_or_else(|| panic!("nothing mounted at {}", path.display()))
    }

    #[test]
    fn bind_readonly_refuses_writes() {
        let (_tmp, src, dst) = dirs();
        let wanted = MountFlags {
            nosuid: true,
            nodev: true,
            noatime: true,
            ..Default::default()
        };
        bind_readonly(&src, &dst, wanted).unwrap();
        let _guard = MountGuard(dst.clone());

        assert!(is_mount_point(&dst).unwrap());
        assert_eq!(fs::read(dst.join("file")).unwrap(), b"model");
        let err = fs::write(dst.join("file"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        fs::write(src.join("file"), b"still writable").unwrap();

        let m = entry_at(&dst);
        for o in ["ro", "nosuid", "nodev", "noatime"] {
            assert!(m.mount_options.iter().any(|x| x == o), "{o}: {m:?}");
        }
        assert!(!m.has_option("noexec"));

        assert!(unmount(&dst).unwrap());
        assert!(!unmount(&dst).unwrap());
        assert!(!is_mount_point(&dst).unwrap());
        assert!(!unmount(&dst.join("missing")).unwrap());
        assert!(!is_mount_point(&dst.join("missing")).unwrap());
    }

    #[test]
    fn binds_keep_restrictions_of_their_source() {
        let (_tmp, src, dst) = dirs();
        let restricted = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(
            Some("tmpfs"),
            &src,
            Some("tmpfs"),
            restricted,
            Some("size=1m"),
        )
        .unwrap();
        let _src_guard = MountGuard(src.clone());

        let noatime = MountFlags {
            noatime: true,
            ..Default::default()
        };
        bind_writable(&src, &dst, noatime).unwrap();
        let _guard = MountGuard(dst.clone());
        let m = entry_at(&dst);
        for o in ["rw", "nosuid", "nodev", "noexec", "noatime"] {
            assert!(m.mount_options.iter().any(|x| x == o), "{o}: {m:?}");
        }
        fs::write(dst.join("new"), b"x").unwrap();
        assert!(unmount(&dst).unwrap());

        bind_readonly(&src, &dst, MountFlags::default()).unwrap();
        let m = entry_at(&dst);
        for o in ["ro", "nosuid", "nodev", "noexec"] {
            assert!(m.mount_options.iter().any(|x| x == o), "{o}: {m:?}");
        }
    }

    #[test]
    fn plain_writable_bind_and_stacking() {
        let (_tmp, src, dst) = dirs();
        let other = src.parent().unwrap().join("other");
        fs::create_dir(&other).unwrap();

        bind_writable(&src, &dst, MountFlags::default()).unwrap();
        let _guard = MountGuard(dst.clone());
        fs::write(dst.join("file"), b"written through").unwrap();
        assert_eq!(fs::read(src.join("file")).unwrap(), b"written through");

        bind(&other, &dst).unwrap();
        let top = entry_at(&dst);
        assert!(top.root.ends_with("other"), "{top:?}");
        assert!(!dst.join("file").exists());

        assert!(unmount(&dst).unwrap());
        assert!(entry_at(&dst).root.ends_with("src"));
        assert!(unmount(&dst).unwrap());
        assert!(!is_mount_point(&dst).unwrap());
    }

    #[test]
    fn subpath_descriptor_is_a_bind_source() {
        let (_tmp, src, dst) = dirs();
        fs::create_dir_all(src.join("models/llama")).unwrap();
        fs::write(src.join("models/llama/config.json"), b"{}").unwrap();

        let fd = subpath::open_beneath(&src, "models/llama").unwrap();
        bind_readonly(&subpath::proc_path(&fd), &dst, MountFlags::default()).unwrap();
        let _guard = MountGuard(dst.clone());
        drop(fd);

        assert_eq!(fs::read(dst.join("config.json")).unwrap(), b"{}");
        assert!(entry_at(&dst).root.ends_with("models/llama"));
    }

    #[test]
    fn mount_errors_name_their_paths() {
        let (_tmp, src, dst) = dirs();
        let missing = dst.join("missing");
        let err = bind(&src, &missing).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let msg = err.to_string();
        assert!(
            msg.contains(&*src.to_string_lossy()) && msg.contains("missing"),
            "{msg}"
        );

        let err = mount_device(&src.join("file"), &dst, "xfs", true, "").unwrap_err();
        assert!(err.to_string().contains("xfs"), "{err}");
        assert!(!is_mount_point(&dst).unwrap());
    }
}
