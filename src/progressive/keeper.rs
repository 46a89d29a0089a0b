//! The keeper: a process of its own (its own DaemonSet, updated OnDelete)
//! that holds a duplicate of every progressive view's `/dev/fuse`
//! descriptor, so that a driver killed or restarted never takes the
//! connections down with it: the kernel keeps a connection while any
//! descriptor of it is open, queues the pods' requests meanwhile, and the
//! new driver takes the descriptors back and serves on.
//!
//! One request per connection on a Unix seqpacket socket, descriptors
//! passed with `SCM_RIGHTS`: hold one under a key (the view's mount
//! point), release one, or hand all of them over. The socket is the
//! driver's alone (mode 0600 in its state directory): whoever holds a
//! descriptor answers the view's reads.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept, bind, connect, listen, recvmsg, sendmsg, setsockopt, socket, sockopt,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};

/// The largest request or answer: a key is a path.
const MESSAGE_BYTES: usize = 8192;
/// How long either side waits for the other before giving up on it.
const PATIENCE: Duration = Duration::from_secs(5);

#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
enum Request {
    /// Keep the descriptor sent with this message under `key`.
    Hold(String),
    /// Close the descriptor kept under `key`.
    Release(String),
    /// Send every descriptor kept, one message each, then `Done`.
    TakeAll,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
enum Answer {
    Ok,
    /// A descriptor kept under this key comes with the message.
    Held(String),
    Done,
    Refused(String),
}

fn seqpacket() -> Result<OwnedFd> {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::Internal(format!("create a seqpacket socket: {e}")))
}

fn send(fd: RawFd, msg: &impl Serialize, pass: Option<RawFd>) -> nix::Result<()> {
    let bytes = serde_json::to_vec(msg).unwrap_or_default();
    let iov = [IoSlice::new(&bytes)];
    let fds = pass.map(|f| [f]);
    let cmsgs: Vec<ControlMessage<'_>> = fds
        .as_ref()
        .map(|f| vec![ControlMessage::ScmRights(f)])
        .unwrap_or_default();
    sendmsg::<UnixAddr>(fd, &iov, &cmsgs, MsgFlags::empty(), None).map(drop)
}

fn receive<T: for<'de> Deserialize<'de>>(fd: RawFd) -> std::io::Result<(T, Option<OwnedFd>)> {
    let mut buf = vec![0u8; MESSAGE_BYTES];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (n, passed) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<UnixAddr>(fd, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
        let mut passed = None;
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for f in fds {
                    // SAFETY: SCM_RIGHTS installed `f` in this process for us.
                    let owned = unsafe { OwnedFd::from_raw_fd(f) };
                    passed.get_or_insert(owned);
                }
            }
        }
        (msg.bytes, passed)
    };
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let msg = serde_json::from_slice(&buf[..n]).map_err(std::io::Error::other)?;
    Ok((msg, passed))
}

fn patient(fd: &OwnedFd) -> nix::Result<()> {
    let t = nix::sys::time::TimeVal::new(PATIENCE.as_secs() as i64, 0);
    setsockopt(fd, sockopt::ReceiveTimeout, &t)?;
    setsockopt(fd, sockopt::SendTimeout, &t)
}

/// Runs the keeper on `socket` until killed.
pub fn run(socket: &Path) -> Result<()> {
    let _ = std::fs::remove_file(socket);
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).ctx("create", dir)?;
    }
    let listener = seqpacket()?;
    let addr = UnixAddr::new(socket).map_err(|e| Error::io("name", socket, e.into()))?;
    bind(listener.as_raw_fd(), &addr).map_err(|e| Error::io("bind", socket, e.into()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .ctx("chmod", socket)?;
    listen(&listener, Backlog::new(64).unwrap_or(Backlog::MAXCONN))
        .map_err(|e| Error::io("listen on", socket, e.into()))?;
    tracing::info!(socket = %socket.display(), "keeping FUSE connections");
    let mut held: BTreeMap<String, OwnedFd> = BTreeMap::new();
    loop {
        let conn = match accept(listener.as_raw_fd()) {
            // SAFETY: accept returned a new descriptor that nothing owns.
            Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(Error::io("accept on", socket, e.into())),
        };
        // The socket is root's (0600) already; the peer's credentials are
        // checked too, so a descriptor passed by anyone but root (or this
        // keeper's own user) is never held nor handed over.
        match nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials) {
            // SAFETY: geteuid has no preconditions and cannot fail.
            Ok(c) if c.uid() == 0 || c.uid() == unsafe { libc::geteuid() } => {}
            Ok(c) => {
                tracing::warn!(
                    uid = c.uid(),
                    pid = c.pid(),
                    "a process of another user asked the keeper; refused"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the keeper could not tell who asked; refused");
                continue;
            }
        }
        if let Err(e) = serve(&conn, &mut held) {
            tracing::warn!(error = %e, "a request to the keeper failed");
        }
    }
}

fn serve(conn: &OwnedFd, held: &mut BTreeMap<String, OwnedFd>) -> std::io::Result<()> {
    patient(conn)?;
    let fd = conn.as_raw_fd();
    let (req, passed) = receive::<Request>(fd)?;
    let answer = match (req, passed) {
        (Request::Hold(key), Some(dev)) if is_fuse_connection(&dev) => {
            tracing::info!(view = %key, "holding a view's connection");
            held.insert(key, dev);
            Answer::Ok
        }
        (Request::Hold(key), Some(_)) => {
            tracing::warn!(view = %key, "refused to hold a descriptor that is no FUSE connection");
            Answer::Refused("hold: the descriptor is not a FUSE connection (/dev/fuse)".into())
        }
        (Request::Hold(_), None) => Answer::Refused("hold: no descriptor came with it".into()),
        (Request::Release(key), _) => {
            if held.remove(&key).is_some() {
                tracing::info!(view = %key, "released a view's connection");
            }
            Answer::Ok
        }
        (Request::TakeAll, _) => {
            for (key, dev) in held.iter() {
                send(fd, &Answer::Held(key.clone()), Some(dev.as_raw_fd()))?;
            }
            tracing::info!(views = held.len(), "handed every connection over");
            Answer::Done
        }
    };
    send(fd, &answer, None)?;
    Ok(())
}

/// The character device every FUSE connection is opened from.
const FUSE_DEVICE: (u64, u64) = (10, 229);

/// Whether `fd` is a FUSE connection: a descriptor of `/dev/fuse`. Any
/// other (a socket, a file) would have the driver answer a view's reads
/// to whoever holds its other end.
pub fn is_fuse_connection(fd: &OwnedFd) -> bool {
    nix::sys::stat::fstat(fd).is_ok_and(|st| {
        (st.st_mode & libc::S_IFMT) == libc::S_IFCHR
            && (
                libc::major(st.st_rdev) as u64,
                libc::minor(st.st_rdev) as u64,
            ) == FUSE_DEVICE
    })
}

/// A driver's line to its keeper.
#[derive(Clone, Debug)]
pub struct Keeper {
    socket: std::path::PathBuf,
}

impl Keeper {
    pub fn new(socket: &Path) -> Keeper {
        Keeper {
            socket: socket.to_path_buf(),
        }
    }

    fn ask(&self, req: &Request, pass: Option<RawFd>) -> Result<OwnedFd> {
        let fail = |what: &str, e: std::io::Error| {
            Error::Transient(format!(
                "the FUSE keeper at {} did not answer ({what}: {e}); is its container running?",
                self.socket.display()
            ))
        };
        let conn = seqpacket()?;
        patient(&conn).map_err(|e| fail("set timeouts", e.into()))?;
        let addr = UnixAddr::new(&self.socket).map_err(|e| fail("name", e.into()))?;
        connect(conn.as_raw_fd(), &addr).map_err(|e| fail("connect", e.into()))?;
        send(conn.as_raw_fd(), req, pass).map_err(|e| fail("send", e.into()))?;
        Ok(conn)
    }

    fn finish(&self, conn: &OwnedFd) -> Result<()> {
        match receive::<Answer>(conn.as_raw_fd()) {
            Ok((Answer::Ok, _)) => Ok(()),
            Ok((other, _)) => Err(Error::Internal(format!("the keeper answered {other:?}"))),
            Err(e) => Err(Error::Transient(format!(
                "the FUSE keeper at {} did not answer: {e}",
                self.socket.display()
            ))),
        }
    }

    /// Hands the keeper a duplicate of `dev` to hold under `key`.
    pub fn hold(&self, key: &str, dev: &OwnedFd) -> Result<()> {
        let conn = self.ask(&Request::Hold(key.to_string()), Some(dev.as_raw_fd()))?;
        self.finish(&conn)
    }

    /// The keeper closes what it holds under `key` (the view is unmounted).
    pub fn release(&self, key: &str) -> Result<()> {
        let conn = self.ask(&Request::Release(key.to_string()), None)?;
        self.finish(&conn)
    }

    /// Every descriptor the keeper holds, by key; it keeps holding them.
    pub fn take_all(&self) -> Result<Vec<(String, OwnedFd)>> {
        let conn = self.ask(&Request::TakeAll, None)?;
        let mut out = Vec::new();
        loop {
            match receive::<Answer>(conn.as_raw_fd()) {
                Ok((Answer::Held(key), Some(dev))) if is_fuse_connection(&dev) => {
                    out.push((key, dev))
                }
                Ok((Answer::Held(key), Some(_))) => {
                    tracing::warn!(view = %key, "the keeper handed over a descriptor that is no FUSE connection; not served");
                }
                Ok((Answer::Done, _)) => return Ok(out),
                Ok((other, _)) => {
                    return Err(Error::Internal(format!("the keeper answered {other:?}")));
                }
                Err(e) => {
                    return Err(Error::Transient(format!(
                        "the FUSE keeper at {} did not answer: {e}",
                        self.socket.display()
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Descriptors go to the keeper and come back the same open files.
    #[test]
    fn the_keeper_holds_descriptors_and_hands_them_back() {
        let d = tempfile::tempdir().unwrap();
        let socket = d.path().join("keeper.sock");
        let s = socket.clone();
        std::thread::spawn(move || run(&s));
        while !socket.exists() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let k = Keeper::new(&socket);
        let fuse = || OwnedFd::from(std::fs::File::open("/dev/fuse").unwrap());
        // A mark on `a`'s open file (status flags are the open file's,
        // shared by its duplicates), to know it when it comes back.
        let a = fuse();
        let marked = nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&a, nix::fcntl::FcntlArg::F_SETFL(marked)).unwrap();
        k.hold("/views/a", &a).unwrap();
        k.hold("/views/b", &fuse()).unwrap();
        k.release("/views/b").unwrap();
        // Anything but a FUSE connection is refused: a socket held under a
        // view's key would have the next driver answer that view's reads
        // to whoever holds the socket's other end.
        let (_mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let refused = k.hold("/views/c", &OwnedFd::from(theirs));
        assert!(
            matches!(refused, Err(Error::Internal(ref m)) if m.contains("not a FUSE connection")),
            "{refused:?}"
        );
        let file = OwnedFd::from(std::fs::File::open("/").unwrap());
        assert!(k.hold("/views/d", &file).is_err());
        let all = k.take_all().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].0, "/views/a");
        // The descriptor handed back is the same open file as `a`.
        let flags = nix::fcntl::fcntl(&all[0].1, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert!(nix::fcntl::OFlag::from_bits_truncate(flags).contains(marked));
        assert!(is_fuse_connection(&all[0].1));
        // Still held after a take.
        assert_eq!(k.take_all().unwrap().len(), 1);
        let gone = Keeper::new(&d.path().join("none.sock")).release("x");
        assert!(matches!(gone, Err(Error::Transient(_))), "{gone:?}");
    }
}
