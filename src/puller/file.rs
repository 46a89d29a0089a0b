//! `file:///path`: a local directory tree (or single file) as a model.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::cache::manifest::{self, FileEntry, LinkEntry, Tree};
use crate::cache::{self, Backend, Root, Seal};
use crate::error::{Error, IoContext, Result};
use crate::{mount, state};

pub fn parse(uri: &str) -> Result<PathBuf, String> {
    let path = uri
        .strip_prefix("file://")
        .ok_or_else(|| format!("{uri:?} does not start with file://"))?;
    let path = PathBuf::from(path);
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(format!(
            "{uri:?} must name an absolute path without '..', like file:///models/minilm"
        ));
    }
    Ok(path)
}

/// The revision of a local tree: a digest of every entry's path, size and
/// modification time, so an edited tree becomes a new model, not a changed one.
fn revision(src: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = src.join(&rel);
        let meta = fs::symlink_metadata(&dir).ctx("stat", &dir)?;
        if !meta.is_dir() {
            h.update(
                format!(
                    "{}\0{}\0{}\n",
                    rel.display(),
                    meta.len(),
                    meta.mtime_nsec() + meta.mtime() * 1_000_000_000
                )
                .as_bytes(),
            );
            continue;
        }
        let mut names: Vec<_> = fs::read_dir(&dir)
            .ctx("read directory", &dir)?
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        names.sort();
        for n in names {
            let child = rel.join(&n);
            let m = fs::symlink_metadata(src.join(&child)).ctx("stat", &src.join(&child))?;
            if m.is_dir() {
                stack.push(child);
            } else {
                let mtime = m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128;
                h.update(format!("{}\0{}\0{mtime}\n", child.display(), m.len()).as_bytes());
            }
        }
    }
    Ok(hex::encode(h.finalize()))
}

pub fn ensure(root: &Root, uri: &str) -> Result<(String, Seal)> {
    let src = parse(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    if !src.exists() {
        return Err(Error::NotFound(format!(
            "model {uri} does not exist on this node"
        )));
    }
    let rev = revision(&src)?;
    let mut h = Sha256::new();
    h.update(format!("file://{}\0{rev}", src.display()));
    let sid = format!("m{}", &hex::encode(h.finalize())[..31]);
    if let Some(seal) = cache::read_seal(root, &sid)? {
        return Ok((sid, seal));
    }
    let final_dir = root.source(&sid).dir;
    let tmp = root
        .sources_dir()
        .join(format!(".pull-{sid}-{}", uuid::Uuid::new_v4().simple()));
    let result = populate(root, &src, &tmp, &sid, uri, &rev);
    let seal = match result {
        Ok(seal) => seal,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    match fs::rename(&tmp, &final_dir) {
        Ok(()) => {
            state::sync_dir(&root.sources_dir()).ctx("sync", &root.sources_dir())?;
            Ok((sid, seal))
        }
        // Another puller sealed the same model first: theirs is as good.
        Err(_) if cache::read_seal(root, &sid)?.is_some() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok((sid.clone(), cache::read_seal(root, &sid)?.unwrap_or(seal)))
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(Error::io("rename into place", &final_dir, e))
        }
    }
}

/// Fills `tmp` (the future source dir) with the model and its seal.
fn populate(root: &Root, src: &Path, tmp: &Path, sid: &str, uri: &str, rev: &str) -> Result<Seal> {
    fs::create_dir_all(tmp).ctx("create", tmp)?;
    let need = tree_bytes(src)?;
    let free = cache::free_bytes(tmp).ctx("statfs", tmp)?;
    let tree = match root.backend {
        Backend::Local | Backend::Shared => {
            if need > free {
                return Err(no_room(uri, need, free));
            }
            let data = tmp.join("data");
            fs::create_dir_all(&data).ctx("create", &data)?;
            copy_tree(src, &data)?
        }
        Backend::Xfs => {
            // Room for XFS metadata on top of the model itself.
            let size = (need + need / 8 + (64 << 20)).max(cache::xfs::MIN_IMAGE_BYTES);
            if size > free {
                return Err(no_room(uri, size, free));
            }
            let image = tmp.join("image.xfs");
            cache::xfs::create_image(&image, size)?;
            let mnt = tmp.join("mnt");
            fs::create_dir_all(&mnt).ctx("create", &mnt)?;
            let lo = mount::loopdev::attach(&image, false).ctx("attach loop device for", &image)?;
            mount::mount_device(lo.path(), &mnt, "xfs", false, "").ctx("mount", &image)?;
            drop(lo);
            let copied = copy_tree(src, &mnt);
            mount::unmount(&mnt).ctx("unmount", &mnt)?;
            let _ = fs::remove_dir(&mnt);
            let tree = copied?;
            cache::xfs::make_readonly(&image)?;
            tree
        }
    };
    let seal = Seal {
        format: manifest::FORMAT,
        source: sid.to_string(),
        origin: uri.to_string(),
        revision: Some(rev.to_string()),
        sealed_unix: cache::now_unix(),
        total_bytes: tree.total_bytes(),
        files: tree.files,
        dirs: tree.dirs,
        symlinks: tree.symlinks,
    };
    let seal_path = tmp.join("seal.json");
    state::write_json(&seal_path, &seal).ctx("write seal", &seal_path)?;
    Ok(seal)
}

fn no_room(uri: &str, need: u64, free: u64) -> Error {
    Error::ResourceExhausted(format!(
        "model {uri} needs {need} bytes but the cache has {free} free"
    ))
}

fn tree_bytes(src: &Path) -> Result<u64> {
    let meta = fs::symlink_metadata(src).ctx("stat", src)?;
    if !meta.is_dir() {
        return Ok(meta.len());
    }
    let mut total = 0;
    for entry in fs::read_dir(src).ctx("read directory", src)? {
        let entry = entry.ctx("read directory", src)?;
        total += tree_bytes(&entry.path())?;
    }
    Ok(total)
}

/// Copies `src` (a directory, or one file) into `dst`, hashing each file as
/// it streams through and fsyncing it. Refuses entries a model must not hold.
fn copy_tree(src: &Path, dst: &Path) -> Result<Tree> {
    let mut tree = Tree::default();
    let meta = fs::symlink_metadata(src).ctx("stat", src)?;
    if meta.is_file() {
        let name = src
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| "model".into());
        let (size, sha256) = copy_file(src, &dst.join(&name))?;
        tree.files.push(FileEntry {
            path: name.to_string_lossy().into_owned(),
            size,
            sha256,
        });
        return Ok(tree);
    }
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut entries: Vec<_> = fs::read_dir(src.join(&rel))
            .ctx("read directory", &src.join(&rel))?
            .filter_map(|e| e.ok())
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let child = rel.join(e.file_name());
            let child_str = child.to_string_lossy().into_owned();
            let from = src.join(&child);
            let to = dst.join(&child);
            let m = fs::symlink_metadata(&from).ctx("stat", &from)?;
            if m.is_dir() {
                fs::create_dir(&to).ctx("create", &to)?;
                tree.dirs.push(child_str);
                stack.push(child);
            } else if m.is_file() {
                let (size, sha256) = copy_file(&from, &to)?;
                tree.files.push(FileEntry {
                    path: child_str,
                    size,
                    sha256,
                });
            } else if m.file_type().is_symlink() {
                let target = fs::read_link(&from).ctx("read link", &from)?;
                if escapes(&child, &target) {
                    return Err(Error::FailedPrecondition(format!(
                        "model entry {child_str} is a symlink to {} outside the model; refused",
                        target.display()
                    )));
                }
                std::os::unix::fs::symlink(&target, &to).ctx("create symlink", &to)?;
                tree.symlinks.push(LinkEntry {
                    path: child_str,
                    target: target.to_string_lossy().into_owned(),
                });
            } else {
                return Err(Error::FailedPrecondition(format!(
                    "model entry {child_str} is not a file, directory or symlink; refused"
                )));
            }
        }
    }
    tree.dirs.sort();
    tree.files.sort_by(|a, b| a.path.cmp(&b.path));
    tree.symlinks.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(tree)
}

/// True if a symlink at `link` (relative to the model root) pointing at
/// `target` would resolve outside the model.
pub fn escapes(link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return true;
    }
    let mut depth: i64 = link.components().count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
        if depth < 0 {
            return true;
        }
    }
    false
}

/// Copies one file with a fixed buffer, hashing as bytes pass. The new file
/// gets plain 0644: no setuid bits, no device nodes are ever created.
fn copy_file(from: &Path, to: &Path) -> Result<(u64, String)> {
    let mut input = File::open(from).ctx("open", from)?;
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .ctx("create", to)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = input.read(&mut buf).ctx("read", from)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n]).ctx("write", to)?;
        size += n as u64;
    }
    out.sync_all().ctx("sync", to)?;
    Ok((size, hex::encode(h.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_forms() {
        assert!(parse("file:///models/a").is_ok());
        assert!(parse("file://relative").is_err());
        assert!(parse("file:///a/../etc").is_err());
    }

    #[test]
    fn symlink_escape_detection() {
        assert!(escapes(Path::new("a"), Path::new("/etc/passwd")));
        assert!(escapes(Path::new("a"), Path::new("../x")));
        assert!(escapes(Path::new("d/a"), Path::new("../../x")));
        assert!(!escapes(Path::new("d/a"), Path::new("../x")));
        assert!(!escapes(Path::new("d/a"), Path::new("b/c")));
    }
}
