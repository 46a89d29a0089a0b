//! The seal's manifest: every file's path, size and sha256, every directory
//! and symlink, plus where the bytes came from and when they were sealed.
//!
//! Built once when a source is sealed; checked at NodeStage (sizes by
//! default, hashes on request). Holds no credentials.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, IoContext, Result};

pub const FORMAT: u32 = 1;

/// The fixed chunk of a seal's chunk table: small enough that a peer's
/// bad chunk costs little to fetch again and that a chunk is verified
/// before it is handed on (held in memory whole), large enough that a
/// 140 GB model's table stays near a megabyte.
pub const CHUNK_BYTES: u64 = 8 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    pub format: u32,
    pub source: String,
    /// Where the bytes came from: a volume, or a model URI without credentials.
    pub origin: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    pub sealed_unix: u64,
    pub total_bytes: u64,
    /// The chunk of every file's chunk table; 0 in seals made before
    /// chunk tables were recorded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk_bytes: u64,
    pub files: Vec<FileEntry>,
    pub dirs: Vec<String>,
    pub symlinks: Vec<LinkEntry>,
    /// The nodes whose drivers served some of the bytes (peer fill); every
    /// byte was checked against the origin's digests all the same.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filled_from: Vec<String>,
    /// Who signed the model, as the policy of the class that pulled it
    /// verified (`signing`); None when that class checked no signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
}

/// The most a seal may take. Every pull, eviction and capacity report of a
/// root reads the seals in it (whole, up to `state::MAX_RECORD_BYTES`), and
/// peers hold them in memory, so a model whose names alone would outgrow
/// this is refused before its bytes are fetched ([`SealMeter`]), and no
/// seal over it is ever written.
pub const MAX_SEAL_BYTES: u64 = 32 << 20;

/// Bytes a file's entry takes in a seal beside its path: its fields, a
/// sha256, and the pretty printer's indentation.
const FILE_ENTRY_BYTES: u64 = 192;
/// Bytes one chunk digest takes in a file's chunk table.
const CHUNK_ENTRY_BYTES: u64 = 80;
/// Bytes a directory's or a link's entry takes beside its names.
const NAME_ENTRY_BYTES: u64 = 64;

/// An upper bound of what a tree's seal takes, counted entry by entry as
/// the tree becomes known (a listing, or a layer as it unpacks): every
/// path as JSON escapes it, each directory once (those a path implies
/// too), each file's chunk table. Stop adding once [`SealMeter::over`]:
/// what it remembers grows with what it counts.
#[derive(Debug, Default)]
pub struct SealMeter {
    bytes: u64,
    entries: u64,
    dirs: std::collections::HashSet<String>,
}

/// Bytes `s` takes as a JSON string, quotes included.
fn json_len(s: &str) -> u64 {
    let escaped = s
        .chars()
        .map(|c| match c {
            '"' | '\\' => 1,
            c if c.is_control() => 5,
            _ => 0,
        })
        .sum::<u64>();
    s.len() as u64 + escaped + 2
}

impl SealMeter {
    fn add(&mut self, bytes: u64) {
        self.bytes = self.bytes.saturating_add(bytes);
        self.entries += 1;
    }

    /// Every directory above `path`, each once.
    fn parents(&mut self, path: &str) {
        for (i, _) in path.match_indices('/') {
            self.dir(&path[..i]);
        }
    }

    /// A file of `size` bytes at `path`.
    pub fn file(&mut self, path: &str, size: u64) {
        self.parents(path);
        let chunks = size.div_ceil(CHUNK_BYTES);
        self.add(
            json_len(path)
                .saturating_add(FILE_ENTRY_BYTES)
                .saturating_add(chunks.saturating_mul(CHUNK_ENTRY_BYTES)),
        );
    }

    /// A directory at `path` (and those above it).
    pub fn dir(&mut self, path: &str) {
        if path.is_empty() || self.dirs.contains(path) {
            return;
        }
        self.parents(path);
        self.dirs.insert(path.to_string());
        self.add(json_len(path) + NAME_ENTRY_BYTES);
    }

    /// A symlink at `path` to `target`.
    pub fn link(&mut self, path: &str, target: &str) {
        self.parents(path);
        self.add(json_len(path) + json_len(target) + NAME_ENTRY_BYTES);
    }

    /// The bound so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the seal would outgrow [`MAX_SEAL_BYTES`].
    pub fn over(&self) -> bool {
        self.bytes > MAX_SEAL_BYTES
    }

    /// Why a tree this meter outgrew is refused, for `what` (a listing,
    /// a layer).
    pub fn refusal(&self, what: &str) -> String {
        format!(
            "{what} holds more than a seal can record: its first {} entries already take {} bytes \
             of paths and digests, over the {MAX_SEAL_BYTES} bytes a seal may take (every pull, \
             eviction and capacity report on the node reads it whole); a model needs fewer or \
             shorter file names",
            self.entries, self.bytes
        )
    }
}

/// The filesystem block every file, directory and link is charged at
/// least: an empty file costs an inode and, on most filesystems, a block,
/// so a model of 100,000 empty files is not free.
pub const CHARGE_BLOCK: u64 = 4096;

/// What a tree costs against `--cache-capacity` and `--min-free`: each
/// file's size rounded up to whole blocks, at least one, and a block for
/// each other entry (directories, links).
pub fn charge(sizes: impl IntoIterator<Item = u64>, other_entries: u64) -> u64 {
    sizes
        .into_iter()
        .map(|s| s.div_ceil(CHARGE_BLOCK).max(1).saturating_mul(CHARGE_BLOCK))
        .fold(0u64, u64::saturating_add)
        .saturating_add(other_entries.saturating_mul(CHARGE_BLOCK))
}

impl Seal {
    /// The seal of source `sid` over `tree`, sealed now: the one way a seal
    /// is made, whether a user filled the source or the puller did.
    pub fn new(sid: &str, origin: &str, revision: Option<String>, tree: Tree) -> Seal {
        Seal {
            format: FORMAT,
            source: sid.to_string(),
            origin: origin.to_string(),
            revision,
            sealed_unix: super::now_unix(),
            total_bytes: tree.total_bytes(),
            chunk_bytes: CHUNK_BYTES,
            files: tree.files,
            dirs: tree.dirs,
            symlinks: tree.symlinks,
            filled_from: Vec::new(),
            signed_by: None,
        }
    }

    /// The chunk table of `path`, when the seal recorded one at this
    /// chunk size.
    pub fn chunks_of(&self, path: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == path).filter(|f| {
            self.chunk_bytes == CHUNK_BYTES && f.chunks.len() as u64 == f.size.div_ceil(CHUNK_BYTES)
        })
    }

    /// What this model costs the cache (see `charge`).
    pub fn charged_bytes(&self) -> u64 {
        charge(
            self.files.iter().map(|f| f.size),
            (self.dirs.len() + self.symlinks.len()) as u64,
        )
    }

    /// Inodes the model takes where its files are plain files.
    pub fn inodes(&self) -> u64 {
        (self.files.len() + self.dirs.len() + self.symlinks.len()) as u64 + 1
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub sha256: String,
    /// The sha256 of each `CHUNK_BYTES` of the file, in order: what a node
    /// filling from a peer checks each chunk against as it arrives.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A file's sha256 and its chunk table, from one in-order pass over its
/// bytes in pieces of any size.
#[derive(Clone)]
pub struct FileHasher {
    whole: Sha256,
    /// None: the sha256 alone, the chunk table computed later
    /// ([`FileHasher::whole_only`]).
    chunk: Option<Sha256>,
    /// Bytes of the current chunk hashed so far.
    in_chunk: u64,
    chunks: Vec<String>,
}

impl Default for FileHasher {
    fn default() -> Self {
        FileHasher {
            whole: Sha256::new(),
            chunk: Some(Sha256::new()),
            in_chunk: 0,
            chunks: Vec::new(),
        }
    }
}

impl FileHasher {
    /// The sha256 alone: half the hashing, for a pull whose verdict is
    /// waited for and whose chunk table can come after it
    /// ([`chunk_table`]); `finish` gives no chunks.
    pub fn whole_only() -> FileHasher {
        FileHasher {
            chunk: None,
            ..FileHasher::default()
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.whole.update(data);
        let Some(chunk) = self.chunk.as_mut() else {
            return;
        };
        while !data.is_empty() {
            let room = (CHUNK_BYTES - self.in_chunk) as usize;
            let (now, rest) = data.split_at(room.min(data.len()));
            chunk.update(now);
            self.in_chunk += now.len() as u64;
            if self.in_chunk == CHUNK_BYTES {
                let done = std::mem::replace(chunk, Sha256::new());
                self.chunks.push(hex::encode(done.finalize()));
                self.in_chunk = 0;
            }
            data = rest;
        }
    }

    /// The digests of the whole chunks hashed so far.
    pub fn chunks(&self) -> &[String] {
        &self.chunks
    }

    /// The file's sha256 and its chunk table.
    pub fn finish(mut self) -> (String, Vec<String>) {
        if let Some(chunk) = self.chunk
            && self.in_chunk > 0
        {
            self.chunks.push(hex::encode(chunk.finalize()));
        }
        (hex::encode(self.whole.finalize()), self.chunks)
    }
}

/// The sha256 of one chunk's bytes, as a chunk table records it.
pub fn chunk_digest(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkEntry {
    pub path: String,
    pub target: String,
}

/// The tree's contents, before origin and time are attached.
#[derive(Debug, Default)]
pub struct Tree {
    pub files: Vec<FileEntry>,
    pub dirs: Vec<String>,
    pub symlinks: Vec<LinkEntry>,
}

impl Tree {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

impl Seal {
    /// The seal as written, refused (before anything is made immutable or
    /// written) when it would outgrow [`MAX_SEAL_BYTES`].
    pub fn encoded(&self) -> Result<Vec<u8>> {
        let bytes = crate::state::json_bytes(self)
            .map_err(|e| Error::Internal(format!("encode the seal of {}: {e}", self.source)))?;
        if bytes.len() as u64 > MAX_SEAL_BYTES {
            return Err(Error::OverLimit(format!(
                "the seal of {} would take {} bytes for its {} files, {} directories and {} links, \
                 over the {MAX_SEAL_BYTES} bytes a seal may take (every pull, eviction and capacity \
                 report on the node reads it whole); a model needs fewer or shorter file names",
                self.origin,
                bytes.len(),
                self.files.len(),
                self.dirs.len(),
                self.symlinks.len()
            )));
        }
        Ok(bytes)
    }

    pub fn has_dir(&self, rel: &str) -> bool {
        self.dirs.iter().any(|d| d == rel)
    }

    /// Checks a seal read from disk: it seals `sid`, and every path it
    /// lists is relative and stays inside the source, so a check through a
    /// mount never looks outside it.
    pub fn check(&self, sid: &str) -> Result<(), String> {
        if self.source != sid {
            return Err(format!("it seals source {:?}, not {sid}", self.source));
        }
        let paths = self
            .files
            .iter()
            .map(|f| &f.path)
            .chain(&self.dirs)
            .chain(self.symlinks.iter().map(|l| &l.path));
        for p in paths {
            crate::mount::subpath::validate_syntax(p).map_err(|e| format!("path {p:?}: {e}"))?;
        }
        Ok(())
    }
}

/// Walks `root` and hashes every regular file. Refuses what a read-only model
/// must not contain: device files, fifos, sockets, setuid/setgid files, and
/// names that are not UTF-8.
pub fn scan(root: &Path) -> Result<Tree> {
    let mut tree = Tree::default();
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let mut entries: Vec<_> = fs::read_dir(&dir)
            .ctx("read directory", &dir)?
            .collect::<io::Result<_>>()
            .ctx("read directory", &dir)?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name();
            let Some(name_str) = name.to_str() else {
                return Err(Error::Precondition(format!(
                    "source contains a file name that is not UTF-8 in {}",
                    dir.display()
                )));
            };
            let rel_path = rel.join(name_str);
            let rel_str = rel_path.to_string_lossy().into_owned();
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).ctx("stat", &path)?;
            let ft = meta.file_type();
            if ft.is_dir() {
                tree.dirs.push(rel_str);
                stack.push(rel_path);
            } else if ft.is_symlink() {
                let target = fs::read_link(&path).ctx("read link", &path)?;
                tree.symlinks.push(LinkEntry {
                    path: rel_str,
                    target: target.to_string_lossy().into_owned(),
                });
            } else if ft.is_file() {
                if meta.permissions().mode() & 0o6000 != 0 {
                    return Err(Error::Precondition(format!(
                        "source file {rel_str} has a setuid or setgid bit; models must not carry them"
                    )));
                }
                // A seal hashes what the filesystem holds, not pages this
                // node's client kept from before another node's writer
                // changed the file (a shared root).
                let f = File::open(&path).ctx("open", &path)?;
                crate::state::forget_cached_pages(&f);
                let (size, sha256, chunks) = hash_open_file(f, &path)?;
                tree.files.push(FileEntry {
                    path: rel_str,
                    size,
                    sha256,
                    chunks,
                });
            } else {
                let kind = if ft.is_block_device() || ft.is_char_device() {
                    "a device file"
                } else if ft.is_fifo() {
                    "a fifo"
                } else {
                    "a socket"
                };
                return Err(Error::Precondition(format!(
                    "source entry {rel_str} is {kind}; models may hold only files, directories and symlinks"
                )));
            }
        }
    }
    tree.dirs.sort();
    tree.files.sort_by(|a, b| a.path.cmp(&b.path));
    tree.symlinks.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(tree)
}

/// Streams a file through sha256 with a fixed buffer: memory stays flat
/// whatever the file's size.
pub fn hash_file(path: &Path) -> Result<(u64, String)> {
    hash_file_chunked(path).map(|(size, sha, _)| (size, sha))
}

/// The chunk table of the file at `path` alone (its sha256 checked
/// before, by a [`FileHasher::whole_only`]).
pub fn chunk_table(path: &Path) -> Result<Vec<String>> {
    use std::os::unix::fs::FileExt;
    let f = File::open(path).ctx("open", path)?;
    let size = f.metadata().ctx("stat", path)?.len();
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    let mut out = Vec::with_capacity(size.div_ceil(CHUNK_BYTES) as usize);
    let mut at = 0;
    while at < size {
        let n = (size - at).min(CHUNK_BYTES) as usize;
        f.read_exact_at(&mut buf[..n], at).ctx("read", path)?;
        out.push(chunk_digest(&buf[..n]));
        at += n as u64;
    }
    Ok(out)
}

/// `hash_file` with the file's chunk table.
pub fn hash_file_chunked(path: &Path) -> Result<(u64, String, Vec<String>)> {
    hash_open_file(File::open(path).ctx("open", path)?, path)
}

/// `hash_file_chunked` of a file already open (`path` names it in errors).
pub fn hash_open_file(mut f: File, path: &Path) -> Result<(u64, String, Vec<String>)> {
    let mut h = FileHasher::default();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).ctx("read", path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    let (sha, chunks) = h.finish();
    Ok((size, sha, chunks))
}

/// Checks a sealed tree still matches its seal. `full` also recomputes
/// every hash. Errors name the first file that differs.
pub fn verify(root: &Path, seal: &Seal, full: bool) -> Result<()> {
    let damaged = |what: String| {
        Error::Precondition(format!(
            "source {} is damaged: {what}; it must be re-created",
            seal.source
        ))
    };
    for d in &seal.dirs {
        if !root.join(d).is_dir() {
            return Err(damaged(format!("directory {d} is missing")));
        }
    }
    for f in &seal.files {
        let path = root.join(&f.path);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => m,
            Ok(_) => return Err(damaged(format!("{} is no longer a regular file", f.path))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(damaged(format!("file {} is missing", f.path)));
            }
            Err(e) => return Err(Error::io("stat", &path, e)),
        };
        if meta.len() != f.size {
            return Err(damaged(format!(
                "file {} has {} bytes, the seal recorded {}",
                f.path,
                meta.len(),
                f.size
            )));
        }
        if full {
            let (_, sha) = hash_file(&path)?;
            if sha != f.sha256 {
                return Err(damaged(format!(
                    "file {} has sha256 {sha}, the seal recorded {}",
                    f.path, f.sha256
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The meter's bound holds for what a seal really takes: names JSON
    /// escapes, deep directories, chunk tables, links; and a seal over the
    /// bound is refused before it is written.
    #[test]
    fn the_seal_meter_bounds_the_written_seal() {
        let mut tree = Tree::default();
        let mut meter = SealMeter::default();
        for i in 0..500u64 {
            let path = format!(
                "d\\{}/q\"{i}/\u{e9}t\u{e9}/{}.bin",
                i % 7,
                "w".repeat((i % 200) as usize)
            );
            let size = i * 3_000_000;
            meter.file(&path, size);
            tree.files.push(FileEntry {
                chunks: vec!["0".repeat(64); size.div_ceil(CHUNK_BYTES) as usize],
                path,
                // As many digits as a size may have, chunks as above.
                size: 10_000_000_000_000_000 + i,
                sha256: "f".repeat(64),
            });
        }
        let mut dirs = std::collections::BTreeSet::new();
        for f in &tree.files {
            for (i, _) in f.path.match_indices('/') {
                dirs.insert(f.path[..i].to_string());
            }
        }
        tree.dirs = dirs.into_iter().collect();
        for i in 0..50 {
            let (path, target) = (format!("l{i}"), format!("d\\{}/x", i % 7));
            meter.link(&path, &target);
            tree.symlinks.push(LinkEntry { path, target });
        }
        let seal = Seal::new(
            &format!("m{}", "a".repeat(31)),
            "hf://o/m",
            Some("r".repeat(40)),
            tree,
        );
        let written = seal.encoded().unwrap().len() as u64;
        assert!(
            meter.bytes() >= written,
            "meter {} < written {written}",
            meter.bytes()
        );
        assert!(
            meter.bytes() < written * 2,
            "meter {} far above written {written}",
            meter.bytes()
        );

        let mut big = seal.clone();
        big.files = (0..200_000)
            .map(|i| FileEntry {
                path: format!("{i:0>200}"),
                size: 1,
                sha256: "f".repeat(64),
                chunks: Vec::new(),
            })
            .collect();
        let e = big.encoded().unwrap_err();
        assert!(
            matches!(&e, Error::OverLimit(m) if m.contains("200000 files")),
            "{e}"
        );
    }

    fn seal_of(tree: Tree) -> Seal {
        Seal {
            format: FORMAT,
            source: "s".into(),
            origin: "test".into(),
            revision: None,
            sealed_unix: 0,
            total_bytes: tree.total_bytes(),
            chunk_bytes: CHUNK_BYTES,
            files: tree.files,
            dirs: tree.dirs,
            symlinks: tree.symlinks,
            filled_from: Vec::new(),
            signed_by: None,
        }
    }

    /// Pieces of any size give the table of fixed chunks, and the last
    /// chunk is the file's tail.
    #[test]
    fn a_chunk_table_does_not_depend_on_how_bytes_arrive() {
        let data: Vec<u8> = (0..(2 * CHUNK_BYTES + 5))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut one = FileHasher::default();
        one.update(&data);
        let mut many = FileHasher::default();
        for piece in data.chunks(1_000_003) {
            many.update(piece);
        }
        let (sha, chunks) = one.finish();
        assert_eq!(many.finish(), (sha.clone(), chunks.clone()));
        assert_eq!(sha, hex::encode(Sha256::digest(&data)));
        let c = CHUNK_BYTES as usize;
        assert_eq!(
            chunks,
            [&data[..c], &data[c..2 * c], &data[2 * c..]].map(chunk_digest)
        );
        let (empty_sha, empty) = FileHasher::default().finish();
        assert!(empty.is_empty());
        assert_eq!(empty_sha, hex::encode(Sha256::digest(b"")));
        // The sha256 alone, and the table from the file afterwards: the
        // same sha256 and the same table.
        let mut whole = FileHasher::whole_only();
        for piece in data.chunks(777_777) {
            whole.update(piece);
        }
        assert_eq!(whole.finish(), (sha, Vec::new()));
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("f"), &data).unwrap();
        assert_eq!(chunk_table(&d.path().join("f")).unwrap(), chunks);
        fs::write(d.path().join("e"), b"").unwrap();
        assert!(chunk_table(&d.path().join("e")).unwrap().is_empty());
    }

    #[test]
    fn scan_and_verify_detect_changes() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("m/1_Pooling")).unwrap();
        fs::write(d.path().join("m/config.json"), b"{}").unwrap();
        fs::write(d.path().join("m/1_Pooling/config.json"), b"{\"a\":1}").unwrap();
        std::os::unix::fs::symlink("config.json", d.path().join("m/alias")).unwrap();
        let tree = scan(d.path()).unwrap();
        assert_eq!(tree.dirs, vec!["m", "m/1_Pooling"]);
        assert_eq!(tree.files.len(), 2);
        assert_eq!(tree.total_bytes(), 9);
        assert_eq!(
            tree.files[1].sha256,
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        let seal = seal_of(tree);
        verify(d.path(), &seal, true).unwrap();

        // Same size, other bytes: only a full check sees it.
        fs::write(d.path().join("m/config.json"), b"[]").unwrap();
        verify(d.path(), &seal, false).unwrap();
        let err = verify(d.path(), &seal, true).unwrap_err().to_string();
        assert!(err.contains("m/config.json has sha256"), "{err}");

        fs::write(d.path().join("m/config.json"), b"{}!").unwrap();
        let err = verify(d.path(), &seal, false).unwrap_err().to_string();
        assert!(err.contains("has 3 bytes, the seal recorded 2"), "{err}");
    }

    #[test]
    fn scan_refuses_special_files() {
        let d = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&d.path().join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = scan(d.path()).unwrap_err().to_string();
        assert!(err.contains("pipe is a fifo"), "{err}");
    }
}
