//! Who may read a model: a requester proves its access at the origin
//! before it is handed anything of a model it did not fetch itself (a
//! sealed copy, a pull another requester runs, work an earlier pull left),
//! and a proof is trusted for a while per (model, requester).
//!
//! A listing proves nothing (a gated Hub repo lists publicly, an S3 prefix
//! may allow List but not Get), so the proof is bytes read with the
//! requester's own credentials (`Source::authorize`). This module never
//! fetches a model; it only says yes or no.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use super::super::source::{Resolved, Source};
use crate::error::{Error, Result};

/// How long a requester's proven access to a model is trusted: a revoked
/// token keeps at most this long.
pub(super) const PROVEN_FOR: Duration = Duration::from_secs(600);

/// How many proofs are kept before the stale ones are swept.
const KEPT: usize = 10_000;

/// Per model whose pull runs: its requester (if any), and which lead.
type Leading = Arc<Mutex<HashMap<String, (Option<String>, u64)>>>;

/// Proofs of access, per (model, requester), and who runs each pull.
#[derive(Default)]
pub(super) struct Access {
    proven: Mutex<HashMap<(String, String), Instant>>,
    /// The requester whose pull of each model runs in this process (and
    /// which lead it is): a request with the same credentials joins it as
    /// its own.
    leading: Leading,
    leads: std::sync::atomic::AtomicU64,
}

/// A pull led by one requester, until dropped.
pub(super) struct Lead {
    leading: Leading,
    sid: String,
    id: u64,
}

impl Drop for Lead {
    fn drop(&mut self) {
        let mut leading = self.leading.lock().unwrap_or_else(|p| p.into_inner());
        // A lead that followed this one is its own to end.
        if leading.get(&self.sid).is_some_and(|(_, id)| *id == self.id) {
            leading.remove(&self.sid);
        }
    }
}

impl Access {
    /// The pull of `sid` that runs now is `source`'s requester's, fetching
    /// with its own credentials.
    pub(super) fn lead(&self, sid: &str, source: &dyn Source) -> Lead {
        let id = self
            .leads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.leading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sid.to_string(), (source.requester(), id));
        Lead {
            leading: self.leading.clone(),
            sid: sid.to_string(),
            id,
        }
    }

    /// Takes the pull of `sid` (`try_lock`, under this lock so that no
    /// request sees the pull held before its leader is named) and leads it;
    /// or, when another pull holds it, says whether that one presents
    /// `source`'s credentials (joining it is then no more than pulling).
    pub(super) fn lead_or_join<G>(
        &self,
        sid: &str,
        source: &dyn Source,
        try_lock: impl FnOnce() -> Option<G>,
    ) -> (Option<(G, Lead)>, bool) {
        let mut leading = self.leading.lock().unwrap_or_else(|p| p.into_inner());
        match try_lock() {
            Some(g) => {
                let id = self
                    .leads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                leading.insert(sid.to_string(), (source.requester(), id));
                let lead = Lead {
                    leading: self.leading.clone(),
                    sid: sid.to_string(),
                    id,
                };
                (Some((g, lead)), false)
            }
            None => {
                let same = source.requester().is_some_and(|mine| {
                    leading
                        .get(sid)
                        .is_some_and(|(theirs, _)| theirs.as_ref() == Some(&mine))
                });
                (None, same)
            }
        }
    }

    /// Whether `requester` proved its access to `sid` within `PROVEN_FOR`.
    fn fresh(&self, sid: &str, requester: &str) -> bool {
        self.proven
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(sid.to_string(), requester.to_string()))
            .is_some_and(|at| at.elapsed() < PROVEN_FOR)
    }

    /// `requester` read `sid` with its own credentials (its own pull), or
    /// proved it may.
    pub(super) fn remember(&self, sid: &str, requester: String) {
        let mut seen = self.proven.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > KEPT {
            seen.retain(|_, at| at.elapsed() < PROVEN_FOR);
        }
        seen.insert((sid.to_string(), requester), Instant::now());
    }

    /// Proves the requester's access to `sid` at the origin, unless it did
    /// lately. A source without a requester (built by hand: tests,
    /// embedding) has nobody to tell apart.
    pub(super) async fn prove(
        &self,
        sid: &str,
        source: &dyn Source,
        resolved: &Resolved,
    ) -> Result<()> {
        let Some(requester) = source.requester() else {
            return Ok(());
        };
        if !self.fresh(sid, &requester) {
            source.authorize(resolved).await?;
            self.remember(sid, requester);
        }
        Ok(())
    }

    /// While the origin is down nobody can prove access at it: a model an
    /// admin's class names is served, a tenant's only to a requester that
    /// proved its access lately.
    pub(super) fn while_down(&self, sid: &str, source: &dyn Source) -> Result<()> {
        if !source.tenant_named() {
            return Ok(());
        }
        if source.requester().is_some_and(|r| self.fresh(sid, &r)) {
            return Ok(());
        }
        Err(Error::Transient(format!(
            "the origin is unreachable, so access to model {sid} cannot be proven for this requester; peers serve a tenant's model only after the origin confirmed access; a retry tries again"
        )))
    }

    /// Admits a requester to bytes it will not fetch from the origin
    /// itself: a pull of `sid` that another requester runs, work a pull
    /// left, or peers. `outage`: the origin's resolve failed and the
    /// listing came from peers. An origin that listed the model but does
    /// not answer the check now (a manifest's blob host down) is treated
    /// as down.
    pub(super) async fn admit(
        &self,
        sid: &str,
        source: &dyn Source,
        resolved: &Resolved,
        outage: bool,
    ) -> Result<()> {
        if outage {
            return self.while_down(sid, source);
        }
        match self.prove(sid, source, resolved).await {
            Err(e) if super::is_retryable(&e) => {
                warn!(error = %e, "the origin did not answer the access check; admitted only as while it is down");
                self.while_down(sid, source)
            }
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::puller::source::RemoteFile;
    use bytes::Bytes;
    use futures::stream::BoxStream;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An origin that answers its listing to anyone and its bytes only to
    /// `allowed` requesters, counting the reads.
    struct Gated {
        requester: &'static str,
        allowed: bool,
        down: bool,
        reads: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Source for Gated {
        async fn resolve(&self) -> Result<Resolved> {
            unreachable!("the check never resolves")
        }
        async fn read(
            &self,
            _f: &RemoteFile,
            _offset: u64,
            _len: Option<u64>,
        ) -> Result<BoxStream<'static, Result<Bytes>>> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            if self.down {
                return Err(Error::Transient("503".into()));
            }
            if !self.allowed {
                return Err(Error::Precondition("401 gated".into()));
            }
            Ok(Box::pin(futures::stream::iter([Ok(Bytes::from_static(
                b"x",
            ))])))
        }
        fn tenant_named(&self) -> bool {
            true
        }
        fn requester(&self) -> Option<String> {
            Some(self.requester.into())
        }
    }

    fn listing() -> Resolved {
        Resolved {
            uri: "hf://org/gated".into(),
            revision: "r".into(),
            files: vec![RemoteFile {
                path: "w.bin".into(),
                size: Some(10),
                sha256: None,
                locator: "w".into(),
                unpack: crate::puller::source::Unpack::None,
            }],
        }
    }

    fn gated(requester: &'static str, allowed: bool, down: bool) -> Gated {
        Gated {
            requester,
            allowed,
            down,
            reads: AtomicUsize::new(0),
        }
    }

    #[tokio::test]
    async fn a_requester_is_admitted_on_its_own_proof_only() {
        let access = Access::default();
        let (a, b) = (gated("a", true, false), gated("b", false, false));
        access.admit("m1", &a, &listing(), false).await.unwrap();
        // Another requester's proof is not b's.
        let e = access.admit("m1", &b, &listing(), false).await.unwrap_err();
        assert!(matches!(e, Error::Precondition(_)), "{e}");
        // A proof is kept: a's second admission reads nothing.
        access.admit("m1", &a, &listing(), false).await.unwrap();
        assert_eq!(a.reads.load(Ordering::SeqCst), 1);
        // Nor is a proof for one model one for another.
        access.admit("m2", &a, &listing(), false).await.unwrap();
        assert_eq!(a.reads.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_pull_is_joined_as_ones_own_only_with_the_same_credentials() {
        let access = Access::default();
        let (a, b) = (gated("a", true, false), gated("b", false, false));
        let held = std::sync::Mutex::new(());
        let (first, _) = access.lead_or_join("m1", &a, || held.try_lock().ok());
        let (guard, lead) = first.expect("the first request leads");
        assert!(matches!(
            access.lead_or_join("m1", &a, || held.try_lock().ok()),
            (None, true)
        ));
        assert!(matches!(
            access.lead_or_join("m1", &b, || held.try_lock().ok()),
            (None, false)
        ));
        let other = std::sync::Mutex::new(());
        assert!(
            access
                .lead_or_join("m2", &a, || other.try_lock().ok())
                .0
                .is_some()
        );
        // A lead named after this one outlives this one's end.
        let next = access.lead("m1", &b);
        drop(lead);
        assert!(matches!(
            access.lead_or_join("m1", &b, || held.try_lock().ok()),
            (None, true)
        ));
        drop(next);
        assert!(matches!(
            access.lead_or_join("m1", &a, || held.try_lock().ok()),
            (None, false)
        ));
        drop(guard);
    }

    #[tokio::test]
    async fn while_the_origin_is_down_only_a_recent_proof_admits_a_tenant() {
        let access = Access::default();
        let (a, b) = (gated("a", true, true), gated("b", true, true));
        access.remember("m1", "a".into());
        access.admit("m1", &a, &listing(), true).await.unwrap();
        let e = access.admit("m1", &b, &listing(), true).await.unwrap_err();
        assert!(matches!(e, Error::Transient(_)), "{e}");
        // An origin that lists but does not answer the check is down too.
        let e = access.admit("m1", &b, &listing(), false).await.unwrap_err();
        assert!(matches!(e, Error::Transient(m) if m.contains("cannot be proven")));
    }
}
