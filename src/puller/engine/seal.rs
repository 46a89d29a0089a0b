//! The end of a pull: sizes verified, the seal written, the work
//! directory renamed into place.

use super::*;

/// Verifies sizes, writes the seal, and renames the work directory into
/// place. Bookkeeping is removed only after the rename, so a crash in
/// between never forces a re-download.
pub(super) fn seal_work(
    root: &Root,
    sid: &str,
    work: &Work,
    entries: Vec<FileEntry>,
    uri: &str,
    revision: &str,
) -> Result<Seal> {
    let mut files: BTreeMap<String, FileEntry> = BTreeMap::new();
    for e in entries {
        files.insert(e.path.clone(), e);
    }
    // Layers may have overwritten or whited-out files of earlier layers:
    // keep what is really there.
    files.retain(|p, _| {
        work.data
            .join(p)
            .symlink_metadata()
            .map(|m| m.is_file())
            .unwrap_or(false)
    });
    let mut tree = Tree::default();
    walk_dirs(&work.data, Path::new(""), &mut tree)?;
    for f in files.values() {
        let len = fs::metadata(work.data.join(&f.path))
            .ctx("stat", &work.data.join(&f.path))?
            .len();
        if len != f.size {
            return Err(Error::Internal(format!(
                "{} has {len} bytes after the pull, expected {}",
                f.path, f.size
            )));
        }
    }
    tree.files = files.into_values().collect();
    if let Some(mnt) = &work.mounted {
        mount::unmount(mnt).ctx("unmount", mnt)?;
        let _ = fs::remove_dir(mnt);
        cache::xfs::make_readonly(&work.dir.join("image.xfs"))?;
    }
    let seal = Seal {
        format: manifest::FORMAT,
        source: sid.to_string(),
        origin: uri.to_string(),
        revision: Some(revision.to_string()),
        sealed_unix: cache::now_unix(),
        total_bytes: tree.total_bytes(),
        files: tree.files,
        dirs: tree.dirs,
        symlinks: tree.symlinks,
    };
    state::write_json(&work.dir.join("seal.json"), &seal).ctx("write seal", &work.dir)?;
    let final_dir = root.source(sid).dir;
    match fs::rename(&work.dir, &final_dir) {
        Ok(()) => {}
        Err(_) if cache::read_seal(root, sid)?.is_some() => {
            let _ = fs::remove_dir_all(&work.dir);
            return cache::read_seal(root, sid)?
                .ok_or_else(|| Error::Internal("seal vanished".into()));
        }
        Err(e) => return Err(Error::io("rename into place", &final_dir, e)),
    }
    state::sync_dir(&root.sources_dir()).ctx("sync", &root.sources_dir())?;
    for leftover in ["state", "blobs", "partial", "lock"] {
        let p = final_dir.join(leftover);
        let _ = fs::remove_dir_all(&p).or_else(|_| fs::remove_file(&p));
    }
    Ok(seal)
}

/// Directories and symlinks of the unpacked tree; files come from the
/// hashes computed while downloading.
pub(super) fn walk_dirs(base: &Path, rel: &Path, tree: &mut Tree) -> Result<()> {
    let dir = base.join(rel);
    let mut entries: Vec<_> = fs::read_dir(&dir)
        .ctx("read directory", &dir)?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let child = rel.join(&name);
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
