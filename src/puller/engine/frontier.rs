//! The hashed frontier of one file: ranges written by many connections
//! are hashed once, in order, from memory when they arrive in time and
//! from disk when they ran ahead; and the flow that decides which.

use super::*;

/// The streams of one pull that are transferring rather than waiting for a
/// reorder window. Waiting costs nothing while others keep the pull
/// moving (the bytes stay in memory and are hashed from there); when too
/// few would, a stream writes on, and its bytes are read back from disk
/// instead: a single large file behind a slow link keeps every connection.
pub(super) struct Flow {
    pub(super) moving: std::sync::atomic::AtomicUsize,
    /// Fewest streams that must keep moving.
    pub(super) floor: usize,
    /// Bytes written ahead of a full reorder window, hashed from disk.
    pub(super) spilled: AtomicU64,
}

impl Flow {
    pub(super) fn new(floor: usize) -> Flow {
        Flow {
            moving: std::sync::atomic::AtomicUsize::new(0),
            floor,
            spilled: AtomicU64::new(0),
        }
    }

    /// Counts a stream as moving for as long as the guard lives.
    pub(super) fn enter(self: &Arc<Self>) -> Moving {
        self.moving.fetch_add(1, Ordering::SeqCst);
        Moving(self.clone())
    }

    /// Whether one of the moving streams may stop and wait.
    pub(super) fn may_pause(&self) -> bool {
        self.moving.load(Ordering::SeqCst) > self.floor
    }
}

pub(super) struct Moving(pub(super) Arc<Flow>);

impl Drop for Moving {
    fn drop(&mut self) {
        self.0.moving.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The sha256 of one file whose ranges arrive in any order, hashed from
/// memory in one in-order pass.
///
/// A window written exactly at the hashed frontier is hashed by its writer.
/// A window written beyond it is held, in memory, until the frontier
/// reaches it; `read_back` hashes held windows then. At most `spares`
/// windows are held per file: a writer further ahead waits until the
/// frontier catches up or a held window is hashed, if the [`Flow`] lets it;
/// else its bytes are *spilled*, left on disk to be read back. Waiting
/// cannot deadlock: the range at the frontier is always being fetched, and
/// its writer never waits. Ranges already on disk (spilled, or resumed
/// from an earlier run) are read back from the file.
pub(super) struct Frontier {
    pub(super) state: Mutex<FrontierState>,
    pub(super) wake: std::sync::Condvar,
    /// Bytes of one window.
    pub(super) window: usize,
    /// Windows this file may hold ahead of the frontier.
    pub(super) spares: usize,
    pub(super) flow: Arc<Flow>,
    /// Where the hashed prefix is published (peers read it), with the
    /// file's path in the model.
    pub(super) view: std::sync::OnceLock<(Arc<Partial>, String)>,
}

pub(super) struct FrontierState {
    /// None while a writer or the read-back is hashing outside the lock.
    pub(super) sha: Option<FileHasher>,
    /// Bytes `[0, hashed)` are in `sha`.
    pub(super) hashed: u64,
    /// Ahead of the frontier, in memory: offset -> window.
    pub(super) held: BTreeMap<u64, Window>,
    /// Ahead of the frontier, on disk (spilled or resumed): start -> end,
    /// merged.
    pub(super) written: BTreeMap<u64, u64>,
    /// Emptied windows, for reuse.
    pub(super) free: Vec<Window>,
    /// No more bytes will be written.
    pub(super) closed: bool,
}

impl Frontier {
    pub(super) fn new(window: usize, spares: usize, flow: Arc<Flow>) -> Frontier {
        Frontier {
            state: Mutex::new(FrontierState {
                sha: Some(FileHasher::default()),
                hashed: 0,
                held: BTreeMap::new(),
                written: BTreeMap::new(),
                free: Vec::new(),
                closed: false,
            }),
            wake: std::sync::Condvar::new(),
            window,
            spares,
            flow,
            view: std::sync::OnceLock::new(),
        }
    }

    /// Hashes the sha256 alone, not the chunk table (before any byte).
    pub(super) fn whole_only(&self) {
        self.lock().sha = Some(FileHasher::whole_only());
    }

    /// Publishes the hashed prefix to `view` as it grows.
    pub(super) fn report_to(&self, view: Arc<Partial>, path: &str) {
        let _ = self.view.set((view, path.to_string()));
    }

    fn report(&self, h: &FileHasher, hashed: u64) {
        if let Some((view, path)) = self.view.get() {
            view.hashed(path, hashed, h.chunks());
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, FrontierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wait<'a>(
        &self,
        s: std::sync::MutexGuard<'a, FrontierState>,
    ) -> std::sync::MutexGuard<'a, FrontierState> {
        self.wake.wait(s).unwrap_or_else(|p| p.into_inner())
    }

    /// An empty window for a stream.
    pub(super) fn take_window(&self) -> Window {
        self.lock()
            .free
            .pop()
            .unwrap_or_else(|| Window::new(self.window))
    }

    pub(super) fn give_window(&self, mut w: Window) {
        w.clear();
        self.lock().free.push(w);
    }

    /// Records bytes already in the file (a resumed range): read back later.
    pub(super) fn mark_written(&self, start: u64, end: u64) {
        insert_range(&mut self.lock().written, start, end);
        self.wake.notify_all();
    }

    /// Takes the window just written at `at`: hashes it if it is at the
    /// frontier, else holds it; if the reorder window is full, waits for
    /// room while the flow allows, else spills it. Returns an empty window
    /// for the writer to go on with.
    pub(super) fn hand_over(&self, at: u64, mut w: Window) -> Window {
        let n = w.len() as u64;
        if let Some((view, _)) = self.view.get() {
            view.arrived(n);
        }
        let mut s = self.lock();
        loop {
            // Abandoned: the bytes are on disk but will not be recorded.
            if s.closed {
                w.clear();
                return w;
            }
            if s.hashed == at
                && let Some(mut h) = s.sha.take()
            {
                // Hash outside the lock: other ranges keep writing meanwhile.
                drop(s);
                h.update(w.data());
                self.report(&h, at + n);
                s = self.lock();
                s.sha = Some(h);
                s.hashed = at + n;
                drop(s);
                self.wake.notify_all();
                w.clear();
                return w;
            }
            if s.held.len() < self.spares {
                let spare = s.free.pop().unwrap_or_else(|| Window::new(self.window));
                s.held.insert(at, w);
                drop(s);
                self.wake.notify_all();
                return spare;
            }
            if !self.flow.may_pause() {
                insert_range(&mut s.written, at, at + n);
                drop(s);
                self.flow.spilled.fetch_add(n, Ordering::Relaxed);
                self.wake.notify_all();
                w.clear();
                return w;
            }
            // Paused, this stream no longer counts as moving; it looks
            // again now and then, since others may stop or end meanwhile.
            self.flow.moving.fetch_sub(1, Ordering::SeqCst);
            s = self
                .wake
                .wait_timeout(s, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.flow.moving.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// No more writes: `read_back` finishes what is left, then returns.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }

    /// Hashes held windows, and resumed ranges from `out`, as the frontier
    /// reaches them, until closed; then the sha256 of `[0, size)` and its
    /// chunk table.
    pub(super) fn read_back(
        &self,
        out: &File,
        part: &Path,
        size: u64,
    ) -> Result<(String, Vec<String>)> {
        let mut buf = Vec::new();
        let mut s = self.lock();
        loop {
            let at = s.hashed;
            if s.sha.is_some()
                && let Some(mut w) = s.held.remove(&at)
            {
                let mut h = s.sha.take().expect("checked above");
                drop(s);
                h.update(w.data());
                let end = at + w.len() as u64;
                self.report(&h, end);
                w.clear();
                s = self.lock();
                s.sha = Some(h);
                s.hashed = end;
                s.free.push(w);
                self.wake.notify_all();
                continue;
            }
            let resumed = match (s.sha.is_some(), s.written.get(&at).copied()) {
                (true, Some(end)) => Some(end),
                _ => None,
            };
            if let Some(end) = resumed {
                s.written.remove(&at);
                let mut h = s.sha.take().expect("checked above");
                drop(s);
                buf.resize(1 << 20, 0);
                let mut pos = at;
                let mut read = Ok(());
                while pos < end {
                    let n = ((end - pos) as usize).min(buf.len());
                    if let Err(e) = out.read_exact_at(&mut buf[..n], pos) {
                        read = Err(e).ctx("read back", part);
                        break;
                    }
                    h.update(&buf[..n]);
                    pos += n as u64;
                }
                self.report(&h, pos);
                s = self.lock();
                s.sha = Some(h);
                s.hashed = pos;
                self.wake.notify_all();
                read?;
                continue;
            }
            // Closed with nothing at the frontier: done, or a gap that no
            // writer will fill (the download failed).
            if s.closed && s.sha.is_some() {
                break;
            }
            s = self.wait(s);
        }
        match s.sha.take() {
            Some(h) if s.hashed == size && s.written.is_empty() && s.held.is_empty() => {
                Ok(h.finish())
            }
            _ => Err(Error::Internal(format!(
                "download of {} ended with {} of {size} bytes hashed",
                part.display(),
                s.hashed
            ))),
        }
    }
}

/// Closes a [`Frontier`] however its download ends, cancellation included.
pub(super) struct CloseOnDrop(pub(super) Arc<Frontier>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Adds `[start, end)` to disjoint merged ranges.
pub(super) fn insert_range(ranges: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) {
    if start == end {
        return;
    }
    if let Some((&s, &e)) = ranges.range(..=start).next_back()
        && e == start
    {
        ranges.remove(&s);
        start = s;
    }
    if let Some(e) = ranges.remove(&end) {
        end = e;
    }
    ranges.insert(start, end);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    #[test]
    fn written_ranges_merge() {
        let mut r = BTreeMap::new();
        insert_range(&mut r, 8, 12);
        insert_range(&mut r, 0, 4);
        insert_range(&mut r, 4, 8);
        insert_range(&mut r, 20, 20);
        insert_range(&mut r, 16, 20);
        assert_eq!(r, BTreeMap::from([(0, 12), (16, 20)]));
    }

    fn window(bytes: &[u8]) -> Window {
        let mut w = Window::new(bytes.len());
        assert!(w.fill(bytes).is_empty());
        w
    }

    /// Four writers, each taking every fourth piece in order as the
    /// connections of one file do, plus a range resumed from disk: the
    /// frontier hashes every byte once, in order, holding no more than its
    /// reorder window, and never deadlocks, whether writers ahead of a full
    /// window wait (floor 0) or spill to disk (floor 8).
    #[test]
    fn the_frontier_hashes_every_byte_once_in_order() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f.part");
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let want = {
            let mut h = FileHasher::default();
            h.update(&data);
            h.finish()
        };
        let out = Arc::new(
            OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&path)
                .unwrap(),
        );
        out.set_len(data.len() as u64).unwrap();
        out.write_all_at(&data[30_000..32_000], 30_000).unwrap();
        let data = Arc::new(data);
        for (spares, floor) in [(1, 0), (2, 0), (5, 0), (1, 8), (2, 8)] {
            let flow = Arc::new(Flow::new(floor));
            let f = Arc::new(Frontier::new(1000, spares, flow.clone()));
            f.mark_written(30_000, 32_000);
            let reader = {
                let (f, o, p) = (f.clone(), out.clone(), path.clone());
                std::thread::spawn(move || f.read_back(&o, &p, 40_000))
            };
            let writers: Vec<_> = (0..4u64)
                .map(|k| {
                    let (f, data, out, flow) = (f.clone(), data.clone(), out.clone(), flow.clone());
                    std::thread::spawn(move || {
                        let _moving = flow.enter();
                        let mut held_max = 0;
                        for i in (k..40).step_by(4).filter(|i| !(30..32).contains(i)) {
                            let (a, b) = (i as usize * 1000, (i as usize + 1) * 1000);
                            out.write_all_at(&data[a..b], a as u64).unwrap();
                            let back = f.hand_over(a as u64, window(&data[a..b]));
                            assert!(back.is_empty());
                            held_max = held_max.max(f.lock().held.len());
                        }
                        held_max
                    })
                })
                .collect();
            for w in writers {
                assert!(w.join().unwrap() <= spares);
            }
            f.close();
            assert_eq!(
                reader.join().unwrap().unwrap(),
                want,
                "spares {spares}, floor {floor}"
            );
            let spilled = flow.spilled.load(Ordering::Relaxed);
            if floor == 0 {
                assert_eq!(spilled, 0, "writers may wait: nothing is spilled");
            } else {
                assert!(spilled > 0, "writers may not wait: something is spilled");
            }
        }
    }

    #[test]
    fn a_frontier_with_a_gap_fails_instead_of_hashing_a_hole() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("f.part");
        let out = File::create(&path).unwrap();
        let f = Frontier::new(4, 1, Arc::new(Flow::new(0)));
        f.hand_over(0, window(b"abcd"));
        f.hand_over(8, window(b"ijkl"));
        f.close();
        assert!(f.read_back(&out, &path, 12).is_err());
    }

    /// A writer ahead of a full reorder window is released by closing,
    /// as when another file of the pull fails.
    #[test]
    fn closing_releases_a_waiting_writer() {
        let flow = Arc::new(Flow::new(0));
        let f = Arc::new(Frontier::new(4, 1, flow.clone()));
        f.hand_over(8, window(b"ijkl"));
        let waiting = {
            let f = f.clone();
            std::thread::spawn(move || {
                let _moving = flow.enter();
                f.hand_over(12, window(b"mnop"))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiting.is_finished());
        f.close();
        assert!(waiting.join().unwrap().is_empty());
    }
}
