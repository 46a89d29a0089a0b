//! Per-file progress of a pull, recorded in its area's progress directory
//! only after the bytes it describes are durable, so a pull killed at any
//! point resumes.

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
