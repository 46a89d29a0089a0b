//! Writer leases: which node has an unsealed source staged writable, and at
//! which staging path. A lease is a file in `writers/` next to the source,
//! so every node and the sealing controller see it, and it outlives any
//! process: a driver killed with the source mounted still holds it.
//!
//! A lease is *exclusive* unless the source is a directory on a shared
//! filesystem staged MULTI_NODE_MULTI_WRITER. An exclusive lease is taken in
//! one step that cannot race: a fresh directory holding `<node>` is renamed
//! onto `writers/`, which the kernel (or NFS server) allows only while
//! `writers/` is empty or missing. A shared lease is `writers/<node>`
//! created with O_EXCL, followed by a look for an exclusive holder; an
//! exclusive taker's rename fails as soon as that file exists, so of the
//! two, whichever comes second backs off. One node holds at most one lease
//! per source, for one staging path: the same node at another path is a
//! second writer like any other.
//!
//! This never mounts; it only decides who may.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::layout::{ConfinedSource, SourceId, check_node_id};
use super::{Root, now_unix};
use crate::error::{Error, IoContext, Result};
use crate::state;

/// What a lease file holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub node: String,
    pub staging: String,
    pub exclusive: bool,
    pub since_unix: u64,
}

/// How many writers a stage lets in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Share {
    /// One node, one staging path: every XFS source, and every source not
    /// staged MULTI_NODE_MULTI_WRITER.
    Exclusive,
    /// A directory on a shared filesystem that several nodes may write at
    /// once, each at one staging path.
    MultiNode,
}

/// A holder as found in `writers/`: the lease, or why it could not be read
/// (a lease left by an older driver holds only a time).
#[derive(Clone, Debug)]
pub struct Holder {
    pub node: String,
    pub lease: Option<Lease>,
}

impl Holder {
    pub fn describe(&self) -> String {
        match &self.lease {
            Some(l) => format!("node {} (staged at {})", self.node, l.staging),
            None => format!("node {}", self.node),
        }
    }
    fn is(&self, node: &str, staging: &str) -> bool {
        self.node == node
            && self
                .lease
                .as_ref()
                .is_none_or(|l| l.staging == staging && l.node == node)
    }
}

/// Every lease in `writers/`. A name that is not a node id is reported as
/// a holder too: the source stays fenced, never silently opened.
pub fn holders(src: &ConfinedSource) -> Result<Vec<Holder>> {
    let dir = src.via.writers();
    let names = state::list_names(&dir).ctx("list writers in", &src.real.writers())?;
    Ok(names
        .into_iter()
        .map(|node| {
            let lease = if check_node_id(&node).is_ok() {
                state::read_json::<Lease>(&dir.join(&node))
                    .ok()
                    .flatten()
                    .filter(|l| l.node == node)
            } else {
                None
            };
            Holder { node, lease }
        })
        .collect())
}

fn refuse(sid: &SourceId, others: &[Holder]) -> Error {
    let who: Vec<String> = others.iter().map(Holder::describe).collect();
    Error::Precondition(format!(
        "source {sid} is already staged writable on {}; an unsealed source has one writer: \
         unstage it there first (stop the pods that write it), or seal it and read it \
         through cache volumes",
        who.join(", ")
    ))
}

/// Takes the writer lease of `node` at `staging`, then checks the source is
/// not sealed or being sealed (see `cache` for why in this order). Returns
/// whether this call created the lease: false when `node` already held it
/// for `staging` (a retried stage).
pub fn acquire(
    root: &Root,
    src: &ConfinedSource,
    sid: &SourceId,
    node: &str,
    staging: &Path,
    share: Share,
) -> Result<bool> {
    check_node_id(node).map_err(Error::Internal)?;
    let staging_s = staging.to_string_lossy().into_owned();
    let lease = Lease {
        node: node.to_string(),
        staging: staging_s.clone(),
        exclusive: share == Share::Exclusive,
        since_unix: now_unix(),
    };
    let created = match share {
        Share::Exclusive => acquire_exclusive(src, sid, &lease)?,
        Share::MultiNode => acquire_shared(src, sid, &lease)?,
    };
    if sealed_or_sealing(src)? {
        if created {
            release(root, src, node, staging)?;
        }
        return Err(Error::Precondition(format!(
            "source {sid} is sealed (or being sealed) and can only be mounted read-only"
        )));
    }
    Ok(created)
}

/// Whether the source is sealed or being sealed, asked of its directory's
/// listing rather than by name: a network filesystem's client may answer a
/// lookup from a cached "no such file" (NFS's lookupcache, GlusterFS's
/// negative-timeout) for the marker another node's controller has just
/// created, while a listing reaches the server. This is the half of the
/// fence (see `cache`) that runs on the writer's node, so it must never be
/// answered stale.
fn sealed_or_sealing(src: &ConfinedSource) -> Result<bool> {
    let names = state::list_names(&src.via.dir).ctx("list", &src.real.dir)?;
    let named = |p: std::path::PathBuf| {
        p.file_name()
            .is_some_and(|n| names.iter().any(|m| n == m.as_str()))
    };
    Ok(named(src.via.seal()) || named(src.via.sealing()))
}

fn acquire_exclusive(src: &ConfinedSource, sid: &SourceId, lease: &Lease) -> Result<bool> {
    let bytes = lease_bytes(lease);
    // Two rounds: a holder may release between our rename and our look.
    for _ in 0..2 {
        let tmp_name = format!(".writers-{}", uuid::Uuid::new_v4().simple());
        let tmp = src.via.dir.join(&tmp_name);
        fs::create_dir(&tmp).ctx("create", &src.real.dir.join(&tmp_name))?;
        let made = (|| {
            let f = tmp.join(&lease.node);
            state::create_marker(&f, &bytes)?;
            state::sync_dir(&tmp)?;
            fs::rename(&tmp, src.via.writers())
        })();
        match made {
            Ok(()) => {
                state::sync_dir(&src.via.dir).ctx("sync", &src.real.dir)?;
                return Ok(true);
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
                let _ = fs::remove_dir_all(&tmp);
                let holders = holders(src)?;
                if holders.is_empty() {
                    continue;
                }
                if let [only] = &holders[..]
                    && only.is(&lease.node, &lease.staging)
                {
                    return Ok(false);
                }
                return Err(refuse(sid, &holders));
            }
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                return Err(Error::io("take writer lease", &src.real.writers(), e));
            }
        }
    }
    Err(Error::Busy(format!(
        "the writer lease of source {sid} changed hands while it was being taken; retry"
    )))
}

fn acquire_shared(src: &ConfinedSource, sid: &SourceId, lease: &Lease) -> Result<bool> {
    let path = src.via.writers().join(&lease.node);
    let real = src.real.writers().join(&lease.node);
    match fs::symlink_metadata(src.via.writers()) {
        Ok(m) if !m.is_dir() => {
            return Err(Error::Precondition(format!(
                "{} is not a directory; refusing to take a lease through it",
                src.real.writers().display()
            )));
        }
        _ => {}
    }
    let created =
        state::create_marker(&path, &lease_bytes(lease)).ctx("take writer lease", &real)?;
    let holders = holders(src)?;
    let (mine, others): (Vec<Holder>, Vec<Holder>) =
        holders.into_iter().partition(|h| h.node == lease.node);
    if !created && !mine.iter().any(|h| h.is(&lease.node, &lease.staging)) {
        return Err(refuse(sid, &mine));
    }
    // Another shared holder is fine; an exclusive one, or one whose lease
    // cannot be read, is not.
    let blocking: Vec<Holder> = others
        .into_iter()
        .filter(|h| h.lease.as_ref().is_none_or(|l| l.exclusive))
        .collect();
    if !blocking.is_empty() {
        if created {
            state::remove_file(&path).ctx("remove writer lease", &real)?;
        }
        return Err(refuse(sid, &blocking));
    }
    Ok(created)
}

/// Drops `node`'s lease if it is the one for `staging`. A lease for another
/// staging path is left alone: unstaging a path that never held the source
/// must not open it to a second writer.
pub fn release(_root: &Root, src: &ConfinedSource, node: &str, staging: &Path) -> Result<()> {
    check_node_id(node).map_err(Error::Internal)?;
    let path = src.via.writers().join(node);
    let real = src.real.writers().join(node);
    let staging = staging.to_string_lossy();
    match state::read_json::<Lease>(&path) {
        Ok(None) => return Ok(()),
        Ok(Some(l)) if l.staging != staging => {
            tracing::info!(
                lease = %real.display(),
                held_for = %l.staging,
                "not releasing a writer lease held for another staging path"
            );
            return Ok(());
        }
        // Ours, or one an older driver wrote (a bare time): ours to drop.
        Ok(Some(_)) | Err(_) => {}
    }
    state::remove_file(&path).ctx("remove writer lease", &real)
}

/// Drops `node`'s lease whatever staging path it names: an operator's
/// recovery of a source whose writer node died holding it (nothing on a
/// dead node can release it, and the driver never breaks another node's
/// lease by itself). Returns the holder removed; NotFound, naming the
/// holders there are, when `node` holds none.
pub fn break_lease(src: &ConfinedSource, sid: &SourceId, node: &str) -> Result<Holder> {
    let all = holders(src)?;
    let Some(held) = all.iter().find(|h| h.node == node).cloned() else {
        let who: Vec<String> = all.iter().map(Holder::describe).collect();
        return Err(Error::NotFound(format!(
            "source {sid} has no writer lease of node {node}; {}",
            if who.is_empty() {
                "it has no writer at all".to_string()
            } else {
                format!("its writers: {}", who.join(", "))
            }
        )));
    };
    let path = src.via.writers().join(node);
    state::remove_file(&path).ctx("remove writer lease", &src.real.writers().join(node))?;
    Ok(held)
}

fn lease_bytes(lease: &Lease) -> Vec<u8> {
    let mut b = serde_json::to_vec(lease).unwrap_or_default();
    b.push(b'\n');
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Backend;
    use crate::config::Config;

    const SID: &str = "0123456789abcdef0123456789abcdef";

    fn sid() -> SourceId {
        SourceId::parse(SID).unwrap()
    }

    fn root(backend: Backend) -> (tempfile::TempDir, Root) {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = Config {
            shared_paths: vec![tmp.path().to_path_buf()],
            backends: vec![backend],
            ..Config::default()
        };
        let root = crate::cache::Roots::of(&cfg).roots[0].clone();
        fs::create_dir_all(root.source(&sid()).data()).unwrap();
        (tmp, root)
    }

    fn take(root: &Root, node: &str, staging: &str, share: Share) -> Result<bool> {
        let src = root.open_source(&sid()).unwrap();
        acquire(root, &src, &sid(), node, Path::new(staging), share)
    }

    #[test]
    fn exclusive_lease_admits_one_node_at_one_path() {
        let (_t, root) = root(Backend::Xfs);
        assert!(take(&root, "a", "/s/1", Share::Exclusive).unwrap());
        assert!(
            !take(&root, "a", "/s/1", Share::Exclusive).unwrap(),
            "a retry"
        );
        for (node, staging) in [("b", "/s/1"), ("a", "/s/2")] {
            let err = take(&root, node, staging, Share::Exclusive).unwrap_err();
            assert!(matches!(err, Error::Precondition(_)), "{err}");
            assert!(err.to_string().contains("node a (staged at /s/1)"), "{err}");
        }
        // A shared taker sees the exclusive holder too, and leaves nothing.
        let err = take(&root, "b", "/s/1", Share::MultiNode).unwrap_err();
        assert!(err.to_string().contains("node a"), "{err}");
        let src = root.open_source(&sid()).unwrap();
        assert_eq!(holders(&src).unwrap().len(), 1);
        // Unstaging another path does not open the source.
        release(&root, &src, "a", Path::new("/s/2")).unwrap();
        assert!(take(&root, "b", "/s/1", Share::Exclusive).is_err());
        release(&root, &src, "a", Path::new("/s/1")).unwrap();
        assert!(take(&root, "b", "/s/9", Share::Exclusive).unwrap());
        // No temporary directory is left behind.
        let left: Vec<_> = fs::read_dir(root.source(&sid()).dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn racing_exclusive_takers_admit_exactly_one() {
        let (_t, root) = root(Backend::Xfs);
        for round in 0..20 {
            let winners: Vec<bool> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|i| {
                        let root = &root;
                        s.spawn(move || {
                            take(root, &format!("n{i}"), "/s", Share::Exclusive).is_ok()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(winners.iter().filter(|w| **w).count(), 1, "round {round}");
            let src = root.open_source(&sid()).unwrap();
            let h = holders(&src).unwrap();
            release(&root, &src, &h[0].node, Path::new("/s")).unwrap();
        }
    }

    #[test]
    fn multi_node_leases_coexist_but_not_with_an_exclusive_one() {
        let (_t, root) = root(Backend::Shared);
        assert!(take(&root, "a", "/s", Share::MultiNode).unwrap());
        assert!(take(&root, "b", "/s", Share::MultiNode).unwrap());
        let err = take(&root, "a", "/other", Share::MultiNode).unwrap_err();
        assert!(err.to_string().contains("node a (staged at /s)"), "{err}");
        let err = take(&root, "c", "/s", Share::Exclusive).unwrap_err();
        assert!(err.to_string().contains("node a"), "{err}");
    }

    #[test]
    fn a_sealed_source_takes_no_lease() {
        let (_t, root) = root(Backend::Xfs);
        fs::write(root.source(&sid()).sealing(), b"").unwrap();
        let err = take(&root, "a", "/s", Share::Exclusive).unwrap_err();
        assert!(err.to_string().contains("sealed"), "{err}");
        let src = root.open_source(&sid()).unwrap();
        assert!(holders(&src).unwrap().is_empty());
    }
}
