//! What a CSI VolumeCapability asks for, checked against what a volume can
//! give. Shared by CreateVolume, ValidateVolumeCapabilities and the node.

use crate::cache::{Role, Root};
use crate::csi::VolumeCapability;
use crate::csi::volume_capability::AccessType;
use crate::csi::volume_capability::access_mode::Mode;
use crate::error::{Error, Result};
use crate::mount::MountFlags;

/// The parts of a capability the node acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountRequest {
    pub mode: Mode,
    pub flags: MountFlags,
    /// Some(true) when the mount flags ask for `ro`, Some(false) for `rw`.
    pub ro_flag: Option<bool>,
}

impl MountRequest {
    pub fn is_writer(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeWriter
                | Mode::SingleNodeSingleWriter
                | Mode::SingleNodeMultiWriter
                | Mode::MultiNodeSingleWriter
                | Mode::MultiNodeMultiWriter
        )
    }
}

/// Parses one capability: mount access type only, a known access mode,
/// mount flags we can honour.
pub fn parse(cap: &VolumeCapability, field: &str) -> Result<MountRequest> {
    let mount = match &cap.access_type {
        Some(AccessType::Mount(m)) => m,
        Some(AccessType::Block(_)) => {
            return Err(Error::invalid(
                format!("{field}.block"),
                "block access is not supported: modelcache volumes are filesystems \
                 (use volumeMode: Filesystem)",
            ));
        }
        None => {
            return Err(Error::invalid(
                format!("{field}.access_type"),
                "missing: set mount",
            ));
        }
    };
    let mode = cap
        .access_mode
        .as_ref()
        .and_then(|m| Mode::try_from(m.mode).ok())
        .filter(|m| *m != Mode::Unknown)
        .ok_or_else(|| {
            Error::invalid(
                format!("{field}.access_mode"),
                "missing or unknown: set one of SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY, \
                 SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_MULTI_WRITER, MULTI_NODE_READER_ONLY, \
                 MULTI_NODE_SINGLE_WRITER, MULTI_NODE_MULTI_WRITER",
            )
        })?;
    let (flags, ro_flag) = MountFlags::parse(&mount.mount_flags)
        .map_err(|m| Error::invalid(format!("{field}.mount.mount_flags"), m))?;
    if !mount.fs_type.is_empty() && mount.fs_type != "xfs" {
        return Err(Error::invalid(
            format!("{field}.mount.fs_type"),
            format!(
                "{:?} is not offered: leave it empty (or \"xfs\" for backend xfs); the \
                 filesystem is the source's own",
                mount.fs_type
            ),
        ));
    }
    Ok(MountRequest {
        mode,
        flags,
        ro_flag,
    })
}

/// Checks that a volume of `role` in `root` can honour every capability.
pub fn check(caps: &[VolumeCapability], root: &Root, role: Role) -> Result<Vec<MountRequest>> {
    if caps.is_empty() {
        return Err(Error::invalid(
            "volume_capabilities",
            "at least one capability is required",
        ));
    }
    let mut out = Vec::new();
    for (i, cap) in caps.iter().enumerate() {
        let field = format!("volume_capabilities[{i}]");
        let req = parse(cap, &field)?;
        let fs_type = match &cap.access_type {
            Some(AccessType::Mount(m)) => m.fs_type.as_str(),
            _ => "",
        };
        let store = root.backend.store();
        if !fs_type.is_empty() && store.fs_type() != Some(fs_type) {
            return Err(Error::invalid(
                format!("{field}.mount.fs_type"),
                format!(
                    "\"xfs\" needs backend xfs; this volume is on backend {}",
                    root.backend
                ),
            ));
        }
        let multi_node = matches!(
            req.mode,
            Mode::MultiNodeReaderOnly | Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter
        );
        if multi_node && root.node.is_some() {
            return Err(Error::invalid(
                format!("{field}.access_mode"),
                format!(
                    "{} needs storage every node can reach: use backend shared, or backend xfs \
                     with imageLocation: shared ({} is node-local)",
                    req.mode.as_str_name(),
                    root.describe()
                ),
            ));
        }
        if role == Role::Source
            && !store.multi_node_writers()
            && matches!(
                req.mode,
                Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter
            )
        {
            return Err(Error::invalid(
                format!("{field}.access_mode"),
                "an XFS filesystem can be written from one node only: use a SINGLE_NODE_* mode",
            ));
        }
        if role == Role::Cache && req.ro_flag == Some(false) {
            return Err(Error::invalid(
                format!("{field}.mount.mount_flags"),
                "\"rw\" cannot be honoured: cache volumes are always read-only",
            ));
        }
        out.push(req);
    }
    Ok(out)
}
