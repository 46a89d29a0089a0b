//! Mounting a FUSE filesystem this process serves: `/dev/fuse` opened and
//! handed to mount(2), read-only, nosuid, nodev.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::mount::{MsFlags, mount};

/// Mounts a read-only FUSE filesystem at `dst`, named `name` in the mount
/// table (`fuse.<name>`), and returns the connection its server reads.
/// Every user may read it (`allow_other`); the kernel checks the modes the
/// server reports (`default_permissions`), so a pod sees 0444 files.
pub fn mount_fuse(dst: &Path, name: &str) -> io::Result<OwnedFd> {
    let dev: OwnedFd = File::options()
        .read(true)
        .write(true)
        .open("/dev/fuse")?
        .into();
    let opts = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other",
        dev.as_raw_fd()
    );
    mount(
        Some(name),
        dst,
        Some(format!("fuse.{name}").as_str()),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(io::Error::from)?;
    Ok(dev)
}
