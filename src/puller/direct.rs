//! Writing pulled bytes past the page cache.
//!
//! A pull writes each byte once and never reads it again on this path:
//! hashing happens from memory (see the engine's `Frontier`). Going through
//! the page cache would only cost a kernel copy per byte plus writeback, and
//! on a node it would evict pages that serving pods read. So whole blocks
//! are written with O_DIRECT from [`Window`]s, buffers whose bytes start on
//! a block boundary, as O_DIRECT requires. What O_DIRECT cannot take (a
//! file's last partial block, a filesystem that refuses it, such as tmpfs)
//! is written through the page cache; fdatasync covers both.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::warn;

use crate::error::{IoContext, Result};

/// Offset, length and address alignment of O_DIRECT transfers: the largest
/// logical block size in common use.
pub const ALIGN: usize = 4096;

/// A `.part` file: a buffered descriptor, plus an O_DIRECT one where the
/// filesystem accepts it.
pub struct PartFile {
    file: File,
    direct: Option<File>,
    /// Cleared when the filesystem refuses an O_DIRECT transfer.
    direct_ok: AtomicBool,
}

impl std::ops::Deref for PartFile {
    type Target = File;
    fn deref(&self) -> &File {
        &self.file
    }
}

impl PartFile {
    pub fn open(path: &Path, truncate: bool, direct: bool) -> Result<PartFile> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(truncate)
            .read(true)
            .write(true)
            .open(path)
            .ctx("open", path)?;
        // Refused at open by some filesystems: then every write is buffered.
        let direct = direct
            .then(|| {
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .ok()
            })
            .flatten();
        Ok(PartFile {
            direct_ok: AtomicBool::new(direct.is_some()),
            file,
            direct,
        })
    }

    /// Sizes the file and reserves its blocks, so a disk too small fails
    /// here, before any byte is fetched, and ext4 can take direct writes
    /// into allocated blocks under a shared inode lock (writes into holes
    /// would serialize every connection of the file).
    pub fn reserve(&self, size: u64, part: &Path) -> Result<()> {
        if size > 0 {
            match nix::fcntl::fallocate(
                &self.file,
                nix::fcntl::FallocateFlags::empty(),
                0,
                size as libc::off_t,
            ) {
                Ok(()) => {}
                // Not every filesystem can preallocate; writes still work.
                Err(nix::errno::Errno::EOPNOTSUPP) => {}
                Err(e) => return Err(std::io::Error::from(e)).ctx("reserve space for", part),
            }
        }
        self.file.set_len(size).ctx("size", part)
    }

    fn direct_at(&self, at: u64) -> Option<&File> {
        if !at.is_multiple_of(ALIGN as u64) || !self.direct_ok.load(Ordering::Relaxed) {
            return None;
        }
        self.direct.as_ref()
    }

    /// True, and O_DIRECT off from now on, when the error is a refusal.
    fn refused(&self, e: &std::io::Error) -> bool {
        let refused = e.raw_os_error() == Some(libc::EINVAL);
        if refused && self.direct_ok.swap(false, Ordering::Relaxed) {
            warn!(error = %e, "O_DIRECT refused; writing through the page cache");
        }
        refused
    }

    /// Writes `w` at `at`: its whole blocks with O_DIRECT where possible,
    /// the rest buffered.
    pub fn write_window(&self, w: &Window, at: u64, part: &Path) -> Result<()> {
        let data = w.data();
        let mut done = 0;
        if let Some(d) = self.direct_at(at) {
            let n = data.len() / ALIGN * ALIGN;
            match d.write_all_at(&data[..n], at) {
                Ok(()) => done = n,
                Err(e) if self.refused(&e) => {}
                Err(e) => return Err(e).ctx("write", part),
            }
        }
        self.file
            .write_all_at(&data[done..], at + done as u64)
            .ctx("write", part)
    }
}

/// A reusable write buffer whose bytes start on an [`ALIGN`] boundary.
pub struct Window {
    buf: Vec<u8>,
    start: usize,
    cap: usize,
    len: usize,
}

impl Window {
    /// `cap` is rounded up to whole blocks.
    pub fn new(cap: usize) -> Window {
        let cap = cap.max(1).div_ceil(ALIGN) * ALIGN;
        let buf = vec![0u8; cap + ALIGN];
        let start = buf.as_ptr().align_offset(ALIGN);
        Window {
            buf,
            start,
            cap,
            len: 0,
        }
    }

    /// A window with no room, allocating nothing: a placeholder while the
    /// real one is away being written.
    pub fn empty() -> Window {
        Window {
            buf: Vec::new(),
            start: 0,
            cap: 0,
            len: 0,
        }
    }

    /// Copies in what fits; returns the rest.
    pub fn fill<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let n = (self.cap - self.len).min(data.len());
        let at = self.start + self.len;
        self.buf[at..at + n].copy_from_slice(&data[..n]);
        self.len += n;
        &data[n..]
    }

    pub fn is_full(&self) -> bool {
        self.len == self.cap
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole blocks go through O_DIRECT where the filesystem takes it, the
    /// last partial block and unaligned offsets through the page cache; the
    /// file holds exactly what was written either way.
    #[test]
    fn a_part_file_takes_whole_and_partial_blocks() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f.part");
        let size = 3 * ALIGN + 123;
        let data: Vec<u8> = (0..size as u32).map(|i| (i * 31 + i / 7) as u8).collect();
        let out = PartFile::open(&path, true, true).unwrap();
        out.reserve(size as u64, &path).unwrap();
        let window = |bytes: &[u8]| {
            let mut w = Window::new(bytes.len());
            assert!(w.fill(bytes).is_empty());
            w
        };
        out.write_window(&window(&data[ALIGN..3 * ALIGN + 123]), ALIGN as u64, &path)
            .unwrap();
        out.write_window(&window(&data[..100]), 0, &path).unwrap();
        out.write_window(&window(&data[100..ALIGN]), 100, &path)
            .unwrap();
        out.sync_data().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), data);
        // On ext4 and XFS the aligned part must really have gone direct: a
        // silent fallback (a misaligned buffer, say) would pass the above.
        let fs = nix::sys::statfs::statfs(t.path())
            .unwrap()
            .filesystem_type();
        if [
            nix::sys::statfs::EXT4_SUPER_MAGIC,
            nix::sys::statfs::XFS_SUPER_MAGIC,
        ]
        .contains(&fs)
        {
            assert!(out.direct.is_some() && out.direct_ok.load(Ordering::Relaxed));
        }
    }

    #[test]
    fn windows_are_aligned_and_fill_to_capacity() {
        let mut w = Window::new(ALIGN + 1);
        assert_eq!(w.data().as_ptr() as usize % ALIGN, 0);
        let bytes = vec![7u8; 3 * ALIGN];
        let rest = w.fill(&bytes);
        assert_eq!(rest.len(), ALIGN);
        assert!(w.is_full());
        w.clear();
        assert!(w.is_empty());
    }
}
