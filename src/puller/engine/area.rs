//! One pull's work in its area: room made for it, its files fetched,
//! layers unpacked, the tree vouched for and sealed; work that no retry
//! could use is discarded.

use super::*;

impl Engine {
    pub(super) async fn fetch(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
    ) -> Result<(Seal, u64, Option<String>)> {
        let (sid, need) = (pull.sid, pull.total);
        let capacity = self.cfg.capacity.get(&root.backend).copied();
        // Bytes are checked once every size is known; inodes always.
        let room = cache::evict::Need {
            bytes: pull.charged.unwrap_or(0),
            inodes: pull.inodes,
        };
        let (r, s) = (root.clone(), sid.clone());
        let m = self.metrics.clone();
        blocking(move || {
            cache::evict::make_room(&r, room, capacity, &s, &|_| {
                m.evictions.inc();
            })
        })
        .await?;
        let (r, s) = (root.clone(), sid.clone());
        let work = Arc::new(blocking(move || PullArea::open(&r, &s, need)).await?);
        let result = self
            .fetch_into(root, pull, source, sink, &work, capacity)
            .await;
        // Work a retry could resume is kept (a crash, a dead server, a
        // failure the next attempt may not meet). Work that failed for want
        // of space, for being over its limits, or because the source served
        // garbage would only hold space no later pull can use, so it goes
        // now, while the lock is still ours.
        if let Err(e) = &result
            && (e.is_no_space() || matches!(e, Error::OverLimit(_) | Error::SourceFault(_)))
        {
            let w = work.clone();
            if let Err(d) = blocking(move || w.discard()).await {
                warn!(error = %d, "could not remove the failed pull's work directory");
            }
        }
        result
    }

    async fn fetch_into(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
        work: &Arc<PullArea>,
        capacity: Option<u64>,
    ) -> Result<(Seal, u64, Option<String>)> {
        let resolved = pull.resolved;
        work.partial().listed(
            resolved
                .files
                .iter()
                .map(|f| match f.unpack {
                    Unpack::None => Some((f.path.clone(), f.size?)),
                    Unpack::Tar(_) => None,
                })
                .collect(),
        );
        let (refetched, mut refetches) = tokio::sync::mpsc::unbounded_channel();
        let ctx = Arc::new(Ctx {
            refetched,
            source,
            max_bytes: pull.limits.max_bytes,
            cfg: self.cfg.clone(),
            bytes: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            state_lock: Mutex::new(()),
            flush_at: flush_at(&self.cfg),
            flow: Arc::new(Flow::new(self.cfg.connections.max(1))),
            page_cache: pull.readers,
            defer_durable: pull.readers
                && !pull.listing_order
                && pull.total.is_some_and(defers_durability),
        });

        let results = self
            .fetch_files(pull, &ctx, work, sink, &mut refetches)
            .await?;
        let mut entries = Vec::new();
        let mut layers = Vec::new();
        for r in results {
            match r {
                Fetched::File(f) => entries.push(f),
                l @ Fetched::Layer { .. } => layers.push(l),
                Fetched::Failed(_) => {}
            }
        }
        // Every file is in place: the partial directory must not become
        // part of the model (inside the xfs image it is at its root).
        let w = work.clone();
        blocking(move || w.clear_partial()).await?;
        if !layers.is_empty() {
            let unpacked = self
                .unpack_within(root, pull, work, capacity, &entries, layers)
                .await?;
            entries.extend(unpacked);
        }

        let (uri, rev, w) = (
            resolved.uri.clone(),
            resolved.revision.clone(),
            work.clone(),
        );
        let peers = ctx.source.provenance().map(|p| p.peers).unwrap_or_default();
        let vouch = self.vouch(pull.signature);
        // Remembered before the seal is visible: a requester that finds it
        // sealed (a join that waited for this pull) is then not asked to
        // prove at the origin what this pull just read there.
        if let Some(r) = &pull.requester {
            self.access.remember(pull.sid.as_str(), r.clone());
        }
        let seal = blocking(move || {
            w.commit(entries, &uri, &rev, peers, &|tree, data| {
                vouch.tree(tree, data)
            })
        })
        .await?;
        let spilled = ctx.flow.spilled.load(Ordering::Relaxed);
        if spilled > 0 {
            info!(
                spilled_bytes = spilled,
                "bytes that ran ahead of a full reorder window were hashed from disk"
            );
        }
        let from = ctx
            .source
            .provenance()
            .filter(|p| !p.peers.is_empty())
            .map(|p| p.describe());
        Ok((seal, ctx.fetched.load(Ordering::Relaxed), from))
    }
}

/// Whether a model of `total` bytes may stay in the page cache until each
/// file's transfer ends: up to a quarter of the memory available now, so
/// the kernel's own writeback (from a tenth of it dirty) and other pods
/// keep their share, and a crash loses at most that much transfer.
fn defers_durability(total: u64) -> bool {
    let available = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        .saturating_mul(1024);
    total <= available / 4
}

/// Bytes of one buffer: the budget shared by every buffer that may exist,
/// one per stream and one more per stream for the reorder windows; whole
/// blocks, so that full buffers go out with O_DIRECT.
fn flush_at(cfg: &EngineConfig) -> usize {
    let buffers = (cfg.models.max(1) * cfg.files.max(1) * cfg.connections.max(1) * 2) as u64;
    let n = (cfg.buffer_budget / buffers).clamp(256 << 10, 4 << 20) as usize;
    n / ALIGN * ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn write_buffers_share_one_budget() {
        let cfg = EngineConfig::default();
        assert_eq!(flush_at(&cfg), 2 << 20);
        let many = EngineConfig {
            connections: 16,
            ..EngineConfig::default()
        };
        assert_eq!(flush_at(&many), 512 << 10);
        let huge = EngineConfig {
            connections: 1000,
            ..EngineConfig::default()
        };
        assert_eq!(flush_at(&huge), 256 << 10);
    }
}
