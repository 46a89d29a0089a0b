//! The running pull jobs, keyed by the volume name that wants each.
//!
//! A 100 GB model takes many minutes; external-provisioner gives each
//! CreateVolume a deadline (`--timeout`) and retries with backoff. So a
//! pull runs in a job of its own, keyed by the volume name that wants it:
//! a call waits for its job until shortly before its deadline and then
//! answers "still pulling" while the job goes on, and the retry joins the
//! same job. A job whose PVC is gone is cancelled by `cancel`; its partial
//! bytes stay as resumable (and evictable) work. Jobs never hold a lock or
//! a caller's future: dropping a call never stops a transfer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cache::{Root, SourceId};
use crate::error::{Error, Result};
pub use crate::provision::plan::{Owner, Until};
use crate::puller::engine::{Ask, Engine, Progress, ProgressSink, Pulled};
use crate::puller::source::Source;

type Outcome = crate::outcome::Outcome<Arc<Pulled>>;

/// One running pull.
struct Job {
    uri: String,
    /// Who wants it, when known.
    owner: Option<Owner>,
    started: Instant,
    last: Arc<Mutex<Option<Progress>>>,
    /// The model the origin resolved the request to, once it has.
    resolved: Arc<watch::Sender<Option<Resolved>>>,
    done: watch::Receiver<Outcome>,
    task: tokio::task::AbortHandle,
}

/// The running pull jobs of one controller.
#[derive(Default)]
pub struct Jobs {
    running: Mutex<HashMap<String, Arc<Job>>>,
}

/// Forwards to the caller's sink and remembers the latest progress, for
/// the "still pulling" answer.
struct Recording {
    inner: Arc<dyn ProgressSink>,
    last: Arc<Mutex<Option<Progress>>>,
    resolved: Arc<watch::Sender<Option<Resolved>>>,
    /// Bytes counted into the in-flight gauge, taken out when the job ends.
    counted: std::sync::atomic::AtomicI64,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Drop for Recording {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.pull_bytes_in_flight
            .dec_by(self.counted.load(std::sync::atomic::Ordering::Relaxed));
        m.pulls_in_flight.dec();
    }
}

impl ProgressSink for Recording {
    fn resolved(&self, sid: &str, uri: &str, revision: &str) {
        // The engine's own id, said as text because progress lives below
        // the cache: it parses.
        if let Some(id) = SourceId::parse(sid) {
            self.resolved.send_replace(Some(Resolved {
                sid: id,
                uri: uri.to_string(),
                revision: revision.to_string(),
            }));
        }
        self.inner.resolved(sid, uri, revision)
    }
    fn started(&self, uri: &str, total: Option<u64>) {
        self.inner.started(uri, total)
    }
    fn progress(&self, p: &Progress) {
        let now = i64::try_from(p.bytes).unwrap_or(i64::MAX);
        let before = self.counted.swap(now, std::sync::atomic::Ordering::Relaxed);
        self.metrics
            .pull_bytes_in_flight
            .inc_by(now.saturating_sub(before));
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
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

/// What a job needs to start.
#[derive(Clone)]
pub struct Request {
    /// The volume name: a retry of the same CreateVolume has the same one.
    pub key: String,
    /// The URI as shown (no query).
    pub uri: String,
    pub owner: Option<Owner>,
    pub root: Root,
    pub source: Arc<dyn Source>,
    /// The asking class's signature policy.
    pub signature: Option<Arc<crate::signing::Policy>>,
    pub sink: Arc<dyn ProgressSink>,
    /// When the volume that asks may be answered.
    pub until: Until,
}

/// What an early create waits for: the model sealed, or its pull under
/// way far enough (`Until`).
pub enum Early {
    Sealed(Arc<Pulled>),
    Arriving {
        /// The model, as the origin resolved it.
        model: Resolved,
        partial: Arc<crate::cache::partial::Partial>,
    },
}

/// What the origin resolved a request to: the model's id, and its name and
/// revision at the origin.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub sid: SourceId,
    pub uri: String,
    pub revision: String,
}

impl Jobs {
    /// Joins the job for `req.key`, starting it if none runs, and waits for
    /// it up to `wait` (forever when None). A job that ended is forgotten,
    /// so the next call after a failure starts afresh.
    pub async fn pull(
        &self,
        engine: &Arc<Engine>,
        req: Request,
        wait: Option<Duration>,
    ) -> Result<Arc<Pulled>> {
        let job = self.join_or_start(engine, req);
        let outcome = crate::outcome::wait(&job.done, "a pull job", wait).await;
        let Some(outcome) = outcome else {
            return Err(Error::Transient(still_pulling(&job)));
        };
        self.forget(&job);
        outcome
    }

    /// Like `pull`, but answers as soon as the pull of the job's model runs
    /// in this process with its listing known, or every listed file
    /// verified (`Early::Arriving`, as `Request::until` says); the job goes
    /// on. A model already sealed, or one whose listing cannot be shown
    /// before its bytes, is waited for as `pull` would.
    pub async fn pull_early(
        &self,
        engine: &Arc<Engine>,
        req: Request,
        wait: Option<Duration>,
    ) -> Result<Early> {
        let until = req.until;
        let pulls = req.root.pulls.clone();
        let job = self.join_or_start(engine, req);
        let deadline = wait.map(|w| tokio::time::Instant::now() + w);
        let mut done = job.done.clone();
        let mut resolved = job.resolved.subscribe();
        let mut starts = pulls.starts();
        loop {
            if let Some(outcome) = done.borrow_and_update().clone() {
                self.forget(&job);
                return outcome.map(Early::Sealed).map_err(|e| e.replay());
            }
            starts.borrow_and_update();
            let model = resolved.borrow_and_update().clone();
            // The stage of the model's pull, once it runs here; the view
            // itself is not held while waiting, so an ended pull's is freed.
            let mut stage = None;
            if let Some(model) = model
                && let Some(partial) = pulls.get(&model.sid)
            {
                let mut rx = partial.stage();
                if until.answers_at(*rx.borrow_and_update()) {
                    tracing::debug!(model = %model.sid, ?until, "answering before the seal");
                    return Ok(Early::Arriving { model, partial });
                }
                stage = Some(rx);
            }
            let now = tokio::time::Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Transient(still_pulling(&job)));
            }
            let staged = async {
                match stage.as_mut() {
                    // An error is the pull's end: its view is gone, and the
                    // next round finds the next pull or the outcome.
                    Some(rx) => rx.changed().await.unwrap_or(()),
                    None => std::future::pending().await,
                }
            };
            let wake = deadline.unwrap_or(now + Duration::from_secs(3600));
            tokio::select! {
                changed = done.changed() => if changed.is_err() {
                    self.forget(&job);
                    return Err(Error::Internal(
                        "a pull job ended without an outcome".into(),
                    ));
                },
                _ = resolved.changed() => {}
                _ = starts.changed() => {}
                () = staged => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    fn join_or_start(&self, engine: &Arc<Engine>, req: Request) -> Arc<Job> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = running.get(&req.key) {
            return job.clone();
        }
        let (tx, rx) = watch::channel(None);
        let last = Arc::new(Mutex::new(None));
        let resolved = Arc::new(watch::Sender::new(None));
        let metrics = engine.metrics().clone();
        metrics.pulls_in_flight.inc();
        let sink: Arc<dyn ProgressSink> = Arc::new(Recording {
            inner: req.sink,
            last: last.clone(),
            resolved: resolved.clone(),
            counted: Default::default(),
            metrics,
        });
        let (engine, root, source, uri) = (engine.clone(), req.root, req.source, req.uri.clone());
        let (signature, until) = (req.signature, req.until);
        let asker = req.key.clone();
        // Slots are shared fairly between the namespaces that want pulls.
        let who = req
            .owner
            .as_ref()
            .map(|o| o.namespace().to_string())
            .unwrap_or_default();
        let task = tokio::spawn(async move {
            let outcome = engine
                .pull_for(
                    &Ask {
                        who: &who,
                        asker: Some(&asker),
                        signature: signature.as_ref(),
                        listing_order: until == Until::Listed,
                        readers: until != Until::Sealed,
                    },
                    &root,
                    source,
                    sink.as_ref(),
                )
                .await;
            if let Err(e) = &outcome {
                sink.failed(&uri, &e.to_string());
            }
            let _ = tx.send(Some(outcome.map(Arc::new).map_err(Arc::new)));
        });
        let job = Arc::new(Job {
            uri: req.uri,
            owner: req.owner,
            started: Instant::now(),
            last,
            resolved,
            done: rx,
            task: task.abort_handle(),
        });
        running.insert(req.key, job.clone());
        job
    }

    fn forget(&self, job: &Arc<Job>) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.retain(|_, j| !Arc::ptr_eq(j, job));
    }

    /// Who wants each running job, for the sweeper to check.
    pub fn owners(&self) -> Vec<(String, Owner)> {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running
            .iter()
            .filter_map(|(k, j)| j.owner.clone().map(|o| (k.clone(), o)))
            .collect()
    }

    /// Stops the job for `key` (its PVC is gone). The transfer's finished
    /// ranges stay on disk: a later pull of the model resumes them, and
    /// eviction may reclaim them.
    pub fn cancel(&self, key: &str) -> bool {
        let job = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        match job {
            Some(j) => {
                j.task.abort();
                tracing::info!(volume = key, uri = %j.uri, "pull cancelled: nothing wants it any more");
                true
            }
            None => false,
        }
    }

    /// Waits until the job for `key` has its outcome, or at once when none
    /// runs.
    pub async fn ended(&self, key: &str) {
        let done = {
            let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            running.get(key).map(|j| j.done.clone())
        };
        if let Some(mut done) = done {
            // An error: the job's task is gone, and so is the wait.
            let _ = done.wait_for(Option::is_some).await;
        }
    }

    /// Whether a pull for `key` runs (or ended with nobody told yet).
    pub fn is_running(&self, key: &str) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(key)
    }

    /// Whether the job for `key` is still at work: not ended, nor ended
    /// with its outcome waiting for the next call to collect it.
    pub fn is_working(&self, key: &str) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .is_some_and(|j| j.done.borrow().is_none())
    }

    /// How many pulls run.
    pub fn len(&self) -> usize {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn still_pulling(job: &Job) -> String {
    let last = job.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mib = |b: u64| b as f64 / 1048576.0;
    let progress = match last {
        Some(p) => {
            let of = p
                .total
                .map(|t| {
                    format!(
                        " of {:.1} MiB ({:.0}%)",
                        mib(t),
                        100.0 * p.bytes as f64 / t.max(1) as f64
                    )
                })
                .unwrap_or_default();
            let eta = p
                .eta
                .map(|e| format!(", about {}s left", e.as_secs()))
                .unwrap_or_default();
            format!(
                "{:.1} MiB{of} at {:.1} MiB/s{eta}",
                mib(p.bytes),
                p.rate_bytes_per_sec / 1048576.0
            )
        }
        None => "resolving and preparing".into(),
    };
    format!(
        "still pulling {} for {}s: {progress}; the pull goes on without this call, and a retry \
         joins it",
        job.uri,
        job.started.elapsed().as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::puller::engine::{EngineConfig, NoProgress};
    use crate::puller::source::{RemoteFile, Resolved, Unpack};
    use bytes::Bytes;
    use futures::stream::{self, BoxStream, StreamExt};
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn local_root(dir: &std::path::Path) -> Root {
        let cfg = Config {
            node_id: Some("n1".into()),
            state_dir: dir.to_path_buf(),
            ..Config::default()
        };
        crate::cache::Roots::of(&cfg).roots.remove(0)
    }

    /// One file of `len` bytes, served slowly, counting resolves.
    struct Slow {
        uri: &'static str,
        len: u64,
        resolves: AtomicUsize,
        delay: Duration,
    }

    #[async_trait::async_trait]
    impl Source for Slow {
        async fn resolve(&self) -> Result<Resolved> {
            self.resolves.fetch_add(1, Ordering::SeqCst);
            Ok(Resolved {
                uri: self.uri.into(),
                revision: "r1".into(),
                files: vec![RemoteFile {
                    path: "w.bin".into(),
                    size: Some(self.len),
                    sha256: None,
                    locator: "w".into(),
                    unpack: Unpack::None,
                }],
            })
        }

        async fn read(
            &self,
            _f: &RemoteFile,
            offset: u64,
            len: Option<u64>,
        ) -> Result<BoxStream<'static, Result<Bytes>>> {
            let n = len.unwrap_or(self.len - offset);
            let delay = self.delay;
            let chunks = (0..n.div_ceil(4096)).map(move |i| {
                let size = (n - i * 4096).min(4096) as usize;
                Bytes::from(vec![1u8; size])
            });
            Ok(stream::iter(chunks)
                .then(move |b| async move {
                    tokio::time::sleep(delay).await;
                    Ok(b)
                })
                .boxed())
        }

        fn ranges(&self) -> bool {
            false
        }
    }

    #[tokio::test]
    async fn a_call_that_gives_up_leaves_the_pull_running_and_a_retry_joins_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = local_root(dir.path());
        let engine = Arc::new(Engine::new(
            EngineConfig::default(),
            crate::puller::extract_layer,
        ));
        let jobs = Jobs::default();
        let src = Arc::new(Slow {
            uri: "test://slow",
            len: 64 * 4096,
            resolves: AtomicUsize::new(0),
            delay: Duration::from_millis(5),
        });
        let req = |s: Arc<Slow>| Request {
            key: "pvc-1".into(),
            uri: "test://slow".into(),
            owner: None,
            root: root.clone(),
            source: s,
            signature: None,
            sink: Arc::new(NoProgress),
            until: Until::Sealed,
        };
        let t0 = Instant::now();
        let e = jobs
            .pull(&engine, req(src.clone()), Some(Duration::from_millis(50)))
            .await
            .err()
            .expect("the first call gives up at its deadline");
        assert!(
            matches!(&e, Error::Transient(m) if m.contains("still pulling")),
            "{e:?}"
        );
        assert_eq!(jobs.len(), 1, "the pull runs on without its caller");
        let pulled = jobs
            .pull(&engine, req(src.clone()), None)
            .await
            .expect("the retry joins and finishes");
        assert!(!pulled.hit);
        assert_eq!(
            src.resolves.load(Ordering::SeqCst),
            1,
            "joined, not restarted"
        );
        // 64 chunks of 5 ms: one transfer, not one per call.
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(jobs.is_empty());
    }

    /// Two tenants' slow origins hold both slots (`--pull-parallel-models
    /// 2`); a third tenant's pull still proceeds, because a slow pull gives
    /// its slot to a waiting one. With a plain semaphore it waited for a
    /// slow pull to end (20 s here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_origins_cannot_hold_every_slot() {
        let dir = tempfile::tempdir().unwrap();
        let root = local_root(dir.path());
        let engine = Arc::new(Engine::new(
            EngineConfig {
                models: 2,
                stall: Duration::from_millis(300),
                progress_every: Duration::from_millis(50),
                slow_bytes_per_sec: 1 << 20,
                ..EngineConfig::default()
            },
            crate::puller::extract_layer,
        ));
        let jobs = Jobs::default();
        let req = |key: &str, ns: &str, src: Slow| Request {
            key: key.into(),
            uri: src.uri.into(),
            owner: Some(Owner::Pod {
                namespace: ns.into(),
                name: key.into(),
            }),
            root: root.clone(),
            source: Arc::new(src),
            signature: None,
            sink: Arc::new(NoProgress),
            until: Until::Sealed,
        };
        // 4 KiB every 20 ms: about 200 KB/s, live but slow; 20 s in all.
        let slow = |uri| Slow {
            uri,
            len: 4 << 20,
            resolves: AtomicUsize::new(0),
            delay: Duration::from_millis(20),
        };
        for (key, ns, uri) in [
            ("a", "team-a", "test://slow-a"),
            ("b", "team-b", "test://slow-b"),
        ] {
            let e = jobs
                .pull(
                    &engine,
                    req(key, ns, slow(uri)),
                    Some(Duration::from_millis(100)),
                )
                .await
                .err()
                .expect("still pulling");
            assert!(
                matches!(&e, Error::Transient(m) if m.contains("still pulling")),
                "{e:?}"
            );
        }
        let fast = Slow {
            uri: "test://fast",
            len: 64 << 10,
            resolves: AtomicUsize::new(0),
            delay: Duration::ZERO,
        };
        let t0 = Instant::now();
        let pulled = jobs
            .pull(
                &engine,
                req("c", "team-c", fast),
                Some(Duration::from_secs(10)),
            )
            .await
            .expect("the third tenant's pull proceeds while both slow ones run");
        assert!(!pulled.hit);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(jobs.is_running("a") && jobs.is_running("b"));
        assert!(jobs.cancel("a") && jobs.cancel("b"));
    }

    /// A live trickle that could never finish in time ends at its
    /// deadline (grace plus size at the floor rate), and says which flags.
    #[tokio::test]
    async fn a_pull_slower_than_its_deadline_allows_ends() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::new(
            EngineConfig {
                min_average_bytes_per_sec: 64 << 10,
                deadline_grace: Duration::from_millis(200),
                ..EngineConfig::default()
            },
            crate::puller::extract_layer,
        );
        // 64 KiB at 4 KiB per 200 ms: 3.2 s, against a 1.2 s deadline.
        let src = Arc::new(Slow {
            uri: "test://trickle",
            len: 64 << 10,
            resolves: AtomicUsize::new(0),
            delay: Duration::from_millis(200),
        });
        let t0 = Instant::now();
        let e = engine
            .pull(&local_root(dir.path()), src, &NoProgress)
            .await
            .err()
            .expect("the deadline ends it");
        assert!(
            matches!(&e, Error::Transient(m) if m.contains("--pull-min-average-bytes-per-second")),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }

    /// One file of unlisted size, sent 4 KiB every `delay`, counting the
    /// reads that started.
    struct Unlisted {
        uri: String,
        delay: Duration,
        reads: Arc<AtomicUsize>,
    }

    #[async_trait::async_trait]
    impl Source for Unlisted {
        async fn resolve(&self) -> Result<Resolved> {
            Ok(Resolved {
                uri: self.uri.clone(),
                revision: "r1".into(),
                files: vec![RemoteFile {
                    path: "w.bin".into(),
                    size: None,
                    sha256: None,
                    locator: "w".into(),
                    unpack: Unpack::None,
                }],
            })
        }

        async fn read(
            &self,
            _f: &RemoteFile,
            _offset: u64,
            _len: Option<u64>,
        ) -> Result<BoxStream<'static, Result<Bytes>>> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            let delay = self.delay;
            Ok(stream::iter(0..1_000_000u64)
                .then(move |_| async move {
                    tokio::time::sleep(delay).await;
                    Ok(Bytes::from(vec![1u8; 4096]))
                })
                .boxed())
        }

        fn ranges(&self) -> bool {
            false
        }
    }

    /// A body of no stated length that trickles ends once it falls under
    /// the floor past the grace period, as a listed one does at its
    /// deadline; before, it held its pull for ever.
    #[tokio::test]
    async fn a_trickle_of_unlisted_size_ends_at_the_floor() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::new(
            EngineConfig {
                min_average_bytes_per_sec: 1 << 20,
                deadline_grace: Duration::from_millis(300),
                progress_every: Duration::from_millis(50),
                ..EngineConfig::default()
            },
            crate::puller::extract_layer,
        );
        let src = Arc::new(Unlisted {
            uri: "test://trickle-unlisted".into(),
            delay: Duration::from_millis(50),
            reads: Arc::default(),
        });
        let e = tokio::time::timeout(
            Duration::from_secs(20),
            engine.pull(&local_root(dir.path()), src, &NoProgress),
        )
        .await
        .expect("the trickle held the pull")
        .err()
        .expect("the floor ends it");
        assert!(
            matches!(&e, Error::Transient(m) if m.contains("unlisted size") && m.contains("--pull-min-average-bytes-per-second")),
            "{e:?}"
        );
    }

    /// Slow pulls give their slots back and go on, but no more of them run
    /// than the bound: a namespace's third transfer waits (here: with one
    /// slot, two per namespace) and starts once one of its first two ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_transfers_that_gave_their_slots_back_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let root = local_root(dir.path());
        let engine = Arc::new(Engine::new(
            EngineConfig {
                models: 1,
                stall: Duration::from_millis(200),
                progress_every: Duration::from_millis(50),
                slow_bytes_per_sec: 1 << 20,
                ..EngineConfig::default()
            },
            crate::puller::extract_layer,
        ));
        let jobs = Jobs::default();
        let reads: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
        for (i, r) in reads.iter().enumerate() {
            let req = Request {
                key: format!("slow-{i}"),
                uri: format!("test://slow-{i}"),
                owner: Some(Owner::Pod {
                    namespace: "team-a".into(),
                    name: format!("p{i}"),
                }),
                root: root.clone(),
                source: Arc::new(Unlisted {
                    uri: format!("test://slow-{i}"),
                    delay: Duration::from_millis(100),
                    reads: r.clone(),
                }),
                signature: None,
                sink: Arc::new(NoProgress),
                until: Until::Sealed,
            };
            let _ = jobs
                .pull(&engine, req, Some(Duration::from_millis(600)))
                .await;
        }
        let started = |r: &Arc<AtomicUsize>| r.load(Ordering::SeqCst) > 0;
        assert!(
            started(&reads[0]) && started(&reads[1]),
            "the first two run"
        );
        assert!(
            !started(&reads[2]),
            "a third slow transfer of the namespace ran"
        );
        assert!(jobs.cancel("slow-0"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !started(&reads[2]) {
            assert!(Instant::now() < deadline, "the third never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(jobs.cancel("slow-1") && jobs.cancel("slow-2"));
    }

    #[tokio::test]
    async fn a_cancelled_job_stops_and_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let root = local_root(dir.path());
        let engine = Arc::new(Engine::new(
            EngineConfig::default(),
            crate::puller::extract_layer,
        ));
        let jobs = Jobs::default();
        let src = Arc::new(Slow {
            uri: "test://slow",
            len: 1 << 20,
            resolves: AtomicUsize::new(0),
            delay: Duration::from_millis(50),
        });
        let r = Request {
            key: "gone".into(),
            uri: "test://slow".into(),
            owner: Some(Owner::Pvc {
                namespace: "ns".into(),
                name: "pvc".into(),
            }),
            root,
            source: src,
            signature: None,
            sink: Arc::new(NoProgress),
            until: Until::Sealed,
        };
        let _ = jobs.pull(&engine, r, Some(Duration::from_millis(20))).await;
        assert_eq!(
            jobs.owners(),
            vec![(
                "gone".into(),
                Owner::Pvc {
                    namespace: "ns".into(),
                    name: "pvc".into()
                }
            )]
        );
        assert!(jobs.cancel("gone"));
        assert!(jobs.is_empty());
        assert!(!jobs.cancel("gone"));
    }
}
