//! Unpacks one OCI layer (a tar, plain, gzip or zstd) into a model
//! directory, hashing every regular file while it is written.
//!
//! A layer comes from a registry we do not trust, so nothing in it may
//! write, link or point outside `dest`, create a device or fifo, or keep a
//! setuid, setgid or sticky bit. Every entry is reached by walking its
//! parent directories one component at a time from a directory fd with
//! `O_NOFOLLOW`, so a symlink made by an earlier entry (or layer) is never
//! followed by a later one. Refusals are `FailedPrecondition` naming the
//! entry; the caller discards its work directory, since part of the layer
//! may already be on disk.
//!
//! OCI whiteouts are applied for multi-layer images: `.wh.<name>` removes
//! `<name>` and `.wh..wh..opq` empties its directory, both only of what
//! earlier layers left (the image spec never lets a whiteout hide an entry
//! of its own layer). Layers must therefore be extracted in manifest order,
//! one after the other, into the same `dest`; `merge` then combines their
//! file lists.

use std::cell::Cell;
use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path};
use std::rc::Rc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, linkat, symlinkat, unlinkat};
use tar::EntryType;

use crate::cache::manifest::FileEntry;
use crate::error::{Error, IoContext, Result};
use crate::puller::source::Compression;

/// What one layer may still write: what is left of the model's byte and
/// file limits (and of the cache's room) after the files and layers
/// before it.
#[derive(Debug)]
pub struct Budget {
    /// Bytes of regular files the layer may write.
    pub bytes: u64,
    /// What `bytes` comes from, for the error: the flag or parameter, or
    /// the cache's free space.
    pub bytes_limit: String,
    /// Tar entries the layer may hold (files, directories, links, whiteouts).
    pub entries: u64,
    pub entries_limit: String,
    /// What the model's seal would take, across every layer unpacked with
    /// this budget: a layer is refused once it outgrows the bound.
    pub seal: std::sync::Mutex<crate::cache::manifest::SealMeter>,
}

impl Budget {
    /// No limit but the filesystem's (tests, and callers that check elsewhere).
    pub fn unlimited() -> Budget {
        Budget {
            bytes: u64::MAX,
            bytes_limit: "no limit".into(),
            entries: u64::MAX,
            entries_limit: "no limit".into(),
            seal: Default::default(),
        }
    }
}

/// Tar metadata read between two entries: GNU long names and links, PAX
/// extended headers, and whatever data a non-file entry carries. The tar
/// crate buffers extension headers whole; this is what it may buffer.
pub const MAX_TAR_METADATA: u64 = 1 << 20;

/// Counts what the tar parser reads from the decompressed layer, and
/// refuses to feed it more than [`MAX_TAR_METADATA`] while it is looking
/// for the next entry (so a 1 GiB PAX header is never buffered).
struct Meter {
    read: Cell<u64>,
    /// Set while the parser looks for the next entry: `read` at that time.
    between_entries: Cell<Option<u64>>,
    tripped: Cell<bool>,
}

struct Metered<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let m = &self.meter;
        let mut want = buf.len();
        if let Some(start) = m.between_entries.get() {
            let used = m.read.get().saturating_sub(start);
            let room = MAX_TAR_METADATA.saturating_sub(used);
            if room == 0 && !buf.is_empty() {
                m.tripped.set(true);
                return Err(io::Error::other("tar metadata over the limit"));
            }
            want = want.min(usize::try_from(room).unwrap_or(usize::MAX));
        }
        let n = self.inner.read(&mut buf[..want])?;
        m.read.set(m.read.get().saturating_add(n as u64));
        Ok(n)
    }
}

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

/// Unpacks the tar layer `blob` into `dest` (created if missing) and returns
/// every regular file it wrote, with size and sha256, paths relative to
/// `dest` and '/'-separated, sorted. Blocking: run it in `spawn_blocking`.
///
/// Bounded whatever the layer holds: its files may write at most
/// `budget.bytes` (a gzip or zstd bomb stops there, `ResourceExhausted`),
/// it may hold at most `budget.entries` entries, and extension headers
/// are read up to [`MAX_TAR_METADATA`] (`SourceFault` beyond).
///
/// Modes are reduced to 0755 (directories, executables) or 0644; ownership
/// and times are not restored. Files are fsynced; directories are not (the
/// caller syncs when it renames the finished tree into place).
pub fn extract(
    blob: &Path,
    compression: Compression,
    dest: &Path,
    budget: &Budget,
) -> Result<Vec<FileEntry>> {
    let file = File::open(blob).ctx("open layer", blob)?;
    let reader = BufReader::with_capacity(1 << 20, file);
    let reader: Box<dyn Read> = match compression {
        Compression::None => Box::new(reader),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(reader)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(reader).ctx("start zstd decoder for", blob)?,
        ),
    };
    fs::create_dir_all(dest).ctx("create", dest)?;
    let root = openat(
        nix::fcntl::AT_FDCWD,
        dest,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io("open", dest, e.into()))?;
    let meter = Rc::new(Meter {
        read: Cell::new(0),
        between_entries: Cell::new(None),
        tripped: Cell::new(false),
    });
    let reader = Metered {
        inner: reader,
        meter: meter.clone(),
    };
    let mut layer = Layer {
        blob,
        dest,
        root,
        files: BTreeMap::new(),
        touched: HashSet::new(),
        buf: vec![0; 1 << 20],
        written: 0,
        budget,
    };
    let bad_archive = |e: io::Error| {
        Error::Precondition(format!(
            "layer {} is not a valid tar archive ({compression:?} compression): {e}",
            blob.display()
        ))
    };
    let mut archive = tar::Archive::new(reader);
    let mut entries = archive.entries().map_err(bad_archive)?;
    let mut count = 0u64;
    loop {
        meter.between_entries.set(Some(meter.read.get()));
        let next = entries.next();
        meter.between_entries.set(None);
        let entry = match next {
            None => break,
            Some(Ok(e)) => e,
            Some(Err(_)) if meter.tripped.get() => {
                return Err(Error::SourceFault(format!(
                    "layer {} has more than {MAX_TAR_METADATA} bytes of tar metadata (GNU long \
                     names, PAX headers, or data of a non-file entry) after entry #{count}",
                    blob.display()
                )));
            }
            Some(Err(e)) => return Err(bad_archive(e)),
        };
        count += 1;
        if count > budget.entries {
            return Err(Error::OverLimit(format!(
                "layer {} holds more than {} entries ({})",
                blob.display(),
                budget.entries,
                budget.entries_limit
            )));
        }
        layer.apply(entry)?;
    }
    Ok(layer.files.into_values().collect())
}

/// Combines the file lists of layers extracted in order into the same
/// `dest`: a later layer's entry replaces an earlier one at the same path,
/// and files a later layer removed (whiteouts, or replaced by a directory
/// or symlink) are dropped. Sorted by path.
pub fn merge(dest: &Path, layers: Vec<Vec<FileEntry>>) -> Result<Vec<FileEntry>> {
    let mut files = BTreeMap::new();
    for layer in layers {
        for f in layer {
            files.insert(f.path.clone(), f);
        }
    }
    let mut kept = Vec::with_capacity(files.len());
    for (path, f) in files {
        let abs = dest.join(&path);
        match fs::symlink_metadata(&abs) {
            Ok(m) if m.is_file() => kept.push(f),
            Ok(_) => {}
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENOTDIR) => {}
            Err(e) => return Err(Error::io("stat", &abs, e)),
        }
    }
    Ok(kept)
}

/// The state of one layer's extraction.
struct Layer<'a> {
    blob: &'a Path,
    dest: &'a Path,
    root: OwnedFd,
    /// Regular files written by this layer, by relative path.
    files: BTreeMap<String, FileEntry>,
    /// Every path this layer created, and every ancestor of one: what its
    /// own whiteouts must leave alone.
    touched: HashSet<String>,
    buf: Vec<u8>,
    /// Bytes of regular files written so far.
    written: u64,
    budget: &'a Budget,
}

fn refuse(name: &str, why: impl std::fmt::Display) -> Error {
    Error::Precondition(format!("layer entry {name:?} {why}; refused"))
}

/// Splits an entry name into its components, refusing absolute names,
/// '..' and names that are not UTF-8. `.` and empty components are dropped.
fn components(name: &str) -> Result<Vec<String>> {
    if name.starts_with('/') {
        return Err(refuse(name, "is an absolute path"));
    }
    let mut out = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(refuse(name, "has a '..' component")),
            c if c.chars().any(char::is_control) => {
                return Err(refuse(name, "has a control character in its name"));
            }
            c => out.push(c.to_string()),
        }
    }
    Ok(out)
}

/// Whether a symlink at `link` (components relative to dest) pointing at
/// `target` stays inside dest. Stricter than a lexical check: '..' may only
/// lead the target, because after a directory name that is itself a symlink
/// the kernel resolves '..' from wherever that symlink pointed.
fn link_target_ok(link: &[String], target: &str) -> std::result::Result<(), &'static str> {
    if target.is_empty() {
        return Err("is a symlink with an empty target");
    }
    let target = Path::new(target);
    if target.is_absolute() {
        return Err("is a symlink to an absolute path, which would point outside the model");
    }
    // The link's own directory is `link.len() - 1` levels below dest.
    let mut depth = link.len() as i64 - 1;
    let mut seen_name = false;
    for c in target.components() {
        match c {
            Component::ParentDir if seen_name => {
                return Err("is a symlink whose target has '..' after a directory name");
            }
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => seen_name = true,
            _ => {}
        }
        if depth < 0 {
            return Err("is a symlink whose target climbs outside the model");
        }
    }
    Ok(())
}

/// 0755 for directories and anything executable, 0644 otherwise: never a
/// setuid, setgid or sticky bit, never group or world write.
fn file_mode(tar_mode: u32) -> u32 {
    if tar_mode & 0o111 != 0 { 0o755 } else { 0o644 }
}

const DIR_MODE: u32 = 0o755;

impl Layer<'_> {
    fn apply<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<()> {
        let name = String::from_utf8(entry.path_bytes().into_owned()).map_err(|e| {
            refuse(
                &String::from_utf8_lossy(e.as_bytes()),
                "has a name that is not UTF-8",
            )
        })?;
        let kind = entry.header().entry_type();
        // Extension headers the tar crate did not fold into the next entry.
        if matches!(
            kind,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            return Ok(());
        }
        let comps = components(&name)?;
        if let Some(base) = comps.last()
            && base.starts_with(WHITEOUT_PREFIX)
        {
            return self.whiteout(&name, &comps);
        }
        let path = comps.join("/");
        match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let size = entry.header().size().unwrap_or(0);
                self.meter(|m| m.file(&path, size))?;
                let mode = entry.header().mode().unwrap_or(0o644);
                self.write_file(&name, &comps, &mut entry, file_mode(mode))
            }
            EntryType::Directory => {
                self.meter(|m| m.dir(&path))?;
                self.make_dir(&name, &comps)
            }
            EntryType::Symlink => {
                let target = self.link_name(&name, &entry)?;
                self.meter(|m| m.link(&path, &target))?;
                self.make_symlink(&name, &comps, &target)
            }
            EntryType::Link => {
                let target = self.link_name(&name, &entry)?;
                self.meter(|m| m.file(&path, 0))?;
                self.make_hardlink(&name, &comps, &target)
            }
            EntryType::Char | EntryType::Block => Err(refuse(&name, "is a device file")),
            EntryType::Fifo => Err(refuse(&name, "is a fifo")),
            other => Err(refuse(
                &name,
                format_args!("has unsupported type {other:?}"),
            )),
        }
    }

    /// Counts an entry toward the model's seal; refused once the seal
    /// would outgrow its bound, before the entry is written.
    fn meter(&self, count: impl FnOnce(&mut crate::cache::manifest::SealMeter)) -> Result<()> {
        let mut seal = self.budget.seal.lock().unwrap_or_else(|p| p.into_inner());
        count(&mut seal);
        if seal.over() {
            return Err(Error::OverLimit(
                seal.refusal(&format!("layer {}", self.blob.display())),
            ));
        }
        Ok(())
    }

    fn link_name<R: Read>(&self, name: &str, entry: &tar::Entry<'_, R>) -> Result<String> {
        let raw = entry
            .link_name_bytes()
            .ok_or_else(|| refuse(name, "is a link without a target"))?;
        String::from_utf8(raw.into_owned())
            .map_err(|_| refuse(name, "is a link whose target is not UTF-8"))
    }

    /// Opens the directory holding `comps`' last component, walking from
    /// dest without following symlinks. With `create`, missing directories
    /// are made (0755); without, a missing one gives `None`.
    fn parent(&mut self, name: &str, comps: &[String], create: bool) -> Result<Option<OwnedFd>> {
        let mut dir = self
            .root
            .try_clone()
            .map_err(|e| Error::io("duplicate fd of", self.dest, e))?;
        let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        for (i, c) in comps[..comps.len().saturating_sub(1)].iter().enumerate() {
            let prefix = comps[..=i].join("/");
            let next = match openat(dir.as_fd(), c.as_str(), dir_flags, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) if create => {
                    match mkdirat(dir.as_fd(), c.as_str(), Mode::from_bits_truncate(DIR_MODE)) {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(e) => {
                            return Err(Error::io("create", &self.dest.join(&prefix), e.into()));
                        }
                    }
                    let fd = openat(dir.as_fd(), c.as_str(), dir_flags, Mode::empty())
                        .map_err(|e| Error::io("open", &self.dest.join(&prefix), e.into()))?;
                    set_mode(&fd, DIR_MODE, &self.dest.join(&prefix))?;
                    fd
                }
                Err(Errno::ENOENT) => return Ok(None),
                Err(Errno::ENOTDIR | Errno::ELOOP) => {
                    return Err(refuse(
                        name,
                        format_args!(
                            "goes through {prefix:?}, which an earlier entry made a symlink or file, not a directory"
                        ),
                    ));
                }
                Err(e) => return Err(Error::io("open", &self.dest.join(&prefix), e.into())),
            };
            if create {
                self.touched.insert(prefix);
            }
            dir = next;
        }
        Ok(Some(dir))
    }

    /// Removes whatever is at `base` in `dir` (a file, a symlink without
    /// following it, or a whole directory), forgetting files of this layer
    /// that went with it. With `keep_dir`, an existing directory stays and
    /// `true` is returned.
    fn clear(&mut self, dir: &OwnedFd, rel: &str, base: &str, keep_dir: bool) -> Result<bool> {
        let abs = self.dest.join(rel);
        let st = match fstatat(dir.as_fd(), base, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(false),
            Err(e) => return Err(Error::io("stat", &abs, e.into())),
        };
        let is_dir = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR;
        if is_dir {
            if keep_dir {
                return Ok(true);
            }
            // The parents were just walked without following symlinks, and
            // remove_dir_all never follows the links it meets inside.
            fs::remove_dir_all(&abs).ctx("remove", &abs)?;
            let below = format!("{rel}/");
            self.files.retain(|p, _| !p.starts_with(&below));
        } else {
            unlinkat(dir.as_fd(), base, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| Error::io("remove", &abs, e.into()))?;
            self.files.remove(rel);
        }
        Ok(false)
    }

    fn write_file<R: Read>(
        &mut self,
        name: &str,
        comps: &[String],
        data: &mut R,
        mode: u32,
    ) -> Result<()> {
        let Some((base, _)) = comps.split_last() else {
            return Err(refuse(name, "is a file named like the model root"));
        };
        let rel = comps.join("/");
        let abs = self.dest.join(&rel);
        let dir = self.parent(name, comps, true)?.expect("created");
        // Never write through an existing inode: it may be a hardlink or a
        // symlink; the old name is removed and a new file made.
        self.clear(&dir, &rel, base, false)?;
        let fd = openat(
            dir.as_fd(),
            base.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| Error::io("create", &abs, e.into()))?;
        let mut out = File::from(fd);
        let mut h = crate::cache::manifest::FileHasher::default();
        let mut size = 0u64;
        loop {
            let n = data.read(&mut self.buf).map_err(|e| {
                Error::Precondition(format!(
                    "layer {} could not be read at entry {name:?}: {e}",
                    self.blob.display()
                ))
            })?;
            if n == 0 {
                break;
            }
            self.written = self.written.saturating_add(n as u64);
            if self.written > self.budget.bytes {
                return Err(Error::OverLimit(format!(
                    "layer {} unpacks to more than {} bytes ({}); stopped at entry {name:?}",
                    self.blob.display(),
                    self.budget.bytes,
                    self.budget.bytes_limit
                )));
            }
            h.update(&self.buf[..n]);
            out.write_all(&self.buf[..n]).ctx("write", &abs)?;
            size += n as u64;
        }
        out.set_permissions(fs::Permissions::from_mode(mode))
            .ctx("set mode of", &abs)?;
        out.sync_all().ctx("sync", &abs)?;
        self.touched.insert(rel.clone());
        self.files.insert(rel.clone(), {
            let (sha256, chunks) = h.finish();
            FileEntry {
                path: rel,
                size,
                sha256,
                chunks,
            }
        });
        Ok(())
    }

    fn make_dir(&mut self, name: &str, comps: &[String]) -> Result<()> {
        let Some((base, _)) = comps.split_last() else {
            return Ok(()); // "./": the model root itself
        };
        let rel = comps.join("/");
        let abs = self.dest.join(&rel);
        let dir = self.parent(name, comps, true)?.expect("created");
        if !self.clear(&dir, &rel, base, true)? {
            mkdirat(
                dir.as_fd(),
                base.as_str(),
                Mode::from_bits_truncate(DIR_MODE),
            )
            .map_err(|e| Error::io("create", &abs, e.into()))?;
        }
        let fd = openat(
            dir.as_fd(),
            base.as_str(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::io("open", &abs, e.into()))?;
        set_mode(&fd, DIR_MODE, &abs)?;
        self.touched.insert(rel);
        Ok(())
    }

    fn make_symlink(&mut self, name: &str, comps: &[String], target: &str) -> Result<()> {
        let Some((base, _)) = comps.split_last() else {
            return Err(refuse(name, "is a symlink named like the model root"));
        };
        link_target_ok(comps, target)
            .map_err(|why| refuse(name, format_args!("{why} ({target:?})")))?;
        let rel = comps.join("/");
        let dir = self.parent(name, comps, true)?.expect("created");
        self.clear(&dir, &rel, base, false)?;
        symlinkat(target, dir.as_fd(), base.as_str())
            .map_err(|e| Error::io("create symlink", &self.dest.join(&rel), e.into()))?;
        self.touched.insert(rel);
        Ok(())
    }

    /// A hardlink may only name a regular file this layer already wrote, so
    /// it can neither reach outside dest nor alias a file of another layer.
    fn make_hardlink(&mut self, name: &str, comps: &[String], target: &str) -> Result<()> {
        let Some((base, _)) = comps.split_last() else {
            return Err(refuse(name, "is a hardlink named like the model root"));
        };
        let target_comps = components(target).map_err(|_| {
            refuse(
                name,
                format_args!("is a hardlink to {target:?}, outside the model"),
            )
        })?;
        let target_rel = target_comps.join("/");
        let Some(entry) = self.files.get(&target_rel).cloned() else {
            return Err(refuse(
                name,
                format_args!(
                    "is a hardlink to {target:?}, which is not a regular file extracted earlier from this layer"
                ),
            ));
        };
        let rel = comps.join("/");
        if rel == target_rel {
            return Ok(());
        }
        let Some(target_dir) = self.parent(name, &target_comps, false)? else {
            return Err(refuse(
                name,
                format_args!("is a hardlink to {target:?}, which is gone"),
            ));
        };
        let dir = self.parent(name, comps, true)?.expect("created");
        self.clear(&dir, &rel, base, false)?;
        // No AT_SYMLINK_FOLLOW: the target name itself is never followed.
        linkat(
            target_dir.as_fd(),
            target_comps.last().expect("non-empty").as_str(),
            dir.as_fd(),
            base.as_str(),
            AtFlags::empty(),
        )
        .map_err(|e| Error::io("create hardlink", &self.dest.join(&rel), e.into()))?;
        self.touched.insert(rel.clone());
        self.files
            .insert(rel.clone(), FileEntry { path: rel, ..entry });
        Ok(())
    }

    /// Applies `.wh.<name>` or `.wh..wh..opq` to what earlier layers left.
    fn whiteout(&mut self, name: &str, comps: &[String]) -> Result<()> {
        let (base, parents) = comps.split_last().expect("has a whiteout name");
        let Some(dir) = self.parent(name, comps, false)? else {
            return Ok(()); // nothing below a missing directory to hide
        };
        let dir_rel = parents.join("/");
        if base == OPAQUE_WHITEOUT {
            return self.clear_lower(&dir_rel);
        }
        let hidden = &base[WHITEOUT_PREFIX.len()..];
        if hidden.starts_with(WHITEOUT_PREFIX) {
            return Ok(()); // other aufs metadata (.wh..wh.plnk, ...)
        }
        if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
            return Err(refuse(name, "is a whiteout of an invalid name"));
        }
        let rel = if dir_rel.is_empty() {
            hidden.to_string()
        } else {
            format!("{dir_rel}/{hidden}")
        };
        if self.touched.contains(&rel) {
            return Ok(());
        }
        self.clear(&dir, &rel, hidden, false)?;
        Ok(())
    }

    /// Empties the directory `dir_rel` of everything this layer did not
    /// create (an opaque whiteout may precede or follow the layer's own
    /// entries in that directory).
    fn clear_lower(&mut self, dir_rel: &str) -> Result<()> {
        let abs = self.dest.join(dir_rel);
        let mut names: Vec<String> = Vec::new();
        for e in fs::read_dir(&abs).ctx("read directory", &abs)? {
            let e = e.ctx("read directory", &abs)?;
            names.push(e.file_name().to_string_lossy().into_owned());
        }
        for n in names {
            let rel = if dir_rel.is_empty() {
                n.clone()
            } else {
                format!("{dir_rel}/{n}")
            };
            let child = self.dest.join(&rel);
            let meta = fs::symlink_metadata(&child).ctx("stat", &child)?;
            if self.touched.contains(&rel) {
                if meta.is_dir() {
                    self.clear_lower(&rel)?;
                }
            } else if meta.is_dir() {
                fs::remove_dir_all(&child).ctx("remove", &child)?;
            } else {
                fs::remove_file(&child).ctx("remove", &child)?;
            }
        }
        Ok(())
    }
}

fn set_mode(fd: &OwnedFd, mode: u32, path: &Path) -> Result<()> {
    nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))
        .map_err(|e| Error::io("set mode of", path, e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;

    /// Builds a layer entry by entry; `raw_name` writes header name bytes
    /// directly, as the Builder refuses '..' and absolute names.
    struct Tar(tar::Builder<Vec<u8>>);

    impl Tar {
        fn new() -> Tar {
            Tar(tar::Builder::new(Vec::new()))
        }
        fn header(kind: EntryType, size: u64, mode: u32) -> tar::Header {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(size);
            h.set_mode(mode);
            h
        }
        fn file(mut self, name: &str, data: &[u8]) -> Tar {
            let mut h = Tar::header(EntryType::Regular, data.len() as u64, 0o644);
            self.0.append_data(&mut h, name, data).unwrap();
            self
        }
        fn file_mode(mut self, name: &str, data: &[u8], mode: u32) -> Tar {
            let mut h = Tar::header(EntryType::Regular, data.len() as u64, mode);
            self.0.append_data(&mut h, name, data).unwrap();
            self
        }
        fn dir(mut self, name: &str) -> Tar {
            let mut h = Tar::header(EntryType::Directory, 0, 0o1777);
            self.0.append_data(&mut h, name, io::empty()).unwrap();
            self
        }
        fn link(mut self, kind: EntryType, name: &str, target: &str) -> Tar {
            let mut h = Tar::header(kind, 0, 0o777);
            self.0.append_link(&mut h, name, target).unwrap();
            self
        }
        fn raw(mut self, kind: EntryType, name: &[u8], link: &[u8], data: &[u8]) -> Tar {
            let mut h = Tar::header(kind, data.len() as u64, 0o644);
            let old = h.as_old_mut();
            old.name[..name.len()].copy_from_slice(name);
            old.linkname[..link.len()].copy_from_slice(link);
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }
        fn pax_file(mut self, long_name: &str, data: &[u8]) -> Tar {
            let record = |k: &str, v: &str| {
                let body = format!(" {k}={v}\n");
                let mut len = body.len() + 1;
                while format!("{len}{body}").len() != len {
                    len += 1;
                }
                format!("{len}{body}")
            };
            let pax = record("path", long_name);
            let mut h = Tar::header(EntryType::XHeader, pax.len() as u64, 0o644);
            h.set_path("PaxHeaders/x").unwrap();
            h.set_cksum();
            self.0.append(&h, pax.as_bytes()).unwrap();
            let mut h = Tar::header(EntryType::Regular, data.len() as u64, 0o644);
            h.set_path("short-placeholder").unwrap();
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }
        fn write(self, dir: &Path, name: &str) -> std::path::PathBuf {
            let bytes = self.0.into_inner().unwrap();
            let p = dir.join(name);
            fs::write(&p, bytes).unwrap();
            p
        }
    }

    struct Fixture {
        tmp: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            Fixture {
                tmp: tempfile::tempdir().unwrap(),
            }
        }
        fn dest(&self) -> std::path::PathBuf {
            self.tmp.path().join("root/dest")
        }
        /// Extracts `t` into dest; on a refusal, checks nothing appeared
        /// next to dest, and returns the message.
        fn refused(&self, t: Tar) -> String {
            let blob = t.write(self.tmp.path(), "layer.tar");
            let err =
                extract(&blob, Compression::None, &self.dest(), &Budget::unlimited()).unwrap_err();
            assert!(matches!(err, Error::Precondition(_)), "{err:?}");
            let outside: Vec<_> = fs::read_dir(self.tmp.path().join("root"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(outside, vec!["dest"], "something was written outside dest");
            err.to_string()
        }
    }

    fn sha(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    #[test]
    fn normal_layer() {
        let f = Fixture::new();
        let long = format!("deep/{}/weights.bin", "d".repeat(120));
        let pax_name = format!("pax/{}.json", "p".repeat(150));
        let t = Tar::new()
            .dir("models/")
            .file("models/config.json", b"{}")
            .file_mode("models/run.sh", b"#!/bin/sh\n", 0o4755)
            .file_mode("models/secret", b"x", 0o6640)
            .dir("models/1_Pooling")
            .file("models/1_Pooling/config.json", b"{\"a\":1}")
            .link(EntryType::Symlink, "models/alias.json", "config.json")
            .link(EntryType::Symlink, "models/1_Pooling/up", "../config.json")
            .link(EntryType::Link, "models/hard.json", "models/config.json")
            .file(&long, b"long")
            .pax_file(&pax_name, b"pax");
        let blob = t.write(f.tmp.path(), "layer.tar");
        let files = extract(&blob, Compression::None, &f.dest(), &Budget::unlimited()).unwrap();
        let names: Vec<_> = files.iter().map(|e| e.path.as_str()).collect();
        let mut want = vec![
            long.as_str(),
            "models/1_Pooling/config.json",
            "models/config.json",
            "models/hard.json",
            "models/run.sh",
            "models/secret",
            pax_name.as_str(),
        ];
        want.sort();
        assert_eq!(names, want);
        let hard = files.iter().find(|e| e.path == "models/hard.json").unwrap();
        assert_eq!((hard.size, hard.sha256.as_str()), (2, sha(b"{}").as_str()));
        let d = f.dest();
        assert_eq!(fs::read(d.join(&long)).unwrap(), b"long");
        assert_eq!(fs::read(d.join(&pax_name)).unwrap(), b"pax");
        assert_eq!(fs::read(d.join("models/1_Pooling/up")).unwrap(), b"{}");
        assert_eq!(
            fs::read_link(d.join("models/alias.json")).unwrap(),
            Path::new("config.json")
        );
        let mode = |p: &str| fs::symlink_metadata(d.join(p)).unwrap().mode() & 0o7777;
        assert_eq!(mode("models/run.sh"), 0o755);
        assert_eq!(mode("models/secret"), 0o644);
        assert_eq!(mode("models"), 0o755);
        assert_eq!(mode("models/1_Pooling"), 0o755);
        assert_eq!(mode("models/config.json"), 0o644);
    }

    #[test]
    fn compressed_layers() {
        let f = Fixture::new();
        let tar = Tar::new().file("a/b.txt", b"hello").0.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar).unwrap();
        let gz_path = f.tmp.path().join("l.tar.gz");
        fs::write(&gz_path, gz.finish().unwrap()).unwrap();
        let zst_path = f.tmp.path().join("l.tar.zst");
        fs::write(&zst_path, zstd::encode_all(&tar[..], 1).unwrap()).unwrap();
        for (p, c) in [
            (&gz_path, Compression::Gzip),
            (&zst_path, Compression::Zstd),
        ] {
            let dest = f.tmp.path().join(format!("{c:?}"));
            let files = extract(p, c, &dest, &Budget::unlimited()).unwrap();
            assert_eq!(files.len(), 1);
            assert_eq!(files[0].sha256, sha(b"hello"));
            assert_eq!(fs::read(dest.join("a/b.txt")).unwrap(), b"hello");
        }
        // A gzip layer declared as zstd is a clear refusal, not a panic.
        let err = extract(
            &gz_path,
            Compression::Zstd,
            &f.tmp.path().join("x"),
            &Budget::unlimited(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a valid tar archive"), "{err}");
    }

    /// A tar of one `size`-byte file of zeros, streamed through `wrap`
    /// (a compressor), never held in memory whole.
    fn zeros_layer<W: Write>(wrap: W, size: u64) -> W {
        let mut b = tar::Builder::new(wrap);
        let mut h = Tar::header(EntryType::Regular, size, 0o644);
        b.append_data(&mut h, "zeros.bin", io::repeat(0).take(size))
            .unwrap();
        b.into_inner().unwrap()
    }

    fn budget(bytes: u64, entries: u64) -> Budget {
        Budget {
            bytes,
            bytes_limit: "the test's limit".into(),
            entries,
            entries_limit: "the test's entry limit".into(),
            seal: Default::default(),
        }
    }

    /// Bombs of zeros stop at the byte budget, with ResourceExhausted
    /// naming the limit, having written no more than the budget.
    #[test]
    fn gzip_and_zstd_bombs_stop_at_the_budget() {
        let f = Fixture::new();
        let gz = zeros_layer(
            flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()),
            1 << 30,
        )
        .finish()
        .unwrap();
        let zst = zeros_layer(zstd::Encoder::new(Vec::new(), 3).unwrap(), 1 << 30)
            .finish()
            .unwrap();
        assert!(gz.len() < 8 << 20 && zst.len() < 1 << 20);
        for (bytes, c) in [(gz, Compression::Gzip), (zst, Compression::Zstd)] {
            let blob = f.tmp.path().join(format!("bomb-{c:?}"));
            fs::write(&blob, bytes).unwrap();
            let dest = f.tmp.path().join(format!("out-{c:?}"));
            let err = extract(&blob, c, &dest, &budget(8 << 20, 10)).unwrap_err();
            assert!(
                matches!(&err, Error::OverLimit(m)
                    if m.contains("more than 8388608 bytes (the test's limit)") && m.contains("zeros.bin")),
                "{err:?}"
            );
            let written = fs::metadata(dest.join("zeros.bin")).map_or(0, |m| m.len());
            assert!(written <= 8 << 20, "{written} bytes written");
        }
    }

    /// Extension headers larger than MAX_TAR_METADATA are refused while
    /// being read, never buffered whole: a 64 MiB PAX header, a 64 MiB GNU
    /// long name, and a directory entry carrying 64 MiB of data.
    #[test]
    fn huge_tar_headers_are_refused_not_buffered() {
        let f = Fixture::new();
        for (kind, name) in [
            (EntryType::XHeader, "pax"),
            (EntryType::GNULongName, "longname"),
            (EntryType::Directory, "dir"),
        ] {
            let size = 64u64 << 20;
            let mut b = tar::Builder::new(zstd::Encoder::new(Vec::new(), 1).unwrap());
            let mut h = Tar::header(kind, size, 0o644);
            h.set_path(name).unwrap();
            h.set_cksum();
            b.append(&h, io::repeat(b'a').take(size)).unwrap();
            let mut h = Tar::header(EntryType::Regular, 1, 0o644);
            b.append_data(&mut h, "after", &b"x"[..]).unwrap();
            let blob = f.tmp.path().join(format!("{name}.tar.zst"));
            fs::write(&blob, b.into_inner().unwrap().finish().unwrap()).unwrap();
            let err = extract(
                &blob,
                Compression::Zstd,
                &f.tmp.path().join(name),
                &Budget::unlimited(),
            )
            .unwrap_err();
            assert!(
                matches!(&err, Error::SourceFault(m) if m.contains("tar metadata")),
                "{name}: {err:?}"
            );
        }
    }

    /// Many tiny entries stop at the entry budget.
    #[test]
    fn many_tiny_entries_stop_at_the_entry_budget() {
        let f = Fixture::new();
        let mut t = Tar::new();
        for i in 0..300 {
            t = t.file(&format!("d/{i}"), b"");
        }
        let blob = t.write(f.tmp.path(), "many.tar");
        let err = extract(&blob, Compression::None, &f.dest(), &budget(u64::MAX, 100)).unwrap_err();
        assert!(
            matches!(&err, Error::OverLimit(m)
                if m.contains("more than 100 entries (the test's entry limit)")),
            "{err:?}"
        );
        assert!(fs::read_dir(f.dest().join("d")).unwrap().count() <= 100);
    }

    /// A layer of many files whose names are long (each within NAME_MAX
    /// and PATH_MAX) stops once its seal would outgrow the bound, saying
    /// so, long before all of them are written.
    #[test]
    fn a_layer_whose_seal_would_outgrow_its_bound_stops() {
        let f = Fixture::new();
        let deep: Vec<String> = (b'a'..=b'o')
            .map(|c| (c as char).to_string().repeat(250))
            .collect();
        let deep = deep.join("/");
        let mut t = Tar::new();
        for i in 0..12_000 {
            t = t.file(&format!("{deep}/f-{i:05}-{}", "x".repeat(200)), b"");
        }
        let blob = t.write(f.tmp.path(), "bloat.tar");
        let err = extract(
            &blob,
            Compression::None,
            &f.dest(),
            &budget(u64::MAX, u64::MAX),
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::OverLimit(m) if m.contains("a seal may take at most") || m.contains("33554432")),
            "{err:?}"
        );
        let written = fs::read_dir(f.dest().join(&deep)).unwrap().count();
        assert!(
            written < 9_000,
            "{written} files were written before the refusal"
        );
    }

    #[test]
    fn refuses_control_characters_in_names() {
        let f = Fixture::new();
        let err = f.refused(Tar::new().raw(EntryType::Regular, b"a\tb", b"", b"x"));
        assert!(err.contains("control character"), "{err}");
    }

    #[test]
    fn refuses_parent_dir_names() {
        let f = Fixture::new();
        let err = f.refused(Tar::new().raw(EntryType::Regular, b"../evil", b"", b"x"));
        assert!(err.contains("\"../evil\" has a '..' component"), "{err}");
        let err = f.refused(Tar::new().raw(EntryType::Regular, b"a/../../evil", b"", b"x"));
        assert!(err.contains("has a '..' component"), "{err}");
    }

    #[test]
    fn refuses_absolute_names() {
        let f = Fixture::new();
        let err = f.refused(Tar::new().raw(EntryType::Regular, b"/tmp/evil", b"", b"x"));
        assert!(err.contains("\"/tmp/evil\" is an absolute path"), "{err}");
    }

    #[test]
    fn refuses_escaping_symlinks() {
        let f = Fixture::new();
        let err = f.refused(Tar::new().link(EntryType::Symlink, "link", "/etc"));
        assert!(
            err.contains("\"link\" is a symlink to an absolute path"),
            "{err}"
        );
        let err = f.refused(Tar::new().link(EntryType::Symlink, "a/link", "../../etc"));
        assert!(err.contains("climbs outside the model"), "{err}");
        // Lexically inside, but '..' after a name that may itself be a link.
        let err = f.refused(Tar::new().link(EntryType::Symlink, "d/l", "..").link(
            EntryType::Symlink,
            "e",
            "d/l/..",
        ));
        assert!(
            err.contains("\"e\" is a symlink whose target has '..' after"),
            "{err}"
        );
    }

    #[test]
    fn never_writes_through_an_earlier_symlink() {
        let f = Fixture::new();
        fs::create_dir_all(f.dest().join("sub")).unwrap();
        // `a -> sub` is inside and allowed; writing `a/passwd` must still
        // not follow it.
        let err = f.refused(
            Tar::new()
                .link(EntryType::Symlink, "a", "sub")
                .file("a/passwd", b"root::0:0::/:/bin/sh"),
        );
        assert!(err.contains("\"a/passwd\" goes through \"a\""), "{err}");
        assert!(!f.dest().join("sub/passwd").exists());
        // The classic attack is refused at its first entry.
        let err = f.refused(
            Tar::new()
                .link(EntryType::Symlink, "link", "/etc")
                .file("link/passwd", b"x"),
        );
        assert!(
            err.contains("\"link\" is a symlink to an absolute path"),
            "{err}"
        );
    }

    #[test]
    fn refuses_bad_hardlinks() {
        let f = Fixture::new();
        let err = f.refused(Tar::new().raw(EntryType::Link, b"h", b"/etc/passwd", b""));
        assert!(
            err.contains("\"h\" is a hardlink to \"/etc/passwd\", outside"),
            "{err}"
        );
        let err = f.refused(Tar::new().raw(EntryType::Link, b"h", b"../x", b""));
        assert!(err.contains("outside the model"), "{err}");
        // Present in dest from an earlier layer, but not from this one.
        fs::write(f.dest().join("old"), b"x").unwrap();
        let err = f.refused(Tar::new().link(EntryType::Link, "h", "old"));
        assert!(
            err.contains("not a regular file extracted earlier from this layer"),
            "{err}"
        );
        let err = f.refused(Tar::new().link(EntryType::Symlink, "s", "old").link(
            EntryType::Link,
            "h",
            "s",
        ));
        assert!(err.contains("\"h\" is a hardlink to \"s\""), "{err}");
    }

    #[test]
    fn refuses_devices_and_fifos() {
        let f = Fixture::new();
        for (kind, what) in [
            (EntryType::Char, "is a device file"),
            (EntryType::Block, "is a device file"),
            (EntryType::Fifo, "is a fifo"),
        ] {
            let err = f.refused(Tar::new().raw(kind, b"dev", b"", b""));
            assert!(err.contains(&format!("\"dev\" {what}")), "{err}");
            assert!(!f.dest().join("dev").exists());
        }
    }

    #[test]
    fn whiteouts_across_layers() {
        let f = Fixture::new();
        let dest = f.dest();
        let l1 = Tar::new()
            .file("a", b"a")
            .file("keep", b"k")
            .file("d/x", b"x")
            .file("d/sub/y", b"y")
            .file("e/z", b"z")
            .write(f.tmp.path(), "l1.tar");
        let l2 = Tar::new()
            .file(".wh.a", b"")
            .file("d/new", b"n")
            .file("d/.wh..wh..opq", b"")
            .file("e/.wh.z", b"")
            .file(".wh.missing", b"")
            .write(f.tmp.path(), "l2.tar");
        let f1 = extract(&l1, Compression::None, &dest, &Budget::unlimited()).unwrap();
        let f2 = extract(&l2, Compression::None, &dest, &Budget::unlimited()).unwrap();
        assert_eq!(
            f2.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
            vec!["d/new"]
        );
        let all = merge(&dest, vec![f1, f2]).unwrap();
        let names: Vec<_> = all.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(names, vec!["d/new", "keep"]);
        assert!(!dest.join("a").exists() && !dest.join("d/sub").exists());
        assert!(dest.join("e").is_dir() && !dest.join("e/z").exists());
        assert!(!dest.join(".wh.a").exists());
    }
}
