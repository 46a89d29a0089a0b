//! A pull's work directory: `sources/.pull-<sid>/` under an flock, with
//! per-file progress records that are written only after the bytes they
//! describe are durable, so a pull killed at any point resumes.

use super::*;

/// Per-file progress, persisted after the bytes it describes are durable.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct FileState {
    pub(super) path: String,
    /// Finished chunk indexes, whose bytes are durable.
    pub(super) done: BTreeSet<u64>,
    /// Chunks in flight when last recorded: index -> leading bytes that are
    /// durable. A restart resumes each after them, so a `kill -9` costs
    /// at most [`PARTIAL_EVERY`] per connection instead of whole chunks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) partial: BTreeMap<u64, u64>,
    /// The chunk size `done` counts in; another size starts over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) chunk_bytes: Option<u64>,
    /// The size the listing gave when `done` was recorded: a server may
    /// list the same version at another size later (a lying
    /// Content-Length under one strong ETag), and then `done` means nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) size_listed: Option<u64>,
    /// Set once the whole file is verified and in place.
    pub(super) sha256: Option<String>,
    pub(super) size: Option<u64>,
    /// For layers: the files they unpacked to.
    pub(super) extracted: Option<Vec<FileEntry>>,
}

pub(super) struct Work {
    pub(super) dir: PathBuf,
    /// Where model files go: `data/`, or the mounted image for xfs.
    pub(super) data: PathBuf,
    pub(super) state: PathBuf,
    pub(super) blobs: PathBuf,
    /// Files being downloaded, named by a digest of their model path, so
    /// no name a source lists (`a` and `a.part`) can collide with them.
    pub(super) partial: PathBuf,
    pub(super) mounted: Option<PathBuf>,
    /// How the root holds a source: where the area came from, and how it
    /// grows.
    pub(super) store: &'static dyn crate::cache::store::SourceStore,
    /// Held for the whole pull; released on drop, or by the kernel on death.
    pub(super) _lock: nix::fcntl::Flock<File>,
}

impl Drop for Work {
    fn drop(&mut self) {
        if let Some(mnt) = &self.mounted
            && mount::is_mount_point(mnt).unwrap_or(false)
        {
            let _ = mount::unmount(mnt);
        }
    }
}

pub(super) fn state_path(work: &Work, path: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(path.as_bytes());
    work.state
        .join(format!("{}.json", &hex::encode(h.finalize())[..32]))
}

/// Opens (or resumes) the work directory of a pull and locks it.
pub(super) fn open_work(root: &Root, sid: &str, need: Option<u64>) -> Result<Work> {
    let dir = root.sources_dir().join(format!(".pull-{sid}"));
    fs::create_dir_all(&dir).ctx("create", &dir)?;
    let lock_path = dir.join("lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .ctx("open", &lock_path)?;
    // Another process (a second controller replica on a shared root) may be
    // pulling the same model; it will seal it, and the CO retries us.
    let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
        |_| {
            Error::Busy(format!(
                "model {sid} is being pulled by another process; retry later"
            ))
        },
    )?;
    let state = dir.join("state");
    let blobs = dir.join("blobs");
    fs::create_dir_all(&state).ctx("create", &state)?;
    fs::create_dir_all(&blobs).ctx("create", &blobs)?;
    let store = root.backend.store();
    let area = store.open_pull(&dir, need)?;
    let (data, mounted) = (area.data, area.mounted);
    let partial = match mounted {
        Some(_) => data.join(PARTIAL_DIR),
        None => dir.join("partial"),
    };
    fs::create_dir_all(&partial).ctx("create", &partial)?;
    Ok(Work {
        dir,
        data,
        state,
        blobs,
        partial,
        mounted,
        store,
        _lock: lock,
    })
}

/// Removes a failed pull's work directory, which the caller holds locked.
pub(super) fn discard_work(work: &Work) -> Result<()> {
    if let Some(mnt) = &work.mounted
        && mount::is_mount_point(mnt).ctx("inspect", mnt)?
    {
        mount::unmount(mnt).ctx("unmount", mnt)?;
    }
    remove_tree(&work.dir)
}

/// `remove_dir_all`, where a tree already gone is success.
pub(super) fn remove_tree(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", dir, e)),
    }
}

pub(super) fn load_state(work: &Work, path: &str) -> Result<FileState> {
    let p = state_path(work, path);
    Ok(state::read_json(&p)
        .ctx("read pull state", &p)?
        .unwrap_or_else(|| FileState {
            path: path.to_string(),
            ..FileState::default()
        }))
}

pub(super) fn save_state(work: &Work, st: &FileState) -> Result<()> {
    let p = state_path(work, &st.path);
    state::write_json(&p, st).ctx("write pull state", &p)
}
