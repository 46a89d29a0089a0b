//! Resolve a volume's subPath inside a model directory without ever leaving it.
//!
//! The model's content is not ours to trust: a symlink inside it may point
//! anywhere. Resolution therefore happens in the kernel (openat2 with
//! RESOLVE_BENEATH) and yields a file descriptor; callers bind-mount
//! `/proc/self/fd/N` so the directory checked is the directory mounted.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, open};
use nix::sys::stat::Mode;

use super::with_context;

const MAX_LEN: usize = 4096;

/// Check that `sub` is a plain relative path: non-empty, at most 4096 bytes, no NUL, no leading
/// '/', and no empty, "." or ".." components. One spelling per directory keeps subPaths
/// comparable as strings.
pub fn validate_syntax(sub: &str) -> Result<(), String> {
    if sub.is_empty() {
        return Err("subPath is empty".into());
    }
    if sub.len() > MAX_LEN {
        return Err(format!(
            "subPath is {} bytes long, at most {MAX_LEN} are allowed",
            sub.len()
        ));
    }
    if sub.contains('\0') {
        return Err(format!("subPath {sub:?} contains a NUL byte"));
    }
    if sub.starts_with('/') {
        return Err(format!(
            "subPath {sub:?} is absolute; it must be relative to the model root"
        ));
    }
    for component in sub.split('/') {
        match component {
            ".." => return Err(format!("subPath {sub:?} must not contain \"..\"")),
            "." => return Err(format!("subPath {sub:?} must not contain \".\" components")),
            "" => {
                return Err(format!(
                    "subPath {sub:?} has an empty component (doubled or trailing '/')"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Open the directory `sub` beneath `root` as an O_PATH descriptor. Fails with InvalidInput
/// for bad syntax or when resolution would leave `root` (through a symlink or a mount point),
/// and with NotFound when the directory does not exist.
pub fn open_beneath(root: &Path, sub: &str) -> io::Result<OwnedFd> {
    validate_syntax(sub).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let root_fd = open(root, flags, Mode::empty())
        .map_err(|e| with_context(e, format_args!("open {}", root.display())))?;
    let how = OpenHow::new().flags(flags).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_MAGICLINKS
            | ResolveFlag::RESOLVE_NO_XDEV,
    );
    let escape = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "subPath {sub:?} escapes the source {} via {why}",
                root.display()
            ),
        )
    };
    match crate::beneath::openat2_settled(&root_fd, sub, how) {
        Ok(fd) => Ok(fd),
        Err(Errno::EXDEV) => Err(escape("a symlink or a mount point")),
        Err(Errno::ELOOP) => Err(escape("a symlink (magic link or symlink loop)")),
        Err(e) => Err(with_context(
            e,
            format_args!("open subPath {sub:?} beneath {}", root.display()),
        )),
    }
}

/// Opens `rel` beneath the directory `base` with no symlink anywhere on the way: for paths the
/// driver laid out itself (a source's directory, its data, its image), where a symlink can only
/// be a forgery by someone else who writes the same shared filesystem. `flags` says how to
/// open the last component (O_PATH|O_DIRECTORY for a bind source, O_RDONLY or O_RDWR for an
/// image); O_CLOEXEC is always added. RESOLVE_NO_SYMLINKS refuses a link in the last component
/// too (O_NOFOLLOW is left out: with O_PATH it would open the link itself). ELOOP and EXDEV mean
/// a symlink or an escape and come back as InvalidInput naming the path.
pub fn open_confined(
    base: &OwnedFd,
    base_path: &Path,
    rel: &str,
    flags: OFlag,
) -> io::Result<OwnedFd> {
    let how = OpenHow::new().flags(flags | OFlag::O_CLOEXEC).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS,
    );
    match crate::beneath::openat2_settled(base, rel, how) {
        Ok(fd) => Ok(fd),
        Err(Errno::ELOOP) | Err(Errno::EXDEV) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is, or passes through, a symlink: the driver never follows links it \
                 did not make out of its storage root",
                base_path.join(rel).display()
            ),
        )),
        Err(e) => Err(with_context(
            e,
            format_args!("open {}", base_path.join(rel).display()),
        )),
    }
}

/// Opens the directory `path` itself, following nothing in its last component: the anchor of
/// `open_confined`.
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| with_context(e, format_args!("open {}", path.display())))
}

/// A path naming exactly the directory behind `fd`, usable as a bind-mount source while `fd`
/// stays open.
pub fn proc_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    #[test]
    fn syntax_rejects_escapes_and_odd_spellings() {
        for bad in [
            "", "..", "/abs", "a/../b", "a/..", "./a", "a/./b", "a//b", "a/", "a\0b",
        ] {
            assert!(validate_syntax(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_syntax(&"a".repeat(MAX_LEN + 1)).is_err());
        for good in ["a", "models/llama-3/weights", "..a/b..", ".hidden", "a b"] {
            assert_eq!(validate_syntax(good), Ok(()), "{good:?}");
        }
        assert!(validate_syntax("a/../b").unwrap_err().contains(".."));
    }

    /// root/models/llama (dir), root/models/etc -> /etc, root/models/esc -> ../../x,
    /// root/models/alias -> llama, root/models/up -> ../models/llama, root/file
    fn tree() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("x")).unwrap();
        let root = tmp.path().join("root");
        fs::create_dir_all(root.join("models/llama")).unwrap();
        fs::write(root.join("file"), b"").unwrap();
        symlink("/etc", root.join("models/etc")).unwrap();
        symlink("../../x", root.join("models/esc")).unwrap();
        symlink("llama", root.join("models/alias")).unwrap();
        symlink("../models/llama", root.join("models/up")).unwrap();
        (tmp, root)
    }

    fn same_dir(fd: &OwnedFd, dir: &Path) -> bool {
        fs::canonicalize(proc_path(fd)).unwrap() == fs::canonicalize(dir).unwrap()
    }

    #[test]
    fn opens_directories_inside_the_root() {
        let (_tmp, root) = tree();
        let llama = root.join("models/llama");
        for sub in ["models/llama", "models/alias", "models/up"] {
            let fd = open_beneath(&root, sub).unwrap();
            assert!(same_dir(&fd, &llama), "{sub}");
        }
    }

    #[test]
    fn symlinks_leaving_the_root_are_refused() {
        let (_tmp, root) = tree();
        for sub in ["models/etc", "models/esc"] {
            let err = open_beneath(&root, sub).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{sub}: {err}");
            assert!(err.to_string().contains("escapes the source"), "{err}");
        }
        let err = open_beneath(&root, "models/../..").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let err = open_beneath(&root, "/etc").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn confined_opens_follow_no_symlink_at_all() {
        let (_tmp, root) = tree();
        let base = open_dir(&root).unwrap();
        let dir = OFlag::O_PATH | OFlag::O_DIRECTORY;
        assert!(open_confined(&base, &root, "models/llama", dir).is_ok());
        // Even a link that stays inside the root is refused.
        for rel in ["models/alias", "models/etc", "models/esc", "../x", "/etc"] {
            let err = open_confined(&base, &root, rel, dir).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{rel}: {err}");
        }
        let err = open_confined(&base, &root, "models/etc", dir).unwrap_err();
        assert!(err.to_string().contains("models/etc"), "{err}");
    }

    #[test]
    fn missing_or_non_directory_targets() {
        let (_tmp, root) = tree();
        let err = open_beneath(&root, "models/missing").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert!(err.to_string().contains("models/missing"), "{err}");
        let err = open_beneath(&root, "file").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotADirectory, "{err}");
        let err = open_beneath(&root.join("nope"), "a").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }
}
