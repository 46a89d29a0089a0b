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
    // The calling RPC's volume stays held until this work ends, even if
    // the RPC is cancelled first (`lock::OpGuard::hold`).
    let kept = crate::lock::kept();
    let mut task = tokio::task::spawn_blocking(move || {
        let done = f();
        drop(kept);
        done
    });
    let done = tokio::select! {
        done = &mut task => done,
        () = tokio::time::sleep(SLOW) => {
            drop(slot);
            task.await
        }
    };
    done.map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}

/// Runs `f` on a thread of its own at a lower CPU priority (nice 10) and
/// waits for it: work that may lag (a chunk table after the verdict)
/// yields the CPU to what a pod waits for. A thread of its own, because a
/// pool thread could not take its priority back without CAP_SYS_NICE.
pub fn niced<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setpriority on this thread's own id; no memory.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
            f()
        })
        .join()
        .map_err(|_| Error::Internal("a background hashing thread panicked".into()))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call whose caller gave up (its future dropped at the deadline)
    /// while its blocking work is stuck in a filesystem keeps its volume:
    /// a retry is refused as in progress until the work ends, then the key
    /// is free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_calls_keep_their_key_until_their_blocking_work_ends() {
        let locks = crate::lock::OpLocks::default();
        let (release, stuck) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel::<()>();
        let guard = locks.try_lock("vol").unwrap();
        let call = guard.hold(async move {
            blocking(move || {
                let _ = started.send(());
                let _ = stuck.recv();
                Ok(())
            })
            .await
        });
        let gave_up = tokio::time::timeout(Duration::from_millis(300), call).await;
        assert!(gave_up.is_err(), "the call should still be running");
        running.await.unwrap();
        let retry = locks.try_lock("vol");
        assert!(
            matches!(retry, Err(Error::Busy(_))),
            "a retry ran beside the stuck work"
        );
        release.send(()).unwrap();
        let t0 = std::time::Instant::now();
        while locks.try_lock("vol").is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the key was never freed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

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
