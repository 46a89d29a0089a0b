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
use std::os::unix::fs::MetadataExt;
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
        // A failed test may leave a reader blocked in the view, which keeps
        // the detached connection (and so the server) alive: wait a little,
        // then leave the thread to end with the process rather than hang.
        if let Some(s) = self.server.take() {
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

fn mount(files: &[(&str, u64)], wait_bound: Duration) -> Mounted {
    let dir = tempfile::tempdir().unwrap();
    for d in ["mnt", "backing"] {
        fs::create_dir(dir.path().join(d)).unwrap();
    }
    let listing: Vec<(String, u64)> = files.iter().map(|(p, s)| (p.to_string(), *s)).collect();
    let vol = Arc::new(Volume::new(
        Tree::new(&listing).unwrap(),
        Arc::new(Gates::new(files.len())),
        dir.path().join("backing"),
        wait_bound,
    ));
    let dev = modelcache_csi::mount::fuse::mount_fuse(&dir.path().join("mnt"), "modelcache")
        .expect("mount FUSE (root and /dev/fuse)");
    let v = vol.clone();
    let server = Some(std::thread::spawn(move || serve(dev, v)));
    Mounted { dir, vol, server }
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

/// safetensors readers mmap their shards: each page fault must become a
/// large READ (the kernel's readahead, up to 1 MiB), not one per 4 KiB page.
#[test]
fn page_faults_of_an_mmap_reader_become_large_reads() {
    let bytes = pseudo_random(7, 8 << 20);
    let m = mount(
        &[("shard.safetensors", bytes.len() as u64)],
        Duration::from_secs(30),
    );
    let path = m.mnt().join("shard.safetensors");
    let mapped = std::thread::spawn(move || mmap_sum(&path));
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

/// Sums every byte of `path` through a shared read-only mapping.
fn mmap_sum(path: &Path) -> (u64, usize) {
    let mut f = fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a private read of a file nobody truncates while mapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping is `len` readable bytes until munmap below.
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    let sum = s.iter().map(|b| *b as u64).sum();
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(p, len) };
    let _ = f.read(&mut [0u8; 1]);
    (sum, len)
}
