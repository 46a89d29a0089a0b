//! The sealed store: sources (a writable tree, or an XFS image), their seals,
//! and the records of the volumes that expose them.
//!
//! A source is sealed once and then never changes; many cache volumes read
//! one sealed source, and none of them holds a copy. This module decides
//! what is on disk and in which order it is written; it never mounts for a
//! pod and never builds gRPC statuses.
//!
//! Two fences keep readers from seeing a source that can still change, and
//! both hold across nodes because they live on the filesystem next to the
//! source: a node that stages a source writable first creates
//! `writers/<node>` and then looks for a seal; sealing first creates
//! `sealing` and then looks for writers. Whichever comes second sees the
//! other and backs off.

pub mod copy;
pub mod evict;
pub mod external;
pub mod grow;
pub mod id;
pub mod layout;
pub mod lease;
pub mod manifest;
pub mod partial;
pub mod pull;
pub mod record;
pub mod store;
pub mod warm;
pub mod xfs;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

pub use layout::{
    Backend, Root, Roots, SourceId, SourceKind, SourcePaths, VolumeId, uuid_for_name,
};
pub use manifest::Seal;
pub use record::{External, Role, Verify, VolumeRecord};

use crate::error::{Error, IoContext, Result};
use crate::state;

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Finds a volume's root and record; NotFound when either is unknown.
pub fn lookup(roots: &Roots, volume_id: &str) -> Result<(Root, VolumeRecord)> {
    let not_found = || Error::NoVolume {
        id: volume_id.to_string(),
    };
    let id = VolumeId::parse(volume_id).ok_or_else(not_found)?;
    let root = roots.for_id(&id).map_err(|_| not_found())?.clone();
    let rec = read_volume(&root, &id.uuid)?.ok_or_else(not_found)?;
    Ok((root, rec))
}

/// `lookup` for async callers: records may sit on a network filesystem,
/// whose stalls must not hold a runtime worker.
pub async fn lookup_off_runtime(roots: &Roots, volume_id: &str) -> Result<(Root, VolumeRecord)> {
    let (roots, id) = (roots.clone(), volume_id.to_string());
    crate::offload::blocking(move || lookup(&roots, &id)).await
}

/// Reads a volume's record, refusing one that fails `VolumeRecord::check`
/// with an error naming the file.
pub fn read_volume(root: &Root, uuid: &str) -> Result<Option<VolumeRecord>> {
    if !layout::is_volume_uuid(uuid) {
        return Err(Error::Precondition(format!(
            "volume uuid {uuid:?} is malformed; refusing it in {}",
            root.describe()
        )));
    }
    let path = root.volume_record(uuid);
    let rec: Option<VolumeRecord> = state::read_json(&path).map_err(|e| invalid(&path, e))?;
    if let Some(rec) = &rec {
        rec.check(root, uuid).map_err(|why| {
            Error::Precondition(format!(
                "volume record {} is not valid and is refused: {why}",
                path.display()
            ))
        })?;
    }
    Ok(rec)
}

/// A record that exists but cannot be used: named, never followed.
fn invalid(path: &Path, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::InvalidData {
        Error::Precondition(format!(
            "{} is not valid and is refused: {e}",
            path.display()
        ))
    } else {
        Error::io("read", path, e)
    }
}

pub fn write_volume(root: &Root, rec: &VolumeRecord) -> Result<()> {
    let path = record_path(root, rec)?;
    state::write_json(&path, rec).ctx("write volume record", &path)
}

/// As [`write_volume`], not durable until [`sync_volume`]: for a volume
/// answered before its seal whose pull a durable record resumes after a
/// crash (`provision::pulls`), which writes this record again.
pub fn write_volume_unsynced(root: &Root, rec: &VolumeRecord) -> Result<()> {
    let path = record_path(root, rec)?;
    state::write_json_unsynced(&path, rec).ctx("write volume record", &path)
}

fn record_path(root: &Root, rec: &VolumeRecord) -> Result<std::path::PathBuf> {
    let uuid = VolumeId::parse(&rec.id)
        .map(|v| v.uuid)
        .ok_or_else(|| Error::Internal(format!("malformed volume id {}", rec.id)))?;
    Ok(root.volume_record(&uuid))
}

/// Makes a volume's record and its reference in the sealed model `sid`
/// durable: what [`write_volume_unsynced`] and an unsynced
/// [`add_pull_ref`] left to the disk's own time.
pub fn sync_volume(root: &Root, uuid: &str, sid: &SourceId) -> Result<()> {
    let rec = root.volume_record(uuid);
    state::sync_file(&rec).ctx("sync volume record", &rec)?;
    let source = root.source(sid);
    let r = source.refs().join(uuid);
    state::sync_file(&r).ctx("sync reference", &r)?;
    // The refs directory itself may have been made unsynced.
    state::sync_dir(&source.dir).ctx("sync source", &source.dir)
}

pub fn remove_volume(root: &Root, uuid: &str) -> Result<()> {
    let path = root.volume_record(uuid);
    state::remove_file(&path).ctx("remove volume record", &path)
}

pub fn list_volumes(root: &Root) -> Result<Vec<VolumeRecord>> {
    let mut out = Vec::new();
    for uuid in volume_uuids(root)? {
        out.extend(read_listed(root, &uuid)?);
    }
    Ok(out)
}

/// The uuids of the volume records in a root, unread and unordered.
pub fn volume_uuids(root: &Root) -> Result<Vec<String>> {
    let dir = root.volumes_dir();
    Ok(state::list_names(&dir)
        .ctx("list volumes in", &dir)?
        .into_iter()
        .filter_map(|name| name.strip_suffix(".json").map(str::to_string))
        .collect())
}

/// A volume record as a listing reads it: a record gone meanwhile, or one
/// forged into a shared root, is skipped, so one bad file never hides
/// every volume.
pub fn read_listed(root: &Root, uuid: &str) -> Result<Option<VolumeRecord>> {
    match read_volume(root, uuid) {
        Err(e @ Error::Precondition(_)) => {
            tracing::warn!(error = %e, "skipping a volume record");
            Ok(None)
        }
        r => r,
    }
}

/// Reads a source's seal, refusing a malformed source id and a seal whose
/// paths leave the source, or that names another source.
pub fn read_seal(root: &Root, sid: &SourceId) -> Result<Option<Seal>> {
    if !layout::is_source_id(sid) {
        return Err(Error::Precondition(format!(
            "source id {sid:?} is malformed; refusing it in {}",
            root.describe()
        )));
    }
    let path = root.source(sid).seal();
    let mut seal: Option<Seal> = state::read_json(&path).map_err(|e| invalid(&path, e))?;
    // Another node's seal must never look absent here (a second pull, a
    // writable stage of a sealed source): a miss is confirmed by listing,
    // and a seal the server has is read again until this client sees it.
    if seal.is_none() && state::listed(&path, &root.dir).ctx("look for", &path)? {
        let start = std::time::Instant::now();
        while seal.is_none() && start.elapsed() < state::STALE_RETRY {
            std::thread::sleep(std::time::Duration::from_millis(50));
            seal = state::read_json(&path).map_err(|e| invalid(&path, e))?;
        }
        if seal.is_none() {
            return Err(Error::Transient(format!(
                "{} is listed by its directory but this node cannot open it yet; retry",
                path.display()
            )));
        }
    }
    if let Some(seal) = &seal {
        seal.check(sid).map_err(|why| {
            Error::Precondition(format!(
                "seal {} is not valid and is refused: {why}",
                path.display()
            ))
        })?;
    }
    Ok(seal)
}

pub fn source_exists(root: &Root, sid: &SourceId) -> bool {
    root.source(sid).dir.is_dir()
}

/// Nodes that have the source staged writable.
pub fn writers(root: &Root, sid: &SourceId) -> Result<Vec<String>> {
    let dir = root.source(sid).writers();
    state::list_names(&dir).ctx("list writers in", &dir)
}

/// Cache volumes (by uuid) that read the source.
pub fn refs(root: &Root, sid: &SourceId) -> Result<Vec<String>> {
    let dir = root.source(sid).refs();
    state::list_names(&dir).ctx("list references in", &dir)
}

/// References a source that exists: the reference is made only inside the
/// source's own directory, never by recreating that directory, so a source
/// evicted meanwhile (renamed away at any step) is `Error::Evicted` and
/// leaves no empty skeleton behind for a later pull to trip on.
pub fn add_ref(root: &Root, sid: &SourceId, uuid: &str) -> Result<()> {
    let sp = root.source(sid);
    let refs = sp.refs();
    let path = refs.join(uuid);
    let made = (|| -> io::Result<bool> {
        match fs::create_dir(&refs) {
            Ok(()) => state::sync_dir(&sp.dir)?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        state::create_marker_in(&path, b"")
    })();
    match made {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(Error::Evicted {
            source_id: sid.to_string(),
        }),
        Err(e) => Err(Error::io("create reference", &path, e)),
    }
}

/// References a model still being pulled, from inside its pull's area:
/// the seal renames the area into place with the reference in it, so it
/// is never missing for eviction to misread. False: the area is gone (the
/// model sealed or the pull ended), and nothing was made.
/// `durable: false` when a record of the pull that survives a crash
/// brings the reference back (`provision::pulls`); [`sync_volume`] then
/// makes it durable once the model is sealed.
pub fn add_pull_ref(root: &Root, sid: &SourceId, uuid: &str, durable: bool) -> Result<bool> {
    let area = root.pull_area(sid);
    let refs = area.refs();
    let path = refs.join(uuid);
    let made = (|| -> io::Result<()> {
        match fs::create_dir(&refs) {
            Ok(()) if durable => state::sync_dir(&area.dir)?,
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        match durable {
            true => state::create_marker_in(&path, b"").map(drop),
            false => state::create_marker_unsynced(&path, b"").map(drop),
        }
    })();
    match made {
        Ok(()) => Ok(true),
        // The seal moved the area between our create and its sync: the
        // reference moved with it.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Ok(root.source(sid).refs().join(uuid).exists())
        }
        Err(e) => Err(Error::io("create reference", &path, e)),
    }
}

/// Removes a volume's reference, wherever it is: in the sealed model, or
/// in the area of a pull still running (a progressive volume's); without
/// waiting for anyone. Eviction renames a model away for a moment
/// (`.trash-<sid>-…`) to look for references, and puts it back when it
/// finds one; a reference not in place is removed from such a trash, so
/// that it does not come back with the model. One can still come back
/// (the model renamed away again between the two looks): it then belongs
/// to no volume record, and counts only until it is older than
/// [`evict::REF_GRACE`].
pub fn remove_ref(root: &Root, sid: &SourceId, uuid: &str) -> Result<()> {
    let in_place = root.source(sid).refs().join(uuid);
    if !unlink_ref(&in_place)? {
        let trash = format!(".trash-{sid}-");
        let trashes: Vec<PathBuf> = fs::read_dir(root.sources_dir())
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&trash))
                    .map(|e| e.path().join("refs").join(uuid))
                    .collect()
            })
            .unwrap_or_default();
        let mut removed = false;
        for r in &trashes {
            if unlink_ref(r)? {
                removed = true;
                break;
            }
        }
        // Put back between the two looks.
        if !removed && !trashes.is_empty() {
            unlink_ref(&in_place)?;
        }
    }
    if let Some(sid) = SourceId::parse_model(sid) {
        let path = root.pull_area(&sid).refs().join(uuid);
        state::remove_file(&path).ctx("remove reference", &path)?;
    }
    Ok(())
}

/// Unlinks one reference; false if it was not there. An eviction may
/// rename its directory away right after: a sync that finds it gone is
/// no error.
fn unlink_ref(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            if let Some(dir) = path.parent() {
                match state::sync_dir(dir) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        return Err(Error::io("sync", dir, e));
                    }
                    _ => {}
                }
            }
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("remove reference", path, e)),
    }
}

/// Creates an empty writable source. Idempotent.
pub fn create_source(root: &Root, sid: &SourceId, capacity_bytes: u64) -> Result<()> {
    root.backend
        .store()
        .create(&root.source(sid), capacity_bytes)
}

/// Makes `to` a writable copy of `from`: the one case where bytes are
/// duplicated, because the result must be writable. Reflinks where the
/// filesystem can; what a copy may not carry is the store's to refuse.
pub fn copy_source(root: &Root, from: &SourceId, to: &SourceId) -> Result<()> {
    let store = root.backend.store();
    let src = root.open_source(from)?;
    let dst = root.source(to);
    let to_path = store.bytes_path(&dst);
    if to_path.exists() {
        return Ok(());
    }
    fs::create_dir_all(&dst.dir).ctx("create", &dst.dir)?;
    let tmp = dst
        .dir
        .join(format!(".copy-{}", uuid::Uuid::new_v4().simple()));
    if let Err(e) = store.copy(&src, &tmp) {
        let _ = fs::remove_dir_all(&tmp).or_else(|_| fs::remove_file(&tmp));
        return Err(e);
    }
    fs::rename(&tmp, &to_path).ctx("rename into place", &to_path)?;
    state::sync_dir(&dst.dir).ctx("sync", &dst.dir)?;
    Ok(())
}

/// Removes a source and everything in it. The caller has checked that no
/// volume reads it and no node writes it.
pub fn delete_source(root: &Root, sid: &SourceId) -> Result<()> {
    let sp = root.source(sid);
    root.backend.store().check_detached(sid, &sp)?;
    if !sp.dir.exists() {
        return Ok(());
    }
    // Renamed away first, so a crash mid-delete never leaves a half-deleted
    // source under its real name.
    let trash = root
        .sources_dir()
        .join(format!(".trash-{sid}-{}", uuid::Uuid::new_v4().simple()));
    fs::rename(&sp.dir, &trash).ctx("move to trash", &sp.dir)?;
    fs::remove_dir_all(&trash).ctx("remove", &trash)
}

/// Removes what a crash may have left: trash, and the private mounts of a
/// seal that was cut short.
pub fn sweep(root: &Root) {
    for name in list_hidden(&root.sources_dir()) {
        if name.starts_with(".trash-") {
            let _ = fs::remove_dir_all(root.sources_dir().join(name));
        }
    }
    pull::tidy_sealed(root);
    if let Ok(entries) = fs::read_dir(root.tmp_dir()) {
        for entry in entries.flatten() {
            let path = entry.path();
            while crate::mount::is_mount_point(&path).unwrap_or(false) {
                if crate::mount::unmount(&path).is_err() {
                    break;
                }
            }
            let _ = fs::remove_dir(&path);
        }
    }
}

fn list_hidden(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

/// Seals a source: refuses while any node has it writable, then records
/// every file's size and sha256 and makes the seal visible in one rename.
/// Idempotent: a sealed source returns its seal.
pub fn seal_source(root: &Root, sid: &SourceId, origin: &str) -> Result<Seal> {
    let sp = root.source(sid);
    if let Some(seal) = read_seal(root, sid)? {
        return Ok(seal);
    }
    // What is scanned is opened beneath the root: a link planted in a
    // shared root must not make the controller hash (or loop-mount) a host
    // path.
    let src = match root.open_source(sid) {
        Err(Error::NotFound(_)) => {
            return Err(Error::NotFound(format!("source {sid} does not exist")));
        }
        r => r?,
    };
    // An existing marker is our own earlier attempt, cut short.
    state::create_marker(&sp.sealing(), now_unix().to_string().as_bytes())
        .ctx("create sealing marker", &sp.sealing())?;
    let result = (|| {
        let writers = writers(root, sid)?;
        if !writers.is_empty() {
            return Err(Error::Precondition(format!(
                "source {sid} is still staged writable on node(s) {}; stop the pods that \
                 write it (the volume must be unstaged everywhere) before sealing",
                writers.join(", ")
            )));
        }
        let store = root.backend.store();
        let tree = store.scan(root, &src, &sp)?;
        let seal = Seal::new(sid, origin, None, tree);
        let bytes = seal.encoded()?;
        store.make_immutable(&src, &sp)?;
        state::write_atomic(&sp.seal(), &bytes).ctx("write seal", &sp.seal())?;
        Ok(seal)
    })();
    state::remove_file(&sp.sealing()).ctx("remove sealing marker", &sp.sealing())?;
    result
}

/// Makes the node's state directory (every node-local root lives under
/// it) reachable by root alone: models are read through the mounts the
/// driver makes, whose own modes let pods read them, never by a local
/// user walking the host path to a tenant's private model or image.
pub fn keep_private(state_dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(state_dir).ctx("create", state_dir)?;
    std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o700))
        .ctx("restrict", state_dir)
}

/// Free bytes for new data in a root's filesystem.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    Ok(space_of(dir)?.0)
}

/// (free, total) bytes of the filesystem holding `dir`.
fn space_of(dir: &Path) -> io::Result<(u64, u64)> {
    let st = statvfs_of(dir)?;
    let frag = st.fragment_size() as u64;
    Ok((
        (st.blocks_available() as u64).saturating_mul(frag),
        (st.blocks() as u64).saturating_mul(frag),
    ))
}

fn statvfs_of(dir: &Path) -> io::Result<nix::sys::statvfs::Statvfs> {
    fs::create_dir_all(dir)?;
    nix::sys::statvfs::statvfs(dir).map_err(io::Error::from)
}

/// A root's free space and inodes, and how much of each the driver may use.
#[derive(Clone, Copy, Debug)]
pub struct Space {
    pub free: u64,
    /// Bytes kept free (`--min-free`) on this filesystem.
    pub reserve: u64,
    pub free_inodes: u64,
    /// Inodes kept free (`--min-free-inodes`).
    pub inode_reserve: u64,
}

impl Space {
    /// Free bytes beyond the reserve: what new data may take.
    pub fn usable(&self) -> u64 {
        self.free.saturating_sub(self.reserve)
    }

    /// Free inodes beyond the reserve.
    pub fn usable_inodes(&self) -> u64 {
        self.free_inodes.saturating_sub(self.inode_reserve)
    }
}

impl std::fmt::Display for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes usable ({} free, {} kept free by --min-free), {} inodes usable ({} free, {} kept free by --min-free-inodes)",
            self.usable(),
            self.free,
            self.reserve,
            self.usable_inodes(),
            self.free_inodes,
            self.inode_reserve
        )
    }
}

pub fn space(root: &Root) -> Result<Space> {
    let st = statvfs_of(&root.dir).ctx("statfs", &root.dir)?;
    let frag = st.fragment_size() as u64;
    let total = (st.blocks() as u64).saturating_mul(frag);
    // A filesystem that does not count inodes (some FUSE and network
    // ones report 0 of 0) has none to run out of.
    let (files, ffree) = (st.files() as u64, st.files_available() as u64);
    let (free_inodes, inode_reserve) = if files == 0 {
        (u64::MAX, 0)
    } else {
        (ffree, root.inode_reserve.of(files))
    };
    Ok(Space {
        free: (st.blocks_available() as u64).saturating_mul(frag),
        reserve: root.reserve.of(total),
        free_inodes,
        inode_reserve,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_pull_killed_after_its_rename_is_tidied_on_restart() {
        let d = tempfile::tempdir().unwrap();
        let cfg = Config {
            node_id: Some("n".into()),
            state_dir: d.path().to_path_buf(),
            ..Config::default()
        };
        let root = Roots::of(&cfg).roots.remove(0);
        let sid = format!("m{}", "a".repeat(31));
        let dir = root.sources_dir().join(&sid);
        for sub in ["data", "state", "blobs", "partial"] {
            fs::create_dir_all(dir.join(sub)).unwrap();
        }
        fs::write(dir.join("data/config.json"), b"{}").unwrap();
        fs::write(dir.join("state/x.json"), b"{}").unwrap();
        fs::write(dir.join("lock"), b"").unwrap();
        fs::write(dir.join(".seal.json.tmp-123"), b"{").unwrap();
        // Not sealed yet: a pull that may still be running keeps everything.
        sweep(&root);
        assert!(dir.join("state").exists());
        fs::write(dir.join("seal.json"), b"{}").unwrap();
        sweep(&root);
        for gone in ["state", "blobs", "partial", "lock", ".seal.json.tmp-123"] {
            assert!(!dir.join(gone).exists(), "{gone} is left");
        }
        assert!(dir.join("data/config.json").is_file());
        assert!(dir.join("seal.json").is_file());
    }
}
