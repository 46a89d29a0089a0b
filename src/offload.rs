//! Blocking filesystem work, run off the async runtime's threads: a slow
//! disk or an NFS-backed root must never stall other calls.

use crate::error::{Error, Result};

/// Runs `f` on tokio's blocking pool and waits for it.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}
