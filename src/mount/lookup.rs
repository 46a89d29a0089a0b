//! The mount at one path, asked of the kernel for that path alone, so a
//! call's cost does not grow with the node's mount table.
//!
//! Reading `/proc/self/mountinfo` makes the kernel print every mount of the
//! namespace: with 5,000 mounts (a busy node: each pod brings its secrets,
//! tokens and volumes) that is tens of milliseconds per look, and a publish
//! looked twice. Instead `statx` says whether a path is the root of a mount
//! (Linux 5.8) and `statmount` describes that one mount (Linux 6.8; its
//! source 6.13). On kernels without them, or when the kernel's answer does
//! not line up with the path, the table is read as before: the answer is the
//! same, only slower.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::mountinfo::{self, MountEntry};

/// What `statx` says about a path's place among mounts.
enum Place {
    /// Nothing is there.
    Missing,
    /// The path is not the root of any mount.
    NotMountRoot,
    /// The root of the mount with this unique id (0 when the kernel gives
    /// none).
    MountRoot(u64),
    /// The kernel cannot tell (before Linux 5.8).
    Unknown,
}

fn place(path: &Path) -> io::Result<Place> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: `statx` writes at most one `struct statx` into `buf`, which
    // lives for the call; `c` is a NUL-terminated path.
    let mut buf: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_NO_AUTOMOUNT | libc::AT_STATX_SYNC_AS_STAT,
            libc::STATX_MNT_ID_UNIQUE,
            &mut buf,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(Place::Missing),
            Some(libc::ENOSYS) => Ok(Place::Unknown),
            _ => Err(io::Error::new(
                e.kind(),
                format!("statx {}: {e}", path.display()),
            )),
        };
    }
    let bit = libc::STATX_ATTR_MOUNT_ROOT as u64;
    if buf.stx_attributes_mask & bit == 0 {
        return Ok(Place::Unknown);
    }
    if buf.stx_attributes & bit == 0 {
        return Ok(Place::NotMountRoot);
    }
    let unique = if buf.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0 {
        buf.stx_mnt_id
    } else {
        0
    };
    Ok(Place::MountRoot(unique))
}

/// Whether `path` is a mount point; a missing path is not.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    match place(path)? {
        Place::Missing => Ok(false),
        Place::NotMountRoot => Ok(false),
        Place::MountRoot(_) => Ok(true),
        Place::Unknown => Ok(from_table(path)?.is_some()),
    }
}

/// The topmost mount at `path`, as the mount table would list it; `None`
/// when nothing is mounted there or the path is missing.
pub fn entry_at(path: &Path) -> io::Result<Option<MountEntry>> {
    match place(path)? {
        Place::Missing | Place::NotMountRoot => Ok(None),
        Place::Unknown | Place::MountRoot(0) => from_table(path),
        Place::MountRoot(id) => {
            let canonical = canonical(path)?;
            match statmount::describe(id) {
                // A path can be the root of a mount it was not mounted on
                // (a bind of a mount's root seen through another path); the
                // table decides those.
                Some(e) if Some(&e.mount_point) == canonical.as_ref() => Ok(Some(e)),
                _ => from_table(path),
            }
        }
    }
}

fn canonical(path: &Path) -> io::Result<Option<PathBuf>> {
    match std::fs::canonicalize(path) {
        Ok(p) => Ok(Some(p)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("resolve {}: {e}", path.display()),
        )),
    }
}

/// The slow, always-available answer: the whole table.
fn from_table(path: &Path) -> io::Result<Option<MountEntry>> {
    in_table(path, mountinfo::read_table)
}

/// The topmost mount at `path` in the table `table` gives, read only if
/// the path exists.
pub(super) fn in_table(
    path: &Path,
    table: impl FnOnce() -> io::Result<Vec<MountEntry>>,
) -> io::Result<Option<MountEntry>> {
    let Some(canonical) = canonical(path)? else {
        return Ok(None);
    };
    Ok(mountinfo::mount_at(&table()?, &canonical).cloned())
}

/// Whether this kernel's `statmount` can describe a mount as fully as the
/// table does (Linux 6.13: the source and the fuse subtype), found out once
/// by asking it about `/`, whose source is never empty.
fn statmount_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| match place(Path::new("/")) {
        Ok(Place::MountRoot(id)) if id != 0 => statmount::query(id)
            .is_ok_and(|r| r.is_some_and(|(mask, _)| mask & statmount::SB_SOURCE != 0)),
        _ => false,
    })
}

/// Whether lookups here are answered without reading the whole table.
pub fn per_mount_lookups() -> bool {
    statmount_usable()
}

/// `statmount(2)`, which no crate we use wraps yet; the layout is the
/// kernel's ABI (include/uapi/linux/mount.h), which only ever grows.
mod statmount {
    use super::*;

    // Syscalls added after 5.1 share one number on every architecture; the
    // 32-bit ones are left to the table.
    const SYS_STATMOUNT: Option<libc::c_long> = if cfg!(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "powerpc64",
        target_arch = "s390x",
        target_arch = "loongarch64"
    )) {
        Some(457)
    } else {
        None
    };

    const SB_BASIC: u64 = 0x1;
    const MNT_BASIC: u64 = 0x2;
    const MNT_ROOT: u64 = 0x8;
    const MNT_POINT: u64 = 0x10;
    const FS_TYPE: u64 = 0x20;
    const MNT_OPTS: u64 = 0x80;
    const FS_SUBTYPE: u64 = 0x100;
    pub(super) const SB_SOURCE: u64 = 0x200;
    /// Always answered for a live mount.
    const BASIC: u64 = SB_BASIC | MNT_BASIC | MNT_ROOT | MNT_POINT | FS_TYPE;
    /// Left out of the answer's mask when empty.
    const WANTED: u64 = BASIC | MNT_OPTS | FS_SUBTYPE | SB_SOURCE;

    const SB_RDONLY: u32 = 0x1;
    const SB_SYNCHRONOUS: u32 = 0x10;
    const SB_DIRSYNC: u32 = 0x80;
    const SB_LAZYTIME: u32 = 0x0200_0000;

    const ATTR_RDONLY: u64 = 0x1;
    const ATTR_NOSUID: u64 = 0x2;
    const ATTR_NODEV: u64 = 0x4;
    const ATTR_NOEXEC: u64 = 0x8;
    const ATTR_ATIME: u64 = 0x70;
    const ATTR_NOATIME: u64 = 0x10;
    const ATTR_STRICTATIME: u64 = 0x20;
    const ATTR_NODIRATIME: u64 = 0x80;
    const ATTR_NOSYMFOLLOW: u64 = 0x0020_0000;

    /// `struct mnt_id_req`, version 0.
    #[repr(C)]
    struct Request {
        size: u32,
        spare: u32,
        mnt_id: u64,
        param: u64,
    }

    /// Offsets into `struct statmount`; strings follow the 512-byte header.
    const HEADER: usize = 512;

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_ne_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_ne_bytes(b[off..off + 8].try_into().unwrap())
    }
    /// The NUL-terminated string at `off` into the string area.
    fn str_at(b: &[u8], off: u32) -> Option<&[u8]> {
        let s = b.get(HEADER + off as usize..)?;
        Some(&s[..s.iter().position(|&c| c == 0)?])
    }

    /// The mount with unique id `id`, as a mount table line; `None` when
    /// the kernel cannot say all of it or the mount is gone (then the
    /// caller reads the table).
    pub(super) fn describe(id: u64) -> Option<MountEntry> {
        if !statmount_usable() {
            return None;
        }
        let (_, b) = query(id).ok()??;
        entry(&b)
    }

    /// The mask of what the kernel answered and its answer; `Ok(None)`
    /// when the mount is gone, `Err(())` when this kernel has no statmount.
    pub(super) fn query(id: u64) -> Result<Option<(u64, Vec<u8>)>, ()> {
        let req = Request {
            size: std::mem::size_of::<Request>() as u32,
            spare: 0,
            mnt_id: id,
            param: WANTED,
        };
        let nr = SYS_STATMOUNT.ok_or(())?;
        let mut buf = vec![0u8; 4096];
        loop {
            // SAFETY: the kernel writes at most `buf.len()` bytes into
            // `buf` and reads one `Request`; both outlive the call.
            let rc = unsafe {
                libc::syscall(
                    nr,
                    &req as *const Request,
                    buf.as_mut_ptr(),
                    buf.len(),
                    0u32,
                )
            };
            if rc == 0 {
                break;
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EOVERFLOW) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
                Some(libc::ENOENT) => return Ok(None),
                _ => return Err(()),
            }
        }
        Ok(Some((u64_at(&buf, 8), buf)))
    }

    /// The answer in mountinfo's terms, options in mountinfo's order.
    fn entry(b: &[u8]) -> Option<MountEntry> {
        let mask = u64_at(b, 8);
        if mask & BASIC != BASIC {
            return None;
        }
        let field = |bit: u64, off: usize| match mask & bit {
            0 => Some(&[][..]),
            _ => str_at(b, u32_at(b, off)),
        };
        let path = |off| {
            Some(PathBuf::from(std::ffi::OsString::from_vec(
                str_at(b, u32_at(b, off))?.to_vec(),
            )))
        };
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let (sb_flags, attr) = (u32_at(b, 32), u64_at(b, 64));
        let on = |bit: u64, name: &'static str| (attr & bit != 0).then_some(name);
        let mount_options = [
            Some(if attr & ATTR_RDONLY != 0 { "ro" } else { "rw" }),
            on(ATTR_NOSUID, "nosuid"),
            on(ATTR_NODEV, "nodev"),
            on(ATTR_NOEXEC, "noexec"),
            (attr & ATTR_ATIME == ATTR_NOATIME).then_some("noatime"),
            on(ATTR_NODIRATIME, "nodiratime"),
            // MOUNT_ATTR_RELATIME is zero: neither of the others.
            (attr & ATTR_ATIME & (ATTR_NOATIME | ATTR_STRICTATIME) == 0).then_some("relatime"),
            on(ATTR_NOSYMFOLLOW, "nosymfollow"),
        ];
        let sb = |bit: u32, name: &'static str| (sb_flags & bit != 0).then_some(name);
        let mut super_options: Vec<String> = [
            Some(if sb_flags & SB_RDONLY != 0 {
                "ro"
            } else {
                "rw"
            }),
            sb(SB_SYNCHRONOUS, "sync"),
            sb(SB_DIRSYNC, "dirsync"),
            sb(SB_LAZYTIME, "lazytime"),
        ]
        .into_iter()
        .flatten()
        .map(String::from)
        .collect();
        super_options.extend(mountinfo::options(field(MNT_OPTS, 4)?));
        // mountinfo names a fuse filesystem with its subtype: "fuse.glusterfs".
        let mut fs_type = text(field(FS_TYPE, 36)?);
        let subtype = field(FS_SUBTYPE, 120)?;
        if !subtype.is_empty() {
            fs_type = format!("{fs_type}.{}", text(subtype));
        }
        let source = match field(SB_SOURCE, 124)? {
            [] => "none".to_string(),
            s => text(s),
        };
        Some(MountEntry {
            mount_id: u32_at(b, 56),
            parent_id: u32_at(b, 60),
            major: u32_at(b, 16),
            minor: u32_at(b, 20),
            root: path(104)?,
            mount_point: path(108)?,
            mount_options: mount_options
                .into_iter()
                .flatten()
                .map(String::from)
                .collect(),
            fs_type,
            source,
            super_options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::testing::MountGuard;
    use crate::mount::{MountFlags, bind_readonly, mount_tmpfs};

    /// Every lookup here answers what the table does, for mounts of several
    /// kinds and for paths that are not mounts.
    #[test]
    fn agrees_with_the_table() {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let (t, sub, dst) = (base.join("t"), base.join("t/sub dir"), base.join("dst"));
        std::fs::create_dir_all(&t).unwrap();
        mount_tmpfs(&t, 1 << 20).unwrap();
        let _t = MountGuard(t.clone());
        std::fs::create_dir(&sub).unwrap();
        std::fs::create_dir(&dst).unwrap();
        let flags = MountFlags {
            nosuid: true,
            nodev: true,
            noatime: true,
            ..Default::default()
        };
        bind_readonly(&sub, &dst, flags).unwrap();
        let _dst = MountGuard(dst.clone());
        let table = mountinfo::read_table().unwrap();
        for p in [
            Path::new("/"),
            Path::new("/proc"),
            &t,
            &dst,
            &sub,
            &base,
            &base.join("missing"),
        ] {
            let want = mountinfo::mount_at(&table, p).cloned();
            let mut got = entry_at(p).unwrap();
            if let (Some(g), Some(w)) = (&mut got, &want) {
                // Propagation and unknown attributes aside, the kernel's two
                // answers list the same options in the same order.
                g.mount_options.retain(|o| w.mount_options.contains(o));
            }
            assert_eq!(got, want, "{}", p.display());
            assert_eq!(
                is_mount_point(p).unwrap(),
                want.is_some(),
                "{}",
                p.display()
            );
        }
        let e = entry_at(&dst).unwrap().unwrap();
        assert_eq!(e.root, Path::new("/sub dir"));
        assert!(e.is_readonly() && e.has_option("nosuid") && e.has_option("noatime"));
        // From 6.8 on the answers above came from statmount, not a fallback
        // to the table.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release
            .split(['.', '-'])
            .map(|n| n.parse::<u32>().unwrap_or(0));
        if (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 8) {
            assert!(per_mount_lookups(), "kernel {release}: statmount unused");
        }
    }
}
