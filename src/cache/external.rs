//! Volumes over bytes another driver owns (a `pvc://` source exposed in
//! place): what such a volume names, how it is mounted read-only, and how
//! a mount of it is recognised. Nothing outside this file tells a
//! directory from a block device.

use std::path::Path;

use super::record::External;
use super::store::identity;
use crate::error::{IoContext, Result};
use crate::mount::{MountFlags, Mounter, mountinfo::MountEntry};

impl External {
    /// The host path or device it names.
    pub fn path(&self) -> &str {
        match self {
            External::Dir { path } => path,
            External::XfsBlock { device } => device,
        }
    }

    /// Mounts it read-only on `content`: a directory is bound, a block
    /// device holding XFS is mounted `ro,norecovery,nouuid`. No seal covers
    /// these bytes, so the read-only mount is the only guarantee, and
    /// nosuid,nodev keep what they hold from acting as programs or devices.
    pub fn mount(&self, m: &dyn Mounter, content: &Path) -> Result<()> {
        let at = Path::new(self.path());
        match self {
            External::Dir { .. } => {
                let flags = MountFlags {
                    nosuid: true,
                    nodev: true,
                    ..MountFlags::default()
                };
                m.bind(at, content, true, flags)
                    .ctx("bind-mount read-only", at)
            }
            External::XfsBlock { .. } => m
                .mount_device(at, content, "xfs", true, super::xfs::READER_OPTIONS)
                .ctx("mount read-only", at),
        }
    }

    /// Whether `existing`, mounted at `content`, shows it.
    pub fn shows(&self, m: &dyn Mounter, content: &Path, existing: &MountEntry) -> Result<bool> {
        Ok(match self {
            External::Dir { path } => identity(&m.view(content))? == identity(Path::new(path))?,
            External::XfsBlock { device } => {
                std::fs::canonicalize(device).is_ok_and(|d| Path::new(&existing.source) == d)
            }
        })
    }

    /// Why a mount of it can no longer show it, if so.
    pub fn gone(&self) -> Option<String> {
        let path = self.path();
        (!Path::new(path).exists()).then(|| format!("{path} behind this volume is gone"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::fake::FakeMounter;

    #[test]
    fn a_directory_is_bound_read_only_and_recognised_only_at_its_own_mount() {
        let dir = tempfile::tempdir().unwrap();
        let (pv, other, content) = (
            dir.path().join("pv"),
            dir.path().join("other"),
            dir.path().join("content"),
        );
        for d in [&pv, &other, &content] {
            std::fs::create_dir(d).unwrap();
        }
        let m = FakeMounter::default();
        let ext = External::Dir {
            path: pv.display().to_string(),
        };
        ext.mount(&m, &content).unwrap();
        let e = m.at(&content).unwrap();
        assert!(e.is_readonly() && e.has_option("nosuid") && e.has_option("nodev"));
        assert!(ext.shows(&m, &content, &e).unwrap());
        let elsewhere = External::Dir {
            path: other.display().to_string(),
        };
        assert!(!elsewhere.shows(&m, &content, &e).unwrap());
        assert_eq!(ext.gone(), None);
        std::fs::remove_dir(&pv).unwrap();
        assert!(ext.gone().unwrap().contains("is gone"));
    }

    #[test]
    fn a_block_device_is_mounted_as_a_reader_would() {
        let dir = tempfile::tempdir().unwrap();
        let content = dir.path().join("content");
        std::fs::create_dir(&content).unwrap();
        let m = FakeMounter::default();
        let ext = External::XfsBlock {
            device: "/dev/null".into(),
        };
        ext.mount(&m, &content).unwrap();
        let e = m.at(&content).unwrap();
        assert_eq!(
            (e.fs_type.as_str(), e.source.as_str()),
            ("xfs", "/dev/null")
        );
        assert!(e.is_readonly());
        for opt in ["norecovery", "nouuid"] {
            assert!(e.super_options.iter().any(|o| o == opt), "{e:#?}");
        }
        assert!(ext.shows(&m, &content, &e).unwrap());
    }
}
