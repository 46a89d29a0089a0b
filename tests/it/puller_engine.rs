//! The download engine against a real local source wrapped with fault
//! injection: verification, resume, join, stalls, Retry-After, capacity and
//! eviction. Real files, real fsyncs, a real size-limited tmpfs for ENOSPC.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use modelcache_csi::cache::{self, Backend, Root};
use modelcache_csi::config::Config;
use modelcache_csi::error::{Error, Result};
use modelcache_csi::puller::engine::{Engine, EngineConfig, NoProgress};
use modelcache_csi::puller::file::FileSource;
use modelcache_csi::puller::source::{RemoteFile, Resolved, Source};
use sha2::{Digest, Sha256};

/// Faults to inject into a wrapped source.
#[derive(Default)]
struct Faults {
    /// Claim this sha256 for every file (a corrupted object).
    wrong_sha: bool,
    /// Fail every read for good after this many bytes were served in total.
    die_after: Option<u64>,
    /// The first N reads stall forever after their first piece.
    stalls: AtomicUsize,
    /// The first N reads answer Retry-After.
    retry_after: AtomicUsize,
    /// Claim a wrong sha256 for this one file only.
    wrong_sha_of: Option<&'static str>,
    /// Each piece of model.safetensors is served this late.
    slow_big: Option<Duration>,
}

struct Faulty {
    inner: FileSource,
    faults: Faults,
    reads: AtomicUsize,
    served: Arc<AtomicU64>,
}

impl Faulty {
    fn new(dir: &Path, faults: Faults) -> Arc<Faulty> {
        Arc::new(Faulty {
            inner: FileSource::new(&format!("file://{}", dir.display())).unwrap(),
            faults,
            reads: AtomicUsize::new(0),
            served: Arc::new(AtomicU64::new(0)),
        })
    }
}

#[async_trait::async_trait]
impl Source for Faulty {
    async fn resolve(&self) -> Result<Resolved> {
        let mut r = self.inner.resolve().await?;
        for f in &mut r.files {
            if self.faults.wrong_sha || self.faults.wrong_sha_of == Some(f.path.as_str()) {
                f.sha256 = Some("00".repeat(32));
            }
        }
        Ok(r)
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if self
            .faults
            .retry_after
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Error::RetryAfter {
                message: "busy".into(),
                after: Duration::from_millis(50),
            });
        }
        let stall = self
            .faults
            .stalls
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let served = self.served.clone();
        let die_after = self.faults.die_after;
        let slow = self
            .faults
            .slow_big
            .filter(|_| file.path == "model.safetensors");
        let inner = self.inner.read(file, offset, len).await?;
        let s = inner.enumerate().then(move |(i, item)| {
            let served = served.clone();
            async move {
                if stall && i > 0 {
                    futures::future::pending::<()>().await;
                }
                if let Some(d) = slow {
                    tokio::time::sleep(d).await;
                }
                let b = item?;
                let total = served.fetch_add(b.len() as u64, Ordering::SeqCst) + b.len() as u64;
                if die_after.is_some_and(|d| total > d) {
                    return Err(Error::NotFound("injected permanent failure".into()));
                }
                Ok(b)
            }
        });
        Ok(s.boxed())
    }
}

fn model(dir: &Path, big_mib: usize) -> BTreeMap<String, String> {
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    let mut files = BTreeMap::new();
    let mut put = |rel: &str, bytes: Vec<u8>| {
        std::fs::write(dir.join(rel), &bytes).unwrap();
        files.insert(rel.to_string(), hex::encode(Sha256::digest(&bytes)));
    };
    put("config.json", b"{\"hidden_size\": 384}".to_vec());
    put("1_Pooling/config.json", b"{\"pooling\": \"mean\"}".to_vec());
    let mut big = vec![0u8; big_mib << 20];
    let mut x: u64 = 0x9E3779B97F4A7C15;
    for b in big.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    put("model.safetensors", big);
    files
}

fn root_at(dir: &Path) -> Root {
    let cfg = Config {
        node_id: Some("n".into()),
        state_dir: dir.to_path_buf(),
        backends: vec![Backend::Local],
        ..Config::default()
    };
    modelcache_csi::cache::Roots::of(&cfg).roots.remove(0)
}

fn fast(cfg: EngineConfig) -> EngineConfig {
    EngineConfig {
        chunk_bytes: 1 << 20,
        backoff: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
        stall: Duration::from_millis(300),
        ..cfg
    }
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(fast(cfg), modelcache_csi::puller::extract_layer)
}

fn sealed_files(root: &Root, sid: &cache::SourceId) -> BTreeMap<String, String> {
    let data = root.source(sid).data();
    let mut out = BTreeMap::new();
    for f in cache::read_seal(root, sid).unwrap().unwrap().files {
        let bytes = std::fs::read(data.join(&f.path)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&bytes)), f.sha256, "{}", f.path);
        out.insert(f.path, f.sha256);
    }
    out
}

fn visible_sources(root: &Root) -> Vec<String> {
    modelcache_csi::state::list_names(&root.sources_dir()).unwrap()
}

#[tokio::test]
async fn pulls_verifies_and_seals_byte_for_byte() {
    let t = tempfile::tempdir().unwrap();
    let want = model(&t.path().join("m"), 5);
    let root = root_at(&t.path().join("state"));
    let src = Faulty::new(&t.path().join("m"), Faults::default());
    let p = engine(EngineConfig::default())
        .pull(&root, src.clone(), &NoProgress)
        .await
        .unwrap();
    assert!(!p.hit);
    assert_eq!(sealed_files(&root, &p.sid), want);
    assert!(p.seal.revision.is_some());
    // No bookkeeping is left inside the sealed source.
    let mut names: Vec<_> = std::fs::read_dir(root.source(&p.sid).dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["data", "seal.json"]);
    // A second pull is a hit and reads nothing.
    let reads = src.reads.load(Ordering::SeqCst);
    let again = engine(EngineConfig::default())
        .pull(&root, src.clone(), &NoProgress)
        .await
        .unwrap();
    assert!(again.hit);
    assert_eq!(again.sid, p.sid);
    assert_eq!(src.reads.load(Ordering::SeqCst), reads);
}

/// A single large file behind slow connections keeps all its connections
/// busy, even with a reorder window far smaller than the ranges in flight:
/// the bytes that run ahead are hashed from disk instead of holding the
/// connections back, and the seal is still byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_file_keeps_every_connection_busy() {
    let t = tempfile::tempdir().unwrap();
    let want = model(&t.path().join("m"), 16);
    let timed = |connections: usize, state: &str| {
        let root = root_at(&t.path().join(state));
        // 40 ms per 1 MiB piece, per connection: 16 pieces in series take
        // at least 640 ms.
        let src = Faulty::new(
            &t.path().join("m"),
            Faults {
                slow_big: Some(Duration::from_millis(40)),
                ..Faults::default()
            },
        );
        async move {
            // 256 KiB windows: 1 MiB of reorder window per file, against
            // 12 MiB that three connections ahead of the frontier fetch.
            let cfg = EngineConfig {
                connections,
                buffer_budget: 1 << 20,
                ..fast(EngineConfig::default())
            };
            let cfg = EngineConfig {
                chunk_bytes: 4 << 20,
                ..cfg
            };
            let start = std::time::Instant::now();
            let p = Engine::new(cfg, modelcache_csi::puller::extract_layer)
                .pull(&root, src, &NoProgress)
                .await
                .unwrap();
            (start.elapsed(), sealed_files(&root, &p.sid))
        }
    };
    let (one, one_files) = timed(1, "one").await;
    let (four, four_files) = timed(4, "four").await;
    assert_eq!(one_files, want);
    assert_eq!(four_files, want);
    assert!(one >= Duration::from_millis(640), "{one:?}");
    assert!(
        four.as_secs_f64() < 0.5 * one.as_secs_f64(),
        "4 connections took {four:?}, 1 took {one:?}: the file's connections waited for each other"
    );
}

#[tokio::test]
async fn a_corrupted_object_is_refused_and_nothing_is_sealed() {
    let t = tempfile::tempdir().unwrap();
    model(&t.path().join("m"), 1);
    let root = root_at(&t.path().join("state"));
    let src = Faulty::new(
        &t.path().join("m"),
        Faults {
            wrong_sha: true,
            ..Faults::default()
        },
    );
    let err = engine(EngineConfig::default())
        .pull(&root, src, &NoProgress)
        .await
        .err()
        .expect("must fail");
    let msg = err.to_string();
    assert!(matches!(err, Error::Precondition(_)), "{err:?}");
    assert!(
        msg.contains("failed verification") && msg.contains("nothing was sealed"),
        "{msg}"
    );
    // Only the (hidden) work directory may remain: no source is visible.
    assert!(
        visible_sources(&root).is_empty(),
        "{:?}",
        visible_sources(&root)
    );
}

/// An 8 MiB model pulled one file and one connection at a time by a run
/// that dies for good once `die_after` bytes were served.
async fn interrupted_pull(
    die_after: u64,
) -> (
    tempfile::TempDir,
    BTreeMap<String, String>,
    Root,
    EngineConfig,
) {
    let t = tempfile::tempdir().unwrap();
    let want = model(&t.path().join("m"), 8);
    let root = root_at(&t.path().join("state"));
    let cfg = EngineConfig {
        connections: 1,
        files: 1,
        ..EngineConfig::default()
    };
    let dying = Faulty::new(
        &t.path().join("m"),
        Faults {
            die_after: Some(die_after),
            ..Faults::default()
        },
    );
    assert!(
        engine(cfg.clone())
            .pull(&root, dying, &NoProgress)
            .await
            .is_err()
    );
    (t, want, root, cfg)
}

#[tokio::test]
async fn an_interrupted_pull_resumes_without_refetching_finished_chunks() {
    // The first run dies for good after ~5 MiB.
    let (t, want, root, cfg) = interrupted_pull(5 << 20).await;
    assert!(visible_sources(&root).is_empty());
    // The retry only fetches what was not yet durable.
    let healthy = Faulty::new(&t.path().join("m"), Faults::default());
    let p = engine(cfg)
        .pull(&root, healthy.clone(), &NoProgress)
        .await
        .unwrap();
    assert_eq!(sealed_files(&root, &p.sid), want);
    let refetched = healthy.served.load(Ordering::SeqCst);
    let total: u64 = (8 << 20) + 39;
    assert!(
        refetched < total - (3 << 20),
        "resume fetched {refetched} of {total} bytes again"
    );
}

/// A chunk in flight when the run dies is not lost whole: its progress is
/// recorded every few MiB, so the retry resumes inside the chunk. With
/// 32 MiB chunks (the default) a `kill -9` used to cost every chunk in
/// flight, up to 128 MiB per file at four connections.
#[tokio::test]
async fn an_interrupted_pull_resumes_inside_a_chunk() {
    let t = tempfile::tempdir().unwrap();
    let want = model(&t.path().join("m"), 40);
    let root = root_at(&t.path().join("state"));
    let cfg = EngineConfig {
        chunk_bytes: 32 << 20,
        connections: 1,
        files: 1,
        ..fast(EngineConfig::default())
    };
    let engine = || Engine::new(cfg.clone(), modelcache_csi::puller::extract_layer);
    // Dies 28 MiB into the first 32 MiB chunk of model.safetensors.
    let dying = Faulty::new(
        &t.path().join("m"),
        Faults {
            die_after: Some(28 << 20),
            ..Faults::default()
        },
    );
    assert!(engine().pull(&root, dying, &NoProgress).await.is_err());
    let healthy = Faulty::new(&t.path().join("m"), Faults::default());
    let p = engine()
        .pull(&root, healthy.clone(), &NoProgress)
        .await
        .unwrap();
    assert_eq!(sealed_files(&root, &p.sid), want);
    let refetched = healthy.served.load(Ordering::SeqCst);
    assert!(
        refetched <= 24 << 20,
        "the retry fetched {refetched} bytes of 40 MiB: the chunk in flight started over"
    );
}

/// A kill can land after a file was renamed into place but before its
/// sha256 was recorded: its state then lists every chunk as done while the
/// `.part` those chunks were written to is gone. The retry must fetch the
/// file again, not seal a zero-filled one (seen in the e2e faults flow).
#[tokio::test]
async fn a_kill_between_rename_and_record_refetches_the_file() {
    // Largest first: model.safetensors, then config.json (20 bytes) finish;
    // the run dies in 1_Pooling/config.json.
    let (t, want, root, cfg) = interrupted_pull((8 << 20) + 25).await;
    // Put config.json's state back to the moment before its sha256 was
    // recorded: chunks done, no sha256, the file already renamed into place.
    let mut found = false;
    for dir in std::fs::read_dir(root.sources_dir()).unwrap() {
        let state = dir.unwrap().path().join("state");
        for f in std::fs::read_dir(&state).into_iter().flatten() {
            let f = f.unwrap().path();
            let mut v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap();
            if v["path"] == "config.json" {
                assert!(v["sha256"].is_string(), "config.json finished first: {v}");
                assert!(!v["done"].as_array().unwrap().is_empty(), "{v}");
                v.as_object_mut().unwrap().remove("sha256");
                std::fs::write(&f, serde_json::to_vec(&v).unwrap()).unwrap();
                found = true;
            }
        }
    }
    assert!(found, "no state recorded for config.json");
    let healthy = Faulty::new(&t.path().join("m"), Faults::default());
    let p = engine(cfg).pull(&root, healthy, &NoProgress).await.unwrap();
    assert_eq!(sealed_files(&root, &p.sid), want);
}

/// When one file fails verification the pull ends at once, dropping the
/// other files' downloads mid-way. Their hasher threads must end too: a
/// stuck one leaked a thread per failed pull and hung runtime shutdown.
#[test]
fn a_failed_pull_leaves_no_hasher_thread_behind() {
    let t = tempfile::tempdir().unwrap();
    model(&t.path().join("m"), 8);
    let root = root_at(&t.path().join("state"));
    let src = Faulty::new(
        &t.path().join("m"),
        Faults {
            wrong_sha_of: Some("config.json"),
            slow_big: Some(Duration::from_millis(20)),
            ..Faults::default()
        },
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Err(err) = rt.block_on(engine(EngineConfig::default()).pull(&root, src, &NoProgress))
    else {
        panic!("a wrong sha256 must fail the pull");
    };
    assert!(matches!(err, Error::Precondition(_)), "{err}");
    let start = std::time::Instant::now();
    rt.shutdown_timeout(Duration::from_secs(5));
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "a blocking task was still running {:?} after the pull failed",
        start.elapsed()
    );
}

#[tokio::test]
async fn twenty_concurrent_pulls_fetch_once() {
    let t = tempfile::tempdir().unwrap();
    model(&t.path().join("m"), 3);
    let root = root_at(&t.path().join("state"));
    let src = Faulty::new(&t.path().join("m"), Faults::default());
    let engine = Arc::new(engine(EngineConfig::default()));
    let pulls = (0..20).map(|_| {
        let (e, r, s) = (engine.clone(), root.clone(), src.clone());
        tokio::spawn(async move { e.pull(&r, s, &NoProgress).await.map(|p| (p.sid, p.hit)) })
    });
    let results: Vec<_> = futures::future::join_all(pulls)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    assert_eq!(results.iter().filter(|(_, hit)| !hit).count(), 1);
    assert!(results.iter().all(|(sid, _)| *sid == results[0].0));
    // 3 MiB in 1 MiB chunks + 2 small files: one read each.
    assert_eq!(src.reads.load(Ordering::SeqCst), 5);
    assert_eq!(src.served.load(Ordering::SeqCst), (3 << 20) + 39);
}

#[tokio::test]
async fn stalls_and_retry_after_are_survived() {
    let t = tempfile::tempdir().unwrap();
    let want = model(&t.path().join("m"), 2);
    let root = root_at(&t.path().join("state"));
    let src = Faulty::new(
        &t.path().join("m"),
        Faults {
            stalls: AtomicUsize::new(2),
            retry_after: AtomicUsize::new(2),
            ..Faults::default()
        },
    );
    let p = engine(EngineConfig::default())
        .pull(&root, src, &NoProgress)
        .await
        .unwrap();
    assert_eq!(sealed_files(&root, &p.sid), want);
}

struct Tmpfs(PathBuf);
impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = modelcache_csi::mount::unmount_lazy(&self.0);
    }
}

fn small_fs(dir: &Path, mib: u64) -> Tmpfs {
    std::fs::create_dir_all(dir).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some(format!("size={mib}m").as_str()),
    )
    .unwrap();
    Tmpfs(dir.to_path_buf())
}

#[tokio::test]
async fn a_model_that_cannot_fit_is_refused_before_any_byte_is_written() {
    let t = tempfile::tempdir().unwrap();
    model(&t.path().join("m"), 12);
    let fs = small_fs(&t.path().join("small"), 8);
    let root = root_at(&fs.0);
    let src = Faulty::new(&t.path().join("m"), Faults::default());
    let err = engine(EngineConfig::default())
        .pull(&root, src.clone(), &NoProgress)
        .await
        .err()
        .expect("must fail");
    assert!(matches!(err, Error::OverLimit(_)), "{err:?}");
    assert_eq!(
        src.reads.load(Ordering::SeqCst),
        0,
        "nothing may be fetched"
    );
    assert!(
        !root.sources_dir().exists() || std::fs::read_dir(root.sources_dir()).unwrap().count() == 0
    );
}

#[tokio::test]
async fn capacity_evicts_least_recently_used_but_never_a_model_in_use() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(&t.path().join("state"));
    let mut sids = Vec::new();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let dir = t.path().join(name);
        model(&dir, 2);
        std::fs::write(dir.join("tag"), name).unwrap();
        let cfg = EngineConfig {
            capacity: BTreeMap::from([(Backend::Local, 7 << 20)]),
            ..EngineConfig::default()
        };
        let p = engine(cfg)
            .pull(&root, Faulty::new(&dir, Faults::default()), &NoProgress)
            .await
            .unwrap();
        cache::evict::touch(&root, &p.sid).unwrap();
        // Distinct last-used seconds, oldest first.
        std::fs::write(
            root.source(&p.sid).dir.join("last-used"),
            (1000 + i).to_string(),
        )
        .unwrap();
        sids.push(p.sid);
    }
    // "a" is the oldest but in use: a cache volume references it.
    let rec_uuid = "0123456789abcdef0123456789abcdef";
    cache::add_ref(&root, &sids[0], rec_uuid).unwrap();
    cache::write_volume(
        &root,
        &cache::VolumeRecord {
            id: root.volume_id(rec_uuid),
            name: "in-use".into(),
            backend: Backend::Local,
            role: cache::Role::Cache,
            source: sids[0].clone(),
            sub_path: None,
            verify: Default::default(),
            capacity_bytes: 1,
            node: None,
            model: None,
            revision: None,
            external: None,
            content_source: None,
            namespace: None,
            signed_by: None,
            progressive: false,
            request: String::new(),
            created_unix: 0,
        },
    )
    .unwrap();
    // A fourth model needs room: "b" (oldest unused) goes, "a" stays.
    let dir = t.path().join("d");
    model(&dir, 2);
    let cfg = EngineConfig {
        capacity: BTreeMap::from([(Backend::Local, 7 << 20)]),
        ..EngineConfig::default()
    };
    engine(cfg)
        .pull(&root, Faulty::new(&dir, Faults::default()), &NoProgress)
        .await
        .unwrap();
    assert!(
        cache::read_seal(&root, &sids[0]).unwrap().is_some(),
        "a model in use was evicted"
    );
    assert!(
        cache::read_seal(&root, &sids[1]).unwrap().is_none(),
        "the least recently used unused model stays"
    );
    assert!(cache::read_seal(&root, &sids[2]).unwrap().is_some());
    // Pinned models survive idle eviction; unpinned idle ones go.
    cache::evict::set_pinned(&root, &sids[2], true).unwrap();
    let gone = cache::evict::evict_idle(&root, Duration::from_secs(0)).unwrap();
    assert!(
        !gone.contains(&sids[2]) && !gone.contains(&sids[0]),
        "{gone:?}"
    );
    assert_eq!(gone.len(), 1);
}
