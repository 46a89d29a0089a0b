//! A progressive volume's FUSE view, through the real kernel: the whole
//! tree before any byte, reads that wait for their file's verdict and then
//! return exact bytes, EIO for a failed file that heals when fetched again,
//! a bounded wait, page faults turned into large reads, no writes.
//!
//! The verdicts come from the test (standing for the pull's verifier),
//! which writes each file's bytes into the backing directory first, as the
//! fill would. Wiring the fill and CSI to it is issue #24's next step.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use modelcache_csi::progressive::fuse::{Volume, serve};
use modelcache_csi::progressive::gate::Gates;
use modelcache_csi::progressive::tree::Tree;

use crate::support::fixtures::pseudo_random;

/// The mounted view, unmounted (lazily) however the test ends.
struct Mounted {
    dir: tempfile::TempDir,
    vol: Arc<Volume>,
    /// The FUSE connection's number, to abort it if a test leaves readers
    /// blocked.
    conn: u64,
    server: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl Mounted {
    fn mnt(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }
    fn backing(&self) -> PathBuf {
        self.dir.path().join("backing")
    }
    /// The fill: the file's bytes land, then its verdict.
    fn arrive(&self, index: usize, rel: &str, bytes: &[u8]) {
        let p = self.backing().join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
        self.vol.gates.verified(index);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.mnt(), nix::mount::MntFlags::MNT_DETACH);
        // A failed test may leave readers blocked in the view, which keeps
        // the detached connection (and so the server) alive. The process
        // could then never exit: its readers wait in the kernel for answers
        // from a server that exiting kills. So after a little while the
        // connection is aborted (fusectl), which fails them all.
        if let Some(s) = self.server.take() {
            let until = Instant::now() + Duration::from_secs(2);
            while !s.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !s.is_finished() {
                abort_connection(self.conn);
            }
            let until = Instant::now() + Duration::from_secs(2);
            while !s.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if s.is_finished() {
                let _ = s.join();
            }
        }
    }
}

/// The FUSE connection behind the mount at `mnt`: its device's minor.
fn connection_of(mnt: &Path) -> u64 {
    let dev = fs::metadata(mnt).expect("stat the FUSE root").dev();
    nix::sys::stat::minor(dev)
}

/// Aborts FUSE connection `conn` (the minor of the mount's device).
fn abort_connection(conn: u64) {
    let ctl = Path::new("/sys/fs/fuse/connections");
    if !ctl.join(conn.to_string()).exists() {
        let _ = nix::mount::mount(
            Some("fusectl"),
            ctl,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    let _ = fs::write(ctl.join(conn.to_string()).join("abort"), "1");
}

fn mount(files: &[(&str, u64)], wait_bound: Duration) -> Mounted {
    mount_named(files, wait_bound, "pv-server")
}

/// As `mount`, with the server's thread named `name` (at most 15 bytes, the
/// kernel's limit), so that threads it spawns, which inherit the name, can
/// be counted.
fn mount_named(files: &[(&str, u64)], wait_bound: Duration, name: &str) -> Mounted {
    let dir = tempfile::tempdir().unwrap();
    for d in ["mnt", "backing"] {
        fs::create_dir(dir.path().join(d)).unwrap();
    }
    let listing: Vec<(String, u64)> = files.iter().map(|(p, s)| (p.to_string(), *s)).collect();
    let vol = Arc::new(Volume::new(
        Arc::new(Tree::new(&listing).unwrap()),
        Arc::new(Gates::new(files.len())),
        vec![dir.path().join("backing")],
        wait_bound,
    ));
    let dev = modelcache_csi::mount::fuse::mount_fuse(&dir.path().join("mnt"), "modelcache")
        .expect("mount FUSE (root and /dev/fuse)");
    let v = vol.clone();
    let server = Some(
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(dev, v))
            .unwrap(),
    );
    let conn = connection_of(&dir.path().join("mnt"));
    Mounted {
        dir,
        vol,
        conn,
        server,
    }
}

/// Reads `path` whole on another thread; returns its bytes (or error) and
/// when it finished.
fn read_later(path: PathBuf) -> std::thread::JoinHandle<(std::io::Result<Vec<u8>>, Instant)> {
    std::thread::spawn(move || {
        let r = fs::read(&path);
        (r, Instant::now())
    })
}

#[test]
fn reads_wait_for_their_verdict_and_never_see_an_unverified_byte() {
    let weights = pseudo_random(1, 3 << 20);
    let files = [
        ("config.json", 2),
        ("model-00001.safetensors", weights.len() as u64),
        ("tokenizer/vocab.txt", 5),
    ];
    let m = mount(&files, Duration::from_secs(30));
    let mnt = m.mnt();

    // The whole tree and every final size, before any byte has arrived.
    let mut names: Vec<_> = fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["config.json", "model-00001.safetensors", "tokenizer"]
    );
    assert_eq!(
        fs::metadata(mnt.join("model-00001.safetensors"))
            .unwrap()
            .len(),
        weights.len() as u64
    );
    let meta = fs::metadata(mnt.join("tokenizer/vocab.txt")).unwrap();
    assert_eq!((meta.len(), meta.mode() & 0o7777), (5, 0o444));
    assert!(fs::metadata(mnt.join("tokenizer")).unwrap().is_dir());
    assert!(fs::metadata(mnt.join("nope")).is_err());

    // A reader of the weights waits; bytes landing without a verdict do not
    // release it (never an unverified byte).
    let reader = read_later(mnt.join("model-00001.safetensors"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!reader.is_finished(), "a read returned before any verdict");
    let p = m.backing().join("model-00001.safetensors");
    fs::write(&p, &weights[..1 << 20]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!reader.is_finished(), "a read returned unverified bytes");
    assert_eq!(
        m.vol.gates.asked(),
        [1],
        "the fill hears which file is wanted"
    );
    fs::write(&p, &weights).unwrap();
    let verdict = Instant::now();
    m.vol.gates.verified(1);
    let (got, done) = reader.join().unwrap();
    assert!(done >= verdict);
    assert!(
        got.unwrap() == weights,
        "the bytes read are the verified ones"
    );

    // Other files were readable meanwhile, and stay pending on their own.
    m.arrive(0, "config.json", b"{}");
    assert_eq!(fs::read(mnt.join("config.json")).unwrap(), b"{}");

    // Writes are refused by the kernel: the mount is read-only.
    let e = fs::OpenOptions::new()
        .write(true)
        .open(mnt.join("config.json"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
}

/// Reads `path` whole with O_DIRECT, 1 MiB at a time into a page-aligned
/// buffer, as fastsafetensors and direct-I/O loaders do.
fn direct_read(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    const CHUNK: usize = 1 << 20;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let layout = std::alloc::Layout::from_size_align(CHUNK, 4096).unwrap();
    // SAFETY: the layout is non-zero; the buffer is freed below and only
    // read through the slice while it lives.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, CHUNK) };
    let mut out = Vec::new();
    let done = loop {
        match f.read_at(buf, out.len() as u64) {
            Ok(0) => break Ok(()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => break Err(e),
        }
    };
    unsafe { std::alloc::dealloc(ptr, layout) };
    done.map(|()| out)
}

/// O_DIRECT through the view (issue #45 item 3): a direct read of a verified
/// file returns its bytes; of a pending file it waits for the verdict as a
/// buffered read does, and then returns exactly the verified bytes.
#[test]
fn a_direct_reader_of_the_view_waits_like_a_buffered_one() {
    let (a, b) = (
        pseudo_random(11, 4 << 20),
        pseudo_random(12, (3 << 20) + 4321),
    );
    let files = [
        ("a.safetensors", a.len() as u64),
        ("b.safetensors", b.len() as u64),
    ];
    let m = mount(&files, Duration::from_secs(30));
    m.arrive(0, "a.safetensors", &a);
    assert!(
        direct_read(&m.mnt().join("a.safetensors")).expect("O_DIRECT read of a verified file") == a,
        "a direct read of a verified file returned other bytes"
    );

    let path = m.mnt().join("b.safetensors");
    let reader = std::thread::spawn(move || (direct_read(&path), Instant::now()));
    // The reader's request reaches the view however loaded the machine is.
    let until = Instant::now() + Duration::from_secs(10);
    while m.vol.gates.asked().is_empty() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        m.vol.gates.asked(),
        [1],
        "the fill hears which file is wanted"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !reader.is_finished(),
        "a direct read returned before any verdict"
    );
    let p = m.backing().join("b.safetensors");
    fs::write(&p, &b).unwrap();
    let verdict = Instant::now();
    m.vol.gates.verified(1);
    let (got, done) = reader.join().unwrap();
    assert!(done >= verdict);
    assert!(
        got.expect("O_DIRECT read once verified") == b,
        "a direct read returned other bytes than the verified ones"
    );
}

#[test]
fn a_failed_file_reads_eio_and_heals_when_fetched_again() {
    let m = mount(&[("a.bin", 5), ("b.bin", 3)], Duration::from_secs(30));
    let reader = read_later(m.mnt().join("a.bin"));
    std::thread::sleep(Duration::from_millis(100));
    // The fill wrote wrong bytes; the verifier says so.
    fs::write(m.backing().join("a.bin"), b"WRONG").unwrap();
    m.vol.gates.failed(0, "sha256 mismatch");
    let (got, _) = reader.join().unwrap();
    assert_eq!(got.unwrap_err().raw_os_error(), Some(libc::EIO));
    // Other files are unaffected.
    m.arrive(1, "b.bin", b"bbb");
    assert_eq!(fs::read(m.mnt().join("b.bin")).unwrap(), b"bbb");
    // Fetched again: pending, then right.
    m.vol.gates.refetching(0);
    let reader = read_later(m.mnt().join("a.bin"));
    std::thread::sleep(Duration::from_millis(100));
    assert!(!reader.is_finished());
    m.arrive(0, "a.bin", b"right");
    assert_eq!(reader.join().unwrap().0.unwrap(), b"right");
}

#[test]
fn a_stalled_fill_answers_eio_within_the_bound() {
    let m = mount(&[("stuck.bin", 10)], Duration::from_millis(500));
    let t = Instant::now();
    let e = fs::read(m.mnt().join("stuck.bin")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(10),
        "{took:?}"
    );
}

/// A reader parked on a file still arriving can always be killed: the
/// kernel sends FUSE_INTERRUPT for the request the daemon holds, which is
/// answered EINTR at once. Before, SIGKILL left the reader in D state
/// (request_wait_answer) until the file's verdict or the wait bound: a pod
/// stuck Terminating.
#[test]
fn a_reader_parked_on_a_pending_file_can_be_killed() {
    let m = mount(&[("pending.bin", 4096)], Duration::from_secs(120));
    for tool in [["cat", ""], ["dd", "bs=4096"]] {
        let mut cmd = std::process::Command::new(tool[0]);
        match tool[0] {
            "cat" => cmd.arg(m.mnt().join("pending.bin")),
            _ => cmd
                .arg(format!("if={}", m.mnt().join("pending.bin").display()))
                .arg(tool[1])
                .arg("of=/dev/null"),
        };
        let mut child = cmd.spawn().unwrap();
        let parked = Instant::now() + Duration::from_secs(10);
        while m.vol.parked.load(Ordering::Relaxed) == 0 {
            assert!(
                Instant::now() < parked,
                "{}: the open was never parked",
                tool[0]
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().unwrap();
        let died = Instant::now() + Duration::from_secs(5);
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            assert!(
                Instant::now() < died,
                "{}: a killed reader of a pending file did not die (D state)",
                tool[0]
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let answered = Instant::now() + Duration::from_secs(5);
        while m.vol.parked.load(Ordering::Relaxed) != 0 {
            assert!(
                Instant::now() < answered,
                "the interrupted request stayed parked"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The file still reads once it arrives.
    let body = pseudo_random(7, 4096);
    m.arrive(0, "pending.bin", &body);
    assert!(fs::read(m.mnt().join("pending.bin")).unwrap() == body);
}

/// Threads of this process named `name`.
fn threads_named(name: &str) -> usize {
    fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim_end() == name)
        .count()
}

/// Many pods starting at once on a slow fill: their READs are parked,
/// each an entry, not a thread; one waker answers them as their files are
/// verified, each with its own bytes.
#[test]
fn readers_waiting_on_a_slow_fill_are_parked_not_given_threads() {
    let n = 100;
    let names: Vec<String> = (0..n).map(|i| format!("shard-{i:03}.bin")).collect();
    let bodies: Vec<Vec<u8>> = (0..n).map(|i| pseudo_random(i as u64, 8192)).collect();
    let files: Vec<(&str, u64)> = names.iter().map(|f| (f.as_str(), 8192)).collect();
    let m = mount_named(&files, Duration::from_secs(60), "pv-parked");
    let readers: Vec<_> = names.iter().map(|f| read_later(m.mnt().join(f))).collect();
    // As many as the kernel lets through at once (it queues the rest).
    let (mut last, mut steady) = (0, Instant::now());
    let until = Instant::now() + Duration::from_secs(20);
    while steady.elapsed() < Duration::from_millis(500) && Instant::now() < until {
        let now = m.vol.parked.load(Ordering::Relaxed);
        if now != last {
            (last, steady) = (now, Instant::now());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(last >= 32, "only {last} READs reached the server");
    assert_eq!(
        threads_named("pv-parked"),
        1,
        "{last} parked READs: the server spawned threads for them"
    );
    for i in (0..n).rev() {
        m.arrive(i, &names[i], &bodies[i]);
    }
    for (i, r) in readers.into_iter().enumerate() {
        let got = r.join().unwrap().0.unwrap();
        assert!(got == bodies[i], "{}: wrong bytes", names[i]);
    }
    assert_eq!(m.vol.parked.load(Ordering::Relaxed), 0);
}

/// safetensors readers mmap their shards: each page fault must become a
/// large READ (the kernel's readahead, up to 1 MiB), not one per 4 KiB page.
#[test]
fn page_faults_of_an_mmap_reader_become_large_reads() {
    let bytes = pseudo_random(7, 8 << 20);
    let m = mount(
        &[("shard.safetensors", bytes.len() as u64)],
        Duration::from_secs(30),
    );
    // A file opened pending waits for its verdict and is then read by
    // passthrough (the kernel's own page cache). Through the daemon: one
    // opened while it had failed (direct io), then fetched again.
    m.vol.gates.failed(0, "sha256 mismatch");
    let opened = fs::File::open(m.mnt().join("shard.safetensors")).unwrap();
    m.vol.gates.refetching(0);
    let mapped = std::thread::spawn(move || {
        let bytes = mmap_file(&opened);
        (bytes.iter().map(|b| *b as u64).sum::<u64>(), bytes.len())
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !mapped.is_finished(),
        "a page fault was served before a verdict"
    );
    m.arrive(0, "shard.safetensors", &bytes);
    let (sum, len) = mapped.join().unwrap();
    assert_eq!(len, bytes.len());
    assert_eq!(sum, bytes.iter().map(|b| *b as u64).sum::<u64>());
    let (reads, read) = (
        m.vol.reads.load(Ordering::Relaxed),
        m.vol.read_bytes.load(Ordering::Relaxed),
    );
    assert!(read >= bytes.len() as u64, "{read}");
    let pages = bytes.len() as u64 / 4096;
    assert!(
        reads * 16 <= pages,
        "{reads} READs for {pages} pages: page faults are not turned into large reads"
    );
}

/// The bytes of `path` read through a shared mapping: page faults, not
/// read(2).
pub fn mmap_bytes(path: &Path) -> Vec<u8> {
    mmap_file(&fs::File::open(path).unwrap())
}

fn mmap_file(f: &fs::File) -> Vec<u8> {
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a read-only mapping of a file nobody truncates while mapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping is `len` readable bytes until munmap below.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec();
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(p, len) };
    bytes
}

/// A real pull in progress, as a progressive stage finds it: the engine
/// fetching a model of a config and four 6 MiB shards over paced HTTP in
/// listing order, its area, its partial view, and the FUSE view following
/// it.
struct PacedPull {
    m: Mounted,
    listing: Vec<(String, u64)>,
    shards: Vec<Vec<u8>>,
    pull: tokio::task::JoinHandle<
        modelcache_csi::error::Result<modelcache_csi::puller::engine::Pulled>,
    >,
    partial: Arc<modelcache_csi::cache::partial::Partial>,
    sid: modelcache_csi::cache::SourceId,
    started: Instant,
    _server: crate::support::fixtures::FileServer,
}

async fn paced_pull() -> PacedPull {
    paced_pull_with(|_| {}).await
}

/// As [`paced_pull`], with `faults` set on the origin before the pull
/// starts.
async fn paced_pull_with(faults: impl FnOnce(&crate::support::fixtures::FileServer)) -> PacedPull {
    use crate::support::fixtures::{self, FileServer};
    use modelcache_csi::config::{Config, EngineConfig};
    use modelcache_csi::puller::SourceOptions;
    use modelcache_csi::puller::engine::{Engine, NoProgress};

    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("model");
    fs::create_dir_all(&model).unwrap();
    let shards: Vec<Vec<u8>> = (0..4).map(|i| pseudo_random(20 + i, 6 << 20)).collect();
    fs::write(model.join("config.json"), b"{\"layers\": 4}").unwrap();
    for (i, s) in shards.iter().enumerate() {
        fs::write(
            model.join(format!("model-0000{}-of-00004.safetensors", i + 1)),
            s,
        )
        .unwrap();
    }
    let server = FileServer::start(&model).await;
    server.put("m.json", fixtures::manifest_for(&model, true));
    // Two connections of 6 MiB/s: about 2 s for the 24 MiB.
    server.throttle(6 << 20);
    faults(&server);
    let uri = format!("{}#manifest", server.url("m.json"));
    let source = modelcache_csi::puller::open(&uri, &SourceOptions::default())
        .await
        .unwrap();
    let listing: Vec<(String, u64)> = source
        .resolve()
        .await
        .unwrap()
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size.unwrap()))
        .collect();
    assert_eq!(listing[0].0, "config.json");
    let root = modelcache_csi::cache::Roots::of(&Config::for_node("n", &t.path().join("state")))
        .roots
        .remove(0);
    let engine = Engine::new(
        EngineConfig {
            listing_order: true,
            chunk_bytes: 1 << 20,
            connections: 2,
            ..EngineConfig::default()
        },
        modelcache_csi::puller::extract_layer,
    );
    let started = Instant::now();
    let r = root.clone();
    let pull = tokio::spawn(async move { engine.pull(&r, source, &NoProgress).await });

    let sid = loop {
        let names: Vec<String> = fs::read_dir(root.sources_dir())
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(n) = names.iter().find_map(|n| n.strip_prefix(".pull-")) {
            break modelcache_csi::cache::SourceId::parse(n).unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no pull area");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let partial = loop {
        if let Some(p) = root.pulls.get(&sid) {
            break p;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no partial view"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let dir = t.path().join("mnt");
    fs::create_dir(&dir).unwrap();
    let tree = Arc::new(Tree::new(&listing).unwrap());
    let gates = Arc::new(Gates::new(listing.len()));
    modelcache_csi::progressive::follow(&partial, &tree, &gates);
    let area_data = root.sources_dir().join(format!(".pull-{sid}")).join("data");
    let vol = Arc::new(Volume::new(
        tree,
        gates,
        vec![area_data, root.source(&sid).data()],
        Duration::from_secs(60),
    ));
    let dev = modelcache_csi::mount::fuse::mount_fuse(&dir, "modelcache").unwrap();
    let v = vol.clone();
    let server_thread = std::thread::spawn(move || serve(dev, v));
    let m = Mounted {
        conn: connection_of(&dir),
        dir: t,
        vol,
        server: Some(server_thread),
    };
    assert_eq!(m.mnt(), dir);
    PacedPull {
        m,
        listing,
        shards,
        pull,
        partial,
        sid,
        started,
        _server: server,
    }
}

/// The serving half on a real pull: the engine fetches a model over HTTP
/// (paced) in listing order, each file's gate opens as the engine verifies
/// it, and a reader of the shards in order reads the first one while the
/// pull still fetches the rest (how long before its end is printed), every
/// byte exact, the last ones after the seal moved the area into place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_in_listing_order_opens_each_shard_as_it_is_verified() {
    let p = paced_pull().await;
    let (mnt, started) = (p.m.mnt(), p.started);
    // The "inference server": reads every shard in order, timing each and
    // noting whether every file was verified when the read returned.
    let reader = {
        let (mnt, listing, partial) = (mnt.clone(), p.listing.clone(), p.partial.clone());
        std::thread::spawn(move || {
            listing
                .iter()
                .map(|(p, _)| {
                    let bytes = fs::read(mnt.join(p));
                    (p.clone(), bytes, started.elapsed(), partial.all_verified())
                })
                .collect::<Vec<_>>()
        })
    };
    let pulled = p.pull.await.unwrap().expect("the pull seals");
    let pull_took = started.elapsed();
    assert_eq!(pulled.sid, p.sid);
    let read = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    for (i, (path, bytes, _, _)) in read.iter().enumerate() {
        let bytes = bytes.as_ref().unwrap_or_else(|e| panic!("{path}: {e}"));
        if i > 0 {
            assert!(*bytes == p.shards[i - 1], "{path}: wrong bytes");
        }
    }
    let (first_shard, all_verified_then) = (read[1].2, read[1].3);
    eprintln!("first shard read at {first_shard:?} of a {pull_took:?} pull");
    assert!(
        !all_verified_then,
        "the first shard was read only once every file was verified (at {first_shard:?} of a {pull_took:?} pull)"
    );
}

/// A reader that wants the last shard first (a loader that opens the
/// index's last file, say): its READ moves that shard to the front of the
/// fill, which verifies it before the shards listed ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_a_file_far_down_the_listing_jumps_the_fill_queue() {
    let p = paced_pull().await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let order = order.clone();
        p.partial.subscribe(Box::new(move |path, _| {
            order.lock().unwrap().push(path.to_string())
        }));
    }
    let last = p.listing.last().unwrap().0.clone();
    let reader = {
        let (path, started, partial) = (p.m.mnt().join(&last), p.started, p.partial.clone());
        std::thread::spawn(move || {
            let bytes = fs::read(path);
            (bytes, started.elapsed(), partial.all_verified())
        })
    };
    let pulled = p.pull.await.unwrap().expect("the pull seals");
    let pull_took = p.started.elapsed();
    assert_eq!(pulled.sid, p.sid);
    let (bytes, at, all_verified_then) =
        tokio::task::spawn_blocking(move || reader.join().unwrap())
            .await
            .unwrap();
    assert!(bytes.unwrap() == p.shards[3], "{last}: wrong bytes");
    let order = order.lock().unwrap().clone();
    let pos = |name: &str| order.iter().position(|p| p == name).unwrap();
    eprintln!("verified in order {order:?}; {last} read at {at:?} of a {pull_took:?} pull");
    assert!(
        pos(&last) < pos(&p.listing[2].0),
        "the wanted shard did not jump the queue: {order:?}"
    );
    // And it was read while the pull still fetched the shards it jumped
    // (how long before the pull's end is the machine's figure, printed).
    assert!(
        !all_verified_then,
        "{last} was read only once every file was verified (at {at:?} of a {pull_took:?} pull)"
    );
}

/// Drops `path`'s cached pages, so a timed read of it comes from the disk.
/// Only this file's: dropping the whole page cache would slow every test
/// running beside this one (the peer fan-out's timing above all).
fn drop_cached(path: &Path) {
    let f = fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: advice on a descriptor we own; no memory is passed.
    let r = unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    assert_eq!(r, 0, "posix_fadvise");
}

/// Reads `path` whole in 1 MiB reads; returns the time it took.
fn timed_read(path: &Path) -> Duration {
    let mut f = fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    while f.read(&mut buf).unwrap() > 0 {}
    t.elapsed()
}

/// Once verified, a file is read by the kernel itself (FUSE passthrough):
/// no READ reaches the daemon, so a cold sequential read runs at the speed
/// of reading the backing file directly (both timed and printed; the disk
/// is shared with whatever else runs, so the ratio is not asserted: the
/// daemon's READ count is the claim). A file opened through the
/// daemon while it was pending keeps that mode, and a later open of it
/// still reads right.
#[test]
fn a_verified_file_is_read_by_passthrough_at_the_speed_of_its_backing_file() {
    let size = 256 << 20;
    let m = mount(
        &[("big.bin", size as u64), ("pending.bin", 4)],
        Duration::from_secs(30),
    );
    let bytes = pseudo_random(3, size);
    m.arrive(0, "big.bin", &bytes);
    let mut through_view = Vec::new();
    let mut direct = Vec::new();
    // Passthrough reads the backing file's own pages: dropping those makes
    // both reads cold.
    let backing = m.backing().join("big.bin");
    for _ in 0..3 {
        drop_cached(&backing);
        through_view.push(timed_read(&m.mnt().join("big.bin")));
        drop_cached(&backing);
        direct.push(timed_read(&backing));
    }
    assert_eq!(
        m.vol.reads.load(Ordering::Relaxed),
        0,
        "READs reached the daemon: no passthrough"
    );
    assert!(fs::read(m.mnt().join("big.bin")).unwrap() == bytes);
    // Replicas read one shard at once: every open of a verified file is
    // passthrough, each with its own backing id, and the kernel takes them.
    let opened: Vec<fs::File> = (0..4)
        .map(|_| fs::File::open(m.mnt().join("big.bin")).unwrap())
        .collect();
    for f in &opened {
        let mut b = vec![0u8; 4096];
        f.read_exact_at(&mut b, 4096).unwrap();
        assert!(b[..] == bytes[4096..8192]);
    }
    drop(opened);
    through_view.sort();
    direct.sort();
    let ratio = through_view[1].as_secs_f64() / direct[1].as_secs_f64();
    eprintln!("passthrough {through_view:?} direct {direct:?} ratio {ratio:.2}");

    // Opened while pending: the open waits for the verdict, and the file
    // is then read by passthrough like any verified one (a handle opened
    // through the daemon would carry all its reads).
    let opener = std::thread::spawn({
        let p = m.mnt().join("pending.bin");
        move || fs::File::open(p)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !opener.is_finished(),
        "an open of a pending file returned before its verdict"
    );
    m.arrive(1, "pending.bin", b"late");
    let mut held = opener.join().unwrap().unwrap();
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "late");
    assert_eq!(
        m.vol.reads.load(Ordering::Relaxed),
        0,
        "the file opened while pending was read through the daemon"
    );
}

/// The origin corrupts a shard's first byte: a reader of that shard never
/// sees the wrong bytes. Once, and the pull fetches the file again and the
/// reader (waiting through it) gets the exact bytes; every time, and after
/// its re-fetches the pull gives up, the reader gets EIO, and other shards
/// read right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_the_origin_corrupts_are_never_read_and_heal_when_fetched_again() {
    const SHARD: &str = "model-00002-of-00004.safetensors";
    for (times, heals) in [(1, true), (usize::MAX, false)] {
        let p = paced_pull_with(|s| s.corrupt_first_byte(SHARD, times)).await;
        let reader = {
            let path = p.m.mnt().join(SHARD);
            std::thread::spawn(move || fs::read(path))
        };
        let pulled = p.pull.await.unwrap();
        let ended = Instant::now();
        let read = tokio::task::spawn_blocking(move || reader.join().unwrap())
            .await
            .unwrap();
        // Told, not timed out: the view's bound is 60 s.
        assert!(
            ended.elapsed() < Duration::from_secs(5),
            "the reader waited on after the pull ended"
        );
        if heals {
            pulled.expect("the pull seals after fetching the shard again");
            assert!(read.unwrap() == p.shards[1], "{SHARD}: wrong bytes");
        } else {
            let Err(e) = pulled else {
                panic!("the pull sealed a shard whose every fetch failed")
            };
            assert!(e.to_string().contains("failed verification"), "{e}");
            let e = read.expect_err("a read of a shard that failed");
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
            let first = p.listing[1].0.clone();
            let ok = fs::read(p.m.mnt().join(&first)).expect("a verified shard still reads");
            assert!(ok == p.shards[0], "{first}: wrong bytes");
        }
    }
}

/// #24 item 7: a pull whose volume is usable once its files are verified
/// tells each file verified before its last bytes are durable; its sha256
/// is recorded only after. A crash right when every file is verified (the
/// process's runtime gone at once, as with kill -9) with a power loss on
/// top (every file whose sha256 is not recorded zeroed: what unwritten
/// pages could leave on disk) loses nothing: the next pull trusts no file
/// it did not record, fetches those again, and seals the origin's exact
/// bytes. Tried with fresh models until a crash lands in that window.
#[test]
fn a_crash_once_every_file_is_verified_but_before_it_is_durable_loses_nothing() {
    use crate::support::fixtures::{self, FileServer};
    use modelcache_csi::config::{Config, EngineConfig};
    use modelcache_csi::puller::SourceOptions;
    use modelcache_csi::puller::engine::{Ask, Engine, NoProgress};

    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    // The origin outlives both "processes" of the driver.
    let origin_rt = runtime();
    let engine = || {
        Engine::new(
            EngineConfig {
                chunk_bytes: 1 << 20,
                connections: 2,
                ..EngineConfig::default()
            },
            modelcache_csi::puller::extract_layer,
        )
    };
    for attempt in 0..8u64 {
        let t = tempfile::tempdir().unwrap();
        let model = t.path().join("model");
        fs::create_dir_all(&model).unwrap();
        let shards: Vec<Vec<u8>> = (0..3)
            .map(|i| pseudo_random(700 + attempt * 10 + i, 8 << 20))
            .collect();
        fs::write(model.join("config.json"), b"{\"layers\": 3}").unwrap();
        for (i, s) in shards.iter().enumerate() {
            fs::write(model.join(format!("shard-{i}.bin")), s).unwrap();
        }
        let server = origin_rt.block_on(FileServer::start(&model));
        server.put("m.json", fixtures::manifest_for(&model, true));
        let uri = format!("{}#manifest", server.url("m.json"));
        let root =
            modelcache_csi::cache::Roots::of(&Config::for_node("n", &t.path().join("state")))
                .roots
                .remove(0);

        // The first process: pulls for a volume usable once verified.
        let first = runtime();
        let (r, u) = (root.clone(), uri.clone());
        let pull = first.spawn(async move {
            let source = modelcache_csi::puller::open(&u, &SourceOptions::default()).await?;
            let ask = Ask {
                readers: true,
                ..Ask::default()
            };
            engine().pull_for(&ask, &r, source, &NoProgress).await
        });
        let started = Instant::now();
        let sid = loop {
            let area = fs::read_dir(root.sources_dir()).ok().and_then(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .find_map(|n| {
                        n.strip_prefix(".pull-")
                            .and_then(modelcache_csi::cache::SourceId::parse)
                    })
            });
            if let Some(sid) = area
                && root.pulls.get(&sid).is_some_and(|p| p.all_verified())
            {
                break Some(sid);
            }
            if pull.is_finished() || started.elapsed() > Duration::from_secs(30) {
                break None;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        // The crash: no task of the first process runs another step.
        first.shutdown_background();
        let Some(sid) = sid else {
            eprintln!("attempt {attempt}: sealed before every file was seen verified");
            continue;
        };
        // Whatever blocking call was under way ends; nothing follows it.
        std::thread::sleep(Duration::from_millis(300));
        let area = root.sources_dir().join(format!(".pull-{sid}"));
        if !area.exists() || root.source(&sid).dir.join("seal.json").exists() {
            eprintln!("attempt {attempt}: the seal beat the crash");
            continue;
        }
        // The power loss: a file in place whose sha256 is not recorded may
        // hold anything its pages had not reached the disk with; and it is
        // a new boot, so what was said written but not durable is not
        // trusted (`Written`): here, gone.
        for e in fs::read_dir(area.join("state")).unwrap().flatten() {
            if e.file_name().to_string_lossy().ends_with(".written.json") {
                fs::remove_file(e.path()).unwrap();
            }
        }
        let recorded: Vec<String> = fs::read_dir(area.join("state"))
            .unwrap()
            .filter_map(|e| {
                let v: serde_json::Value =
                    serde_json::from_slice(&fs::read(e.ok()?.path()).ok()?).ok()?;
                v["sha256"].as_str()?;
                Some(v["path"].as_str()?.to_string())
            })
            .collect();
        let mut zeroed = Vec::new();
        for name in ["config.json", "shard-0.bin", "shard-1.bin", "shard-2.bin"] {
            let at = area.join("data").join(name);
            if !recorded.iter().any(|p| p == name) && at.exists() {
                let len = fs::metadata(&at).unwrap().len() as usize;
                fs::write(&at, vec![0u8; len]).unwrap();
                zeroed.push(name);
            }
        }
        if zeroed.is_empty() {
            eprintln!("attempt {attempt}: every file was recorded before the crash");
            continue;
        }
        let gets_before: Vec<usize> = (0..3)
            .map(|i| server.gets(&format!("shard-{i}.bin")))
            .collect();

        // The next process resumes and seals.
        let second = runtime();
        let (r, u) = (root.clone(), uri.clone());
        let pulled = second
            .block_on(async move {
                let source = modelcache_csi::puller::open(&u, &SourceOptions::default()).await?;
                engine().pull(&r, source, &NoProgress).await
            })
            .expect("the resumed pull seals");
        assert_eq!(pulled.sid, sid);
        let data = root.source(&pulled.sid).data();
        for (i, s) in shards.iter().enumerate() {
            let name = format!("shard-{i}.bin");
            assert!(
                fs::read(data.join(&name)).unwrap() == *s,
                "{name}: the seal holds other bytes than the origin's (zeroed: {zeroed:?})"
            );
            let refetched = server.gets(&name) > gets_before[i];
            assert_eq!(
                refetched,
                zeroed.contains(&name.as_str()),
                "{name}: fetched again only if its sha256 was not recorded (zeroed: {zeroed:?})"
            );
        }
        assert_eq!(
            fs::read(data.join("config.json")).unwrap(),
            b"{\"layers\": 3}"
        );
        eprintln!(
            "attempt {attempt}: crashed with {zeroed:?} verified but unrecorded; all sealed exact"
        );
        second.shutdown_background();
        return;
    }
    panic!("no crash landed between the verdicts and the records in 8 attempts");
}
