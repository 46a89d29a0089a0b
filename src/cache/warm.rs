//! Which model each StorageClass last had pulled into a node-local root: one
//! small record per class, kept after the volumes that pulled it are gone,
//! so the node can say which classes it is warm for (their model sealed
//! here) until eviction takes the model.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::layout::{Root, SourceId};
use crate::error::{IoContext, Result};
use crate::state;

/// A class's model on this root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassModel {
    /// The class's `source` parameter when the model was pulled: a class
    /// since changed to name another model is not warm for this one.
    pub source: String,
    /// The sealed (or arriving) source the class's volumes read.
    pub sid: SourceId,
}

fn dir(root: &Root) -> PathBuf {
    root.dir.join("classes")
}

/// A StorageClass name (a DNS subdomain) is a safe file name; anything
/// else is never written or read.
fn is_class_name(class: &str) -> bool {
    !class.is_empty()
        && class.len() <= 253
        && !class.starts_with('.')
        && class
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'))
}

/// Records that `class`'s volumes on `root` read `model`. The last pull
/// of a class wins: a class pinned to a moving revision is warm for the
/// revision pulled last.
pub fn remember(root: &Root, class: &str, model: &ClassModel) -> Result<()> {
    if !is_class_name(class) || !model.sid.is_model() {
        return Ok(());
    }
    let dir = dir(root);
    std::fs::create_dir_all(&dir).ctx("create", &dir)?;
    let path = dir.join(format!("{class}.json"));
    if state::read_json::<ClassModel>(&path)
        .ok()
        .flatten()
        .as_ref()
        == Some(model)
    {
        return Ok(());
    }
    state::write_json(&path, model).ctx("write", &path)
}

/// The classes whose model is sealed on one of `roots`, with that model.
pub fn warm(roots: &[Root]) -> BTreeMap<String, ClassModel> {
    let mut out = BTreeMap::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(dir(root)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(class) = name.strip_suffix(".json").filter(|c| is_class_name(c)) else {
                continue;
            };
            let Ok(Some(model)) = state::read_json::<ClassModel>(&e.path()) else {
                continue;
            };
            // An evicted model's record stays (one small file per class):
            // eviction may put a model back when a reference appears.
            if root.source(&model.sid).seal().is_file() {
                out.insert(class.to_string(), model);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Backend;

    fn root(dir: &std::path::Path) -> Root {
        Root::with_anchor(
            Backend::Local,
            dir.to_path_buf(),
            Some("n".into()),
            dir.to_path_buf(),
            Default::default(),
        )
    }

    const SID: &str = "m0123456789abcdef0123456789abcde";

    #[test]
    fn a_class_is_warm_while_its_model_is_sealed() {
        let t = tempfile::tempdir().unwrap();
        let r = root(t.path());
        let model = ClassModel {
            source: "hf://org/m@abc".into(),
            sid: SourceId::parse(SID).unwrap(),
        };
        remember(&r, "llama", &model).unwrap();
        let sid = model.sid.clone();
        // Arriving: not warm yet, and remembered.
        std::fs::create_dir_all(r.source(&sid).dir).unwrap();
        assert!(warm(std::slice::from_ref(&r)).is_empty());
        std::fs::write(r.source(&sid).seal(), "{}").unwrap();
        assert_eq!(
            warm(std::slice::from_ref(&r)),
            BTreeMap::from([("llama".to_string(), model)])
        );
        // Evicted: cold until it is sealed here again.
        std::fs::remove_dir_all(r.source(&sid).dir).unwrap();
        assert!(warm(std::slice::from_ref(&r)).is_empty());
        std::fs::create_dir_all(r.source(&sid).dir).unwrap();
        std::fs::write(r.source(&sid).seal(), "{}").unwrap();
        assert_eq!(warm(std::slice::from_ref(&r)).len(), 1);
    }

    #[test]
    fn only_class_names_become_files() {
        let t = tempfile::tempdir().unwrap();
        let r = root(t.path());
        let model = ClassModel {
            source: "s".into(),
            sid: SourceId::parse(SID).unwrap(),
        };
        for bad in ["", "../x", "a/b", ".hidden", "UPPER"] {
            remember(&r, bad, &model).unwrap();
        }
        assert!(!dir(&r).exists());
        // A source volume's own id is the tenant's data, never a class's
        // model.
        let volume = ClassModel {
            source: "s".into(),
            sid: SourceId::parse("0123456789abcdef0123456789abcdef").unwrap(),
        };
        remember(&r, "ok", &volume).unwrap();
        assert!(!dir(&r).exists());
    }
}
