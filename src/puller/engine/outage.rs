//! While the origin is down: the revision it resolved for a request
//! before pins that request's retries, and peers that hold the pinned
//! model sealed list it and serve its bytes.

use super::*;

/// How long a revision resolved for an asker pins its retries.
const RESOLVED_PINS_FOR: Duration = Duration::from_secs(24 * 3600);

impl Engine {
    /// What the request means: the origin's listing; while the origin is
    /// down, a pinned model's from peers that hold it sealed (true: an
    /// outage), as is that of a request the origin resolved before.
    pub(super) async fn resolve(
        &self,
        root: &Root,
        source: &dyn Source,
        asker: Option<&str>,
    ) -> Result<(Resolved, bool)> {
        match source.resolve().await {
            Ok(r) => {
                self.remember_resolved(asker, source, &r);
                Ok((r, false))
            }
            Err(e) if is_retryable(&e) => {
                match self.listing_from_peers(root, source, asker, &e).await {
                    Some(r) => Ok((r, true)),
                    None => Ok((self.retry("resolve", || source.resolve()).await?, false)),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// The source a pull reads: `origin`, or peers in front of it. Peers
    /// hand over bytes the origin never sees asked for, so the requester
    /// proves access to the origin first, as for a cache hit.
    pub(super) async fn filled(
        &self,
        root: &Root,
        sid: &SourceId,
        resolved: &Resolved,
        origin: Arc<dyn Source>,
        outage: bool,
    ) -> Result<Arc<dyn Source>> {
        let Some(fill) = &self.fill else {
            return Ok(origin);
        };
        match fill.around(root, sid, resolved, origin.clone()).await {
            Some(filled) => {
                self.access
                    .admit(sid.as_str(), origin.as_ref(), resolved, outage)
                    .await?;
                Ok(filled)
            }
            None if outage => Err(Error::Transient(format!(
                "the origin of {} is unreachable and no peer can serve the model now; a retry tries again",
                resolved.uri
            ))),
            None => Ok(origin),
        }
    }

    /// The listing of a pinned model from peers while its origin is down
    /// (`error`, retryable), if the engine fills from peers and one holds it.
    async fn listing_from_peers(
        &self,
        root: &Root,
        source: &dyn Source,
        asker: Option<&str>,
        error: &Error,
    ) -> Option<Resolved> {
        let fill = self.fill.as_ref()?;
        let pin = source
            .pinned()
            .or_else(|| self.resolved_before(asker, source))?;
        let sid = source_id(source, &pin.uri, &pin.revision);
        let listing = fill.listing(root, &sid, &pin).await?;
        warn!(model = %pin.uri, revision = %pin.revision, origin_error = %error,
            "the origin is unreachable: building the pinned model from peers alone");
        Some(listing)
    }

    /// The key under which what the origin resolved for `asker` is kept:
    /// the same request (a volume's name) by the same requester.
    fn asker_key(asker: Option<&str>, source: &dyn Source) -> Option<String> {
        Some(format!(
            "{}\0{}\0{}",
            asker?,
            source.requester().unwrap_or_default(),
            source.key_scope()
        ))
    }

    fn remember_resolved(&self, asker: Option<&str>, source: &dyn Source, r: &Resolved) {
        let Some(key) = Self::asker_key(asker, source) else {
            return;
        };
        let pin = Pinned {
            uri: r.uri.clone(),
            revision: r.revision.clone(),
            files: Default::default(),
        };
        let mut kept = self.resolved_for.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() > 10_000 {
            kept.retain(|_, (_, at)| at.elapsed() < RESOLVED_PINS_FOR);
        }
        kept.insert(key, (pin, Instant::now()));
    }

    /// The revision the origin resolved for this same request before, as
    /// a pin: the origin's own word for what the request means.
    fn resolved_before(&self, asker: Option<&str>, source: &dyn Source) -> Option<Pinned> {
        let key = Self::asker_key(asker, source)?;
        self.resolved_for
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .filter(|(_, at)| at.elapsed() < RESOLVED_PINS_FOR)
            .map(|(pin, _)| pin.clone())
    }
}
