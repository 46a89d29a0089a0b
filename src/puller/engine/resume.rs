//! Per-file progress of a pull, recorded in its area's progress directory
//! only after the bytes it describes are durable, so a pull killed at any
//! point resumes; and, between those records, what is written but not yet
//! durable, which only a restart of the process on the same boot trusts
//! (the kernel kept the dead process's writes; a reboot may not have).

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
    /// Its chunk table, recorded with `sha256`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) chunks: Vec<String>,
    pub(super) size: Option<u64>,
    /// For layers: the files they unpacked to.
    pub(super) extracted: Option<Vec<FileEntry>>,
}

pub(super) fn state_path(work: &PullArea, path: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(path.as_bytes());
    work.progress_dir()
        .join(format!("{}.json", &hex::encode(h.finalize())[..32]))
}

pub(super) fn load_state(work: &PullArea, path: &str) -> Result<FileState> {
    let p = state_path(work, path);
    Ok(state::read_json(&p)
        .ctx("read pull state", &p)?
        .unwrap_or_else(|| FileState {
            path: path.to_string(),
            ..FileState::default()
        }))
}

pub(super) fn save_state(work: &PullArea, st: &FileState) -> Result<()> {
    let p = state_path(work, &st.path);
    state::write_json(&p, st).ctx("write pull state", &p)
}

/// Chunks written but not yet made durable (`Ctx::defer_durable` holds
/// durability back to the end of a file's transfer). Written without an
/// fsync, and trusted only by a process of the same boot: a crash of the
/// driver loses nothing the kernel has, a crash of the machine loses what
/// it must.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct Written {
    /// `/proc/sys/kernel/random/boot_id` when written.
    pub(super) boot: String,
    pub(super) chunk_bytes: u64,
    pub(super) size: u64,
    pub(super) done: BTreeSet<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) partial: BTreeMap<u64, u64>,
    /// The whole file was written and hashed, and may have been put in
    /// place before its record: what is in place is it.
    #[serde(default)]
    pub(super) whole: bool,
}

/// This boot's id, or None where the kernel does not say (nothing written
/// but not durable is then ever trusted).
pub(super) fn boot_id() -> Option<&'static str> {
    static ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .as_deref()
}

fn written_path(work: &PullArea, path: &str) -> PathBuf {
    state_path(work, path).with_extension("written.json")
}

/// What this boot wrote of `path` beyond its durable record, if anything
/// trustworthy (a record another boot wrote, or one a crash tore, is
/// nothing).
pub(super) fn load_written(work: &PullArea, path: &str) -> Option<Written> {
    let w: Written = state::read_json(&written_path(work, path)).ok()??;
    (Some(w.boot.as_str()) == boot_id()).then_some(w)
}

pub(super) fn save_written(work: &PullArea, path: &str, w: &Written) -> Result<()> {
    let p = written_path(work, path);
    state::write_json_unsynced(&p, w).ctx("write pull progress", &p)
}

pub(super) fn forget_written(work: &PullArea, path: &str) {
    let _ = fs::remove_file(written_path(work, path));
}
