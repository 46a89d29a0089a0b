//! The records persisted for volumes, in their root's `volumes/` directory.

use serde::{Deserialize, Serialize};

use super::Backend;

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
    pub source: String,
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
    /// Canonical form of the CreateVolume arguments: the same name with other
    /// arguments is AlreadyExists.
    pub request: String,
    pub created_unix: u64,
}
