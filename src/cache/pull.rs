//! A pull in progress: the area a model is written into before it is
//! sealed (`sources/.pull-<sid>/`), and its whole life on disk: opened
//! under its lock with the store's area, grown, discarded, committed into
//! a seal and renamed into place in one step, swept when abandoned.
//!
//! The puller decides what bytes go where inside `data()`, and keeps its
//! own progress records in `progress_dir()`; it never mounts, chmods or
//! names anything else here. Peer fill's chunk tables and progressive
//! volumes' partial views belong to this type too.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::layout::{PULL_PREFIX, Root, SourceId, SourcePaths};
use super::manifest::{FileEntry, LinkEntry, Seal, Tree};
use super::partial::Partial;
use super::store::{Growth, SourceStore};
use crate::error::{Error, IoContext, Result};
use crate::state;

pub use super::store::PARTIAL_DIR;

/// What a pull keeps beside the model, never part of it: removed once
/// the model is in place.
const BOOKKEEPING: [&str; 4] = ["state", "blobs", "partial", "lock"];

/// One pull's area, held under an exclusive flock for as long as the value
/// lives: another process (a second controller on a shared root) that
/// opens the same model gets `Busy` and retries after.
pub struct PullArea {
    root: Root,
    sid: SourceId,
    paths: SourcePaths,
    data: PathBuf,
    partial: PathBuf,
    store: &'static dyn SourceStore,
    /// An flock on the area's `lock` file (`File::try_lock`), released
    /// when the file is closed: on drop, after the area's mount is undone,
    /// or by the kernel when the process dies. Closing cannot fail the way
    /// an explicit unlock can on a network filesystem whose server went
    /// away (nix's `Flock` panics on that in its drop).
    lock: Option<File>,
    /// What has arrived so far, for peers (`partial`).
    view: Arc<Partial>,
}

/// Whether a pull of `sid` left work in `root` (or one runs there now,
/// in another process): an area that a new pull would resume.
pub fn left_over(root: &Root, sid: &SourceId) -> bool {
    root.pull_area(sid).dir.exists()
}

impl PullArea {
    /// Opens (or resumes) the area of `sid` in `root`, sized for about
    /// `need` bytes where the store needs a size, and locks it.
    pub fn open(root: &Root, sid: &SourceId, need: Option<u64>) -> Result<PullArea> {
        let paths = root.pull_area(sid);
        let dir = &paths.dir;
        fs::create_dir_all(dir).ctx("create", dir)?;
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .ctx("open", &lock_path)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::Busy(format!(
                    "model {sid} is being pulled by another process; retry later"
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io("lock", &lock_path, e)),
        }
        for sub in ["state", "blobs"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).ctx("create", &p)?;
        }
        let store = root.backend.store();
        let dirs = store.open_pull(&paths, need)?;
        Ok(PullArea {
            root: root.clone(),
            sid: sid.clone(),
            data: dirs.data,
            partial: dirs.partial,
            paths,
            store,
            lock: Some(lock),
            view: root.pulls.register(sid),
        })
    }

    /// What has arrived so far, file by file.
    pub fn partial(&self) -> &Arc<Partial> {
        &self.view
    }

    /// The area itself, for messages.
    pub fn dir(&self) -> &Path {
        &self.paths.dir
    }

    /// Where the model's files go, at their paths in the model.
    pub fn data(&self) -> &Path {
        &self.data
    }

    /// Files still arriving, renamed into `data()` once whole; on the same
    /// filesystem.
    pub fn partial_dir(&self) -> &Path {
        &self.partial
    }

    /// The puller's own progress records, kept until the seal.
    pub fn progress_dir(&self) -> PathBuf {
        self.paths.dir.join("state")
    }

    /// Whole downloads that are not model files (layer blobs), kept until
    /// they are unpacked.
    pub fn blobs_dir(&self) -> PathBuf {
        self.paths.dir.join("blobs")
    }

    /// Every file has arrived: what was still arriving goes, so that it
    /// never becomes part of the model.
    pub fn clear_partial(&self) -> Result<()> {
        remove_tree(&self.partial)
    }

    /// Grows the area after a layer overflowed it.
    pub fn grow(&self) -> Result<Growth> {
        self.store.grow_pull(&self.paths)
    }

    /// Removes the area and everything in it (a failed pull that no retry
    /// could use), while the lock is still ours.
    pub fn discard(&self) -> Result<()> {
        self.store.release_pull(&self.paths)?;
        remove_tree(&self.paths.dir)
    }

    /// Seals the area as source `sid`: checks that each of `files` is in
    /// place at its size, records the tree, makes the bytes immutable and
    /// renames the area into place. Bookkeeping goes only after the rename,
    /// so a crash in between never forces a download again. Losing the
    /// rename to another process that sealed the same model is a success:
    /// its seal is returned.
    /// `filled_from`: the peers that served some of the bytes. `vouch`
    /// judges the tree (at the data directory) before anything is made
    /// immutable: its error leaves nothing sealed, and the work in place
    /// for a retry; its answer is who signed.
    pub fn commit(
        &self,
        files: Vec<FileEntry>,
        origin: &str,
        revision: &str,
        filled_from: Vec<String>,
        vouch: Vouch<'_>,
    ) -> Result<Seal> {
        let tree = self.tree(files)?;
        let signed_by = vouch(&tree, &self.data)?;
        let mut seal = Seal::new(&self.sid, origin, Some(revision.to_string()), tree);
        seal.filled_from = filled_from;
        seal.signed_by = signed_by;
        let bytes = seal.encoded()?;
        self.store.release_pull(&self.paths)?;
        let confined = self.root.open_pull_area(&self.sid)?;
        self.store.make_immutable(&confined, &self.paths)?;
        drop(confined);
        let at = self.paths.seal();
        state::write_atomic(&at, &bytes).ctx("write seal", &at)?;
        let place = self.root.source(&self.sid).dir;
        if let Err(e) = fs::rename(&self.paths.dir, &place) {
            if let Some(theirs) = super::read_seal(&self.root, &self.sid)? {
                let _ = remove_tree(&self.paths.dir);
                return Ok(theirs);
            }
            return Err(Error::io("rename into place", &place, e));
        }
        let sources = self.root.sources_dir();
        state::sync_dir(&sources).ctx("sync", &sources)?;
        remove_bookkeeping(&place);
        Ok(seal)
    }

    /// The files that really are in `data()` (a later layer may have
    /// overwritten or whited out an earlier one's), each at its size, with
    /// every directory and link.
    fn tree(&self, files: Vec<FileEntry>) -> Result<Tree> {
        let mut by_path: BTreeMap<String, FileEntry> = BTreeMap::new();
        for f in files {
            by_path.insert(f.path.clone(), f);
        }
        by_path.retain(|p, _| {
            self.data
                .join(p)
                .symlink_metadata()
                .is_ok_and(|m| m.is_file())
        });
        let mut tree = Tree::default();
        walk_dirs(&self.data, Path::new(""), &mut tree)?;
        for f in by_path.values() {
            let at = self.data.join(&f.path);
            let len = fs::metadata(&at).ctx("stat", &at)?.len();
            if len != f.size {
                return Err(Error::Internal(format!(
                    "{} has {len} bytes after the pull, expected {}",
                    f.path, f.size
                )));
            }
        }
        tree.files = by_path.into_values().collect();
        Ok(tree)
    }
}

impl Drop for PullArea {
    /// A mount left by a pull that stopped is undone; the bytes stay for a
    /// retry. Unmounting can block on a busy filesystem, so on an async
    /// runtime it happens on the blocking pool.
    fn drop(&mut self) {
        let (store, paths, lock) = (self.store, self.paths.clone(), self.lock.take());
        // The lock goes last: whoever takes the area next must not find
        // our mount going away under it.
        let release = move || {
            if let Err(e) = store.release_pull(&paths) {
                tracing::warn!(error = %e, area = %paths.dir.display(), "could not release a pull's area");
            }
            drop(lock);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(release)),
            Err(_) => release(),
        }
    }
}

/// A judgement of a tree about to be sealed (see `PullArea::commit`).
pub type Vouch<'a> = &'a (dyn Fn(&Tree, &Path) -> Result<Option<String>> + Sync);

/// No judgement: nothing to check, nobody signed.
pub fn unvouched(_: &Tree, _: &Path) -> Result<Option<String>> {
    Ok(None)
}

/// Removes the areas of pulls no process is running (their lock is free)
/// but `except`'s: they hold disk space that nothing else would give back.
/// Returns how many went.
pub fn remove_abandoned(root: &Root, except: &SourceId) -> Result<usize> {
    let dir = root.sources_dir();
    let keep = root.pull_area(except).dir;
    let areas = match fs::read_dir(&dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(PULL_PREFIX))
            .map(|e| e.path())
            .filter(|p| *p != keep)
            .collect::<Vec<_>>(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io("list", &dir, e)),
    };
    let mut removed = 0;
    for area in areas {
        let Ok(lock) = OpenOptions::new().write(true).open(area.join("lock")) else {
            continue;
        };
        // Held by a live pull (here or in another process): leave it.
        // Released when `lock` is closed, at the end of this iteration.
        if lock.try_lock().is_err() {
            continue;
        }
        let paths = SourcePaths { dir: area.clone() };
        if root.backend.store().release_pull(&paths).is_err() {
            continue;
        }
        let trash = dir.join(format!(".trash-{}", uuid::Uuid::new_v4().simple()));
        fs::rename(&area, &trash).ctx("move to trash", &area)?;
        fs::remove_dir_all(&trash).ctx("remove", &trash)?;
        tracing::info!(area = %area.display(), "removed an abandoned pull's partial work");
        removed += 1;
    }
    Ok(removed)
}

/// A pull killed between its rename into place and its cleanup leaves its
/// bookkeeping inside the sealed model (the seal lists only `data/`, so no
/// reader sees it, but nothing else would ever remove it).
pub fn tidy_sealed(root: &Root) {
    let Ok(entries) = fs::read_dir(root.sources_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if SourceId::parse_model(&name).is_none() {
            continue;
        }
        let dir = entry.path();
        if dir.join("seal.json").is_file() {
            remove_bookkeeping(&dir);
        }
    }
}

fn remove_bookkeeping(dir: &Path) {
    for leftover in BOOKKEEPING {
        let p = dir.join(leftover);
        let _ = fs::remove_dir_all(&p).or_else(|_| fs::remove_file(&p));
    }
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with('.') && n.contains(".tmp-") {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// `remove_dir_all`, where a tree already gone is success.
fn remove_tree(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", dir, e)),
    }
}

/// Directories and links of the tree under `base`; files come from the
/// hashes the pull computed while writing them.
fn walk_dirs(base: &Path, rel: &Path, tree: &mut Tree) -> Result<()> {
    let dir = base.join(rel);
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .ctx("read directory", &dir)?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let child = rel.join(e.file_name());
        let s = child.to_string_lossy().into_owned();
        let m = fs::symlink_metadata(e.path()).ctx("stat", &e.path())?;
        if m.is_dir() {
            tree.dirs.push(s);
            walk_dirs(base, &child, tree)?;
        } else if m.file_type().is_symlink() {
            let target = fs::read_link(e.path()).ctx("read link", &e.path())?;
            tree.symlinks.push(LinkEntry {
                path: s,
                target: target.to_string_lossy().into_owned(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::manifest::hash_file_chunked;
    use crate::config::Config;

    fn root(dir: &Path) -> Root {
        let cfg = Config {
            node_id: Some("n".into()),
            state_dir: dir.to_path_buf(),
            ..Config::default()
        };
        crate::cache::Roots::of(&cfg).roots.remove(0)
    }

    fn model(c: char) -> SourceId {
        SourceId::parse(&format!("m{}", c.to_string().repeat(31))).unwrap()
    }

    fn put(area: &PullArea, path: &str, bytes: &[u8]) -> FileEntry {
        let at = area.data().join(path);
        fs::create_dir_all(at.parent().unwrap()).unwrap();
        fs::write(&at, bytes).unwrap();
        let (size, sha256, chunks) = hash_file_chunked(&at).unwrap();
        FileEntry {
            path: path.into(),
            size,
            sha256,
            chunks,
        }
    }

    #[test]
    fn an_area_is_locked_while_open_and_resumed_after() {
        let d = tempfile::tempdir().unwrap();
        let (root, sid) = (root(d.path()), model('a'));
        let area = PullArea::open(&root, &sid, Some(10)).unwrap();
        assert!(area.dir().ends_with(format!(".pull-{sid}")));
        for p in [area.data(), area.partial_dir()] {
            assert!(p.is_dir(), "{}", p.display());
        }
        put(&area, "a/b.bin", b"half");
        match PullArea::open(&root, &sid, Some(10)) {
            Err(Error::Busy(m)) => assert!(m.contains(sid.as_str()), "{m}"),
            Err(e) => panic!("a second opener got {e}"),
            Ok(_) => panic!("a second opener got the area"),
        }
        // Nobody else may remove it while it is held.
        assert_eq!(remove_abandoned(&root, &model('b')).unwrap(), 0);
        drop(area);
        let again = PullArea::open(&root, &sid, Some(10)).unwrap();
        assert_eq!(fs::read(again.data().join("a/b.bin")).unwrap(), b"half");
    }

    #[test]
    fn a_commit_seals_what_is_there_and_renames_it_into_place() {
        let d = tempfile::tempdir().unwrap();
        let (root, sid) = (root(d.path()), model('c'));
        let area = PullArea::open(&root, &sid, None).unwrap();
        let mut files = vec![put(&area, "config.json", b"{}")];
        files.push(put(&area, "w/model.safetensors", &[7u8; 5000]));
        // A file a later layer whited out is listed but gone: not sealed.
        let gone = put(&area, "old.txt", b"x");
        fs::remove_file(area.data().join("old.txt")).unwrap();
        files.push(gone);
        std::os::unix::fs::symlink("config.json", area.data().join("link")).unwrap();
        fs::write(area.partial_dir().join("x.part"), b"junk").unwrap();
        area.clear_partial().unwrap();
        fs::write(area.progress_dir().join("p.json"), b"{}").unwrap();
        let seal = area
            .commit(files, "s3://b/m", "etag:1", Vec::new(), &unvouched)
            .unwrap();
        assert_eq!(seal.source, sid.as_str());
        assert_eq!(seal.revision.as_deref(), Some("etag:1"));
        let paths: Vec<_> = seal.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["config.json", "w/model.safetensors"]);
        assert_eq!(seal.dirs, ["w"]);
        assert_eq!(seal.symlinks.len(), 1);
        assert_eq!(seal.total_bytes, 5002);
        drop(area);
        assert_eq!(crate::cache::read_seal(&root, &sid).unwrap(), Some(seal));
        let place = root.source(&sid).dir;
        assert!(!root.pull_area(&sid).dir.exists());
        for gone in ["state", "blobs", "partial", "lock"] {
            assert!(!place.join(gone).exists(), "{gone} is left");
        }
        assert!(place.join("data/w/model.safetensors").is_file());
    }

    #[test]
    fn a_commit_refuses_a_file_of_another_size() {
        let d = tempfile::tempdir().unwrap();
        let (root, sid) = (root(d.path()), model('d'));
        let area = PullArea::open(&root, &sid, None).unwrap();
        let mut f = put(&area, "a.bin", b"1234");
        f.size = 5;
        let e = area
            .commit(vec![f], "s3://b/m", "r", Vec::new(), &unvouched)
            .unwrap_err();
        assert!(
            e.to_string().contains("4 bytes after the pull, expected 5"),
            "{e}"
        );
        assert!(crate::cache::read_seal(&root, &sid).unwrap().is_none());
        assert!(area.data().join("a.bin").is_file(), "kept for a retry");
    }

    #[test]
    fn a_refused_tree_is_not_sealed_and_a_vouched_one_records_its_signer() {
        let d = tempfile::tempdir().unwrap();
        let (root, sid) = (root(d.path()), model('9'));
        let area = PullArea::open(&root, &sid, None).unwrap();
        let files = vec![
            put(&area, "w.bin", b"weights"),
            put(&area, "model.sig", b"sig"),
        ];
        area.clear_partial().unwrap();
        let refuse = |tree: &Tree, data: &Path| -> Result<Option<String>> {
            assert_eq!(tree.files.len(), 2);
            assert_eq!(fs::read(data.join("model.sig")).unwrap(), b"sig");
            Err(Error::Precondition("signature model.sig: not ours".into()))
        };
        let e = area
            .commit(files.clone(), "s3://b/m", "r", Vec::new(), &refuse)
            .unwrap_err();
        assert!(e.to_string().contains("not ours"), "{e}");
        assert!(crate::cache::read_seal(&root, &sid).unwrap().is_none());
        // Nothing was made immutable: the work stays as it was, for a retry.
        assert!(area.data().join("w.bin").is_file());
        fs::OpenOptions::new()
            .append(true)
            .open(area.data().join("model.sig"))
            .expect("still writable");
        fs::write(area.data().join("model.sig"), b"sig").unwrap();
        let seal = area
            .commit(files, "s3://b/m", "r", Vec::new(), &|_, _| {
                Ok(Some("key sha256:ab".into()))
            })
            .unwrap();
        assert_eq!(seal.signed_by.as_deref(), Some("key sha256:ab"));
        drop(area);
        let read = crate::cache::read_seal(&root, &sid).unwrap().unwrap();
        assert_eq!(read.signed_by.as_deref(), Some("key sha256:ab"));
    }

    #[test]
    fn losing_the_rename_to_another_sealer_returns_its_seal() {
        let d = tempfile::tempdir().unwrap();
        let (root, sid) = (root(d.path()), model('e'));
        let first = PullArea::open(&root, &sid, None).unwrap();
        let files = vec![put(&first, "a", b"1")];
        let sealed = first
            .commit(files.clone(), "s3://b/m", "r", Vec::new(), &unvouched)
            .unwrap();
        drop(first);
        // A second area of the same model (another root user's process).
        let second = PullArea::open(&root, &sid, None).unwrap();
        put(&second, "a", b"1");
        let got = second
            .commit(files, "s3://b/m", "r", Vec::new(), &unvouched)
            .unwrap();
        assert_eq!(got, sealed);
        drop(second);
        assert!(!root.pull_area(&sid).dir.exists());
    }

    #[test]
    fn discard_and_abandoned_areas_leave_nothing() {
        let d = tempfile::tempdir().unwrap();
        let root = root(d.path());
        let area = PullArea::open(&root, &model('f'), None).unwrap();
        put(&area, "a", &[1u8; 100]);
        area.discard().unwrap();
        assert!(!area.dir().exists());
        area.discard().unwrap();
        drop(area);
        let left = PullArea::open(&root, &model('1'), None).unwrap();
        put(&left, "a", b"x");
        drop(left);
        let ours = PullArea::open(&root, &model('2'), None).unwrap();
        assert_eq!(remove_abandoned(&root, &model('2')).unwrap(), 1);
        assert!(!root.pull_area(&model('1')).dir.exists());
        assert!(ours.data().is_dir(), "the caller's own area stays");
    }

    #[test]
    fn a_directory_area_does_not_grow() {
        let d = tempfile::tempdir().unwrap();
        let area = PullArea::open(&root(d.path()), &model('0'), None).unwrap();
        assert!(matches!(area.grow().unwrap(), Growth::Fixed));
    }
}
