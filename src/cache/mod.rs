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

pub mod evict;
pub mod layout;
pub mod manifest;
pub mod record;
pub mod xfs;

use std::fs;
use std::io;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub use layout::{Backend, Root, Roots, SourcePaths, VolumeId, uuid_for_name};
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
    let not_found = || Error::NotFound(format!("volume {volume_id} does not exist"));
    let id = VolumeId::parse(volume_id).ok_or_else(not_found)?;
    let root = roots.for_id(&id).map_err(|_| not_found())?.clone();
    let rec = read_volume(&root, &id.uuid)?.ok_or_else(not_found)?;
    Ok((root, rec))
}

pub fn read_volume(root: &Root, uuid: &str) -> Result<Option<VolumeRecord>> {
    let path = root.volume_record(uuid);
    state::read_json(&path).ctx("read volume record", &path)
}

pub fn write_volume(root: &Root, rec: &VolumeRecord) -> Result<()> {
    let uuid = VolumeId::parse(&rec.id)
        .map(|v| v.uuid)
        .ok_or_else(|| Error::Internal(format!("malformed volume id {}", rec.id)))?;
    let path = root.volume_record(&uuid);
    state::write_json(&path, rec).ctx("write volume record", &path)
}

pub fn remove_volume(root: &Root, uuid: &str) -> Result<()> {
    let path = root.volume_record(uuid);
    state::remove_file(&path).ctx("remove volume record", &path)
}

pub fn list_volumes(root: &Root) -> Result<Vec<VolumeRecord>> {
    let dir = root.volumes_dir();
    let mut out = Vec::new();
    for name in state::list_names(&dir).ctx("list volumes in", &dir)? {
        if let Some(uuid) = name.strip_suffix(".json")
            && let Some(rec) = read_volume(root, uuid)?
        {
            out.push(rec);
        }
    }
    Ok(out)
}

pub fn read_seal(root: &Root, sid: &str) -> Result<Option<Seal>> {
    let path = root.source(sid).seal();
    state::read_json(&path).ctx("read seal", &path)
}

pub fn source_exists(root: &Root, sid: &str) -> bool {
    root.source(sid).dir.is_dir()
}

/// Nodes that have the source staged writable.
pub fn writers(root: &Root, sid: &str) -> Result<Vec<String>> {
    let dir = root.source(sid).writers();
    state::list_names(&dir).ctx("list writers in", &dir)
}

/// Cache volumes (by uuid) that read the source.
pub fn refs(root: &Root, sid: &str) -> Result<Vec<String>> {
    let dir = root.source(sid).refs();
    state::list_names(&dir).ctx("list references in", &dir)
}

pub fn add_ref(root: &Root, sid: &str, uuid: &str) -> Result<()> {
    let path = root.source(sid).refs().join(uuid);
    state::create_marker(&path, b"").ctx("create reference", &path)?;
    Ok(())
}

pub fn remove_ref(root: &Root, sid: &str, uuid: &str) -> Result<()> {
    let path = root.source(sid).refs().join(uuid);
    state::remove_file(&path).ctx("remove reference", &path)
}

/// Creates an empty writable source. Idempotent.
pub fn create_source(root: &Root, sid: &str, capacity_bytes: u64) -> Result<()> {
    let sp = root.source(sid);
    match root.backend {
        Backend::Xfs => {
            if !sp.image().exists() {
                xfs::create_image(&sp.image(), capacity_bytes)?;
            }
        }
        Backend::Local | Backend::Shared => {
            let data = sp.data();
            if !data.is_dir() {
                // Built beside the final place and renamed: a crash leaves no
                // half-made source under the real name.
                let tmp = sp
                    .dir
                    .join(format!(".data-{}", uuid::Uuid::new_v4().simple()));
                fs::create_dir_all(&tmp).ctx("create", &tmp)?;
                fs::rename(&tmp, &data).ctx("rename into place", &data)?;
                state::sync_dir(&sp.dir).ctx("sync", &sp.dir)?;
            }
        }
    }
    Ok(())
}

/// Makes `to` a writable copy of `from`: the one case where bytes are
/// duplicated, because the result must be writable. Reflinks where the
/// filesystem can.
pub fn copy_source(root: &Root, from: &str, to: &str) -> Result<()> {
    let src = root.source(from);
    let dst = root.source(to);
    let (from_path, to_path) = match root.backend {
        Backend::Xfs => (src.image(), dst.image()),
        Backend::Local | Backend::Shared => (src.data(), dst.data()),
    };
    if to_path.exists() {
        return Ok(());
    }
    fs::create_dir_all(&dst.dir).ctx("create", &dst.dir)?;
    let tmp = dst
        .dir
        .join(format!(".copy-{}", uuid::Uuid::new_v4().simple()));
    let status = std::process::Command::new("cp")
        .args(["-a", "--reflink=auto", "--sparse=always"])
        .arg(&from_path)
        .arg(&tmp)
        .status()
        .ctx("run cp from", &from_path)?;
    if !status.success() {
        let _ = fs::remove_dir_all(&tmp).or_else(|_| fs::remove_file(&tmp));
        return Err(Error::Internal(format!(
            "copying {} to {} failed: cp {status}",
            from_path.display(),
            tmp.display()
        )));
    }
    if root.backend == Backend::Xfs {
        // The copy must be writable even if the original was sealed (0444).
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644)).ctx("chmod", &tmp)?;
        if let Err(e) = xfs::new_uuid(&tmp) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    }
    fs::rename(&tmp, &to_path).ctx("rename into place", &to_path)?;
    state::sync_dir(&dst.dir).ctx("sync", &dst.dir)?;
    Ok(())
}

/// Removes a source and everything in it. The caller has checked that no
/// volume reads it and no node writes it.
pub fn delete_source(root: &Root, sid: &str) -> Result<()> {
    let sp = root.source(sid);
    if root.backend == Backend::Xfs {
        let attached = crate::mount::loopdev::devices_backed_by(&sp.image()).unwrap_or_default();
        if !attached.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "source {sid} is still attached on this node as {}; unstage its volumes first",
                attached[0].0.display()
            )));
        }
    }
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

/// Takes a writer lease for `node`, then checks the source is not sealed or
/// being sealed. See the module docs for why the order matters. Returns
/// whether this call created the lease (false: the node already held it).
pub fn acquire_writer(root: &Root, sid: &str, node: &str) -> Result<bool> {
    let sp = root.source(sid);
    let lease = sp.writers().join(node);
    let created = state::create_marker(&lease, now_unix().to_string().as_bytes())
        .ctx("create writer lease", &lease)?;
    if sp.seal().exists() || sp.sealing().exists() {
        state::remove_file(&lease).ctx("remove writer lease", &lease)?;
        return Err(Error::FailedPrecondition(format!(
            "source {sid} is sealed (or being sealed) and can only be mounted read-only"
        )));
    }
    Ok(created)
}

pub fn release_writer(root: &Root, sid: &str, node: &str) -> Result<()> {
    let lease = root.source(sid).writers().join(node);
    state::remove_file(&lease).ctx("remove writer lease", &lease)
}

/// Seals a source: refuses while any node has it writable, then records
/// every file's size and sha256 and makes the seal visible in one rename.
/// Idempotent: a sealed source returns its seal.
pub fn seal_source(root: &Root, sid: &str, origin: &str) -> Result<Seal> {
    let sp = root.source(sid);
    if let Some(seal) = read_seal(root, sid)? {
        return Ok(seal);
    }
    if !sp.dir.is_dir() {
        return Err(Error::NotFound(format!("source {sid} does not exist")));
    }
    // An existing marker is our own earlier attempt, cut short.
    state::create_marker(&sp.sealing(), now_unix().to_string().as_bytes())
        .ctx("create sealing marker", &sp.sealing())?;
    let result = (|| {
        let writers = writers(root, sid)?;
        if !writers.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "source {sid} is still staged writable on node(s) {}; stop the pods that \
                 write it (the volume must be unstaged everywhere) before sealing",
                writers.join(", ")
            )));
        }
        let tree = match root.backend {
            Backend::Xfs => xfs::scan_image(&sp.image(), &root.tmp_dir())?,
            Backend::Local | Backend::Shared => manifest::scan(&sp.data())?,
        };
        let seal = Seal {
            format: manifest::FORMAT,
            source: sid.to_string(),
            origin: origin.to_string(),
            revision: None,
            sealed_unix: now_unix(),
            total_bytes: tree.total_bytes(),
            files: tree.files,
            dirs: tree.dirs,
            symlinks: tree.symlinks,
        };
        if root.backend == Backend::Xfs {
            xfs::make_readonly(&sp.image())?;
        }
        state::write_json(&sp.seal(), &seal).ctx("write seal", &sp.seal())?;
        Ok(seal)
    })();
    state::remove_file(&sp.sealing()).ctx("remove sealing marker", &sp.sealing())?;
    result
}

/// Free bytes for new data in a root's filesystem.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    fs::create_dir_all(dir)?;
    let st = nix::sys::statvfs::statvfs(dir).map_err(io::Error::from)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}
