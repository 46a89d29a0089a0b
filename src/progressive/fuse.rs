//! The FUSE server of a progressive volume, over the raw `/dev/fuse`
//! protocol: the tree from the listing, and READs answered only from files
//! their gate has verified, or from the prefix of a pending file matched
//! against a chunk table. A READ (or, with passthrough, an OPEN) of bytes
//! still pending is parked, not given a thread: one waker per volume
//! answers the parked requests as their files are decided (or EIO at their
//! bound), so a hundred readers waiting on a slow fill cost a hundred
//! entries, and every other request (and every verified read) goes on
//! meanwhile.
//!
//! Raw rather than `fuser`: a server that must take over a connection from
//! its predecessor (docs/design.md, *Progressive volumes*) never sees an
//! INIT, and `fuser` refuses everything before one. A read-only server
//! needs a dozen opcodes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

use super::gate::Gates;
use super::tree::{Node, ROOT, Tree};

const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const READ: u32 = 15;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const OPENDIR: u32 = 27;
const READDIR: u32 = 28;
const RELEASEDIR: u32 = 29;
const ACCESS: u32 = 34;
const INTERRUPT: u32 = 36;
const DESTROY: u32 = 38;
const BATCH_FORGET: u32 = 42;

const ASYNC_READ: u32 = 1 << 0;
const PARALLEL_DIROPS: u32 = 1 << 18;
const MAX_PAGES: u32 = 1 << 22;
const INIT_EXT: u32 = 1 << 30;
/// FUSE_PASSTHROUGH (bit 37), in the second flags word.
const PASSTHROUGH2: u32 = 1 << (37 - 32);
const FOPEN_PASSTHROUGH: u32 = 1 << 7;
/// No FLUSH at close: nothing is written here, and a close must never
/// wait on this server (a pod's process that closes a file while the
/// driver restarts, or a child closing its inherited descriptors at exec,
/// would hang until a server answered).
const FOPEN_NOFLUSH: u32 = 1 << 5;
/// Reads bypass the page cache, and the open puts the inode in no io mode.
const FOPEN_DIRECT_IO: u32 = 1 << 0;
/// FUSE_DIRECT_IO_ALLOW_MMAP (bit 36): a direct-io file may still be
/// mapped shared (safetensors readers map their shards).
const DIRECT_IO_ALLOW_MMAP2: u32 = 1 << (36 - 32);
/// `_IOW(229, 1, struct fuse_backing_map)` and `_IOW(229, 2, u32)`.
const BACKING_OPEN: libc::c_ulong = 0x4010_e501;
const BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

/// Largest READ the kernel may send: 1 MiB, so a page fault's readahead
/// asks for large ranges, never 4 KiB at a time.
const MAX_READ_PAGES: u16 = 256;
const IN_HEADER: usize = 40;
/// `FUSE_NOTIFY_RESEND`: the kernel queues again every request a server
/// read and did not answer.
const NOTIFY_RESEND: i32 = 7;
/// Set in a handle the daemon serves (not passthrough).
const DAEMON_HANDLE: u32 = 1 << 31;

/// A file handle names its file, so that a server taking over the
/// connection serves handles it never gave out: the file's listing index
/// above, and below a count, with `DAEMON_HANDLE` set when the daemon
/// serves its reads.
fn file_handle(index: usize, daemon: bool, count: u32) -> u64 {
    let low = (count & !DAEMON_HANDLE) | if daemon { DAEMON_HANDLE } else { 0 };
    ((index as u64) << 32) | low as u64
}

/// The listing index of a handle.
fn handle_index(fh: u64) -> usize {
    (fh >> 32) as usize
}

/// Attributes never change while mounted: the listing's sizes are final.
const TTL_SECS: u64 = 3600;

/// One progressive volume as its server sees it.
pub struct Volume {
    pub tree: Arc<Tree>,
    pub gates: Arc<Gates>,
    /// Where a verified file's bytes are, under its listed path, tried in
    /// order: the pull's area while it runs, then the sealed source (the
    /// area is renamed into it at the seal).
    pub backing: Vec<PathBuf>,
    /// How long a READ waits for its file before it answers EIO.
    pub wait_bound: Duration,
    /// READs answered with bytes, and those bytes: how large the kernel's
    /// requests are (a page fault's readahead should be large).
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// READs (and OPENs) parked now, waiting for their file's verdict.
    pub parked: AtomicU64,
    /// READs answered from a pending file's prefix matched against a
    /// chunk table, before its verdict.
    pub early_reads: AtomicU64,
    /// Each verified file's one backing id: the kernel refuses a second
    /// backing file for an inode open for passthrough, so every open of a
    /// file shares one, kept until the connection goes. Written to
    /// `ids_file` before an OPEN is answered with it, so a server taking
    /// the connection over reuses the ids of its predecessor's open
    /// handles.
    passthrough_ids: Mutex<HashMap<usize, u32>>,
    ids_file: Option<PathBuf>,
}

impl Volume {
    pub fn new(
        tree: Arc<Tree>,
        gates: Arc<Gates>,
        backing: Vec<PathBuf>,
        wait_bound: Duration,
    ) -> Volume {
        Volume {
            tree,
            gates,
            backing,
            wait_bound,
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            parked: AtomicU64::new(0),
            early_reads: AtomicU64::new(0),
            passthrough_ids: Mutex::new(HashMap::new()),
            ids_file: None,
        }
    }

    /// Keeps the passthrough ids in `file`, starting from those a server
    /// before this one wrote there.
    pub fn with_ids_file(mut self, file: PathBuf) -> Volume {
        let ids: HashMap<usize, u32> = crate::state::read_json(&file)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.passthrough_ids = Mutex::new(ids);
        self.ids_file = Some(file);
        self
    }
}

/// Serves `vol` on the connection `dev` until the filesystem is unmounted.
pub fn serve(dev: OwnedFd, vol: Arc<Volume>) -> io::Result<()> {
    run(Server::new(dev, vol))
}

/// Serves `vol` on a connection a server before this one negotiated and
/// served (a driver that restarted, handed the descriptor by the keeper):
/// no INIT comes. Passthrough is on when the kernel still takes backing
/// files on this connection; the requests the old server had read but not
/// answered are asked for again (`FUSE_NOTIFY_RESEND`).
pub fn serve_resumed(dev: OwnedFd, vol: Arc<Volume>) -> io::Result<()> {
    let s = Server::new(dev, vol);
    s.passthrough
        .store(s.probe_passthrough(), Ordering::Relaxed);
    s.resumed.store(true, Ordering::Relaxed);
    // struct fuse_out_header { len: 16, error: FUSE_NOTIFY_RESEND, unique: 0 }
    let mut notify = Vec::with_capacity(16);
    notify.extend_from_slice(&16u32.to_le_bytes());
    notify.extend_from_slice(&NOTIFY_RESEND.to_le_bytes());
    notify.extend_from_slice(&0u64.to_le_bytes());
    (&*s.dev).write_all(&notify)?;
    run(s)
}

fn run(s: Arc<Server>) -> io::Result<()> {
    let waker = {
        let s = s.clone();
        std::thread::Builder::new()
            .name("progressive-waker".into())
            .spawn(move || s.wake_parked())?
    };
    let served = s.clone().receive();
    s.stop.store(true, Ordering::Relaxed);
    s.vol.gates.nudge();
    let _ = waker.join();
    served
}

impl Server {
    fn new(dev: OwnedFd, vol: Arc<Volume>) -> Arc<Server> {
        Arc::new(Server {
            vol,
            dev: Arc::new(File::from(dev)),
            open: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            passthrough: Default::default(),
            parked: Mutex::new(Vec::new()),
            stop: Default::default(),
            resumed: Default::default(),
        })
    }

    /// Whether this connection takes backing files, asked of the kernel
    /// with a directory: it answers EPERM when passthrough is off, and
    /// EISDIR (a directory cannot back a file) only when it is on.
    fn probe_passthrough(&self) -> bool {
        let Ok(dir) = File::open("/") else {
            return false;
        };
        match self.register_backing(&dir) {
            Ok(id) => {
                self.close_backing(id);
                true
            }
            Err(e) => e.raw_os_error() == Some(libc::EISDIR),
        }
    }

    /// Reads requests until the filesystem is unmounted.
    fn receive(self: Arc<Self>) -> io::Result<()> {
        let s = self;
        let mut buf = vec![0u8; (MAX_READ_PAGES as usize) * 4096 + 4096];
        loop {
            let n = match (&*s.dev).read(&mut buf) {
                Ok(n) => n,
                // Unmounted: the connection is gone.
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // The request was interrupted before we read it.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(e),
            };
            if n < IN_HEADER {
                continue;
            }
            s.clone().handle(&buf[..n]);
        }
    }
}

/// A request waiting for its file's verdict.
struct Parked {
    h: Header,
    index: usize,
    op: Wait,
    until: std::time::Instant,
    /// Its matched prefix could not be read (the partial file renamed
    /// into place just before the verdict): it waits for the verdict.
    verdict_only: bool,
}

enum Wait {
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    /// An OPEN of a pending file, answered at the verdict so that a file
    /// verified meanwhile is read by passthrough from its first byte:
    /// with gates per file, a READ would wait for the same verdict
    /// anyway, and a handle opened through the daemon would carry every
    /// read of the file through it for as long as it stays open.
    Open,
}

struct Server {
    vol: Arc<Volume>,
    dev: Arc<File>,
    open: Mutex<Handles>,
    next_fh: AtomicU64,
    /// Whether the kernel agreed to passthrough at INIT (6.9+).
    passthrough: std::sync::atomic::AtomicBool,
    /// READs of pending files, answered by the waker.
    parked: Mutex<Vec<Parked>>,
    /// The connection is gone: the waker ends.
    stop: std::sync::atomic::AtomicBool,
    /// Taken over from a server before this one, whose open files this
    /// one does not know (see `answer_open`).
    resumed: std::sync::atomic::AtomicBool,
}

/// An open file of the view.
struct Handle {
    /// Its listing index.
    index: usize,
    /// Its backing file, once a verified READ opened it.
    file: Option<Arc<File>>,
    /// The pull's partial file, while READs of its matched prefix come
    /// before the verdict.
    part: Option<(PathBuf, Arc<File>)>,
}

impl Handle {
    fn new(index: usize) -> Handle {
        Handle {
            index,
            file: None,
            part: None,
        }
    }
}

type Handles = HashMap<u64, Handle>;

#[derive(Clone, Copy)]
struct Header {
    opcode: u32,
    unique: u64,
    node: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes(s.try_into().unwrap()))
        .unwrap_or(0)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().unwrap()))
        .unwrap_or(0)
}

impl Server {
    fn reply(&self, unique: u64, payload: &[u8]) {
        let mut out = Vec::with_capacity(16 + payload.len());
        out.extend_from_slice(&(16 + payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&0i32.to_le_bytes());
        out.extend_from_slice(&unique.to_le_bytes());
        out.extend_from_slice(payload);
        // ENOENT: the request was interrupted and is gone; nothing to do.
        if let Err(e) = (&*self.dev).write(&out)
            && e.raw_os_error() != Some(libc::ENOENT)
        {
            tracing::warn!(unique, error = %e, "the kernel refused a reply");
        }
    }

    fn error(&self, unique: u64, errno: i32) {
        let mut out = Vec::with_capacity(16);
        out.extend_from_slice(&16u32.to_le_bytes());
        out.extend_from_slice(&(-errno).to_le_bytes());
        out.extend_from_slice(&unique.to_le_bytes());
        let _ = (&*self.dev).write(&out);
    }

    fn handle(self: Arc<Self>, req: &[u8]) {
        let h = Header {
            opcode: u32_at(req, 4),
            unique: u64_at(req, 8),
            node: u64_at(req, 16),
        };
        let body = &req[IN_HEADER..];
        match h.opcode {
            INIT => self.init(&h, body),
            LOOKUP => self.lookup(&h, body),
            GETATTR => match self.attr(h.node) {
                Some(a) => {
                    let mut out = Vec::with_capacity(104);
                    out.extend_from_slice(&TTL_SECS.to_le_bytes());
                    out.extend_from_slice(&[0u8; 8]);
                    out.extend_from_slice(&a);
                    self.reply(h.unique, &out);
                }
                None => self.error(h.unique, libc::ENOENT),
            },
            OPEN => self.open_file(&h, body),
            READ => self.read(h, body),
            OPENDIR => match self.vol.tree.get(h.node) {
                Some(Node::Dir { .. }) => self.reply(h.unique, &[0u8; 16]),
                _ => self.error(h.unique, libc::ENOTDIR),
            },
            READDIR => self.readdir(&h, body),
            RELEASE => {
                // Backing ids outlive handles (`Volume::passthrough_ids`).
                self.lock_open().remove(&u64_at(body, 0));
                self.reply(h.unique, &[]);
            }
            STATFS => self.statfs(&h),
            RELEASEDIR | FLUSH | ACCESS | DESTROY => self.reply(h.unique, &[]),
            INTERRUPT => self.interrupt(u64_at(body, 0)),
            // No answer is expected to these.
            FORGET | BATCH_FORGET => {}
            _ => self.error(h.unique, libc::ENOSYS),
        }
    }

    fn lock_open(&self) -> std::sync::MutexGuard<'_, Handles> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn init(&self, h: &Header, body: &[u8]) {
        let (minor, readahead, flags) = (u32_at(body, 4), u32_at(body, 8), u32_at(body, 12));
        let flags2 = if flags & INIT_EXT != 0 {
            u32_at(body, 16)
        } else {
            0
        };
        // Verified files are then read by the kernel itself, at the speed
        // of the filesystem under the cache.
        let passthrough = flags2 & PASSTHROUGH2 != 0;
        self.passthrough.store(passthrough, Ordering::Relaxed);
        let mut ours = flags & (ASYNC_READ | PARALLEL_DIROPS | MAX_PAGES);
        if passthrough {
            ours |= INIT_EXT;
        }
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&7u32.to_le_bytes());
        out.extend_from_slice(&minor.to_le_bytes());
        out.extend_from_slice(&readahead.min(1 << 20).to_le_bytes());
        out.extend_from_slice(&ours.to_le_bytes());
        out.extend_from_slice(&64u16.to_le_bytes()); // max_background
        out.extend_from_slice(&48u16.to_le_bytes()); // congestion_threshold
        out.extend_from_slice(&(128u32 * 1024).to_le_bytes()); // max_write
        out.extend_from_slice(&1u32.to_le_bytes()); // time_gran
        out.extend_from_slice(&MAX_READ_PAGES.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
        let (flags2_out, depth) = if passthrough {
            (PASSTHROUGH2 | (flags2 & DIRECT_IO_ALLOW_MMAP2), 1u32)
        } else {
            (0, 0)
        };
        out.extend_from_slice(&flags2_out.to_le_bytes());
        out.extend_from_slice(&depth.to_le_bytes()); // max_stack_depth
        out.extend_from_slice(&[0u8; 24]);
        self.reply(h.unique, &out);
    }

    /// `fuse_attr` of an inode.
    fn attr(&self, ino: u64) -> Option<[u8; 88]> {
        let (mode, size, nlink) = match self.vol.tree.get(ino)? {
            Node::Dir { .. } => (libc::S_IFDIR | 0o555, 0, 2),
            Node::File { size, .. } => (libc::S_IFREG | 0o444, *size, 1),
        };
        let mut a = [0u8; 88];
        a[0..8].copy_from_slice(&ino.to_le_bytes());
        a[8..16].copy_from_slice(&size.to_le_bytes());
        a[16..24].copy_from_slice(&size.div_ceil(512).to_le_bytes());
        a[60..64].copy_from_slice(&mode.to_le_bytes());
        a[64..68].copy_from_slice(&(nlink as u32).to_le_bytes());
        a[80..84].copy_from_slice(&4096u32.to_le_bytes());
        Some(a)
    }

    fn lookup(&self, h: &Header, body: &[u8]) {
        let name = body.split(|b| *b == 0).next().unwrap_or_default();
        let found = std::str::from_utf8(name)
            .ok()
            .and_then(|n| self.vol.tree.lookup(h.node, n))
            .and_then(|ino| Some((ino, self.attr(ino)?)));
        let Some((ino, a)) = found else {
            return self.error(h.unique, libc::ENOENT);
        };
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(&ino.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes()); // generation
        out.extend_from_slice(&TTL_SECS.to_le_bytes());
        out.extend_from_slice(&TTL_SECS.to_le_bytes());
        out.extend_from_slice(&[0u8; 8]);
        out.extend_from_slice(&a);
        self.reply(h.unique, &out);
    }

    fn open_file(&self, h: &Header, body: &[u8]) {
        let flags = u32_at(body, 0) as i32;
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return self.error(h.unique, libc::EROFS);
        }
        let Some(Node::File { index, .. }) = self.vol.tree.get(h.node) else {
            return self.error(h.unique, libc::EISDIR);
        };
        let index = *index;
        // A file whose prefix a chunk table vouches for opens through the
        // daemon at once: its reads then start at the first matched
        // chunk, not at the whole file's verdict.
        if self.passthrough.load(Ordering::Relaxed)
            && self.vol.gates.state(index) == super::gate::State::Pending
            && !self.vol.gates.partly_readable(index)
        {
            return self.park(*h, index, Wait::Open);
        }
        self.answer_open(h, index);
    }

    /// An OPEN's answer. The kernel allows one io mode per inode: once a
    /// handle of it is open for passthrough, every other open must be
    /// passthrough too (else EIO), and passthrough is refused while a
    /// cached-mode handle is open. A server that took the connection over
    /// does not know its predecessor's handles, so no open here ever
    /// leaves the inode in a mode the next server could not match: with
    /// passthrough, a verified file is always opened for passthrough and
    /// any other with `FOPEN_DIRECT_IO`, which takes no mode. Without it
    /// (kernels before 6.9) nothing is passthrough, and only a server
    /// that took over answers direct io (its predecessor's cached handles
    /// and its own may not mix otherwise).
    fn answer_open(&self, h: &Header, index: usize) {
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        let backing_id = self.passthrough_for(index);
        let direct = backing_id.is_none() && (passthrough || self.resumed.load(Ordering::Relaxed));
        let count = self.next_fh.fetch_add(1, Ordering::Relaxed) as u32;
        let fh = file_handle(index, backing_id.is_none(), count);
        self.lock_open().insert(fh, Handle::new(index));
        let mut out = [0u8; 16];
        out[0..8].copy_from_slice(&fh.to_le_bytes());
        let mut flags = FOPEN_NOFLUSH;
        if direct {
            flags |= FOPEN_DIRECT_IO;
        }
        if let Some(id) = backing_id {
            flags |= FOPEN_PASSTHROUGH;
            out[12..16].copy_from_slice(&id.to_le_bytes());
        }
        out[8..12].copy_from_slice(&flags.to_le_bytes());
        self.reply(h.unique, &out);
    }

    /// The backing id of `index` when it may be read by passthrough: the
    /// kernel agreed to it and the file is verified. Registered at its
    /// first open, and recorded before any handle uses it.
    fn passthrough_for(&self, index: usize) -> Option<u32> {
        if !self.passthrough.load(Ordering::Relaxed)
            || self.vol.gates.state(index) != super::gate::State::Verified
        {
            return None;
        }
        let mut ids = self
            .vol
            .passthrough_ids
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(id) = ids.get(&index) {
            return Some(*id);
        }
        let file = self.open_backing(index).ok()?;
        let id = self
            .register_backing(&file)
            .inspect_err(|e| {
                tracing::debug!(file = index, error = %e, "passthrough refused; reads go through the daemon")
            })
            .ok()?;
        ids.insert(index, id);
        if let Some(f) = &self.vol.ids_file
            && let Err(e) = crate::state::write_json(f, &*ids)
        {
            // Unrecorded, a server taking over would register another
            // backing file for an inode open with this one: EIO.
            tracing::warn!(file = index, error = %e, "could not record a passthrough id; reads go through the daemon");
            ids.remove(&index);
            self.close_backing(id);
            return None;
        }
        Some(id)
    }

    /// Registers `file` with the kernel for passthrough; its backing id.
    fn register_backing(&self, file: &File) -> io::Result<u32> {
        // struct fuse_backing_map { s32 fd; u32 flags; u64 padding; }
        let mut map = [0u8; 16];
        map[0..4].copy_from_slice(&std::os::fd::AsRawFd::as_raw_fd(file).to_le_bytes());
        // SAFETY: the ioctl reads a 16-byte fuse_backing_map from `map`.
        let id = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&*self.dev),
                BACKING_OPEN,
                map.as_ptr(),
            )
        };
        if id < 0 {
            return Err(io::Error::last_os_error());
        }
        if id == 0 || id as u32 & DAEMON_HANDLE != 0 {
            self.close_backing(id as u32);
            return Err(io::Error::other(format!("backing id {id} out of range")));
        }
        Ok(id as u32)
    }

    fn close_backing(&self, id: u32) {
        // SAFETY: the ioctl reads the u32 backing id.
        unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&*self.dev),
                BACKING_CLOSE,
                &id as *const u32,
            );
        }
    }

    fn read(self: Arc<Self>, h: Header, body: &[u8]) {
        let (fh, offset, size) = (u64_at(body, 0), u64_at(body, 8), u32_at(body, 16));
        let index = {
            let mut open = self.lock_open();
            match open.get(&fh) {
                Some(known) => known.index,
                // Opened under the server before this one: the handle
                // names its file.
                None => {
                    let index = handle_index(fh);
                    if self.vol.tree.path_of(index).is_none() {
                        drop(open);
                        return self.error(h.unique, libc::EBADF);
                    }
                    open.insert(fh, Handle::new(index));
                    index
                }
            }
        };
        if self.vol.gates.state(index) == super::gate::State::Verified {
            return self.answer_read(&h, fh, index, offset, size);
        }
        let op = Wait::Read { fh, offset, size };
        if self.ready(index, &op) {
            return self.answer_early(h, index, op);
        }
        self.park(h, index, op);
    }

    /// The end of what a READ at `offset` of `size` bytes of file `index`
    /// returns: short at the end of the file.
    fn read_end(&self, index: usize, offset: u64, size: u32) -> u64 {
        let len = self.vol.tree.size_of(index).unwrap_or(0);
        offset.saturating_add(size as u64).min(len)
    }

    /// Whether parked `op` of pending file `index` may be answered before
    /// the file's verdict: an OPEN once some prefix is matched, a READ
    /// once the bytes it asks for are.
    fn ready(&self, index: usize, op: &Wait) -> bool {
        match op {
            Wait::Open => self.vol.gates.partly_readable(index),
            Wait::Read { offset, size, .. } => self
                .vol
                .gates
                .readable_through(index, self.read_end(index, *offset, *size))
                .is_some(),
        }
    }

    /// Answers `op` of pending file `index` from its matched prefix.
    fn answer_early(&self, h: Header, index: usize, op: Wait) {
        let Wait::Read { fh, offset, size } = op else {
            return self.answer_open(&h, index);
        };
        let end = self.read_end(index, offset, size);
        let Some(at) = self.vol.gates.readable_through(index, end) else {
            return self.park(h, index, op);
        };
        let file = match self.part_file(fh, &at) {
            Ok(f) => f,
            Err(e) => {
                // Renamed into place meanwhile: the verdict is near.
                tracing::debug!(file = index, error = %e, "the partial file is gone; the read waits for the verdict");
                return self.park_until(h, index, op, true);
            }
        };
        let mut buf = vec![0u8; (end.saturating_sub(offset)) as usize];
        if let Err(e) = file.read_exact_at(&mut buf, offset) {
            tracing::warn!(file = index, error = %e, "reading a matched prefix failed; the read waits for the verdict");
            return self.park_until(h, index, op, true);
        }
        // Still vouched for after the read (not failed or fetched again
        // in between): else the bytes may not be the ones matched.
        let still = self.vol.gates.readable_through(index, end).as_ref() == Some(&at)
            || self.vol.gates.state(index) == super::gate::State::Verified;
        if !still {
            return self.park_until(h, index, op, true);
        }
        self.vol.reads.fetch_add(1, Ordering::Relaxed);
        self.vol
            .read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.vol.early_reads.fetch_add(1, Ordering::Relaxed);
        self.reply(h.unique, &buf);
    }

    /// The pull's partial file at `at`, kept with the handle.
    fn part_file(&self, fh: u64, at: &PathBuf) -> io::Result<Arc<File>> {
        if let Some(Handle {
            part: Some((p, f)), ..
        }) = self.lock_open().get(&fh)
            && p == at
        {
            return Ok(f.clone());
        }
        // The engine names it (a digest of the path under the pull's
        // area), never a tenant; no link is followed all the same.
        let f = Arc::new(
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(at)?,
        );
        if let Some(entry) = self.lock_open().get_mut(&fh) {
            entry.part = Some((at.clone(), f.clone()));
        }
        Ok(f)
    }

    /// Leaves a request of pending file `index` to the waker, and tells
    /// the fill the file is wanted.
    fn park(&self, h: Header, index: usize, op: Wait) {
        self.park_until(h, index, op, false)
    }

    fn park_until(&self, h: Header, index: usize, op: Wait, verdict_only: bool) {
        self.vol.gates.ask(index);
        self.lock_parked().push(Parked {
            h,
            index,
            op,
            until: std::time::Instant::now() + self.vol.wait_bound,
            verdict_only,
        });
        self.vol.parked.fetch_add(1, Ordering::Relaxed);
        // Decided between the check and the park: the waker may have
        // looked already, so it is told to look again.
        self.vol.gates.nudge();
    }

    /// The caller of parked request `unique` was interrupted (a signal,
    /// SIGKILL included): it is answered EINTR at once. A request the
    /// daemon has read ends only when the daemon answers it, so without
    /// this a killed reader stayed in D state until its file's verdict or
    /// the wait bound. One no longer parked was answered already: the
    /// interrupt is nothing to do.
    fn interrupt(&self, unique: u64) {
        let found = {
            let mut parked = self.lock_parked();
            let at = parked.iter().position(|p| p.h.unique == unique);
            at.map(|i| parked.swap_remove(i))
        };
        if let Some(p) = found {
            self.vol.parked.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!(
                file = p.index,
                unique,
                "a parked request's caller was interrupted: EINTR"
            );
            self.error(unique, libc::EINTR);
        }
    }

    fn lock_parked(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The waker: answers each parked READ once its file is decided, or
    /// with EIO at its bound, until the connection is gone.
    fn wake_parked(&self) {
        let mut seen = self.vol.gates.generation();
        while !self.stop.load(Ordering::Relaxed) {
            let now = std::time::Instant::now();
            let (ready, next): (Vec<Parked>, Option<std::time::Instant>) = {
                let mut parked = self.lock_parked();
                let all = std::mem::take(&mut *parked);
                let mut ready = Vec::new();
                for p in all {
                    let decided = self.vol.gates.state(p.index) != super::gate::State::Pending
                        || (!p.verdict_only && self.ready(p.index, &p.op));
                    if decided || p.until <= now {
                        ready.push(p);
                    } else {
                        parked.push(p);
                    }
                }
                (ready, parked.iter().map(|p| p.until).min())
            };
            for p in ready {
                self.vol.parked.fetch_sub(1, Ordering::Relaxed);
                match (self.vol.gates.state(p.index), p.op) {
                    // A failed file opens (through the daemon): its reads
                    // fail, and read right once it is fetched again.
                    (super::gate::State::Verified | super::gate::State::Failed(_), Wait::Open) => {
                        self.answer_open(&p.h, p.index)
                    }
                    (super::gate::State::Verified, Wait::Read { fh, offset, size }) => {
                        self.answer_read(&p.h, fh, p.index, offset, size)
                    }
                    (super::gate::State::Failed(why), Wait::Read { .. }) => {
                        tracing::warn!(file = p.index, %why, "read of a failed file: EIO");
                        self.error(p.h.unique, libc::EIO)
                    }
                    (super::gate::State::Pending, op)
                        if !p.verdict_only && self.ready(p.index, &op) =>
                    {
                        self.answer_early(p.h, p.index, op)
                    }
                    (super::gate::State::Pending, _) => {
                        tracing::warn!(file = p.index, "a read or open waited past its bound: EIO");
                        self.error(p.h.unique, libc::EIO)
                    }
                }
            }
            let bound = next.map_or(Duration::from_secs(1), |t| {
                t.saturating_duration_since(std::time::Instant::now())
            });
            seen = self.vol.gates.changed_since(seen, bound);
        }
        // Unmounted: whatever is parked has nobody to answer to.
        let left = std::mem::take(&mut *self.lock_parked());
        self.vol
            .parked
            .fetch_sub(left.len() as u64, Ordering::Relaxed);
    }

    /// A READ of a verified file, from its backing bytes.
    fn answer_read(&self, h: &Header, fh: u64, index: usize, offset: u64, size: u32) {
        let file = match self.backing_file(fh, index) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(file = index, error = %e, "opening a verified file failed");
                return self.error(h.unique, libc::EIO);
            }
        };
        let mut buf = vec![0u8; size as usize];
        let mut got = 0;
        while got < buf.len() {
            match file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(file = index, error = %e, "reading a verified file failed: EIO");
                    return self.error(h.unique, libc::EIO);
                }
            }
        }
        self.vol.reads.fetch_add(1, Ordering::Relaxed);
        self.vol.read_bytes.fetch_add(got as u64, Ordering::Relaxed);
        self.reply(h.unique, &buf[..got]);
    }

    fn backing_file(&self, fh: u64, index: usize) -> io::Result<Arc<File>> {
        if let Some(Handle { file: Some(f), .. }) = self.lock_open().get(&fh) {
            return Ok(f.clone());
        }
        let f = Arc::new(self.open_backing(index)?);
        if let Some(entry) = self.lock_open().get_mut(&fh) {
            entry.file = Some(f.clone());
        }
        Ok(f)
    }

    /// The verified bytes of file `index`, opened beneath a backing dir.
    fn open_backing(&self, index: usize) -> io::Result<File> {
        let path = self
            .vol
            .tree
            .path_of(index)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
        // Each backing directory in turn, every open confined beneath it.
        let mut last = io::Error::from_raw_os_error(libc::ENOENT);
        let mut found = None;
        for dir in &self.vol.backing {
            let opened = File::open(dir).and_then(|d| {
                crate::beneath::openat2_settled(&d, path, how).map_err(io::Error::from)
            });
            match opened {
                Ok(fd) => {
                    found = Some(fd);
                    break;
                }
                Err(e) => last = e,
            }
        }
        Ok(File::from(found.ok_or(last)?))
    }

    fn readdir(&self, h: &Header, body: &[u8]) {
        let (offset, size) = (u64_at(body, 8), u32_at(body, 16) as usize);
        let Some(Node::Dir { children, parent }) = self.vol.tree.get(h.node) else {
            return self.error(h.unique, libc::ENOTDIR);
        };
        let mut entries: Vec<(u64, u32, &str)> = vec![
            (h.node, libc::DT_DIR as u32, "."),
            (
                if h.node == ROOT { ROOT } else { *parent },
                libc::DT_DIR as u32,
                "..",
            ),
        ];
        for (name, ino) in children {
            let kind = match self.vol.tree.get(*ino) {
                Some(Node::Dir { .. }) => libc::DT_DIR,
                _ => libc::DT_REG,
            };
            entries.push((*ino, kind as u32, name));
        }
        let mut out = Vec::new();
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            let len = (24 + name.len()).div_ceil(8) * 8;
            if out.len() + len > size {
                break;
            }
            out.extend_from_slice(&ino.to_le_bytes());
            out.extend_from_slice(&(i as u64 + 1).to_le_bytes());
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(&kind.to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.resize(out.len() + len - 24 - name.len(), 0);
        }
        self.reply(h.unique, &out);
    }

    fn statfs(&self, h: &Header) {
        let mut out = [0u8; 80];
        out[24..32].copy_from_slice(&(self.vol.tree.len() as u64).to_le_bytes()); // files
        out[40..44].copy_from_slice(&4096u32.to_le_bytes()); // bsize
        out[44..48].copy_from_slice(&255u32.to_le_bytes()); // namelen
        out[48..52].copy_from_slice(&4096u32.to_le_bytes()); // frsize
        self.reply(h.unique, &out);
    }
}
