//! `file:///path`: a local directory tree (or single file) as a model, for
//! tests and air-gapped nodes. Symlinked files are read through, so a
//! Hugging Face cache snapshot (symlinks into `blobs/`) works as a source;
//! for a tenant's URI only while they stay beneath the allowed prefix,
//! which the kernel checks (openat2 with RESOLVE_BENEATH) on every open.

use std::collections::HashSet;
use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use sha2::{Digest, Sha256};

use super::source::{RemoteFile, Resolved, Source, Unpack};
use crate::error::{Error, IoContext, Result};

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

pub struct FileSource {
    root: PathBuf,
    /// Every file must resolve beneath this directory (a tenant's allowed
    /// prefix), symlinks included.
    beneath: Option<PathBuf>,
}

impl FileSource {
    pub fn new(uri: &str) -> Result<FileSource> {
        let root = parse(uri).map_err(|m| Error::invalid("source", m))?;
        Ok(FileSource {
            root,
            beneath: None,
        })
    }

    /// The same source, confined to `dir`: a file reached through a link
    /// that leaves it is refused, at listing and at every read.
    pub fn beneath(mut self, dir: PathBuf) -> FileSource {
        self.beneath = Some(dir);
        self
    }
}

/// Opens `path` for reading, resolved by the kernel beneath `base` when
/// given: a symlink (or `..`) that would leave it fails with EXDEV, which
/// becomes PermissionDenied naming the file.
fn open_file(path: &Path, base: Option<&Path>) -> Result<File> {
    match base {
        None => File::open(path).ctx("open", path),
        Some(base) => open_in(&File::open(base).ctx("open", base)?, base, path),
    }
}

/// `open_file` beneath `base`, whose directory `dir` is already open (a
/// listing checks every file against one descriptor).
fn open_in(dir: &File, base: &Path, path: &Path) -> Result<File> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let rel = path.strip_prefix(base).map_err(|_| {
        Error::NotAllowed(format!(
            "{} is not beneath {}",
            path.display(),
            base.display()
        ))
    })?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    match crate::beneath::openat2_settled(dir, rel, how) {
        Ok(fd) => Ok(File::from(fd)),
        Err(nix::errno::Errno::EXDEV | nix::errno::Errno::ELOOP) => {
            Err(Error::NotAllowed(format!(
                "{} leads out of {} through a symbolic link; a source named by a PVC or pod is read \
             only beneath its allowed prefix",
                path.display(),
                base.display()
            )))
        }
        Err(e) => Err(Error::io("open", path, std::io::Error::from(e))),
    }
}

fn list(root: &Path) -> Result<Vec<(String, PathBuf, fs::Metadata)>> {
    let meta = fs::metadata(root).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound(format!(
                "model file://{} does not exist on this node",
                root.display()
            ))
        } else {
            Error::io("stat", root, e)
        }
    })?;
    if meta.is_file() {
        let name = root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        return Ok(vec![(name, root.to_path_buf(), meta)]);
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let m = fs::metadata(&dir).ctx("stat", &dir)?;
        // A symlinked directory loop would otherwise never end.
        if !seen.insert((m.dev(), m.ino())) {
            continue;
        }
        for entry in fs::read_dir(&dir).ctx("read directory", &dir)? {
            let entry = entry.ctx("read directory", &dir)?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(Error::Precondition(format!(
                    "{} holds a file name that is not UTF-8",
                    dir.display()
                )));
            };
            let child = rel.join(name);
            let path = root.join(&child);
            let m = fs::metadata(&path).ctx("stat", &path)?;
            if m.is_dir() {
                stack.push(child);
            } else if m.is_file() {
                out.push((child.to_string_lossy().into_owned(), path, m));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[async_trait::async_trait]
impl Source for FileSource {
    async fn resolve(&self) -> Result<Resolved> {
        let (root, beneath) = (self.root.clone(), self.beneath.clone());
        let entries = tokio::task::spawn_blocking(move || {
            let entries = list(&root)?;
            // What a listing followed, the kernel must be able to reach
            // beneath the prefix too.
            if let Some(b) = &beneath {
                let dir = File::open(b).ctx("open", b)?;
                for (_, path, _) in &entries {
                    open_in(&dir, b, path)?;
                }
            }
            Ok::<_, Error>(entries)
        })
        .await
        .map_err(|e| Error::Internal(format!("listing failed: {e}")))??;
        // An edited tree is a new revision: every path, size and mtime counts.
        let mut h = Sha256::new();
        let mut files = Vec::new();
        for (rel, path, m) in entries {
            h.update(format!("{rel}\0{}\0{}.{}\n", m.len(), m.mtime(), m.mtime_nsec()).as_bytes());
            files.push(RemoteFile {
                path: rel,
                size: Some(m.len()),
                sha256: None,
                locator: path.to_string_lossy().into_owned(),
                unpack: Unpack::None,
            });
        }
        Ok(Resolved {
            uri: format!("file://{}", self.root.display()),
            revision: hex::encode(h.finalize()),
            files,
        })
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        let path = PathBuf::from(&file.locator);
        let f = open_file(&path, self.beneath.as_deref())?;
        let end = match len {
            Some(l) => offset + l,
            None => f.metadata().ctx("stat", &path)?.len(),
        };
        let state = (std::sync::Arc::new(f), offset);
        Ok(stream::unfold(state, move |(f, pos)| {
            let path = path.clone();
            async move {
                if pos >= end {
                    return None;
                }
                let n = ((end - pos) as usize).min(1 << 20);
                let f2 = f.clone();
                let read = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; n];
                    let got = f2.read_at(&mut buf, pos)?;
                    buf.truncate(got);
                    Ok::<_, std::io::Error>(buf)
                })
                .await;
                match read {
                    Ok(Ok(buf)) if buf.is_empty() => None,
                    Ok(Ok(buf)) => {
                        let next = pos + buf.len() as u64;
                        Some((Ok(Bytes::from(buf)), (f, next)))
                    }
                    Ok(Err(e)) => Some((Err(Error::io("read", &path, e)), (f, end))),
                    Err(e) => Some((
                        Err(Error::Internal(format!("read task failed: {e}"))),
                        (f, end),
                    )),
                }
            }
        })
        .boxed())
    }
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

    #[tokio::test]
    async fn lists_and_reads_ranges() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("m/sub")).unwrap();
        fs::write(d.path().join("m/sub/a.bin"), b"0123456789").unwrap();
        std::os::unix::fs::symlink("sub/a.bin", d.path().join("m/link.bin")).unwrap();
        let src = FileSource::new(&format!("file://{}/m", d.path().display())).unwrap();
        let r = src.resolve().await.unwrap();
        let paths: Vec<_> = r.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, vec!["link.bin", "sub/a.bin"]);
        let bytes: Vec<u8> = src
            .read(&r.files[1], 3, Some(4))
            .await
            .unwrap()
            .map(|b| b.unwrap().to_vec())
            .concat()
            .await;
        assert_eq!(bytes, b"3456");
        assert_eq!(src.resolve().await.unwrap().revision, r.revision);
    }

    /// A tenant's `file:///models/m` under the prefix `file:///models/`:
    /// links inside the prefix are read through; one to a host file is
    /// refused at listing, and at reading if it appears afterwards.
    #[tokio::test]
    async fn a_confined_source_stays_beneath_its_prefix() {
        let d = tempfile::tempdir().unwrap();
        let (prefix, outside) = (d.path().join("models"), d.path().join("secret"));
        fs::create_dir_all(prefix.join("m")).unwrap();
        fs::create_dir_all(prefix.join("blobs")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(prefix.join("blobs/w"), b"weights").unwrap();
        fs::write(outside.join("token"), b"secret").unwrap();
        std::os::unix::fs::symlink("../blobs/w", prefix.join("m/w.bin")).unwrap();
        let uri = format!("file://{}/m", prefix.display());
        let src = FileSource::new(&uri).unwrap().beneath(prefix.clone());
        let r = src
            .resolve()
            .await
            .expect("links within the prefix are fine");
        assert_eq!(r.files.len(), 1);

        std::os::unix::fs::symlink(outside.join("token"), prefix.join("m/abs")).unwrap();
        std::os::unix::fs::symlink("../../secret/token", prefix.join("m/rel")).unwrap();
        let e = src.resolve().await.unwrap_err();
        assert!(
            matches!(e, Error::NotAllowed(ref m) if m.contains("symbolic link")),
            "{e}"
        );
        // Swapped in after the listing: the read is refused too.
        fs::remove_file(prefix.join("m/w.bin")).unwrap();
        std::os::unix::fs::symlink(outside.join("token"), prefix.join("m/w.bin")).unwrap();
        let e = src.read(&r.files[0], 0, None).await.err().unwrap();
        assert!(matches!(e, Error::NotAllowed(_)), "{e}");
        // An admin's source is not confined.
        let admin = FileSource::new(&uri).unwrap();
        assert!(admin.resolve().await.is_ok());
    }
}
