//! Fetching one remote file: parallel ranges or one stream, written with
//! O_DIRECT, resumed after the last durable byte, verified by sha256.

use super::*;

/// What one remote file became.
pub(super) enum Fetched {
    File(FileEntry),
    /// The file failed verification every time it was fetched: its
    /// readers are told EIO, and the pull goes on with the others (which
    /// become durable and are never fetched again) before it fails.
    Failed(Error),
    /// A verified layer blob, unpacked later in manifest order.
    Layer {
        index: usize,
        key: String,
        blob: PathBuf,
        compression: Compression,
        subdir: String,
        extracted: Option<Vec<FileEntry>>,
    },
}

/// Why the bytes at `dest`, hashing to `sha`, are not the file the
/// source listed, if they are not.
async fn mismatch(ctx: &Ctx, file: &RemoteFile, dest: &Path, sha: &str) -> Result<Option<String>> {
    Ok(match (&file.sha256, ctx.source.content_md5(file)) {
        (Some(expected), _) => (!expected.eq_ignore_ascii_case(sha))
            .then(|| format!("the source promised sha256 {expected}, the bytes hash to {sha}")),
        (None, Some(md5)) => {
            let d = dest.to_path_buf();
            let got = blocking(move || md5_of(&d)).await?;
            (got != md5)
                .then(|| format!("the source's ETag says MD5 {md5}, the bytes hash to {got}"))
        }
        (None, None) => None,
    })
}

/// Whether a file that failed verification (`why`) is fetched again, and
/// what happens next, after `refetches` refetches from the origin.
///
/// Bytes from a peer that add up to another file: the peers are dropped
/// for it and the origin serves it anew. The origin's own bytes failing
/// may be a transfer gone wrong on the way: the file is fetched anew a
/// bounded number of times. Readers of a progressive volume wait on
/// through either (an EIO now would fail a model load that the next fetch
/// mends); only giving up tells them EIO.
fn fetch_again(ctx: &Ctx, file: &RemoteFile, refetches: &mut u32, why: &str) -> Option<String> {
    if ctx.source.distrust(file) {
        warn!(file = %file.path_or_locator(), "bytes from peers failed the origin's sha256; fetching the file from the origin");
        return Some("bytes from peers did not add up to it; fetching it from the origin".into());
    }
    if *refetches >= ORIGIN_REFETCHES {
        return None;
    }
    *refetches += 1;
    warn!(file = %file.path_or_locator(), %why, refetches = *refetches, "the origin's bytes failed verification; fetching the file again");
    Some(format!(
        "fetching it again (fetch {} of {})",
        *refetches + 1,
        ORIGIN_REFETCHES + 1
    ))
}

/// A file whose `size` bytes failed verification (`why`): they and their
/// record go, and it is fetched again (true), or it failed for good
/// (false), and readers of a progressive volume are told either way.
#[allow(clippy::too_many_arguments)]
async fn rejected(
    ctx: &Ctx,
    work: &Arc<PullArea>,
    file: &RemoteFile,
    key: &str,
    dest: &Path,
    size: u64,
    refetches: &mut u32,
    why: &str,
) -> bool {
    let (d, w, k) = (dest.to_path_buf(), work.clone(), key.to_string());
    let _ = blocking(move || {
        let _ = fs::remove_file(&d);
        state::remove_file(&state_path(&w, &k)).ctx("remove pull state", &w.progress_dir())
    })
    .await;
    let Some(next) = fetch_again(ctx, file, refetches, why) else {
        if file.unpack == Unpack::None {
            work.partial().failed(&file.path, why);
        }
        return false;
    };
    if file.unpack == Unpack::None {
        work.partial().refetching(&file.path, why);
    }
    let _ = ctx.refetched.send(Refetched {
        file: file.path_or_locator().to_string(),
        why: format!("{why}; {next}"),
    });
    ctx.bytes.fetch_sub(
        size.min(ctx.bytes.load(Ordering::Relaxed)),
        Ordering::Relaxed,
    );
    true
}

/// Records a file verified at `dest` as `st` says, and tells readers of a
/// progressive volume that it is readable.
async fn record_verified(
    work: &Arc<PullArea>,
    file: &RemoteFile,
    dest: &Path,
    st: &FileState,
) -> Result<()> {
    let (w, s) = (work.clone(), st.clone());
    blocking(move || {
        save_state(&w, &s)?;
        forget_written(&w, &s.path);
        Ok(())
    })
    .await?;
    if file.unpack == Unpack::None {
        let (size, chunks) = (st.size.unwrap_or(0), st.chunks.clone());
        work.partial()
            .finished(&file.path, size, dest.to_path_buf(), chunks);
    }
    Ok(())
}

/// Records a file written whole, hashed and put in place by a process of
/// this boot that died before recording it: it is the file (see
/// `Written`), and needs its record, not a second transfer.
async fn record_written(
    ctx: &Ctx,
    work: &Arc<PullArea>,
    key: &str,
    dest: &Path,
    file: &RemoteFile,
    st: &mut FileState,
) -> Result<()> {
    let (w, k, d, f) = (
        work.clone(),
        key.to_string(),
        dest.to_path_buf(),
        file.clone(),
    );
    let vouches = ctx.source.content_md5(file).is_none();
    let recovered = blocking(move || Ok(recover_in_place(&w, &k, &d, &f, vouches))).await?;
    if let Some((size, sha, chunks)) = recovered {
        info!(file = %file.path, "written whole and put in place before a crash of the driver; recorded, not fetched again");
        st.size = Some(size);
        st.sha256 = Some(sha);
        st.chunks = chunks;
        let (w, s2) = (work.clone(), st.clone());
        blocking(move || save_state(&w, &s2)).await?;
    }
    Ok(())
}

/// Fetches and verifies one remote file (or layer blob).
pub(super) async fn fetch_file(
    ctx: Arc<Ctx>,
    work: Arc<PullArea>,
    index: usize,
    file: RemoteFile,
) -> Result<Fetched> {
    // Layers are keyed by position too: a manifest may repeat a digest.
    let key = match file.unpack {
        Unpack::None => file.path.clone(),
        Unpack::Tar(_) => format!("layer-{index}-{}", file.locator),
    };
    let w = work.clone();
    let k = key.clone();
    let mut st = blocking(move || load_state(&w, &k)).await?;
    let stem = state_path(&work, &key)
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let (dest, part) = match file.unpack {
        Unpack::None => (
            work.data().join(&file.path),
            work.partial_dir().join(format!("{stem}.part")),
        ),
        // Blobs are named by digest in a directory of their own.
        Unpack::Tar(_) => (
            work.blobs_dir().join(format!("{stem}.blob")),
            work.blobs_dir().join(format!("{stem}.blob.part")),
        ),
    };
    let layer = |extracted: Option<Vec<FileEntry>>, compression| Fetched::Layer {
        index,
        key: key.clone(),
        blob: dest.clone(),
        compression,
        subdir: file.path.clone(),
        extracted,
    };
    if let Unpack::Tar(c) = file.unpack
        && st.extracted.is_some()
    {
        ctx.bytes.fetch_add(st.size.unwrap_or(0), Ordering::Relaxed);
        return Ok(layer(st.extracted.clone(), c));
    }
    if st.sha256.is_none() && file.unpack == Unpack::None && dest.exists() && !part.exists() {
        record_written(&ctx, &work, &key, &dest, &file, &mut st).await?;
    }
    // A finished file is kept only at the size the listing gives now.
    let same_size = file.size.is_none_or(|s| st.size == Some(s));
    let mut refetches = 0;
    let (size, sha, chunks) = match (&st.sha256, dest.exists() && same_size) {
        (Some(sha), true) => {
            let size = st.size.unwrap_or(0);
            ctx.bytes.fetch_add(size, Ordering::Relaxed);
            if file.unpack == Unpack::None {
                work.partial()
                    .finished(&file.path, size, dest.clone(), st.chunks.clone());
            }
            (size, sha.clone(), st.chunks.clone())
        }
        _ => loop {
            st.path = key.clone();
            let (size, sha, chunks) = download(&ctx, &work, &file, &dest, &part, &mut st).await?;
            if let Some(why) = mismatch(&ctx, &file, &dest, &sha).await? {
                let key = key.as_str();
                if rejected(&ctx, &work, &file, key, &dest, size, &mut refetches, &why).await {
                    st = FileState {
                        path: key.to_string(),
                        ..FileState::default()
                    };
                    continue;
                }
                return Ok(Fetched::Failed(Error::Precondition(format!(
                    "{} failed verification: {why} (fetched {} times); nothing was sealed",
                    file.path_or_locator(),
                    refetches + 1
                ))));
            }
            st.sha256 = Some(sha.clone());
            st.size = Some(size);
            st.chunks = chunks.clone();
            record_verified(&work, &file, &dest, &st).await?;
            break (size, sha, chunks);
        },
    };
    Ok(match file.unpack {
        Unpack::None => Fetched::File(FileEntry {
            path: file.path.clone(),
            size,
            sha256: sha,
            chunks,
        }),
        Unpack::Tar(c) => layer(None, c),
    })
}

/// Fetches of a file whose bytes from the origin failed their digest,
/// after the first, before the pull gives up on it.
const ORIGIN_REFETCHES: u32 = 2;

/// The MD5 of a file, read back from disk: checked only for S3 files that
/// peers helped fill, against the origin's ETag.
fn md5_of(path: &Path) -> Result<String> {
    use md5::Digest as _;
    use std::io::Read;
    let mut f = File::open(path).ctx("open", path)?;
    let mut h = md5::Md5::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).ctx("read", path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

impl RemoteFile {
    pub(super) fn path_or_locator(&self) -> &str {
        if self.path.is_empty() {
            &self.locator
        } else {
            &self.path
        }
    }
}

/// Downloads `file` to `dest` through `part`, returning its size, sha256
/// and chunk table.
pub(super) async fn download(
    ctx: &Arc<Ctx>,
    work: &Arc<PullArea>,
    file: &RemoteFile,
    dest: &Path,
    part: &Path,
    st: &mut FileState,
) -> Result<(u64, String, Vec<String>)> {
    if let Some(parent) = dest.parent() {
        fs::create_dir_all(parent).ctx("create", parent)?;
    }
    let ranged = ctx.source.ranges() && file.size.is_some();
    // Chunks recorded as done describe `.part`. Without it (a kill between
    // the rename into place and the state that records the sha256), they
    // describe nothing, and trusting them would seal a zero-filled file.
    if !part.exists() {
        st.done.clear();
        st.partial.clear();
    } else if let Some(size) = file.size {
        // What a process of this boot wrote to `.part` beyond the durable
        // record is there still: resumed after, not fetched again.
        let chunk = ctx.cfg.chunk_bytes.max(1);
        let same = |c: Option<u64>, s: Option<u64>| {
            c.is_none_or(|c| c == chunk) && s.is_none_or(|s| s == size)
        };
        let (w, k) = (work.clone(), st.path.clone());
        let written = blocking(move || Ok(load_written(&w, &k))).await?;
        if let Some(w) = written.filter(|w| w.chunk_bytes == chunk && w.size == size && !w.whole)
            && same(st.chunk_bytes, st.size_listed)
        {
            st.chunk_bytes = Some(chunk);
            st.size_listed = Some(size);
            for (i, b) in w.partial {
                let at = st.partial.entry(i).or_default();
                *at = (*at).max(b);
            }
            st.done.extend(w.done);
        }
    }
    // O_DIRECT pays for itself on large files; a small one would only
    // cost a second descriptor.
    let direct = ranged && !ctx.page_cache && file.size.is_some_and(|s| s >= ctx.flush_at as u64);
    let out = Arc::new(PartFile::open(part, !ranged, direct)?);
    let put_in_place = || {
        let (p, d) = (part.to_path_buf(), dest.to_path_buf());
        blocking(move || fs::rename(&p, &d).ctx("rename into place", &d))
    };
    let (size, (sha, chunks)) = if let (true, Some(size)) = (ranged, file.size) {
        out.reserve(size, part)?;
        let (size, (sha, chunks), durable) =
            ranged_download(ctx, work, file, &out, part, size, st).await?;
        // Readers wait for nothing but the verdict: the file goes in place
        // and is told verified now, and its last ranges become durable
        // after. A crash in between leaves it in place with no sha256
        // recorded and no `.part`, which a resume fetches anew (see above).
        let early = ctx.page_cache && file.unpack == Unpack::None && vouched(ctx, file, &sha);
        if early {
            // Said before the rename, so that a process of this boot that
            // finds the file in place unrecorded knows it whole.
            if let Some(boot) = boot_id() {
                let whole = Written {
                    boot: boot.to_string(),
                    chunk_bytes: ctx.cfg.chunk_bytes.max(1),
                    size,
                    whole: true,
                    ..Written::default()
                };
                let (w, k) = (work.clone(), st.path.clone());
                blocking(move || save_written(&w, &k, &whole)).await?;
            }
            put_in_place().await?;
            work.partial()
                .finished(&file.path, size, dest.to_path_buf(), chunks.clone());
            tracing::debug!(file = %file.path, "verified; readers may read it");
        }
        durable.settle(st).await?;
        // Hashed for the sha256 alone: the chunk table, from the page
        // cache, while the volume's pods start.
        let chunks = match chunks.is_empty() && size > 0 {
            true => {
                let at = if early { dest } else { part }.to_path_buf();
                blocking(move || crate::offload::niced(|| crate::cache::manifest::chunk_table(&at)))
                    .await?
            }
            false => chunks,
        };
        if !early {
            put_in_place().await?;
        }
        (size, (sha, chunks))
    } else {
        st.done.clear();
        let whole = whole_download(ctx, file, &out, part).await?;
        put_in_place().await?;
        whole
    };
    Ok((size, sha, chunks))
}

/// Whether `sha` is all the checking a file gets: the origin's sha256
/// matches it, or the origin gave none and no MD5 is left to check.
fn vouched(ctx: &Ctx, file: &RemoteFile, sha: &str) -> bool {
    match &file.sha256 {
        Some(expected) => expected.eq_ignore_ascii_case(sha),
        None => ctx.source.content_md5(file).is_none(),
    }
}

pub(super) fn chunks(size: u64, chunk: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < size {
        let end = start.saturating_add(chunk.max(1)).min(size);
        out.push((start, end));
        start = end;
    }
    out
}

/// How often a range's progress within a chunk is said (`Written`); a
/// whole chunk is said as it ends. A crash of the driver fetches again at
/// most the chunks in flight, less what was said of them.
const WRITTEN_EVERY: Duration = Duration::from_secs(1);

impl Written {
    fn note(&mut self, f: &Finished) {
        match *f {
            Finished::Chunk(i) => {
                self.partial.remove(&i);
                self.done.insert(i);
            }
            Finished::Prefix(i, n) if !self.done.contains(&i) => {
                let at = self.partial.entry(i).or_default();
                *at = (*at).max(n);
            }
            Finished::Prefix(..) => {}
        }
    }
}

/// A file a process of this boot wrote whole, hashed and put in place,
/// then died before recording (`Written::whole`): its size, sha256 and
/// chunk table, read from it and made durable, when it is what the origin
/// lists; None to fetch it anew.
fn recover_in_place(
    work: &PullArea,
    key: &str,
    dest: &Path,
    file: &RemoteFile,
    vouches: bool,
) -> Option<(u64, String, Vec<String>)> {
    let w = load_written(work, key)?;
    if !w.whole || file.size.is_some_and(|s| s != w.size) {
        return None;
    }
    let f = File::open(dest).ok()?;
    let (size, sha, chunks) = crate::cache::manifest::hash_open_file(f, dest).ok()?;
    let right = match &file.sha256 {
        Some(expected) => expected.eq_ignore_ascii_case(&sha),
        None => vouches,
    };
    if !right || size != w.size {
        return None;
    }
    File::open(dest).and_then(|f| f.sync_all()).ok()?;
    Some((size, sha, chunks))
}

/// How long a pull answered once verified holds its durability back for
/// the create's answer at most (some file not verified yet).
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// How far a range gets between records of its progress: finer than a
/// chunk, coarse enough that recording (one fdatasync and one small state
/// write, batched across connections) stays out of the way.
pub(super) const PARTIAL_EVERY: u64 = 8 << 20;

/// What a connection tells the committer.
pub(super) enum Finished {
    /// Chunk `i` is written whole.
    Chunk(u64),
    /// Chunk `i`'s first `n` bytes are written.
    Prefix(u64, u64),
}

/// The ranges of a file still being made durable and recorded.
pub(super) struct Durable(tokio::task::JoinHandle<Result<FileState>>);

impl Durable {
    /// Waits until every range is durable and recorded; `st` then says so.
    pub(super) async fn settle(self, st: &mut FileState) -> Result<()> {
        *st = self
            .0
            .await
            .map_err(|e| Error::Internal(format!("committer failed: {e}")))??;
        Ok(())
    }
}

/// The ranges of a file of `size` bytes, and a frontier that holds what
/// `st` says was written before; readers of a progressive volume and
/// peers are told of the file.
fn resume_frontier(
    ctx: &Ctx,
    work: &PullArea,
    file: &RemoteFile,
    part: &Path,
    size: u64,
    st: &mut FileState,
) -> (Vec<(u64, u64)>, Arc<Frontier>) {
    let chunk = ctx.cfg.chunk_bytes.max(1);
    // Chunk indexes mean nothing under another chunk size, nor for a file
    // the server now lists at another size.
    if st.chunk_bytes != Some(chunk) || st.size_listed != Some(size) {
        st.done.clear();
        st.partial.clear();
        st.chunk_bytes = Some(chunk);
        st.size_listed = Some(size);
    }
    let all = chunks(size, chunk);
    let n = all.len() as u64;
    st.done.retain(|i| *i < n);
    let done = st.done.clone();
    st.partial.retain(|i, b| {
        *i < n && !done.contains(i) && *b > 0 && *b < all[*i as usize].1 - all[*i as usize].0
    });
    let frontier = ctx.frontier(Some(size));
    if file.unpack == Unpack::None {
        work.partial().begin(&file.path, size, part.to_path_buf());
        match ctx.source.chunk_table(file) {
            Some(table) => work.partial().expect_chunks(&file.path, table),
            // Readers wait for the sha256 alone: the chunk table, half
            // the hashing, comes after the verdict (`download`). Peers
            // reading this pull meanwhile are sent digests computed as
            // they ask (`peer::server`).
            None if ctx.defer_durable => frontier.whole_only(),
            None => {}
        }
        frontier.report_to(work.partial().clone(), &file.path);
    }
    for i in &st.done {
        let (start, end) = all[*i as usize];
        frontier.mark_written(start, end);
        ctx.bytes.fetch_add(end - start, Ordering::Relaxed);
    }
    for (i, b) in &st.partial {
        let start = all[*i as usize].0;
        frontier.mark_written(start, start + b);
        ctx.bytes.fetch_add(*b, Ordering::Relaxed);
    }
    (all, frontier)
}

/// Parallel ranges written with positioned writes and hashed by a
/// [`Frontier`]. A finished range is handed to a committer, which makes
/// every range finished so far durable with one fdatasync and only then
/// records them in `state/`; connections never wait for the disk.
/// Answers once every byte is written and hashed, with the committer
/// still at work: `Durable::settle` waits for it.
pub(super) async fn ranged_download(
    ctx: &Arc<Ctx>,
    work: &Arc<PullArea>,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    size: u64,
    st: &mut FileState,
) -> Result<(u64, (String, Vec<String>), Durable)> {
    let (all, frontier) = resume_frontier(ctx, work, file, part, size, st);
    let hasher = {
        let (f, out, part) = (frontier.clone(), out.clone(), part.to_path_buf());
        tokio::task::spawn_blocking(move || f.read_back(&out, &part, size))
    };
    // This future is dropped mid-way when another file of the pull fails;
    // the hasher thread must then stop waiting for writers that are gone.
    let _close = CloseOnDrop(frontier.clone());
    let (finished_tx, finished_rx) = tokio::sync::mpsc::unbounded_channel::<Finished>();
    let committer = tokio::spawn(commit_ranges(
        ctx.clone(),
        work.clone(),
        out.clone(),
        part.to_path_buf(),
        st.clone(),
        all.len() > 1,
        finished_rx,
    ));
    let missing: Vec<u64> = (0..all.len() as u64)
        .filter(|i| !st.done.contains(i))
        .collect();
    let fetched: Result<()> = futures::stream::iter(missing)
        .map(|i| {
            let (ctx, out, frontier, tx) = (
                ctx.clone(),
                out.clone(),
                frontier.clone(),
                finished_tx.clone(),
            );
            let file = file.clone();
            let (start, end) = all[i as usize];
            let resume_at = start + st.partial.get(&i).copied().unwrap_or(0);
            let part = part.to_path_buf();
            async move {
                let reported = AtomicU64::new(resume_at);
                let report = |pos: u64| {
                    if pos.saturating_sub(reported.load(Ordering::Relaxed)) >= PARTIAL_EVERY {
                        reported.store(pos, Ordering::Relaxed);
                        let _ = tx.send(Finished::Prefix(i, pos - start));
                    }
                };
                fetch_range(&ctx, &file, &out, &part, resume_at, end, &frontier, &report).await?;
                let _ = tx.send(Finished::Chunk(i));
                Ok(())
            }
        })
        .buffer_unordered(ctx.cfg.connections.max(1))
        .try_collect()
        .await;
    drop(finished_tx);
    frontier.close();
    let durable = Durable(committer);
    let (ended, behind) = (Instant::now(), size - frontier.lock().hashed.min(size));
    let hashed = match fetched {
        Ok(()) => hasher
            .await
            .map_err(|e| Error::Internal(format!("hasher failed: {e}")))
            .and_then(|h| h),
        Err(e) => Err(e),
    };
    // The verdict waits for this: worth seeing when it is long.
    if ended.elapsed() >= Duration::from_millis(200) {
        info!(file = %file.path_or_locator(), behind, tail_ms = ended.elapsed().as_millis() as u64, "hashing ended after the transfer");
    }
    match hashed {
        Ok(sha) => Ok((size, sha, durable)),
        // What was fetched is made durable and recorded even when another
        // range failed: a retry resumes from it.
        Err(e) => {
            let _ = durable.settle(st).await;
            Err(e)
        }
    }
}

/// Makes finished ranges durable in batches: waits for one, takes every
/// other already finished, fdatasyncs once, then records them all. So
/// `state/` only ever names ranges whose bytes are on disk. A file of one
/// range is not recorded per range: its sha256 record follows at once.
/// With `Ctx::defer_durable`, the one batch is the whole transfer.
pub(super) async fn commit_ranges(
    ctx: Arc<Ctx>,
    work: Arc<PullArea>,
    out: Arc<PartFile>,
    part: PathBuf,
    mut st: FileState,
    record: bool,
    mut finished: tokio::sync::mpsc::UnboundedReceiver<Finished>,
) -> Result<FileState> {
    while let Some(first) = finished.recv().await {
        let mut batch = vec![first];
        if ctx.defer_durable {
            // One batch: everything, once the transfer has ended, and once
            // the create waiting for the verdict has recorded its volume:
            // that record's fsync would otherwise wait behind this
            // writeback (ext4 commits both in one journal transaction).
            // Meanwhile what is written is said, unsynced, for a restart
            // of the process on this boot (`Written`).
            let mut written = boot_id().filter(|_| record).map(|boot| Written {
                boot: boot.to_string(),
                chunk_bytes: st.chunk_bytes.unwrap_or(0),
                size: st.size_listed.unwrap_or(0),
                done: st.done.clone(),
                partial: st.partial.clone(),
                whole: false,
            });
            let mut said = std::time::Instant::now();
            let mut whole_chunk = matches!(batch[0], Finished::Chunk(_));
            if let Some(w) = &mut written {
                w.note(&batch[0]);
            }
            loop {
                if let Some(w) = &written
                    && (whole_chunk || said.elapsed() >= WRITTEN_EVERY)
                {
                    let (wk, k, w) = (work.clone(), st.path.clone(), w.clone());
                    blocking(move || save_written(&wk, &k, &w)).await?;
                    said = std::time::Instant::now();
                }
                let Some(f) = finished.recv().await else {
                    break;
                };
                whole_chunk = matches!(f, Finished::Chunk(_));
                if let Some(w) = &mut written {
                    w.note(&f);
                }
                batch.push(f);
            }
            work.partial().until_answered(ANSWER_WAIT).await;
        }
        while let Ok(f) = finished.try_recv() {
            batch.push(f);
        }
        let (o, p) = (out.clone(), part.clone());
        blocking(move || o.sync_data().ctx("sync", &p)).await?;
        for f in batch {
            match f {
                Finished::Chunk(i) => {
                    st.partial.remove(&i);
                    st.done.insert(i);
                }
                Finished::Prefix(i, n) if !st.done.contains(&i) => {
                    let b = st.partial.entry(i).or_default();
                    *b = (*b).max(n);
                }
                Finished::Prefix(..) => {}
            }
        }
        if !record {
            continue;
        }
        let snapshot = {
            let _g = ctx.state_lock.lock().unwrap_or_else(|p| p.into_inner());
            st.clone()
        };
        let w = work.clone();
        blocking(move || save_state(&w, &snapshot)).await?;
    }
    Ok(st)
}

/// Fetches `[start, end)` into `out`, resuming after the last byte written
/// when a stream fails or stalls; `report` hears each written position.
#[allow(clippy::too_many_arguments)]
pub(super) async fn fetch_range(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    start: u64,
    end: u64,
    frontier: &Arc<Frontier>,
    report: &(dyn Fn(u64) + Send + Sync),
) -> Result<()> {
    let mut pos = start;
    let mut waits = retries(&ctx.cfg).delays();
    loop {
        let r = stream_into(
            ctx,
            file,
            out,
            part,
            &mut pos,
            Some(end),
            true,
            frontier,
            report,
        )
        .await;
        let e = match r {
            Ok(()) if pos == end => return Ok(()),
            Ok(()) => Error::Transient(format!(
                "{} ended at byte {pos}, expected {end}",
                file.path_or_locator()
            )),
            Err(e) if is_retryable(&e) => e,
            Err(e) => return Err(e),
        };
        let Some(wait) = waits.after(&e) else {
            return Err(e);
        };
        warn!(file = file.path_or_locator(), error = %e, retry_in = ?wait, "range failed; resuming");
        tokio::time::sleep(wait).await;
    }
}

/// A source that cannot serve ranges: fetched whole, hashed inline, and
/// restarted from 0 after a failure.
pub(super) async fn whole_download(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
) -> Result<(u64, (String, Vec<String>))> {
    let mut waits = retries(&ctx.cfg).delays();
    loop {
        out.set_len(0).ctx("truncate", part)?;
        let mut pos = 0;
        // One stream from byte 0 always leads: every byte is hashed inline.
        let frontier = ctx.frontier(file.size);
        // A listed size bounds the stream: a longer body is refused as it
        // arrives, not after it filled the disk.
        let (size, report) = (file.size, &|_| {});
        match stream_into(
            ctx, file, out, part, &mut pos, size, false, &frontier, report,
        )
        .await
        {
            Ok(()) if file.size.is_none_or(|s| s == pos) => {
                let (o, p) = (out.clone(), part.to_path_buf());
                let sha = blocking(move || {
                    o.sync_data().ctx("sync", &p)?;
                    frontier.close();
                    frontier.read_back(&o, &p, pos)
                })
                .await?;
                return Ok((pos, sha));
            }
            Ok(()) => {
                let e = Error::Transient(format!(
                    "{} was cut short at byte {pos}",
                    file.path_or_locator()
                ));
                let Some(wait) = waits.after(&e) else {
                    return Err(e);
                };
                tokio::time::sleep(wait).await;
            }
            Err(e) if is_retryable(&e) => {
                let Some(wait) = waits.after(&e) else {
                    return Err(e);
                };
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e),
        }
        ctx.bytes.fetch_sub(pos, Ordering::Relaxed);
    }
}

/// Streams one request into `out` at `*pos`, advancing it as bytes are
/// written (telling `report` each new position), refusing bytes past
/// `end`; with `ranged`, asks for `[*pos, end)` only. Returns Ok when the stream ends (the caller checks length), and
/// Unavailable when it stalls: fewer than `stall_min_bytes_per_sec x stall`
/// bytes in a stall window, so a trickle counts as a stall too.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream_into(
    ctx: &Ctx,
    file: &RemoteFile,
    out: &Arc<PartFile>,
    part: &Path,
    pos: &mut u64,
    end: Option<u64>,
    ranged: bool,
    frontier: &Arc<Frontier>,
    report: &(dyn Fn(u64) + Send + Sync),
) -> Result<()> {
    let len = end.filter(|_| ranged).map(|e| e.saturating_sub(*pos));
    let start = *pos;
    let mut stream =
        match tokio::time::timeout(ctx.cfg.stall, ctx.source.read(file, *pos, len)).await {
            Ok(s) => s?,
            Err(_) => {
                return Err(Error::Transient(format!(
                    "no answer for {} within {:?}",
                    file.path_or_locator(),
                    ctx.cfg.stall
                )));
            }
        };
    let _moving = ctx.flow.enter();
    let mut win = frontier.take_window();
    let min_bytes = u64::try_from(
        u128::from(ctx.cfg.stall_min_bytes_per_sec) * ctx.cfg.stall.as_millis() / 1000,
    )
    .unwrap_or(u64::MAX)
    .max(1);
    let mut window_end = tokio::time::Instant::now() + ctx.cfg.stall;
    let mut in_window = 0u64;
    loop {
        let next = tokio::time::timeout_at(window_end, stream.next()).await;
        let item = match next {
            Err(_) if in_window >= min_bytes => {
                // Moving fast enough: judge the next window afresh.
                window_end = tokio::time::Instant::now() + ctx.cfg.stall;
                in_window = 0;
                continue;
            }
            Err(_) => {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                return Err(Error::Transient(format!(
                    "{} stalled: {in_window} bytes in {:?}, less than the {min_bytes} \
                     (--pull-stall-min-bytes-per-second x --pull-stall-seconds) a live stream sends",
                    file.path_or_locator(),
                    ctx.cfg.stall
                )));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                return Err(e);
            }
            Ok(Some(Ok(b))) => b,
        };
        in_window = in_window.saturating_add(item.len() as u64);
        let after = pos
            .saturating_add(win.len() as u64)
            .saturating_add(item.len() as u64);
        if let Some(end) = end
            && after > end
        {
            return Err(Error::SourceFault(format!(
                "{} sent more bytes than asked for: bytes {start}-{} were asked, {after} reached",
                file.path_or_locator(),
                end.saturating_sub(1)
            )));
        }
        if end.is_none() && ctx.bytes.load(Ordering::Relaxed) > ctx.max_bytes {
            return Err(Error::OverLimit(format!(
                "{} is larger than the model may be ({} bytes: --max-model-bytes or the \
                 class's maxModelBytes); its size was not listed",
                file.path_or_locator(),
                ctx.max_bytes
            )));
        }
        let mut rest: &[u8] = &item;
        while !rest.is_empty() {
            rest = win.fill(rest);
            if win.is_full() {
                flush(out, part, pos, &mut win, frontier, ctx).await?;
                report(*pos);
            }
        }
    }
    flush(out, part, pos, &mut win, frontier, ctx).await?;
    frontier.give_window(win);
    Ok(())
}

/// Writes the window at `*pos` and hands it to the frontier, which hashes
/// it or holds it; `win` comes back empty (the same buffer or another).
pub(super) async fn flush(
    out: &Arc<PartFile>,
    part: &Path,
    pos: &mut u64,
    win: &mut Window,
    frontier: &Arc<Frontier>,
    ctx: &Ctx,
) -> Result<()> {
    if win.is_empty() {
        return Ok(());
    }
    let w = std::mem::replace(win, Window::empty());
    let n = w.len() as u64;
    let (o, p, f, at) = (out.clone(), part.to_path_buf(), frontier.clone(), *pos);
    *win = blocking(move || {
        o.write_window(&w, at, &p)?;
        Ok(f.hand_over(at, w))
    })
    .await?;
    *pos += n;
    ctx.bytes.fetch_add(n, Ordering::Relaxed);
    ctx.fetched.fetch_add(n, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn chunking_covers_the_file_exactly() {
        assert_eq!(chunks(10, 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(chunks(8, 4), vec![(0, 4), (4, 8)]);
        assert!(chunks(0, 4).is_empty());
    }
}
