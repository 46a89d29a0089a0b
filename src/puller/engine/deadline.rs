//! A transfer's turn and time: the node's transfer shares and pull
//! slots, the slot given to a waiting pull while it is slow, its
//! deadline, and the retries, with backoff, of what may fail for a moment.

use super::*;

pub(super) fn is_retryable(e: &Error) -> bool {
    matches!(e, Error::Transient(_) | Error::RetryAfter { .. })
}

/// A pull's sink that also remembers how far the transfer got, for the
/// slot watch and the deadline's message.
pub(super) struct Counted<'a> {
    pub(super) inner: &'a dyn ProgressSink,
    pub(super) bytes: AtomicU64,
}

impl ProgressSink for Counted<'_> {
    fn started(&self, uri: &str, total: Option<u64>) {
        self.inner.started(uri, total)
    }
    fn progress(&self, p: &Progress) {
        self.bytes.store(p.bytes, Ordering::Relaxed);
        self.inner.progress(p)
    }
    fn sealed(&self, s: &crate::progress::Sealed<'_>) {
        self.inner.sealed(s)
    }
    fn refetching(&self, uri: &str, file: &str, why: &str) {
        self.inner.refetching(uri, file, why)
    }
    fn failed(&self, uri: &str, error: &str) {
        self.inner.failed(uri, error)
    }
}

impl Engine {
    /// One transfer of the model, within the node's slots, from peers or
    /// the origin, to its seal.
    pub(super) async fn transfer(
        &self,
        ask: &Ask<'_>,
        root: &Root,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
        listed: &Listed<'_>,
    ) -> Result<Pulled> {
        let (resolved, sid) = (listed.resolved, listed.sid);
        let _transfer = self.transfers.acquire(ask.who.to_string()).await;
        let slot = self.slots.acquire(ask.who).await;
        sink.started(&resolved.uri, listed.total);
        let (charged, inodes) = need_of(resolved, listed.total);
        let pull = Pull {
            sid,
            resolved,
            total: listed.total,
            charged,
            inodes,
            limits: listed.limits,
            signature: ask.signature,
            listing_order: self.cfg.listing_order || ask.listing_order,
            readers: ask.readers || ask.listing_order,
            requester: source.requester(),
        };
        let counted = Counted {
            inner: sink,
            bytes: AtomicU64::new(0),
        };
        let source = self
            .filled(root, sid, resolved, source, listed.outage)
            .await;
        let fetched = async {
            self.fetch_within_deadline(root, &pull, source?, &counted)
                .await
        };
        let fetched = self
            .give_up_slot_when_slow(slot, &counted.bytes, fetched)
            .await;
        if let Some(fill) = &self.fill {
            fill.ended(root, sid, fetched.is_ok());
        }
        match fetched {
            Ok((seal, fetched, from)) => Ok(self.sealed(sink, listed, seal, fetched, from)),
            Err(e) => {
                warn!(error = %e, "pull failed");
                Err(e)
            }
        }
    }

    /// Runs a pull's transfer holding `slot` while it moves at least
    /// `slow_bytes_per_sec`; a slower one gives the slot to a waiting pull
    /// and goes on without it, so slow origins (a tenant's, say) cannot
    /// hold every slot while others queue.
    pub(super) async fn give_up_slot_when_slow<T>(
        &self,
        slot: Slot,
        bytes: &AtomicU64,
        transfer: impl std::future::Future<Output = T>,
    ) -> T {
        let window = self.cfg.stall;
        let floor = u128::from(self.cfg.slow_bytes_per_sec) * window.as_millis() / 1000;
        let watch = async {
            let mut slot = Some(slot);
            let mut last = bytes.load(Ordering::Relaxed);
            loop {
                tokio::time::sleep(window).await;
                let now = bytes.load(Ordering::Relaxed);
                let moved = u128::from(now.saturating_sub(last));
                last = now;
                if moved < floor && self.slots.waiting() > 0 {
                    info!(
                        bytes_in_window = moved as u64,
                        window_secs = window.as_secs_f64(),
                        "slow transfer: its pull slot goes to a waiting pull"
                    );
                    drop(slot.take());
                    return futures::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            out = transfer => out,
            _ = watch => unreachable!("the watch never ends"),
        }
    }

    /// The transfer, within a deadline that grows with the model: a grace
    /// period plus its size at `min_average_bytes_per_sec`. A live but
    /// hopeless trickle ends there (Unavailable; a retry resumes the work)
    /// instead of holding the pull's resources for ever.
    pub(super) async fn fetch_within_deadline(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &Counted<'_>,
    ) -> Result<(Seal, u64, Option<String>)> {
        if self.cfg.min_average_bytes_per_sec == 0 {
            return self.fetch(root, pull, source, sink).await;
        }
        let Some(total) = pull.total else {
            return self.fetch_at_floor(root, pull, source, sink).await;
        };
        let at_floor = Duration::from_secs(total / self.cfg.min_average_bytes_per_sec);
        let deadline = self.cfg.deadline_grace.saturating_add(at_floor);
        match tokio::time::timeout(deadline, self.fetch(root, pull, source, sink)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Transient(format!(
                "the pull of {total} bytes did not finish within {}s (--pull-deadline-grace-seconds plus its size at \
                 --pull-min-average-bytes-per-second {}); {} bytes arrived; a retry resumes it",
                deadline.as_secs(),
                self.cfg.min_average_bytes_per_sec,
                sink.bytes.load(Ordering::Relaxed)
            ))),
        }
    }

    /// A transfer of unlisted size, held to the same floor as a listed one
    /// as its bytes arrive: past the grace period it must have averaged
    /// `min_average_bytes_per_sec`, so a server that trickles a body
    /// without a length cannot hold a pull for ever.
    async fn fetch_at_floor(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &Counted<'_>,
    ) -> Result<(Seal, u64, Option<String>)> {
        let floor = self.cfg.min_average_bytes_per_sec;
        let started = tokio::time::Instant::now();
        let behind = async {
            loop {
                tokio::time::sleep(self.cfg.progress_every).await;
                let bytes = sink.bytes.load(Ordering::Relaxed);
                let allowed = self
                    .cfg
                    .deadline_grace
                    .saturating_add(Duration::from_secs(bytes / floor));
                if started.elapsed() > allowed {
                    return bytes;
                }
            }
        };
        tokio::select! {
            r = self.fetch(root, pull, source, sink) => r,
            bytes = behind => Err(Error::Transient(format!(
                "the pull of unlisted size averaged under --pull-min-average-bytes-per-second {floor} past \
                 --pull-deadline-grace-seconds {}: {bytes} bytes in {}s; a retry resumes it",
                self.cfg.deadline_grace.as_secs(),
                started.elapsed().as_secs()
            ))),
        }
    }

    pub(super) async fn retry<T, F, Fut>(&self, what: &str, op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        crate::retry::retry(what, retries(&self.cfg), is_retryable, op).await
    }
}

/// The engine's retries of one request: `attempts` tries in all.
pub(super) fn retries(cfg: &EngineConfig) -> crate::retry::Backoff {
    crate::retry::Backoff {
        first: cfg.backoff,
        max: cfg.backoff_max,
        total: None,
        times: Some(cfg.attempts.saturating_sub(1) as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_tries_a_request_attempts_times_in_all() {
        let cfg = EngineConfig {
            attempts: 3,
            ..EngineConfig::default()
        };
        let waits: Vec<_> = retries(&cfg).delays().collect();
        assert_eq!(waits.len(), 2);
        assert!(waits.iter().all(|w| *w <= cfg.backoff_max));
    }
}
