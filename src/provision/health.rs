//! Whether every enabled backend can work on this host right now: each
//! root writable, each store's tools and paths in place (Probe, /healthz).

use crate::cache::Roots;
use crate::config::Config;

/// Reasons the enabled backends cannot work; empty when all can.
pub fn problems(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for root in Roots::of(cfg).roots {
        // A name of this check's own: two checks at once (a liveness probe
        // beside Probe) must not remove each other's file and fail.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = std::fs::create_dir_all(&root.dir).and_then(|_| {
            let probe = root.dir.join(format!(".probe-{}-{n}", std::process::id()));
            std::fs::write(&probe, b"")?;
            std::fs::remove_file(&probe)
        }) {
            out.push(format!("{} is not writable: {e}", root.describe()));
        }
    }
    out.extend(
        cfg.backends
            .iter()
            .filter_map(|b| b.store().unusable(&cfg.shared_paths)),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forty checks at once, as a burst of liveness probes and Probe calls
    /// makes them: none sees another's probe file vanish.
    #[test]
    fn concurrent_checks_do_not_race() {
        let d = tempfile::tempdir().unwrap();
        let cfg = Config::for_node("n", d.path());
        let failed: Vec<String> = std::thread::scope(|s| {
            let all: Vec<_> = (0..40)
                .map(|_| s.spawn(|| (0..20).flat_map(|_| problems(&cfg)).collect::<Vec<_>>()))
                .collect();
            all.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        assert!(
            failed.is_empty(),
            "{} failures, first: {:?}",
            failed.len(),
            failed.first()
        );
    }
}
