//! What the OS cannot tell us, persisted atomically: JSON records written to a
//! temporary file, fsynced, renamed into place, and the directory fsynced.
//!
//! A reader sees either the old record or the new one, never a torn write,
//! even after `kill -9` or a power cut. Nothing here holds locks; callers do.
//!
//! On a network filesystem another client may have replaced or removed
//! what this client's cache still names: reads retry `ESTALE` until the
//! client looks the name up again, and a file another node wrote is read
//! past this client's cached pages (see docs/design.md, *Shared
//! filesystems*).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Writes `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_as(path, bytes, true)
}

/// As [`write_atomic`], without waiting for the disk: after a crash of
/// the process the file is whole or absent, but after a crash of the
/// machine it may be absent or empty. Only for a record that something
/// durable rebuilds; [`sync_file`] makes it durable later. (An fsync on a
/// disk busy writing back a model waits seconds behind it.)
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_as(path, bytes, false)
}

fn write_atomic_as(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    // Unique per writer so that two processes racing on one record never
    // share a temporary file; the last rename wins, whole.
    let tmp = dir.join(format!(".{name}.tmp-{}", uuid::Uuid::new_v4().simple()));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
        fs::rename(&tmp, path)?;
        if durable { sync_dir(dir) } else { Ok(()) }
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    write_atomic(path, &json_bytes(value)?)
}

/// As [`write_json`], not durable until [`sync_file`]: see
/// [`write_atomic_unsynced`].
pub fn write_json_unsynced<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    write_atomic_unsynced(path, &json_bytes(value)?)
}

/// A record as `write_json` writes it, for a caller that must know its
/// size before it is written.
pub fn json_bytes<T: Serialize>(value: &T) -> io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Makes a file written unsynced durable, with its name; a missing file
/// is fine (removed since, durably).
pub fn sync_file(path: &Path) -> io::Result<()> {
    match File::open(path) {
        Ok(f) => f.sync_all()?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    path.parent().map_or(Ok(()), sync_dir)
}

/// The largest record `read_json` reads. A seal lists every file of a
/// model; 64 MiB holds a few hundred thousand entries.
pub const MAX_RECORD_BYTES: u64 = 64 << 20;

/// How long a read retries `ESTALE`. A GlusterFS client answers it for
/// about its entry timeout (1 s by default) after another client replaced
/// the file; NFS clients retry once themselves and then pass it on.
pub const STALE_RETRY: Duration = Duration::from_secs(5);

/// Runs `op` again while it fails with `ESTALE`, for up to `STALE_RETRY`:
/// the name is looked up afresh once the client's cached entry expires.
/// Blocking: call it off the async runtime, as every caller here is.
pub fn retry_stale<T>(mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        match op() {
            Err(e) if is_stale(&e) && start.elapsed() < STALE_RETRY => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(400));
            }
            r => return r,
        }
    }
}

pub fn is_stale(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ESTALE)
}

/// Reads a JSON record; `Ok(None)` when it does not exist.
///
/// Records on a shared filesystem are written by other nodes, so the read
/// trusts nothing about the file: a symlink in its place is refused (never
/// followed to a host file), as is anything but a regular file (a fifo would
/// block forever, a device would never end) or one larger than
/// `MAX_RECORD_BYTES`.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    retry_stale(|| read_json_once(path))
}

fn read_json_once<T: DeserializeOwned>(path: &Path) -> io::Result<Option<T>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "is a symlink; records are regular files and links are never followed",
            ));
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "is not a regular file",
        ));
    }
    if meta.len() > MAX_RECORD_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "is {} bytes long; records are at most {MAX_RECORD_BYTES}",
                meta.len()
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // Bounded again while reading: the file may grow after the stat.
    file.take(MAX_RECORD_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("grew beyond {MAX_RECORD_BYTES} bytes while being read"),
        ));
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e}")))
}

/// Whether `path` exists as a listing of each directory from `top` down
/// shows it. A miss by name on a network filesystem may come from the
/// client's cache of "no such file" (NFS's lookup cache, GlusterFS's
/// negative-timeout); a listing reaches the server, and on a FUSE client
/// it also replaces the cached miss, so a lookup after it sees the file.
/// A readdir per level: for misses that must not be stale, not for every
/// read. A name starting with `.` (a temporary file here) is never found.
pub fn listed(path: &Path, top: &Path) -> io::Result<bool> {
    let Ok(rel) = path.strip_prefix(top) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not below {}", path.display(), top.display()),
        ));
    };
    let mut dir = top.to_path_buf();
    for part in rel.components() {
        let name = part.as_os_str().to_string_lossy();
        if !list_names(&dir)?.iter().any(|n| *n == name) {
            return Ok(false);
        }
        dir.push(part);
    }
    Ok(true)
}

/// Drops this client's cached pages of `f`, so that what is read next
/// comes from the filesystem. A network filesystem's client may keep pages
/// of a file that another node has since changed: a GlusterFS client that
/// made an XFS image kept the empty filesystem's pages after another
/// node's writer filled the image, and a loop device over it showed them
/// (a seal of nothing). Only clean pages go; best effort.
pub fn forget_cached_pages(f: &File) {
    use std::os::fd::AsRawFd;
    if on_local_disk(f) {
        // One page cache sees every write: nothing there can be stale,
        // and dropping it would only make pods read from the disk again.
        return;
    }
    // SAFETY: plain advice on an fd we hold open for the whole call.
    let _ = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// Whether `f` is on a filesystem only this kernel writes (so its page
/// cache is the truth); an unknown filesystem counts as shared.
fn on_local_disk(f: &File) -> bool {
    use nix::sys::statfs::{
        BTRFS_SUPER_MAGIC, EXT4_SUPER_MAGIC, OVERLAYFS_SUPER_MAGIC, TMPFS_MAGIC, XFS_SUPER_MAGIC,
        fstatfs,
    };
    fstatfs(f).is_ok_and(|st| {
        [
            EXT4_SUPER_MAGIC,
            XFS_SUPER_MAGIC,
            BTRFS_SUPER_MAGIC,
            TMPFS_MAGIC,
            OVERLAYFS_SUPER_MAGIC,
        ]
        .contains(&st.filesystem_type())
    })
}

/// Creates an empty marker file durably; `Ok(false)` if it already existed.
pub fn create_marker(path: &Path, content: &[u8]) -> io::Result<bool> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    fs::create_dir_all(dir)?;
    create_marker_in(path, content)
}

/// As [`create_marker`], in a directory that must exist already: NotFound
/// if it does not (it is never made).
pub fn create_marker_in(path: &Path, content: &[u8]) -> io::Result<bool> {
    create_marker_as(path, content, true)
}

/// As [`create_marker_in`], not durable until [`sync_file`]: see
/// [`write_atomic_unsynced`].
pub fn create_marker_unsynced(path: &Path, content: &[u8]) -> io::Result<bool> {
    create_marker_as(path, content, false)
}

fn create_marker_as(path: &Path, content: &[u8], durable: bool) -> io::Result<bool> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))?;
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(mut f) => {
            f.write_all(content)?;
            if durable {
                f.sync_all()?;
                sync_dir(dir)?;
            }
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes a file durably; a missing file is fine.
pub fn remove_file(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => path.parent().map_or(Ok(()), sync_dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Names of the entries of `dir`, sorted, skipping our temporary files;
/// a missing directory is empty. A listing reaches the server of a
/// network filesystem (where a lookup by name may be answered from the
/// client's cache), so it is how another node's new files are looked for
/// when a stale answer would break a fence.
pub fn list_names(dir: &Path) -> io::Result<Vec<String>> {
    retry_stale(|| list_names_once(dir))
}

fn list_names_once(dir: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    match fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries {
                let name = entry?.file_name().to_string_lossy().into_owned();
                if !name.starts_with('.') {
                    names.push(name);
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b.json");
        assert_eq!(read_json::<Vec<u32>>(&p).unwrap(), None);
        write_json(&p, &vec![1u32, 2]).unwrap();
        write_json(&p, &vec![3u32]).unwrap();
        assert_eq!(read_json::<Vec<u32>>(&p).unwrap(), Some(vec![3]));
        // No temporary files are left behind.
        assert_eq!(list_names(&dir.path().join("a")).unwrap(), vec!["b.json"]);
        assert_eq!(fs::read_dir(dir.path().join("a")).unwrap().count(), 1);
    }

    #[test]
    fn read_json_follows_no_link_and_reads_only_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real.json");
        write_json(&target, &vec![7u32]).unwrap();
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = read_json::<Vec<u32>>(&link).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
        let fifo = dir.path().join("fifo.json");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = read_json::<Vec<u32>>(&fifo).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let big = dir.path().join("big.json");
        File::create(&big)
            .unwrap()
            .set_len(MAX_RECORD_BYTES + 1)
            .unwrap();
        let err = read_json::<Vec<u32>>(&big).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }

    #[test]
    fn marker_is_created_once() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m");
        assert!(create_marker(&p, b"x").unwrap());
        assert!(!create_marker(&p, b"y").unwrap());
        remove_file(&p).unwrap();
        remove_file(&p).unwrap();
    }
}
