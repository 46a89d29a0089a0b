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
//!
//! A shared root is written by every node, and by anyone else who can write
//! that filesystem, so nothing read from it names a path by itself: source
//! ids and node ids are checked for their form before they are joined to a
//! path, and what a node mounts is opened beneath the root with no symlink
//! on the way (`Root::open_source`).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

pub use super::id::{SourceId, SourceKind, is_volume_uuid};

pub use crate::config::{Backend, Reserve};

/// One backend's directory.
#[derive(Clone, Debug)]
pub struct Root {
    pub backend: Backend,
    pub dir: PathBuf,
    pub key: String,
    /// Some(node) when only that node can reach the root.
    pub node: Option<String>,
    /// The directory an admin named (`--state-dir`, `--shared-path`) that
    /// holds `dir`: everything below it is resolved without symlinks.
    pub anchor: PathBuf,
    /// Free space the driver never uses up in this root's filesystem.
    pub reserve: Reserve,
    /// Free inodes likewise (`--min-free-inodes`): kubelet and the
    /// container runtime share the filesystem and fail without them.
    pub inode_reserve: Reserve,
    /// The pulls running in it in this process: one registry per process
    /// and root, so `Roots` is built once (in the `Context`) and cloned.
    pub pulls: super::partial::Pulls,
}

/// The name of a pull's area in `sources/` is this and its source id; a
/// leading `.` keeps it out of every listing of sources.
pub const PULL_PREFIX: &str = ".pull-";

/// Whether `sid` has the form of a [`SourceId`].
pub fn is_source_id(sid: &str) -> bool {
    SourceId::parse(sid).is_some()
}

/// A node id becomes a file name (`writers/<node>`): a Kubernetes node
/// name (DNS subdomain) always passes; `/`, a leading `.` and control
/// characters never do.
pub fn check_node_id(node: &str) -> std::result::Result<(), String> {
    let ok = !node.is_empty()
        && node.len() <= 253
        && !node.starts_with('.')
        && node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "node id {node:?} must be 1-253 characters of letters, digits, '.', '-' and '_', \
             not starting with '.' (a Kubernetes node name)"
        ))
    }
}

impl Root {
    #[cfg(test)]
    fn new(backend: Backend, dir: PathBuf, node: Option<String>) -> Root {
        let anchor = dir.clone();
        Root::with_anchor(backend, dir, node, anchor, Reserve::default())
    }

    /// A root at `dir`, whose free space is that of `anchor`'s filesystem
    /// (the state dir, or the shared path) less `reserve`.
    pub fn with_anchor(
        backend: Backend,
        dir: PathBuf,
        node: Option<String>,
        anchor: PathBuf,
        reserve: Reserve,
    ) -> Root {
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
            anchor,
            reserve,
            inode_reserve: Reserve::INODES,
            pulls: Default::default(),
        }
    }

    /// The same root keeping `r` inodes free.
    pub fn with_inode_reserve(mut self, r: Reserve) -> Root {
        self.inode_reserve = r;
        self
    }

    /// Opens a source's directory beneath the root, refusing a malformed id
    /// and any symlink on the way: on a shared root, `sources/<sid>` (or its
    /// `data`, or its image) could have been replaced by a link to a host
    /// path by anyone who writes that filesystem.
    pub fn open_source(&self, sid: &SourceId) -> Result<ConfinedSource> {
        if !is_source_id(sid) {
            return Err(Error::Precondition(format!(
                "source id {sid:?} is malformed; refusing to use it in {}",
                self.describe()
            )));
        }
        self.open_beneath(self.source(sid), &format!("source {sid}"))
    }

    /// A pull's area (`pull::PullArea`), opened as [`open_source`] opens a
    /// source: its bytes are made immutable through the descriptor.
    pub fn open_pull_area(&self, sid: &SourceId) -> Result<ConfinedSource> {
        self.open_beneath(self.pull_area(sid), &format!("the pull area of {sid}"))
    }

    fn open_beneath(&self, real: SourcePaths, what: &str) -> Result<ConfinedSource> {
        let rel = real.dir.strip_prefix(&self.anchor).map_err(|_| {
            Error::Internal(format!(
                "{} is not below {}",
                real.dir.display(),
                self.anchor.display()
            ))
        })?;
        let forged = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                Error::Precondition(e.to_string())
            } else if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound(format!("{what} does not exist in {}", self.describe()))
            } else {
                Error::io("open source", &real.dir, e)
            }
        };
        let anchor = crate::mount::subpath::open_dir(&self.anchor)
            .map_err(|e| Error::io("open storage root", &self.anchor, e))?;
        let fd = crate::mount::subpath::open_confined(
            &anchor,
            &self.anchor,
            &rel.to_string_lossy(),
            OFlag::O_PATH | OFlag::O_DIRECTORY,
        )
        .map_err(forged)?;
        Ok(ConfinedSource {
            via: SourcePaths {
                dir: crate::mount::subpath::proc_path(&fd),
            },
            fd,
            real,
        })
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
    pub fn source(&self, sid: &SourceId) -> SourcePaths {
        SourcePaths {
            dir: self.sources_dir().join(sid.as_str()),
        }
    }
    /// Where a model is written while it is pulled (`pull::PullArea`):
    /// beside its final place, so that sealing is one rename.
    pub fn pull_area(&self, sid: &SourceId) -> SourcePaths {
        SourcePaths {
            dir: self.sources_dir().join(format!("{PULL_PREFIX}{sid}")),
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

/// A source's directory, held open: paths through `via` resolve to the
/// directory that was checked, whatever is renamed or linked in its place
/// afterwards. `real` is for messages.
#[derive(Debug)]
pub struct ConfinedSource {
    fd: OwnedFd,
    pub via: SourcePaths,
    pub real: SourcePaths,
}

impl ConfinedSource {
    fn open(&self, name: &str, flags: OFlag) -> Result<OwnedFd> {
        crate::mount::subpath::open_confined(&self.fd, &self.real.dir, name, flags).map_err(|e| {
            match e.kind() {
                std::io::ErrorKind::InvalidInput => Error::Precondition(e.to_string()),
                std::io::ErrorKind::NotFound => Error::NotFound(format!(
                    "{} does not exist",
                    self.real.dir.join(name).display()
                )),
                _ => Error::io("open", &self.real.dir.join(name), e),
            }
        })
    }

    /// The source's `data` directory, as an O_PATH descriptor to bind-mount
    /// through `/proc/self/fd`.
    pub fn data(&self) -> Result<OwnedFd> {
        self.open("data", OFlag::O_PATH | OFlag::O_DIRECTORY)
    }

    /// The source's image, opened for reading (and writing when `writable`);
    /// only a regular file is accepted.
    pub fn image(&self, writable: bool) -> Result<File> {
        let mode = if writable {
            OFlag::O_RDWR
        } else {
            OFlag::O_RDONLY
        };
        let file = File::from(self.open("image.xfs", mode | OFlag::O_NONBLOCK)?);
        let path = self.real.image();
        let meta = file.metadata().map_err(|e| Error::io("stat", &path, e))?;
        if !meta.is_file() {
            return Err(Error::Precondition(format!(
                "{} is not a regular file; refusing to attach it",
                path.display()
            )));
        }
        Ok(file)
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
    /// Every root a process started with `cfg` can serve, from its flags.
    pub fn of(cfg: &crate::config::Config) -> Roots {
        let mut roots = Vec::new();
        for b in &cfg.backends {
            let place = b.store().placement();
            if place.on_node
                && let Some(node) = &cfg.node_id
            {
                let dir = cfg.state_dir.join(b.as_str());
                roots.push(
                    Root::with_anchor(
                        *b,
                        dir,
                        Some(node.clone()),
                        cfg.state_dir.clone(),
                        cfg.min_free,
                    )
                    .with_inode_reserve(cfg.min_free_inodes),
                );
            }
            if let Some(sub) = place.under_shared {
                for p in &cfg.shared_paths {
                    let dir = if sub.is_empty() {
                        p.clone()
                    } else {
                        p.join(sub)
                    };
                    roots.push(
                        Root::with_anchor(*b, dir, None, p.clone(), cfg.min_free)
                            .with_inode_reserve(cfg.min_free_inodes),
                    );
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
            Error::Precondition(format!(
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

    /// The root of `backend` under the shared path an admin named.
    pub fn shared(&self, backend: Backend, shared_path: &Path) -> Option<&Root> {
        self.roots
            .iter()
            .find(|r| r.backend == backend && r.node.is_none() && r.anchor == shared_path)
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
    fn source_ids_know_their_kind_and_refuse_other_forms() {
        let uuid = uuid_for_name("d", "pvc-1");
        let vol = SourceId::volume(&uuid).unwrap();
        assert_eq!(
            (vol.kind(), vol.as_str()),
            (SourceKind::Volume, uuid.as_str())
        );
        let ext = SourceId::external(&uuid).unwrap();
        assert_eq!(ext.kind(), SourceKind::External);
        assert_ne!(ext, vol);
        let model = SourceId::model(&[0xab; 32]);
        assert!(model.is_model() && !vol.is_model() && !ext.is_model());
        for id in [&vol, &ext, &model] {
            assert_eq!(SourceId::parse(id).as_ref(), Some(id));
            let json = serde_json::to_string(id).unwrap();
            assert_eq!(&serde_json::from_str::<SourceId>(&json).unwrap(), id);
        }
        assert!(SourceId::volume("../../etc").is_none());
        let forged = serde_json::from_str::<SourceId>("\"../../../etc/passwd-0000000000\"");
        assert!(forged.unwrap_err().to_string().contains("malformed"));
    }

    #[test]
    fn source_and_node_ids_have_one_form() {
        for good in [
            "0123456789abcdef0123456789abcdef",
            "m123456789abcdef0123456789abcdef",
            "x123456789abcdef0123456789abcdef",
        ] {
            assert!(is_source_id(good), "{good}");
        }
        for bad in [
            "",
            "../../etc",
            "/etc",
            "0123456789abcdef0123456789abcde",
            "0123456789ABCDEF0123456789abcdef",
            "m123456789abcdef0123456789abcde/",
            "y123456789abcdef0123456789abcdef",
            "m../../../../../../../../../etc/x",
        ] {
            assert!(!is_source_id(bad), "{bad}");
        }
        for good in ["node-1", "ip-10-0-0-1.ec2.internal", "n_2"] {
            assert_eq!(check_node_id(good), Ok(()));
        }
        for bad in ["", ".", "..", ".hidden", "a/b", "a\nb", &"n".repeat(254)] {
            assert!(check_node_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reserve_is_the_smaller_bound() {
        let size = |s: &str| s.strip_suffix('G')?.parse::<u64>().ok().map(|g| g << 30);
        let r = Reserve::default();
        assert_eq!(r.of(100 << 30), 5 << 30);
        assert_eq!(r.of(1 << 40), 10 << 30);
        assert_eq!(Reserve::parse("10%", size).unwrap().of(100 << 30), 10 << 30);
        assert_eq!(Reserve::parse("2G", size).unwrap().of(100 << 30), 2 << 30);
        assert_eq!(
            Reserve::parse("10%,2G", size).unwrap().of(100 << 30),
            2 << 30
        );
        assert_eq!(Reserve::parse("0", |_| Some(0)).unwrap().of(1 << 40), 0);
        assert!(Reserve::parse("101%", size).is_none());
        assert!(Reserve::parse("lots", size).is_none());
        assert_eq!(Reserve::NONE.of(1 << 40), 0);
    }

    #[test]
    fn node_local_roots_differ_per_node() {
        let a = Root::new(Backend::Local, "/s".into(), Some("n1".into()));
        let b = Root::new(Backend::Local, "/s".into(), Some("n2".into()));
        assert_ne!(a.key, b.key);
    }
}
