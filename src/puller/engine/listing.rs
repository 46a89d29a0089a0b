//! A source's listing judged before anything is fetched: every name,
//! no name twice, sizes that add up, and the pull's limits.

use super::*;

// Where an image area keeps files still arriving: a source may not list
// anything under it.
use crate::cache::pull::PARTIAL_DIR;

/// The longest file name and path a model may hold (Linux NAME_MAX and
/// PATH_MAX): longer ones would fail deep in the pull with ENAMETOOLONG.
pub(super) const MAX_NAME_BYTES: usize = 255;
pub(super) const MAX_PATH_BYTES: usize = 4096;

/// Refuses a model path a source listed, as it was sent, never altered:
/// '/'-separated, relative, no empty, '.' or '..' component, no control
/// character, within NAME_MAX and PATH_MAX, not under [`PARTIAL_DIR`].
pub(super) fn check_path(p: &str) -> Result<()> {
    let why = if p.split('/').any(|c| matches!(c, "" | "." | "..")) {
        Some("which would land outside the model")
    } else if p.chars().any(char::is_control) {
        Some("which has a control character in it")
    } else if p.len() > MAX_PATH_BYTES || p.split('/').any(|c| c.len() > MAX_NAME_BYTES) {
        Some("which is longer than a path or file name may be")
    } else if p.split('/').next() == Some(PARTIAL_DIR) {
        Some("which is where the driver keeps partial files")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::SourceFault(format!(
            "it lists a file at {p:?}, {why}; refused"
        ))),
        None => Ok(()),
    }
}

/// The one place a listing is judged before anything is fetched: every
/// name (see [`check_path`]), no name twice, no file inside a file, sizes
/// that add up, and the pull's limits. Returns the model's size when every
/// file's size is known.
pub(super) fn check_listing(r: &Resolved, limits: &PullLimits) -> Result<Option<u64>> {
    if r.files.is_empty() {
        return Err(Error::NotFound(format!("{} has no files", r.uri)));
    }
    let count = r.files.len() as u64;
    if count > limits.max_files {
        return Err(Error::OverLimit(format!(
            "{} lists {count} files, more than this driver or StorageClass allows ({} files: \
             --max-model-files or the class's maxModelFiles); nothing was fetched",
            r.uri, limits.max_files
        )));
    }
    let mut names = BTreeSet::new();
    for f in &r.files {
        if f.path.is_empty() && f.unpack != Unpack::None {
            continue; // a layer unpacked at the model root
        }
        check_path(&f.path)?;
        if f.unpack == Unpack::None && !names.insert(f.path.as_str()) {
            return Err(Error::SourceFault(format!(
                "{} lists the file {:?} twice",
                r.uri, f.path
            )));
        }
    }
    for n in &names {
        for (i, _) in n.match_indices('/') {
            if names.contains(&n[..i]) {
                return Err(Error::SourceFault(format!(
                    "{} lists {:?} both as a file and as a directory (of {n:?})",
                    r.uri,
                    &n[..i]
                )));
            }
        }
    }
    let total = r.total_bytes()?;
    let known = r.known_bytes();
    if known > limits.max_bytes {
        return Err(Error::OverLimit(format!(
            "{} lists {known} bytes, more than this driver or StorageClass allows ({} bytes: \
             --max-model-bytes or the class's maxModelBytes); nothing was fetched",
            r.uri, limits.max_bytes
        )));
    }
    // Layers are metered as they unpack; their blobs are not model files.
    let mut seal = crate::cache::manifest::SealMeter::default();
    for f in r.files.iter().filter(|f| f.unpack == Unpack::None) {
        seal.file(&f.path, f.size.unwrap_or(0));
        if seal.over() {
            return Err(Error::OverLimit(format!(
                "{}; nothing was fetched",
                seal.refusal(&format!("the listing of {}", r.uri))
            )));
        }
    }
    Ok(total)
}

/// What a listing will take in the cache, as far as it tells: bytes as
/// charged (`manifest::charge`: each plain file rounded up to whole blocks,
/// a block per directory; layers at their blob's size), None while a size
/// is unknown; and the inodes of its plain files, their directories and
/// the model's root (what layers unpack is bounded by the files limit).
pub(super) fn need_of(r: &Resolved, total: Option<u64>) -> (Option<u64>, u64) {
    let mut dirs = BTreeSet::new();
    let mut plain = Vec::new();
    for f in r.files.iter().filter(|f| f.unpack == Unpack::None) {
        dirs.extend(f.path.match_indices('/').map(|(i, _)| &f.path[..i]));
        plain.push(f.size.unwrap_or(0));
    }
    let inodes = (plain.len() + dirs.len()) as u64 + 1;
    let listed: u64 = plain.iter().fold(0, |a, b| a.saturating_add(*b));
    let overhead = crate::cache::manifest::charge(plain.iter().copied(), dirs.len() as u64)
        .saturating_sub(listed);
    (total.map(|t| t.saturating_add(overhead)), inodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The review's model: 100,000 empty files whose paths are about 650
    /// bytes each (components of at most 255), a seal of some 80 MB, is
    /// refused before anything is fetched, naming the bound; the same
    /// count with short names passes.
    #[test]
    fn a_listing_whose_seal_would_outgrow_its_bound_is_refused() {
        let listing = |name: &dyn Fn(usize) -> String| Resolved {
            uri: "oci://r/bloat:1".into(),
            revision: "r".into(),
            files: (0..100_000)
                .map(|i| RemoteFile {
                    path: name(i),
                    size: Some(0),
                    sha256: None,
                    locator: String::new(),
                    unpack: Unpack::None,
                })
                .collect(),
        };
        let limits = PullLimits {
            max_bytes: 1 << 40,
            max_files: 100_000,
        };
        let long = |i: usize| {
            format!(
                "{}/{}/c-{i:06}-{}",
                "a".repeat(255),
                "b".repeat(255),
                "x".repeat(120)
            )
        };
        let e = check_listing(&listing(&long), &limits).unwrap_err();
        assert!(
            matches!(&e, Error::OverLimit(m) if m.contains("33554432") && m.contains("nothing was fetched")),
            "{e}"
        );
        let short = |i: usize| format!("shards/part-{i:06}.bin");
        check_listing(&listing(&short), &limits).unwrap();
    }
    /// 20,000 empty files cost 20,000 blocks and as many inodes, not 0.
    #[test]
    fn empty_files_are_charged_a_block_and_an_inode() {
        let files: Vec<(String, Option<u64>)> = (0..20_000)
            .map(|i| (format!("d{}/f{i}", i % 10), Some(0)))
            .collect();
        let refs: Vec<(&str, Option<u64>)> = files.iter().map(|(p, s)| (p.as_str(), *s)).collect();
        let r = listing(&refs);
        let (bytes, inodes) = need_of(&r, r.total_bytes().unwrap());
        assert_eq!(bytes, Some((20_000 + 10) * 4096));
        assert_eq!(inodes, 20_000 + 10 + 1);
        let (bytes, _) = need_of(&listing(&[("a", Some(1)), ("b", Some(4097))]), Some(4098));
        assert_eq!(bytes, Some(4096 + 8192));
        assert_eq!(need_of(&listing(&[("a", None)]), None).0, None);
    }

    #[test]
    fn model_paths_stay_inside() {
        for bad in ["/etc/passwd", "../x", "a/../../x", "a/./b", ""] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
        check_path("1_Pooling/config.json").unwrap();
    }

    #[test]
    fn names_are_refused_as_sent_never_altered() {
        let long = "n".repeat(256);
        for bad in [
            "a\u{7}b",
            "tab\there",
            "new\nline",
            "del\u{7f}",
            "c1\u{85}",
            long.as_str(),
            ".modelcache-partial/x",
        ] {
            let e = check_path(bad).unwrap_err();
            assert!(matches!(e, Error::SourceFault(_)), "{bad:?}: {e:?}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        check_path("ünïcode/名前.bin").unwrap();
        check_path("x/.modelcache-partial").unwrap();
    }

    fn listing(files: &[(&str, Option<u64>)]) -> Resolved {
        Resolved {
            uri: "test://m".into(),
            revision: "r".into(),
            files: files
                .iter()
                .map(|(p, size)| RemoteFile {
                    path: p.to_string(),
                    size: *size,
                    sha256: None,
                    locator: p.to_string(),
                    unpack: Unpack::None,
                })
                .collect(),
        }
    }

    #[test]
    fn a_listing_is_judged_before_anything_is_fetched() {
        let limits = PullLimits::default();
        let fault = |files: &[(&str, Option<u64>)]| {
            let e = check_listing(&listing(files), &limits).unwrap_err();
            assert!(matches!(e, Error::SourceFault(_)), "{e:?}");
            e.to_string()
        };
        let e = fault(&[("a", Some(u64::MAX)), ("b", Some(1))]);
        assert!(e.contains("more than 2^64"), "{e}");
        let e = fault(&[("a", Some(1)), ("a", Some(1))]);
        assert!(e.contains("\"a\" twice"), "{e}");
        let e = fault(&[("a", Some(1)), ("a/b", Some(1))]);
        assert!(e.contains("both as a file and as a directory"), "{e}");
        let e = fault(&[("d/a", Some(1)), ("d/a/b/c", Some(1))]);
        assert!(e.contains("\"d/a\""), "{e}");
        assert_eq!(
            check_listing(
                &listing(&[("a", Some(1)), ("a.part", Some(2)), ("ab/c", None)]),
                &limits
            )
            .unwrap(),
            None
        );
        assert_eq!(
            check_listing(&listing(&[("a", Some(1)), ("b", Some(2))]), &limits).unwrap(),
            Some(3)
        );
        let tight = PullLimits {
            max_bytes: 2,
            max_files: 1,
        };
        let e = check_listing(&listing(&[("a", Some(1)), ("b", None)]), &tight).unwrap_err();
        assert!(
            matches!(&e, Error::OverLimit(m) if m.contains("maxModelFiles")),
            "{e:?}"
        );
        let e = check_listing(
            &listing(&[("a", Some(3)), ("b", None)]),
            &PullLimits {
                max_files: 9,
                ..tight
            },
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::OverLimit(m) if m.contains("maxModelBytes")),
            "{e:?}"
        );
    }
}
