//! The records persisted for volumes, in their root's `volumes/` directory.

use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use super::Backend;
use super::layout::{Root, SourceId, VolumeId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Writable until sealed; a Job fills it.
    Source,
    /// A read-only view of a sealed source. Never a copy.
    Cache,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Cache => "cache",
        }
    }
}

/// How much NodeStage checks a sealed source before exposing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// The seal exists and every file has its recorded size.
    #[default]
    Size,
    /// As `size`, and every file's sha256 is recomputed.
    Full,
}

impl Verify {
    pub fn as_str(self) -> &'static str {
        match self {
            Verify::Size => "size",
            Verify::Full => "full",
        }
    }
}

/// Bytes this driver does not own, exposed read-only in place: the volume
/// of another PV (`pvc://`), on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum External {
    /// A directory (hostPath or local PV), bind-mounted read-only.
    Dir { path: String },
    /// A block device holding XFS (a block-mode local PV), mounted
    /// `ro,norecovery,nouuid`.
    XfsBlock { device: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: String,
    pub name: String,
    pub backend: Backend,
    pub role: Role,
    /// The source this volume exposes (its own, for a source volume).
    pub source: SourceId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
    #[serde(default)]
    pub verify: Verify,
    pub capacity_bytes: i64,
    /// The only node that can reach the volume, for node-local roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The model URI a cache volume was pulled from (no credentials).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The immutable revision that URI resolved to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// Set for a volume over bytes this driver does not own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<External>,
    /// The volume id this one was created from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<String>,
    /// The namespace whose PVC or pod asked for a pulled model: what
    /// `--max-models-per-namespace` counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Who signed the model, as the class's signature policy verified it
    /// when this volume was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
    /// Made before its model was sealed (`progressive: "true"`): staged
    /// through the node's progressive view until the seal.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub progressive: bool,
    /// Canonical form of the CreateVolume arguments: the same name with other
    /// arguments is AlreadyExists.
    pub request: String,
    pub created_unix: u64,
}

impl VolumeRecord {
    /// Checks a record read from `root` under `uuid` before anything is
    /// derived from it. Records on a shared root are written by other nodes
    /// and could be forged by anyone who writes that filesystem, so every
    /// field that becomes a path, or picks what is mounted, is checked:
    /// - the id is ours, names this root, and matches the file's name;
    /// - the source id has the form the driver makes (no `/`, no `..`),
    ///   which parsing it as a [`SourceId`] already enforced;
    /// - the subPath is relative and stays inside the source;
    /// - `external` (a host path or device, exposed in place) appears only
    ///   in a node-local `local` root, which only this node's root user
    ///   writes, and names an absolute path without `..`.
    pub fn check(&self, root: &Root, uuid: &str) -> Result<(), String> {
        let id =
            VolumeId::parse(&self.id).ok_or_else(|| format!("id {:?} is malformed", self.id))?;
        if id.uuid != uuid {
            return Err(format!("id {} does not match the file's name", self.id));
        }
        if id.backend != root.backend || id.root_key != root.key || self.backend != root.backend {
            return Err(format!("id {} belongs to another storage root", self.id));
        }
        if let Some(sub) = &self.sub_path {
            crate::mount::subpath::validate_syntax(sub)?;
        }
        if let Some(ext) = &self.external {
            if root.node.is_none() || !root.backend.store().holds_external() {
                return Err(format!(
                    "it names a host path ({}) but lives in a shared root; only a node's own \
                     local root may hold such records",
                    ext.path()
                ));
            }
            if self.role != Role::Cache {
                return Err("a volume over another driver's bytes must be a cache volume".into());
            }
            let p = Path::new(ext.path());
            if !p.is_absolute() || p.components().any(|c| c == Component::ParentDir) {
                return Err(format!(
                    "host path {:?} is not absolute and plain",
                    ext.path()
                ));
            }
        }
        Ok(())
    }
}
