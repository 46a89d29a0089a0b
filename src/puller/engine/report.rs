//! What a pull tells when it ends: its sink and log at the seal, and its
//! metrics either way.

use super::*;

impl Engine {
    /// Tells of a transfer that sealed the model, `fetched` bytes of it
    /// from the origin or peers (`from`).
    pub(super) fn sealed(
        &self,
        sink: &dyn ProgressSink,
        listed: &Listed<'_>,
        seal: Seal,
        fetched: u64,
        from: Option<String>,
    ) -> Pulled {
        let resolved = listed.resolved;
        self.metrics
            .pull_bytes
            .get_or_create(&crate::metrics::Scheme {
                scheme: crate::metrics::scheme_of(&resolved.uri),
            })
            .inc_by(fetched);
        let took = listed.started.elapsed();
        info!(
            bytes = seal.total_bytes,
            secs = took.as_secs_f64(),
            "sealed"
        );
        let from = match (from, listed.outage) {
            (Some(f), true) => Some(format!(
                "{f}: the origin was unreachable, so the pinned model was built from peers alone"
            )),
            (f, _) => f,
        };
        sink.sealed(&crate::progress::Sealed {
            uri: &resolved.uri,
            revision: &resolved.revision,
            bytes: seal.total_bytes,
            took,
            from: from.as_deref(),
            signed_by: seal.signed_by.as_deref(),
        });
        Pulled {
            sid: listed.sid.clone(),
            signed: seal.signed_by.clone(),
            seal,
            hit: false,
        }
    }

    /// Counts a pull of `uri` that took `took`: a hit, or its outcome and
    /// duration.
    pub(super) fn count(&self, uri: &str, result: &Result<Pulled>, took: Duration) {
        let (m, scheme) = (&self.metrics, crate::metrics::scheme_of(uri));
        let outcome = match result {
            Ok(p) if p.hit => {
                m.cache_hits
                    .get_or_create(&crate::metrics::Scheme { scheme })
                    .inc();
                return;
            }
            Ok(_) => "sealed",
            Err(_) => "failed",
        };
        m.pulls
            .get_or_create(&crate::metrics::PullOutcome {
                scheme: scheme.clone(),
                outcome: outcome.into(),
            })
            .inc();
        m.pull_duration
            .get_or_create(&crate::metrics::Scheme { scheme })
            .observe(took.as_secs_f64());
    }
}

/// Where a pull of `uri` is after `elapsed`, with its rate and what is left.
pub(super) fn progress(uri: &str, bytes: u64, total: Option<u64>, elapsed: Duration) -> Progress {
    let rate = bytes as f64 / elapsed.as_secs_f64().max(1e-3);
    let eta = total
        .filter(|_| rate > 0.0)
        .map(|t| Duration::from_secs_f64(t.saturating_sub(bytes) as f64 / rate));
    Progress {
        uri: uri.to_string(),
        bytes,
        total,
        rate_bytes_per_sec: rate,
        eta,
        from: None,
    }
}
