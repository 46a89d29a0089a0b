//! `file:///path`: a local directory tree (or single file) as a model, for
//! tests and air-gapped nodes. Symlinked files are read through, so a
//! Hugging Face cache snapshot (symlinks into `blobs/`) works as a source.

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
}

impl FileSource {
    pub fn new(uri: &str) -> Result<FileSource> {
        let root = parse(uri).map_err(|m| Error::invalid("source", m))?;
        Ok(FileSource { root })
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
        let root = self.root.clone();
        let entries = tokio::task::spawn_blocking(move || list(&root))
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
        let f = File::open(&path).ctx("open", &path)?;
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
}
