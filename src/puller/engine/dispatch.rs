//! Which file a pull fetches next and with how many streams, and the
//! progress it reports while they run.

use super::*;

impl Engine {
    /// Fetches every file of `pull` into `work`: largest first, or in the
    /// listing's order with a reader's file first; one that fails its
    /// digest fails the pull once the others are in.
    pub(super) async fn fetch_files(
        &self,
        pull: &Pull<'_>,
        ctx: &Arc<Ctx>,
        work: &Arc<PullArea>,
        sink: &dyn ProgressSink,
        refetches: &mut tokio::sync::mpsc::UnboundedReceiver<Refetched>,
    ) -> Result<Vec<Fetched>> {
        // Largest first: the biggest file bounds the pull, so it must not
        // wait behind small ones; or the listing's order, when readers are
        // waiting for the first files. The seal's order depends on neither.
        let mut order: Vec<(usize, RemoteFile)> =
            pull.resolved.files.iter().cloned().enumerate().collect();
        if !pull.listing_order {
            order.sort_by_key(|(_, f)| std::cmp::Reverse(f.size.unwrap_or(0)));
        }
        // Small files, bound by round trips and fsyncs, not bytes, run many
        // at a time; a large one takes up to `connections` streams.
        let connections = self.cfg.connections.max(1);
        // In listing order, a large file takes every stream: the next one
        // starts as it ends, not beside it.
        let files_at_once = match pull.listing_order {
            true => 1,
            false => self.cfg.files.max(1),
        };
        let budget = files_at_once * connections;
        let next = Arc::new(Dispatcher {
            queue: Mutex::new(std::collections::VecDeque::from(order)),
            streams: Arc::new(Semaphore::new(budget)),
            turn: tokio::sync::Mutex::new(()),
            connections,
            chunk_bytes: self.cfg.chunk_bytes,
        });
        let files = futures::stream::iter(0..pull.resolved.files.len())
            .map(|_| {
                let (ctx, work, next) = (ctx.clone(), work.clone(), next.clone());
                async move {
                    let (i, f, _streams) = next.next(&work).await?;
                    fetch_file(ctx, work, i, f).await
                }
            })
            .buffer_unordered(budget);
        let mut files = std::pin::pin!(files);
        let mut results = Vec::new();
        // A file that failed verification fails the pull, but only once
        // the other files are in: each one verified and made durable is
        // never fetched again, and a progressive volume's readers of the
        // others are not held by it.
        let mut failed: Option<Error> = None;
        let start = Instant::now();
        let mut tick = tokio::time::interval_at(
            tokio::time::Instant::now() + self.cfg.progress_every,
            self.cfg.progress_every,
        );
        loop {
            tokio::select! {
                next = files.next() => match next {
                    // The first failure that retries could not mend ends the
                    // pull at once; what other files made durable is resumed.
                    Some(Err(e)) => return Err(e),
                    Some(Ok(Fetched::Failed(e))) => {
                        warn!(error = %e, "a file failed verification; the other files go on");
                        failed.get_or_insert(e);
                    }
                    Some(Ok(r)) => results.push(r),
                    None => break,
                },
                Some(r) = refetches.recv() => sink.refetching(&pull.resolved.uri, &r.file, &r.why),
                _ = tick.tick() => {
                    let mut p = progress(&pull.resolved.uri, ctx.bytes.load(Ordering::Relaxed), pull.total, start.elapsed());
                    p.from = ctx.source.provenance().map(|f| f.describe());
                    info!(
                        bytes = p.bytes,
                        total = ?p.total,
                        rate_mib_s = p.rate_bytes_per_sec / 1048576.0,
                        eta_s = ?p.eta.map(|e| e.as_secs()),
                        "pulling"
                    );
                    sink.progress(&p);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(results),
        }
    }
}

/// Which file goes next, decided as late as possible: when a stream
/// frees, one caller at a time takes the first file a reader of a
/// progressive volume is waiting for (`Partial::want`), else the head of
/// the order, then the rest of the streams it needs. A read of a file far
/// down the listing jumps the queue.
struct Dispatcher {
    queue: Mutex<std::collections::VecDeque<(usize, RemoteFile)>>,
    /// Streams, not files, are what a pull runs at once: a file of one
    /// range is one stream, a larger one up to `connections`. The
    /// semaphore is fair: a large file waiting for its streams holds back
    /// the files after it.
    streams: Arc<Semaphore>,
    turn: tokio::sync::Mutex<()>,
    connections: usize,
    chunk_bytes: u64,
}

impl Dispatcher {
    /// The next file of `work`'s pull, its index in the listing, and the
    /// streams it holds while it is fetched.
    async fn next(
        &self,
        work: &PullArea,
    ) -> Result<(usize, RemoteFile, tokio::sync::OwnedSemaphorePermit)> {
        let shutting = || Error::Internal("pull is shutting down".into());
        let _turn = self.turn.lock().await;
        let mut held = self
            .streams
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| shutting())?;
        let next = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            let wanted = work.partial().wanted();
            let at = wanted
                .iter()
                .find_map(|w| q.iter().position(|(_, f)| &f.path == w))
                .unwrap_or(0);
            q.remove(at)
        };
        let Some((i, f)) = next else {
            return Err(Error::Internal(
                "a pull dispatched more files than it listed".into(),
            ));
        };
        if f.size.is_none_or(|s| s > self.chunk_bytes) && self.connections > 1 {
            let rest = self
                .streams
                .clone()
                .acquire_many_owned(self.connections as u32 - 1)
                .await
                .map_err(|_| shutting())?;
            held.merge(rest);
        }
        Ok((i, f, held))
    }
}
