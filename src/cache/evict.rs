//! Keeping pulled models within a root's capacity.
//!
//! Only models the puller fetched (source ids starting with `m`) are ever
//! evicted; a source volume is the user's data and goes only with its own
//! DeleteVolume. A model is evictable when no cache volume references it and
//! it is not pinned. Under pressure the least recently used go first; in the
//! background, those idle longer than the configured time.
//!
//! Eviction and a new reference race without a lock shared across
//! processes: eviction renames the model away, then looks for references,
//! and puts it back if one appeared; a new reference is added, then the
//! seal is looked for at its place (see `reference_model`).

use std::fs;
use std::time::Duration;

use super::{Root, Seal, SourceId, now_unix, read_seal, read_volume, refs, remove_ref};
use crate::error::{Error, IoContext, Result};
use crate::state;

/// Records that a model was just used.
pub fn touch(root: &Root, sid: &SourceId) -> Result<()> {
    touch_confined(&root.open_source(sid)?)
}

/// How stale `last-used` may be before a use writes it again. Eviction
/// orders models by days and hours of disuse; a minute is noise, and a
/// burst of a hundred stages of one model then costs one durable write,
/// not a hundred.
pub const TOUCH_GRANULARITY_SECS: u64 = 60;

/// As `touch`, through a source directory already opened beneath its root:
/// on a shared root the write cannot be redirected by a link.
pub fn touch_confined(src: &super::layout::ConfinedSource) -> Result<()> {
    let p = src.via.dir.join("last-used");
    let now = now_unix();
    let recent = fs::read_to_string(&p)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_some_and(|t| t <= now && now - t < TOUCH_GRANULARITY_SECS);
    if recent {
        return Ok(());
    }
    state::write_atomic(&p, now.to_string().as_bytes())
        .ctx("write", &src.real.dir.join("last-used"))
}

pub fn last_used(root: &Root, sid: &SourceId) -> u64 {
    let p = root.source(sid).dir.join("last-used");
    fs::read_to_string(&p)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .or_else(|| read_seal(root, sid).ok().flatten().map(|s| s.sealed_unix))
        .unwrap_or(0)
}

/// The admin's pin (`modelcache-csi cache pin`), which no volume undoes.
pub fn set_pinned(root: &Root, sid: &SourceId, pinned: bool) -> Result<()> {
    let p = root.source(sid).dir.join("pinned");
    if pinned {
        state::create_marker(&p, b"").ctx("pin", &p)?;
        Ok(())
    } else {
        state::remove_file(&p).ctx("unpin", &p)
    }
}

/// A volume's pin (`pinned: "true"` on its class): one marker per volume
/// (`pins/<volume uuid>`), so a volume's `pinned: "false"` takes back its
/// own pin only, never the admin's or another volume's (a tenant's class
/// could otherwise unpin what an admin pinned).
pub fn set_volume_pin(root: &Root, sid: &SourceId, volume_uuid: &str, pinned: bool) -> Result<()> {
    if !super::layout::is_volume_uuid(volume_uuid) {
        return Err(Error::Internal(format!(
            "volume uuid {volume_uuid:?} is malformed"
        )));
    }
    let dir = root.source(sid).dir.join("pins");
    let p = dir.join(volume_uuid);
    if pinned {
        fs::create_dir_all(&dir).ctx("create", &dir)?;
        state::create_marker(&p, b"").ctx("pin", &p)?;
        Ok(())
    } else {
        state::remove_file(&p).ctx("unpin", &p)
    }
}

/// Pinned by the admin, or by a volume that still exists.
pub fn is_pinned(root: &Root, sid: &SourceId) -> bool {
    let dir = root.source(sid).dir;
    if dir.join("pinned").exists() {
        return true;
    }
    state::list_names(&dir.join("pins"))
        .unwrap_or_default()
        .iter()
        .any(|uuid| matches!(read_volume(root, uuid), Ok(Some(_))))
}

/// How long a reference may stand without its volume record. A create
/// writes the reference first and the record after it; one that died in
/// between leaves a reference nothing will remove but this.
pub const REF_GRACE: Duration = Duration::from_secs(600);

/// Live references: those whose volume record exists, and those of a
/// create still on its way (younger than [`REF_GRACE`]). Older ones,
/// left by a create that died, are dropped on the way.
pub fn live_refs(root: &Root, sid: &SourceId) -> Result<Vec<String>> {
    let mut live = Vec::new();
    let dir = root.source(sid).refs();
    for r in refs(root, sid)? {
        let young = || {
            fs::metadata(dir.join(&r))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().unwrap_or_default() < REF_GRACE)
        };
        if read_volume(root, &r)?.is_some() || young() {
            live.push(r);
        } else {
            remove_ref(root, sid, &r)?;
        }
    }
    Ok(live)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub sid: SourceId,
    pub last_used: u64,
    /// As charged (`Seal::charged_bytes`).
    pub bytes: u64,
    pub inodes: u64,
}

/// What a new model takes: its bytes as charged (`manifest::charge`) and
/// its inodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    pub bytes: u64,
    pub inodes: u64,
}

/// A model's seal as accounting reads it: one that cannot be read as a
/// seal (torn, over its bound, forged on a shared root) costs only its own
/// model. It is reported, counted as nothing, and evicted as any unused
/// model is; an I/O error still fails the whole count.
enum Accounted {
    Sealed(Box<Seal>),
    Unreadable,
    Unsealed,
}

fn accounted(root: &Root, sid: &SourceId) -> Result<Accounted> {
    match read_seal(root, sid) {
        Ok(Some(seal)) => Ok(Accounted::Sealed(Box::new(seal))),
        Ok(None) => Ok(Accounted::Unsealed),
        Err(Error::Precondition(why)) => {
            tracing::warn!(source = %sid, %why, "a model's seal cannot be read: it is counted as nothing and evicted when unused (`modelcache-csi cache ls` shows it)");
            Ok(Accounted::Unreadable)
        }
        Err(e) => Err(e),
    }
}

/// The models of a root, by id.
fn models(root: &Root) -> Result<Vec<SourceId>> {
    let ids = state::list_names(&root.sources_dir()).ctx("list", &root.sources_dir())?;
    Ok(ids
        .iter()
        .filter_map(|sid| SourceId::parse_model(sid))
        .collect())
}

/// Sealed, unreferenced, unpinned models, least recently used first; a
/// model whose seal cannot be read is one, of unknown size.
pub fn candidates(root: &Root) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for sid in models(root)? {
        if is_pinned(root, &sid) {
            continue;
        }
        let (bytes, inodes) = match accounted(root, &sid)? {
            Accounted::Sealed(seal) => (seal.charged_bytes(), seal.inodes()),
            Accounted::Unreadable => (0, 0),
            Accounted::Unsealed => continue,
        };
        if !live_refs(root, &sid)?.is_empty() {
            continue;
        }
        out.push(Candidate {
            last_used: last_used(root, &sid),
            bytes,
            inodes,
            sid,
        });
    }
    out.sort_by_key(|c| (c.last_used, c.sid.clone()));
    Ok(out)
}

/// Bytes held by sealed models in the root, as charged (a block at least
/// for every file, directory and link).
pub fn usage(root: &Root) -> Result<u64> {
    let mut total = 0u64;
    for sid in models(root)? {
        if let Accounted::Sealed(seal) = accounted(root, &sid)? {
            total = total.saturating_add(seal.charged_bytes());
        }
    }
    Ok(total)
}

/// Bytes a new model may still use: the filesystem's free space beyond the
/// root's reserve (`--min-free`), bounded by the configured capacity.
pub fn available(root: &Root, capacity: Option<u64>) -> Result<u64> {
    let space = super::space(root)?;
    let free = space.usable();
    Ok(match capacity {
        Some(c) => free.min(c.saturating_sub(usage(root)?)),
        None => free,
    })
}

/// What the metrics' gauges read of a root.
impl crate::metrics::GaugedRoot for Root {
    fn backend(&self) -> super::Backend {
        self.backend
    }
    fn dir(&self) -> &std::path::Path {
        &self.dir
    }
    fn sources_dir(&self) -> std::path::PathBuf {
        Root::sources_dir(self)
    }
    fn used(&self) -> Result<u64> {
        usage(self)
    }
    fn free(&self, capacity: Option<u64>) -> Result<u64> {
        available(self, capacity)
    }
}

/// Evicts one model unless a reference appeared meanwhile. Returns whether
/// it was removed.
pub fn evict(root: &Root, sid: &SourceId) -> Result<bool> {
    let dir = root.source(sid).dir;
    let trash = root
        .sources_dir()
        .join(format!(".trash-{sid}-{}", uuid::Uuid::new_v4().simple()));
    match fs::rename(&dir, &trash) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io("move to trash", &dir, e)),
    }
    let late_refs = state::list_names(&trash.join("refs")).ctx("list", &trash)?;
    if !late_refs.is_empty() {
        fs::rename(&trash, &dir).ctx("restore", &dir)?;
        return Ok(false);
    }
    if crate::mount::loopdev::devices_backed_by(&trash.join("image.xfs"))
        .map(|d| !d.is_empty())
        .unwrap_or(false)
    {
        fs::rename(&trash, &dir).ctx("restore", &dir)?;
        return Ok(false);
    }
    fs::remove_dir_all(&trash).ctx("remove", &trash)?;
    tracing::info!(source = %sid, "evicted model");
    Ok(true)
}

/// Frees room for `need` (bytes as charged, and inodes): first the work of
/// pulls nobody is running any more (a failed or abandoned pull's partial
/// files), then least recently used models. ResourceExhausted, naming the
/// limit, before anything is written when even that is not enough; and
/// before anything is evicted when evicting every unused model could not
/// make it fit. `evicted` hears of each model removed, as it goes.
pub fn make_room(
    root: &Root,
    need: Need,
    capacity: Option<u64>,
    for_sid: &SourceId,
    evicted: &dyn Fn(&str),
) -> Result<()> {
    let fits = || -> Result<bool> {
        Ok(need.bytes <= available(root, capacity)?
            && need.inodes <= super::space(root)?.usable_inodes())
    };
    if fits()? {
        return Ok(());
    }
    if super::pull::remove_abandoned(root, for_sid)? > 0 && fits()? {
        return Ok(());
    }
    let candidates: Vec<Candidate> = candidates(root)?
        .into_iter()
        .filter(|c| c.sid != for_sid.as_str())
        .collect();
    let sum = |f: fn(&Candidate) -> u64| candidates.iter().map(f).fold(0u64, u64::saturating_add);
    let (evictable, evictable_inodes) = (sum(|c| c.bytes), sum(|c| c.inodes));
    // The best eviction could do: the free space plus every unused model,
    // within what the capacity leaves to models still in use.
    let space = super::space(root)?;
    let free = space.usable();
    let best = match capacity {
        Some(c) => {
            let in_use = usage(root)?.saturating_sub(evictable);
            free.saturating_add(evictable).min(c.saturating_sub(in_use))
        }
        None => free.saturating_add(evictable),
    };
    let best_inodes = space.usable_inodes().saturating_add(evictable_inodes);
    let cap_note = capacity
        .map(|c| format!(" (--cache-capacity {c} bytes)"))
        .unwrap_or_default();
    if need.bytes > best {
        return Err(Error::OverLimit(format!(
            "the model needs {} bytes (a block at least for each of its entries) but {} could offer \
             at most {best} bytes available{cap_note} ({space}), even after evicting all {} unused \
             models; nothing was evicted",
            need.bytes,
            root.describe(),
            candidates.len()
        )));
    }
    if need.inodes > best_inodes {
        return Err(Error::OverLimit(format!(
            "the model has {} files and directories but {} could offer at most {best_inodes} inodes \
             beyond --min-free-inodes ({space}), even after evicting all {} unused models; nothing \
             was evicted",
            need.inodes,
            root.describe(),
            candidates.len()
        )));
    }
    for c in candidates {
        if evict(root, &c.sid)? {
            evicted(&c.sid);
            if fits()? {
                return Ok(());
            }
        }
    }
    Err(Error::OverLimit(format!(
        "the model needs {} bytes and {} inodes but {} has only {} bytes available{cap_note} even \
         after evicting every unused model ({})",
        need.bytes,
        need.inodes,
        root.describe(),
        available(root, capacity)?,
        super::space(root)?
    )))
}

/// Evicts every candidate idle for at least `idle`; returns their ids.
pub fn evict_idle(root: &Root, idle: Duration) -> Result<Vec<SourceId>> {
    let cutoff = now_unix().saturating_sub(idle.as_secs());
    let mut gone = Vec::new();
    for c in candidates(root)? {
        if c.last_used <= cutoff && evict(root, &c.sid)? {
            gone.push(c.sid);
        }
    }
    Ok(gone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Role, VolumeRecord, write_volume};

    fn volume(root: &Root, uuid: &str, sid: &SourceId) {
        write_volume(
            root,
            &VolumeRecord {
                id: root.volume_id(uuid),
                name: uuid.into(),
                backend: root.backend,
                role: Role::Cache,
                source: sid.clone(),
                sub_path: None,
                verify: Default::default(),
                capacity_bytes: 1,
                node: root.node.clone(),
                model: Some("s3://m/x".into()),
                revision: None,
                external: None,
                content_source: None,
                namespace: None,
                signed_by: None,
                progressive: false,
                request: String::new(),
                created_unix: 0,
            },
        )
        .unwrap();
    }

    /// A tenant's class with `pinned: "false"` takes back its own volume's
    /// pin, never the admin's or another volume's.
    #[test]
    fn a_volume_unpins_only_its_own_pin() {
        let d = tempfile::tempdir().unwrap();
        let root = crate::cache::Roots::of(&crate::config::Config::for_node("n", d.path()))
            .roots
            .remove(0);
        let sid = SourceId::parse(&format!("m{}", "c".repeat(31))).unwrap();
        fs::create_dir_all(root.source(&sid).dir.join("data")).unwrap();
        let (a, b) = ("a".repeat(32), "b".repeat(32));
        volume(&root, &a, &sid);
        volume(&root, &b, &sid);
        assert!(!is_pinned(&root, &sid));

        set_pinned(&root, &sid, true).unwrap();
        set_volume_pin(&root, &sid, &b, false).unwrap();
        assert!(is_pinned(&root, &sid), "a volume undid the admin's pin");
        set_pinned(&root, &sid, false).unwrap();

        set_volume_pin(&root, &sid, &a, true).unwrap();
        set_volume_pin(&root, &sid, &b, false).unwrap();
        assert!(is_pinned(&root, &sid), "another volume undid a's pin");
        set_volume_pin(&root, &sid, &a, false).unwrap();
        assert!(!is_pinned(&root, &sid));

        // A deleted volume's pin ends with it.
        set_volume_pin(&root, &sid, &a, true).unwrap();
        crate::cache::remove_volume(&root, &a).unwrap();
        assert!(!is_pinned(&root, &sid));
        assert!(set_volume_pin(&root, &sid, "../x", true).is_err());
    }

    /// A reference removed while eviction has the model renamed away (to
    /// look for references, before putting it back) is removed from the
    /// trash at once, without waiting for the model to come back, which
    /// then comes back without it. One that comes back anyway (the model
    /// renamed away again between the two looks) has no volume record, and
    /// holds the model only while it is younger than `REF_GRACE`.
    #[test]
    fn a_reference_removed_while_eviction_looks_is_gone_when_the_model_is_back() {
        let d = tempfile::tempdir().unwrap();
        let root = crate::cache::Roots::of(&crate::config::Config::for_node("n", d.path()))
            .roots
            .remove(0);
        let sid = SourceId::parse(&format!("m{}", "e".repeat(31))).unwrap();
        let dir = root.source(&sid).dir;
        fs::create_dir_all(dir.join("data")).unwrap();
        let uuid = "f".repeat(32);
        crate::cache::add_ref(&root, &sid, &uuid).unwrap();
        let trash = root.sources_dir().join(format!(".trash-{sid}-look"));
        fs::rename(&dir, &trash).unwrap();
        remove_ref(&root, &sid, &uuid).unwrap();
        assert!(!trash.join("refs").join(&uuid).exists());
        fs::rename(&trash, &dir).unwrap();
        assert!(
            !refs(&root, &sid).unwrap().contains(&uuid),
            "the reference came back with the model"
        );

        let stray = "a".repeat(32);
        crate::cache::add_ref(&root, &sid, &stray).unwrap();
        assert_eq!(
            live_refs(&root, &sid).unwrap(),
            std::slice::from_ref(&stray)
        );
        let old = std::time::SystemTime::now() - REF_GRACE - Duration::from_secs(60);
        fs::File::open(root.source(&sid).refs().join(&stray))
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(live_refs(&root, &sid).unwrap().is_empty());
        assert!(evict(&root, &sid).unwrap(), "the model was not evicted");
    }

    /// A model whose seal cannot be read (here: over the reader's bound, as
    /// a model of very many long names once made it) costs only itself:
    /// usage, candidates and `make_room` go on around it, and, unused, it
    /// is evicted to make room. Before, each of them failed for the whole
    /// root.
    #[test]
    fn an_unreadable_seal_costs_only_its_own_model() {
        let d = tempfile::tempdir().unwrap();
        let root = crate::cache::Roots::of(&crate::config::Config::for_node("n", d.path()))
            .roots
            .remove(0);
        let good = SourceId::parse(&format!("m{}", "1".repeat(31))).unwrap();
        let bad = SourceId::parse(&format!("m{}", "2".repeat(31))).unwrap();
        let tree = crate::cache::manifest::Tree {
            files: vec![crate::cache::manifest::FileEntry {
                path: "w.bin".into(),
                size: 10_000,
                sha256: "0".repeat(64),
                chunks: Vec::new(),
            }],
            ..Default::default()
        };
        let seal = Seal::new(&good, "s3://m/good", None, tree);
        fs::create_dir_all(root.source(&good).data()).unwrap();
        state::write_json(&root.source(&good).seal(), &seal).unwrap();
        fs::create_dir_all(root.source(&bad).data()).unwrap();
        let huge = fs::File::create(root.source(&bad).seal()).unwrap();
        huge.set_len(state::MAX_RECORD_BYTES + 1).unwrap();
        let garbage = SourceId::parse(&format!("m{}", "3".repeat(31))).unwrap();
        fs::create_dir_all(root.source(&garbage).data()).unwrap();
        fs::write(root.source(&garbage).seal(), b"{ torn").unwrap();

        assert_eq!(usage(&root).unwrap(), seal.charged_bytes());
        let c: Vec<SourceId> = candidates(&root)
            .unwrap()
            .into_iter()
            .map(|c| c.sid)
            .collect();
        assert_eq!(c.len(), 3, "{c:?}");
        // Room is made, the unreadable ones (never used, of unknown size)
        // evicted first.
        let other = SourceId::parse(&format!("m{}", "4".repeat(31))).unwrap();
        let need = Need {
            bytes: 2,
            inodes: 1,
        };
        let evicted = std::sync::Mutex::new(Vec::new());
        make_room(&root, need, Some(seal.charged_bytes() + 1), &other, &|s| {
            evicted.lock().unwrap().push(s.to_string())
        })
        .unwrap();
        let mut first: Vec<String> = evicted.into_inner().unwrap()[..2].to_vec();
        first.sort();
        assert_eq!(first, [bad.to_string(), garbage.to_string()]);
        assert!(!root.source(&bad).dir.exists() && !root.source(&garbage).dir.exists());
    }

    /// A burst of uses writes `last-used` once; a stale one is renewed.
    #[test]
    fn touch_writes_at_most_once_a_minute() {
        let d = tempfile::tempdir().unwrap();
        let root = crate::cache::Roots::of(&crate::config::Config::for_node("n", d.path()))
            .roots
            .remove(0);
        let sid = SourceId::parse(&format!("m{}", "d".repeat(31))).unwrap();
        fs::create_dir_all(root.source(&sid).dir.join("data")).unwrap();
        let p = root.source(&sid).dir.join("last-used");
        touch(&root, &sid).unwrap();
        let first = last_used(&root, &sid);
        assert!(first.abs_diff(now_unix()) <= 1, "{first}");
        let written = fs::metadata(&p).unwrap().modified().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        touch(&root, &sid).unwrap();
        assert_eq!(fs::metadata(&p).unwrap().modified().unwrap(), written);

        let stale = now_unix() - TOUCH_GRANULARITY_SECS;
        fs::write(&p, stale.to_string()).unwrap();
        touch(&root, &sid).unwrap();
        assert!(last_used(&root, &sid) > stale);
        // A clock that went back does not freeze the record in the future.
        fs::write(&p, (now_unix() + 3600).to_string()).unwrap();
        touch(&root, &sid).unwrap();
        assert!(last_used(&root, &sid) <= now_unix());
    }
}
