//! Hostile sources: servers and listings that lie, trickle, overflow or
//! explode, against the download engine (in process) and the driver (a
//! spawned process, whose memory high-water mark is checked). Every case
//! must end in a clear error with a deliberate code, never a panic, an
//! `Internal`, a filled disk, an eviction for nothing or unbounded memory.
//!
//! Run as root under `unshare -m --propagation private` (one case mounts a
//! small tmpfs to fill).

use crate::support::fixtures;
use crate::support::registry;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use modelcache_csi::cache::{self, Backend, Root};
use modelcache_csi::config::Config;
use modelcache_csi::error::{Error, Result};
use modelcache_csi::puller::engine::{Engine, EngineConfig, NoProgress, Pulled};
use modelcache_csi::puller::source::{
    Compression, PullLimits, RemoteFile, Resolved, Source, Unpack,
};
use modelcache_csi::puller::{self, SourceOptions};
use sha2::{Digest, Sha256};

// ------------------------------------------------------------ a scripted source

/// How a scripted file misbehaves.
#[derive(Clone, Default)]
struct Misbehave {
    /// Bytes appended beyond what was asked.
    extra: usize,
    /// Each piece is served this late.
    delay: Option<Duration>,
    /// Reads fail (retryably) once the source served this many bytes in all.
    die_after: Option<usize>,
}

#[derive(Clone)]
struct Scripted {
    uri: String,
    revision: String,
    files: Vec<(RemoteFile, Arc<Vec<u8>>, Misbehave)>,
    ranges: bool,
    reads: Arc<AtomicUsize>,
    served: Arc<AtomicUsize>,
}

impl Scripted {
    fn new(uri: &str) -> Scripted {
        Scripted {
            uri: uri.into(),
            revision: "r1".into(),
            files: Vec::new(),
            ranges: true,
            reads: Arc::new(AtomicUsize::new(0)),
            served: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A file whose listed size is its real one.
    fn file(self, path: &str, data: Vec<u8>) -> Scripted {
        let size = data.len() as u64;
        self.listed(path, Some(size), data, Misbehave::default())
    }

    fn listed(mut self, path: &str, size: Option<u64>, data: Vec<u8>, m: Misbehave) -> Scripted {
        self.files.push((
            RemoteFile {
                path: path.into(),
                size,
                sha256: None,
                locator: path.into(),
                unpack: Unpack::None,
            },
            Arc::new(data),
            m,
        ));
        self
    }

    fn layer(mut self, blob: Vec<u8>, c: Compression) -> Scripted {
        let sha = hex::encode(Sha256::digest(&blob));
        self.files.push((
            RemoteFile {
                path: String::new(),
                size: Some(blob.len() as u64),
                sha256: Some(sha.clone()),
                locator: format!("sha256:{sha}"),
                unpack: Unpack::Tar(c),
            },
            Arc::new(blob),
            Misbehave::default(),
        ));
        self
    }

    fn arc(self) -> Arc<Scripted> {
        Arc::new(self)
    }
}

#[async_trait::async_trait]
impl Source for Scripted {
    async fn resolve(&self) -> Result<Resolved> {
        Ok(Resolved {
            uri: self.uri.clone(),
            revision: self.revision.clone(),
            files: self.files.iter().map(|(f, _, _)| f.clone()).collect(),
        })
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let (_, data, m) = self
            .files
            .iter()
            .find(|(f, _, _)| f.locator == file.locator)
            .cloned()
            .expect("listed");
        let start = (offset as usize).min(data.len());
        let end = match len {
            Some(l) => (start + l as usize).min(data.len()),
            None => data.len(),
        };
        let mut body = data[start..end].to_vec();
        body.extend(std::iter::repeat_n(7u8, m.extra));
        let pieces: Vec<Bytes> = body.chunks(64 << 10).map(Bytes::copy_from_slice).collect();
        let served = self.served.clone();
        Ok(futures::stream::iter(pieces)
            .then(move |p| {
                let m = m.clone();
                let total = served.fetch_add(p.len(), Ordering::SeqCst) + p.len();
                let dead = m.die_after.is_some_and(|d| total > d);
                async move {
                    if let Some(d) = m.delay {
                        tokio::time::sleep(d).await;
                    }
                    if dead {
                        return Err(Error::Transient("injected: connection reset".into()));
                    }
                    Ok(p)
                }
            })
            .boxed())
    }

    fn ranges(&self) -> bool {
        self.ranges
    }
}

// ------------------------------------------------------------ helpers

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
        ..cfg
    }
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(fast(cfg), puller::extract_layer)
}

async fn pull(root: &Root, src: Arc<dyn Source>, cfg: EngineConfig) -> Result<Pulled> {
    // Never a hang: a case that does not end is a failure of its own.
    tokio::time::timeout(
        Duration::from_secs(60),
        engine(cfg).pull(root, src, &NoProgress),
    )
    .await
    .expect("the pull ended within 60 s")
}

fn sealed_models(root: &Root) -> Vec<String> {
    std::fs::read_dir(root.sources_dir())
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('m'))
                .collect()
        })
        .unwrap_or_default()
}

/// The error of a pull that must fail, after checking it sealed nothing.
async fn refused(root: &Root, src: Arc<dyn Source>, cfg: EngineConfig) -> Error {
    let before = sealed_models(root);
    let err = pull(root, src, cfg)
        .await
        .err()
        .expect("the pull must fail");
    assert_eq!(
        sealed_models(root),
        before,
        "a refused pull sealed something"
    );
    err
}

/// The gRPC code a caller would see.
fn code(e: Error) -> (tonic::Code, String) {
    let s = tonic::Status::from(e);
    (s.code(), s.message().to_string())
}

#[track_caller]
fn assert_fault(e: Error, code_want: tonic::Code, fragment: &str) -> String {
    let (c, m) = code(e);
    assert_eq!(c, code_want, "{m}");
    assert!(m.contains(fragment), "{fragment:?} not in {m:?}");
    m
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

fn pull_dirs(root: &Root) -> Vec<String> {
    std::fs::read_dir(root.sources_dir())
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".pull-"))
                .collect()
        })
        .unwrap_or_default()
}

fn noise(n: usize, seed: u64) -> Vec<u8> {
    fixtures::pseudo_random(seed | 1, n)
}

// ------------------------------------------------------------ listings

/// Sizes from a server are checked arithmetic: a sum past 2^64 is the
/// server's fault (it panicked the pull's task before).
#[tokio::test]
async fn listed_sizes_that_overflow_are_a_server_fault() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let src = Scripted::new("test://overflow")
        .listed("a", Some(u64::MAX - 1), vec![], Misbehave::default())
        .listed("b", Some(2), vec![0, 0], Misbehave::default())
        .arc();
    let e = refused(&root, src.clone(), EngineConfig::default()).await;
    assert_fault(e, tonic::Code::FailedPrecondition, "more than 2^64");
    assert_eq!(src.reads.load(Ordering::SeqCst), 0);
}

/// A name listed twice, and a path that is both a file and a directory,
/// are the server's fault, named, before anything is fetched (they were
/// `Internal` from the filesystem).
#[tokio::test]
async fn a_repeated_name_or_a_file_inside_a_file_is_a_server_fault() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let twice = Scripted::new("test://twice")
        .file("config.json", b"{}".to_vec())
        .file("config.json", b"[]".to_vec())
        .arc();
    let e = refused(&root, twice.clone(), EngineConfig::default()).await;
    assert_fault(e, tonic::Code::FailedPrecondition, "\"config.json\" twice");
    let nested = Scripted::new("test://nested")
        .file("weights", b"x".to_vec())
        .file("weights/part-1", b"y".to_vec())
        .arc();
    let e = refused(&root, nested.clone(), EngineConfig::default()).await;
    let m = assert_fault(
        e,
        tonic::Code::FailedPrecondition,
        "both as a file and as a directory",
    );
    assert!(m.contains("\"weights\""), "{m}");
    assert_eq!(
        twice.reads.load(Ordering::SeqCst) + nested.reads.load(Ordering::SeqCst),
        0
    );
}

/// A name with a control character is refused as sent, never published
/// under another name.
#[tokio::test]
async fn a_control_character_in_a_name_is_refused_not_dropped() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    for name in ["conf\u{1}ig.json", "a\tb", "line\nbreak", "x/\u{7f}"] {
        let src = Scripted::new("test://ctl").file(name, b"{}".to_vec()).arc();
        let e = refused(&root, src, EngineConfig::default()).await;
        assert_fault(e, tonic::Code::FailedPrecondition, &format!("{name:?}"));
    }
}

/// A model may list `a` and `a.part`: partial files live where no model
/// name can reach, so each file is sealed with the hash of its own bytes.
#[tokio::test]
async fn a_file_and_its_part_name_are_two_files() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let (slow, fast) = (noise(3 << 20, 1), noise(3 << 20, 2));
    let src = Scripted::new("test://part")
        .listed(
            "a",
            Some(slow.len() as u64),
            slow.clone(),
            Misbehave {
                delay: Some(Duration::from_millis(5)),
                ..Misbehave::default()
            },
        )
        .file("a.part", fast.clone())
        .arc();
    let p = pull(&root, src, EngineConfig::default()).await.unwrap();
    let sealed = sealed_files(&root, &p.sid);
    assert_eq!(sealed["a"], hex::encode(Sha256::digest(&slow)));
    assert_eq!(sealed["a.part"], hex::encode(Sha256::digest(&fast)));
    assert_eq!(sealed.len(), 2);
    assert!(
        !root
            .source(&p.sid)
            .data()
            .join(".modelcache-partial")
            .exists()
    );
}

/// Limits are judged from the listing, before any byte is fetched; a
/// StorageClass lowers them (maxModelBytes, maxModelFiles).
#[tokio::test]
async fn listings_over_the_limits_fetch_nothing() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(&t.path().join("state"));
    let many = Scripted::new("test://many")
        .file("a", vec![1])
        .file("b", vec![2])
        .file("c", vec![3])
        .arc();
    let cfg = EngineConfig {
        limits: PullLimits {
            max_files: 2,
            ..PullLimits::default()
        },
        ..EngineConfig::default()
    };
    let e = refused(&root, many.clone(), cfg).await;
    assert_fault(e, tonic::Code::ResourceExhausted, "--max-model-files");
    assert_eq!(many.reads.load(Ordering::SeqCst), 0);

    // Through the class: a file:// model of 3 MiB under maxModelBytes 1Mi.
    let dir = t.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("w.bin"), noise(3 << 20, 3)).unwrap();
    let mut opts = SourceOptions::default();
    opts.params.insert("maxModelBytes".into(), "1Mi".into());
    let src = puller::open(&format!("file://{}", dir.display()), &opts)
        .await
        .unwrap();
    let e = refused(&root, src, EngineConfig::default()).await;
    let m = assert_fault(e, tonic::Code::ResourceExhausted, "maxModelBytes");
    assert!(m.contains("1048576 bytes"), "{m}");
    opts.params.insert("maxModelBytes".into(), "lots".into());
    let e = puller::open(&format!("file://{}", dir.display()), &opts)
        .await
        .err()
        .unwrap();
    assert_fault(e, tonic::Code::InvalidArgument, "parameters.maxModelBytes");
}

// ------------------------------------------------------------ bodies

/// A body longer than the range asked for is the server's fault, for
/// ranged and for whole downloads (it was `Internal`, or retried as cut
/// short).
#[tokio::test]
async fn a_body_longer_than_asked_is_a_server_fault() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    for ranges in [true, false] {
        let mut src = Scripted::new(&format!("test://long-{ranges}")).listed(
            "w.bin",
            Some(3 << 20),
            noise(3 << 20, 4),
            Misbehave {
                extra: 10,
                ..Misbehave::default()
            },
        );
        src.ranges = ranges;
        let e = refused(&root, src.arc(), EngineConfig::default()).await;
        assert_fault(
            e,
            tonic::Code::FailedPrecondition,
            "sent more bytes than asked",
        );
        assert!(pull_dirs(&root).is_empty(), "{:?}", pull_dirs(&root));
    }
}

/// A file whose size is not listed is bounded while it streams.
#[tokio::test]
async fn an_unlisted_size_is_bounded_while_it_streams() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let mut src = Scripted::new("test://unlisted").listed(
        "w.bin",
        None,
        noise(8 << 20, 5),
        Misbehave::default(),
    );
    src.ranges = false;
    let cfg = EngineConfig {
        limits: PullLimits {
            max_bytes: 2 << 20,
            ..PullLimits::default()
        },
        ..EngineConfig::default()
    };
    let e = refused(&root, src.arc(), cfg).await;
    assert_fault(e, tonic::Code::ResourceExhausted, "--max-model-bytes");
    assert!(pull_dirs(&root).is_empty(), "{:?}", pull_dirs(&root));
}

/// The same revision listed later at a shorter size (a Content-Length
/// that changed under one strong ETag): the chunks recorded for the
/// longer file mean nothing, and the file is fetched again (it indexed
/// out of range before).
#[tokio::test]
async fn a_shorter_size_under_the_same_revision_refetches_the_file() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let long = noise(8 << 20, 6);
    let cfg = EngineConfig {
        connections: 1,
        files: 1,
        attempts: 1,
        ..EngineConfig::default()
    };
    let first = Scripted::new("test://etag").listed(
        "w.bin",
        Some(long.len() as u64),
        long.clone(),
        Misbehave {
            die_after: Some(5 << 20),
            ..Misbehave::default()
        },
    );
    // Five chunks are made durable and recorded, then the server dies.
    let e = pull(&root, first.arc(), cfg.clone()).await.err().unwrap();
    assert!(matches!(e, Error::Transient(_)), "{e:?}");
    assert_eq!(pull_dirs(&root).len(), 1, "resumable work is kept");
    let short = long[..(2 << 20) + 5].to_vec();
    let again = Scripted::new("test://etag")
        .file("w.bin", short.clone())
        .arc();
    let p = pull(&root, again, cfg).await.unwrap();
    assert_eq!(
        sealed_files(&root, &p.sid)["w.bin"],
        hex::encode(Sha256::digest(&short))
    );
}

/// A server sending a byte now and then is stalled, not slow: the stall
/// watchdog judges a rate over its window (it was reset by every byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_server_is_stalled() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("w.bin"), noise(4096, 7)).unwrap();
    let files = fixtures::FileServer::start(t.path()).await;
    files.trickle("w.bin", Duration::from_millis(400));
    let root = root_at(&t.path().join("state"));
    let src = puller::open(&files.url("w.bin"), &SourceOptions::default())
        .await
        .unwrap();
    let cfg = EngineConfig {
        stall: Duration::from_secs(1),
        stall_min_bytes_per_sec: 64,
        attempts: 2,
        ..EngineConfig::default()
    };
    let started = Instant::now();
    let e = refused(&root, src, cfg).await;
    assert_fault(e, tonic::Code::Unavailable, "stalled");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

// ------------------------------------------------------------ capacity

async fn seal_small(root: &Root, name: &str, cfg: &EngineConfig) -> cache::SourceId {
    let src = Scripted::new(&format!("test://{name}"))
        .file("w.bin", noise(2 << 20, name.len() as u64))
        .arc();
    pull(root, src, cfg.clone()).await.unwrap().sid
}

/// A model that could not fit even with every unused model gone is
/// refused before anything is evicted (every unused model went first).
#[tokio::test]
async fn a_model_that_can_never_fit_evicts_nothing() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let cfg = EngineConfig {
        capacity: BTreeMap::from([(Backend::Local, 7 << 20)]),
        ..EngineConfig::default()
    };
    let a = seal_small(&root, "a", &cfg).await;
    let b = seal_small(&root, "bb", &cfg).await;
    let huge = Scripted::new("test://huge")
        .file("w.bin", noise(9 << 20, 8))
        .arc();
    let e = refused(&root, huge.clone(), cfg).await;
    assert_fault(e, tonic::Code::ResourceExhausted, "nothing was evicted");
    assert_eq!(huge.reads.load(Ordering::SeqCst), 0);
    for sid in [&a, &b] {
        assert!(
            cache::read_seal(&root, sid).unwrap().is_some(),
            "{sid} was evicted"
        );
    }
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

/// A pull that filled the disk leaves nothing behind, and the partial
/// work of a pull nobody runs any more is reclaimed when room is needed:
/// later pulls do not fail for want of space (they all did).
#[tokio::test]
async fn a_full_disk_leaves_no_partial_work_that_blocks_later_pulls() {
    let t = tempfile::tempdir().unwrap();
    let fs = small_fs(&t.path().join("small"), 16);
    let root = root_at(&fs.0);
    // No size listed: nothing can be checked or reserved up front.
    let mut filler = Scripted::new("test://filler").listed(
        "w.bin",
        None,
        noise(32 << 20, 9),
        Misbehave::default(),
    );
    filler.ranges = false;
    let e = refused(&root, filler.arc(), EngineConfig::default()).await;
    assert_fault(e, tonic::Code::ResourceExhausted, "");
    assert!(pull_dirs(&root).is_empty(), "{:?}", pull_dirs(&root));
    let next = Scripted::new("test://next")
        .file("w.bin", noise(10 << 20, 10))
        .arc();
    pull(&root, next, EngineConfig::default()).await.unwrap();

    // An abandoned pull (its lock is free) holding most of the disk.
    let fs2 = small_fs(&t.path().join("small2"), 16);
    let root2 = root_at(&fs2.0);
    let stale = root2.sources_dir().join(".pull-mabandoned");
    std::fs::create_dir_all(stale.join("partial")).unwrap();
    std::fs::write(stale.join("lock"), b"").unwrap();
    std::fs::write(stale.join("partial/x.part"), noise(10 << 20, 11)).unwrap();
    let next = Scripted::new("test://next2")
        .file("w.bin", noise(10 << 20, 12))
        .arc();
    pull(&root2, next, EngineConfig::default()).await.unwrap();
    assert!(!stale.exists(), "the abandoned work was not reclaimed");
}

// ------------------------------------------------------------ layers

/// A streaming sha256 writer, for the diff_id of a layer never held whole.
struct Hashing<W>(W, Sha256);
impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(b)?;
        self.1.update(&b[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// A tar holding one entry of `kind` with `size` bytes of `fill`, then a
/// small file, gzip- or zstd-compressed as it is built; with its diff_id.
fn bomb(kind: tar::EntryType, size: u64, fill: u8, c: Compression) -> (Vec<u8>, String) {
    fn build<W: Write>(w: W, kind: tar::EntryType, size: u64, fill: u8) -> Hashing<W> {
        let mut b = tar::Builder::new(Hashing(w, Sha256::new()));
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_path("bomb").unwrap();
        h.set_cksum();
        b.append(&h, std::io::Read::take(std::io::repeat(fill), size))
            .unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(1);
        h.set_mode(0o644);
        b.append_data(&mut h, "after", &b"x"[..]).unwrap();
        b.into_inner().unwrap()
    }
    match c {
        Compression::Gzip => {
            let enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            let h = build(enc, kind, size, fill);
            (
                h.0.finish().unwrap(),
                format!("sha256:{}", hex::encode(h.1.finalize())),
            )
        }
        _ => {
            let enc = zstd::Encoder::new(Vec::new(), 3).unwrap();
            let h = build(enc, kind, size, fill);
            (
                h.0.finish().unwrap(),
                format!("sha256:{}", hex::encode(h.1.finalize())),
            )
        }
    }
}

/// Gzip and zstd bombs of zeros stop at the model's byte limit, and a
/// layer of many tiny entries at its file limit; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_bombs_stop_at_the_limits() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let cfg = EngineConfig {
        limits: PullLimits {
            max_bytes: 64 << 20,
            max_files: 1000,
        },
        ..EngineConfig::default()
    };
    for c in [Compression::Gzip, Compression::Zstd] {
        let (blob, _) = bomb(tar::EntryType::Regular, 1 << 30, 0, c);
        let src = Scripted::new(&format!("test://bomb-{c:?}"))
            .layer(blob, c)
            .arc();
        let e = refused(&root, src, cfg.clone()).await;
        let m = assert_fault(e, tonic::Code::ResourceExhausted, "unpacks to more than");
        assert!(m.contains("--max-model-bytes"), "{m}");
        assert!(pull_dirs(&root).is_empty(), "{:?}", pull_dirs(&root));
    }
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for i in 0..20_000 {
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o644);
        b.append_data(&mut h, format!("d/{i}"), std::io::empty())
            .unwrap();
    }
    let blob = b.into_inner().unwrap().finish().unwrap();
    let src = Scripted::new("test://many-entries")
        .layer(blob, Compression::Gzip)
        .arc();
    let e = refused(&root, src, cfg).await;
    assert_fault(e, tonic::Code::ResourceExhausted, "more than 1000 entries");
    assert!(pull_dirs(&root).is_empty(), "{:?}", pull_dirs(&root));
}

// ------------------------------------------------------------ a fake S3

fn s3_listing(keys: &[(&str, u64)]) -> Vec<u8> {
    let mut x = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\
         <ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Name>models</Name><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>\
         <IsTruncated>false</IsTruncated>",
    );
    for (k, size) in keys {
        x.push_str(&format!(
            "<Contents><Key>{k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>\
             <ETag>\"0123456789abcdef\"</ETag><Size>{size}</Size>\
             <StorageClass>STANDARD</StorageClass></Contents>"
        ));
    }
    x.push_str("</ListBucketResult>");
    x.into_bytes()
}

fn s3_options(base: &str) -> SourceOptions {
    let mut o = SourceOptions::default();
    o.params.insert("s3Endpoint".into(), base.into());
    o.params.insert("s3PathStyle".into(), "true".into());
    o.secrets.insert("awsAccessKeyID".into(), "test".into());
    o.secrets
        .insert("awsSecretAccessKey".into(), "test-secret".into());
    o
}

/// A fake S3 listing keys outside the requested prefix: refused, naming
/// the key (one sliced inside a UTF-8 character panicked the pull; an
/// ASCII one was published under a mangled name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_keys_outside_the_prefix_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    for key in ["modelsab\u{20ac}x/weights", "models/other-model/weights"] {
        let listing = s3_listing(&[("models/m/config.json", 2), (key, 3)]);
        let server = fixtures::ScriptServer::start(move |req| {
            if req.param("list-type").is_some() {
                fixtures::Reply::new(200)
                    .header("Content-Type", "application/xml")
                    .body(listing.clone())
            } else {
                fixtures::Reply::new(404)
            }
        })
        .await;
        let src = puller::open("s3://models/models/m", &s3_options(&server.base()))
            .await
            .unwrap();
        let e = refused(&root, src, EngineConfig::default()).await;
        let m = assert_fault(
            e,
            tonic::Code::FailedPrecondition,
            "not under the requested prefix",
        );
        assert!(m.contains(&format!("{key:?}")), "{m}");
    }
}

/// A fake S3 answering a ranged GET with 200 and the whole object: the
/// server's fault, not `Internal`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_200_to_a_range_request_is_a_server_fault() {
    let t = tempfile::tempdir().unwrap();
    let root = root_at(t.path());
    let object = Arc::new(noise(3 << 20, 13));
    let size = object.len() as u64;
    let listing = s3_listing(&[("m/w.bin", size)]);
    let server = fixtures::ScriptServer::start(move |req| {
        if req.param("list-type").is_some() {
            return fixtures::Reply::new(200)
                .header("Content-Type", "application/xml")
                .body(listing.clone());
        }
        fixtures::Reply::new(200)
            .header("ETag", "\"0123456789abcdef\"")
            .header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
            .body(object.to_vec())
    })
    .await;
    let src = puller::open("s3://models/m", &s3_options(&server.base()))
        .await
        .unwrap();
    let e = refused(&root, src, EngineConfig::default()).await;
    assert_fault(e, tonic::Code::FailedPrecondition, "m/w.bin");
}

// ------------------------------------------------------------ the driver's memory

/// The driver's peak resident memory (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// The manifest limit in docs and deploy: the driver must stay well under it.
const RSS_LIMIT: u64 = 256 << 20;

/// Against a 1 GiB PAX header, a 1 GiB gzip bomb of zeros, and a Hub API
/// answering with 512 MiB of JSON, the spawned driver answers each with a
/// clear error and its memory never grows past RSS_LIMIT (the header and
/// the JSON were buffered whole before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_stays_small_against_bombs() {
    use crate::support::harness::*;
    let t = tempfile::tempdir().unwrap();
    // 512 MiB of JSON that costs the fixture nothing: a sparse file.
    let sparse = t.path().join("huge.json");
    let f = std::fs::File::create(&sparse).unwrap();
    f.set_len(512 << 20).unwrap();
    drop(f);
    let hub = fixtures::ScriptServer::start(move |_| {
        fixtures::Reply::new(200)
            .header("Content-Type", "application/json")
            .file(sparse.clone(), 0, 512 << 20)
    })
    .await;

    let reg = registry::Registry::start().await;
    let (pax, pax_diff) = bomb(tar::EntryType::XHeader, 1 << 30, b'a', Compression::Gzip);
    reg.push_image(
        "evil/pax:v1",
        vec![registry::TarLayer {
            blob: pax,
            diff_id: pax_diff,
        }],
        "amd64",
    )
    .await;
    let (zeros, zeros_diff) = bomb(tar::EntryType::Regular, 1 << 30, 0, Compression::Gzip);
    reg.push_image(
        "evil/zeros:v1",
        vec![registry::TarLayer {
            blob: zeros,
            diff_id: zeros_diff,
        }],
        "amd64",
    )
    .await;

    let d = Driver::start_with(&["--max-model-bytes", "256Mi"]).await;
    let before = peak_rss(d.pid());
    let create = |name: &'static str, params: Vec<(&'static str, String)>| {
        let mut all: Vec<(&str, &str)> = vec![("backend", "local")];
        all.extend(params.iter().map(|(k, v)| (*k, v.as_str())));
        let req = create_req(name, &all, READER);
        let d = &d;
        async move { d.create(req).await }
    };
    let r = create(
        "pvc-pax",
        vec![
            ("source", reg.uri("evil/pax:v1")),
            ("ociPlainHTTP", "true".into()),
        ],
    )
    .await;
    assert_code(r, tonic::Code::FailedPrecondition, "tar metadata");
    let r = create(
        "pvc-zeros",
        vec![
            ("source", reg.uri("evil/zeros:v1")),
            ("ociPlainHTTP", "true".into()),
        ],
    )
    .await;
    assert_code(r, tonic::Code::ResourceExhausted, "unpacks to more than");
    let r = create(
        "pvc-hub",
        vec![
            ("source", "hf://org/model".into()),
            ("hfEndpoint", hub.base()),
        ],
    )
    .await;
    assert_code(r, tonic::Code::FailedPrecondition, "larger than");
    let peak = peak_rss(d.pid());
    assert!(
        peak < RSS_LIMIT,
        "the driver's peak RSS grew from {} to {} MiB",
        before >> 20,
        peak >> 20
    );
    eprintln!(
        "driver peak RSS: {} MiB before, {} MiB after the bombs",
        before >> 20,
        peak >> 20
    );
}
