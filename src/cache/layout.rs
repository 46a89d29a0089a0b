//! Where a backend keeps things on disk, and what volume ids look like.
//!
//! A *root* is one backend's directory: the node's state dir for `local`, a
//! shared filesystem for `shared`, and either of the two for `xfs` images.
//! Controller state lives in the root next to the data it describes:
//!
//! ```text
//! <root>/volumes/<uuid>.json          one record per CSI volume
//! <root>/sources/<sid>/data/          a source's files (local, shared)
//! <root>/sources/<sid>/image.xfs      a source's filesystem image (xfs)
//! <root>/sources/<sid>/seal.json      present once sealed: the manifest
//! <root>/sources/<sid>/sealing        intent marker while a seal is decided
//! <root>/sources/<sid>/writers/<node> a node that has the source staged writable
//! <root>/sources/<sid>/refs/<uuid>    a cache volume that reads this source
//! ```
//!
//! A volume id is `<backend>.<root key>.<uuid>`: DeleteVolume receives only
//! the id, so the id alone must lead back to the root.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Local,
    Shared,
    Xfs,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Local, Backend::Shared, Backend::Xfs];

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shared => "shared",
            Backend::Xfs => "xfs",
        }
    }

    pub fn parse(s: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.as_str() == s)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One backend's directory.
#[derive(Clone, Debug)]
pub struct Root {
    pub backend: Backend,
    pub dir: PathBuf,
    pub key: String,
    /// Some(node) when only that node can reach the root.
    pub node: Option<String>,
}

impl Root {
    fn new(backend: Backend, dir: PathBuf, node: Option<String>) -> Root {
        let mut h = Sha256::new();
        h.update(backend.as_str());
        h.update([0]);
        h.update(node.as_deref().unwrap_or(""));
        h.update([0]);
        h.update(dir.as_os_str().as_encoded_bytes());
        let key = hex::encode(&h.finalize()[..4]);
        Root {
            backend,
            dir,
            key,
            node,
        }
    }

    pub fn volumes_dir(&self) -> PathBuf {
        self.dir.join("volumes")
    }
    pub fn volume_record(&self, uuid: &str) -> PathBuf {
        self.volumes_dir().join(format!("{uuid}.json"))
    }
    pub fn sources_dir(&self) -> PathBuf {
        self.dir.join("sources")
    }
    pub fn source(&self, sid: &str) -> SourcePaths {
        SourcePaths {
            dir: self.sources_dir().join(sid),
        }
    }
    pub fn tmp_dir(&self) -> PathBuf {
        self.dir.join("tmp")
    }
    pub fn volume_id(&self, uuid: &str) -> String {
        format!("{}.{}.{uuid}", self.backend, self.key)
    }
    /// Human description used in error messages.
    pub fn describe(&self) -> String {
        match &self.node {
            Some(n) => format!(
                "{} backend at {} on node {n}",
                self.backend,
                self.dir.display()
            ),
            None => format!("{} backend at {}", self.backend, self.dir.display()),
        }
    }
}

/// Paths of one source inside its root.
#[derive(Clone, Debug)]
pub struct SourcePaths {
    pub dir: PathBuf,
}

impl SourcePaths {
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }
    pub fn image(&self) -> PathBuf {
        self.dir.join("image.xfs")
    }
    pub fn seal(&self) -> PathBuf {
        self.dir.join("seal.json")
    }
    pub fn sealing(&self) -> PathBuf {
        self.dir.join("sealing")
    }
    pub fn writers(&self) -> PathBuf {
        self.dir.join("writers")
    }
    pub fn refs(&self) -> PathBuf {
        self.dir.join("refs")
    }
}

/// A parsed volume id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeId {
    pub backend: Backend,
    pub root_key: String,
    pub uuid: String,
}

impl VolumeId {
    /// `None` for anything that is not one of our ids.
    pub fn parse(id: &str) -> Option<VolumeId> {
        let mut parts = id.split('.');
        let backend = Backend::parse(parts.next()?)?;
        let root_key = parts.next()?;
        let uuid = parts.next()?;
        let hexlen = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if parts.next().is_some() || !hexlen(root_key, 8) || !hexlen(uuid, 32) {
            return None;
        }
        Some(VolumeId {
            backend,
            root_key: root_key.to_string(),
            uuid: uuid.to_string(),
        })
    }
}

/// Derives a volume's uuid from its CSI name: retries of CreateVolume land on
/// the same record without a name index.
pub fn uuid_for_name(driver: &str, name: &str) -> String {
    let ns = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, driver.as_bytes());
    uuid::Uuid::new_v5(&ns, name.as_bytes())
        .simple()
        .to_string()
}

/// Every root this process can serve, derived from its flags.
#[derive(Clone, Debug)]
pub struct Roots {
    pub roots: Vec<Root>,
}

impl Roots {
    pub fn from_config(cfg: &Config) -> Roots {
        let mut roots = Vec::new();
        for b in &cfg.backends {
            match b {
                Backend::Local | Backend::Xfs => {
                    if let Some(node) = &cfg.node_id {
                        let dir = cfg.state_dir.join(b.as_str());
                        roots.push(Root::new(*b, dir, Some(node.clone())));
                    }
                }
                Backend::Shared => {}
            }
            if matches!(b, Backend::Shared | Backend::Xfs) {
                for p in &cfg.shared_paths {
                    let dir = if *b == Backend::Xfs {
                        p.join("xfs")
                    } else {
                        p.clone()
                    };
                    roots.push(Root::new(*b, dir, None));
                }
            }
        }
        Roots { roots }
    }

    pub fn by_key(&self, backend: Backend, key: &str) -> Option<&Root> {
        self.roots
            .iter()
            .find(|r| r.backend == backend && r.key == key)
    }

    /// The root a parsed id lives in, or FailedPrecondition naming why this
    /// process cannot reach it.
    pub fn for_id(&self, id: &VolumeId) -> Result<&Root> {
        self.by_key(id.backend, &id.root_key).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "volume {}.{}.{} lives in a {} storage root this process does not serve \
                 (another node's state dir, or a shared path missing from --shared-path)",
                id.backend, id.root_key, id.uuid, id.backend
            ))
        })
    }

    pub fn node_local(&self, backend: Backend) -> Option<&Root> {
        self.roots
            .iter()
            .find(|r| r.backend == backend && r.node.is_some())
    }

    pub fn shared(&self, backend: Backend, shared_path: &Path) -> Option<&Root> {
        let dir = if backend == Backend::Xfs {
            shared_path.join("xfs")
        } else {
            shared_path.to_path_buf()
        };
        self.roots
            .iter()
            .find(|r| r.backend == backend && r.node.is_none() && r.dir == dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_round_trip() {
        let r = Root::new(Backend::Local, "/x".into(), Some("n1".into()));
        let id = r.volume_id(&uuid_for_name("d", "pvc-1"));
        let parsed = VolumeId::parse(&id).unwrap();
        assert_eq!(parsed.backend, Backend::Local);
        assert_eq!(parsed.root_key, r.key);
        for bad in [
            "",
            "fake-vol-id",
            "local.zz.00",
            "nfs.01234567.0123456789abcdef0123456789abcdef",
        ] {
            assert!(VolumeId::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn names_map_to_stable_distinct_uuids() {
        assert_eq!(uuid_for_name("d", "a"), uuid_for_name("d", "a"));
        assert_ne!(uuid_for_name("d", "a"), uuid_for_name("d", "b"));
        assert_ne!(uuid_for_name("d", "a"), uuid_for_name("e", "a"));
    }

    #[test]
    fn node_local_roots_differ_per_node() {
        let a = Root::new(Backend::Local, "/s".into(), Some("n1".into()));
        let b = Root::new(Backend::Local, "/s".into(), Some("n2".into()));
        assert_ne!(a.key, b.key);
    }
}
