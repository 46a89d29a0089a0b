//! Growing a writable source volume (ControllerExpandVolume,
//! NodeExpandVolume): whether it may grow, the room it takes, its bytes
//! where a size means something (an XFS image), and its record.
//!
//! Only an unsealed source grows. A cache volume, or a sealed source, is
//! read-only and exactly the size of its model; a volume over another
//! driver's bytes is that driver's to size.

use std::path::Path;

use super::layout::{ConfinedSource, Root};
use super::record::{Role, VolumeRecord};
use crate::error::{Error, Result};

/// The bytes `rec` would add to grow to `target` (0 when it is that large
/// already), once it is known that it may: a writable source with the room
/// in `root` beyond the reserve.
pub fn check(root: &Root, rec: &VolumeRecord, target: i64) -> Result<u64> {
    if rec.external.is_some() {
        return Err(Error::Precondition(format!(
            "volume {} exposes another volume's bytes in place; that volume is the one to \
             grow",
            rec.id
        )));
    }
    if rec.role != Role::Source {
        return Err(Error::Precondition(format!(
            "volume {} is a cache volume: read-only, and the size of its model, so it cannot \
             grow. Only a source volume grows, until it is sealed; leave allowVolumeExpansion \
             off on cache classes",
            rec.id
        )));
    }
    if super::read_seal(root, &rec.source)?.is_some() {
        return Err(Error::Precondition(format!(
            "source volume {} is sealed: its bytes are immutable, and so is its size",
            rec.id
        )));
    }
    let growth = target.saturating_sub(rec.capacity_bytes).max(0) as u64;
    if growth > 0 {
        let space = super::space(root)?;
        if growth > space.usable() {
            return Err(Error::OverLimit(format!(
                "volume {} cannot grow by {growth} bytes to {target} in {}: {space}",
                rec.id,
                root.describe()
            )));
        }
    }
    Ok(growth)
}

/// Records `rec` at `target` bytes (never smaller than it was). Returns the
/// size recorded.
pub fn record(root: &Root, rec: &VolumeRecord, target: i64) -> Result<i64> {
    if target <= rec.capacity_bytes {
        return Ok(rec.capacity_bytes);
    }
    let mut grown = rec.clone();
    grown.capacity_bytes = target;
    super::write_volume(root, &grown)?;
    Ok(target)
}

/// Grows writable source `src` (opened from `rec`), staged at `content` on
/// this node, to `target` bytes: its bytes first (an image, its loop
/// device, its filesystem), then its record, so a crash in between is
/// redone by a retry.
pub fn grow_staged(
    root: &Root,
    rec: &VolumeRecord,
    src: &ConfinedSource,
    content: &Path,
    target: i64,
) -> Result<i64> {
    check(root, rec, target)?;
    let size = target.max(rec.capacity_bytes).max(0) as u64;
    root.backend.store().grow_staged(src, content, size)?;
    record(root, rec, target)
}
