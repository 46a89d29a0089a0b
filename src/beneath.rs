//! Opening a path beneath a directory with openat2(2), retried while the
//! kernel says a concurrent rename has not settled: the one retry every
//! confined open shares (a subPath, the driver's own layout, a file://
//! source).

use std::os::fd::OwnedFd;

use nix::errno::Errno;
use nix::fcntl::{OpenHow, openat2};

/// openat2(2), asked again while it answers EAGAIN: the kernel says that
/// when a concurrent rename could have let a ".." escape, and the rename
/// is over by the retry.
pub fn openat2_settled<P: ?Sized + nix::NixPath>(
    dir: &impl std::os::fd::AsFd,
    path: &P,
    how: OpenHow,
) -> nix::Result<OwnedFd> {
    let mut attempts = 0;
    loop {
        match openat2(dir.as_fd(), path, how) {
            Err(Errno::EAGAIN) if attempts < 8 => attempts += 1,
            r => return r,
        }
    }
}
