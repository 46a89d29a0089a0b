//! Loop devices over cache images.
//!
//! Devices are attached with autoclear, so the kernel, not this process, detaches a device when
//! its last user goes away, even if we were killed in between. This module therefore never
//! detaches a device outside tests, and reuses a matching device instead of attaching a second
//! one over the same image.
//!
//! The ioctls are issued directly (LOOP_CONFIGURE attaches and sets flags in one atomic step);
//! the loopdev-3 crate needs libclang at build time and attaches in two steps.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use super::with_context;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// The device reads its backing file with O_DIRECT: a page the filesystem
/// on the device caches is not cached a second time under the backing
/// file (a read-only model read once took 2x its size in page cache, at a
/// quarter of the disk's speed).
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64` from <linux/loop.h>.
#[repr(C)]
#[allow(
    dead_code,
    reason = "mirrors the kernel ABI; only some fields are read"
)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

impl LoopInfo64 {
    const ZERO: Self = Self {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: 0,
        lo_sizelimit: 0,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: 0,
        lo_file_name: [0; 64],
        lo_crypt_name: [0; 64],
        lo_encrypt_key: [0; 32],
        lo_init: [0; 2],
    };
}

/// `struct loop_config` from <linux/loop.h>.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(size_of::<LoopInfo64>() == 232 && size_of::<LoopConfig>() == 304);

mod ioctl {
    use super::{LoopConfig, LoopInfo64};
    // The loop ioctl numbers predate the _IOC encoding, hence the *_bad macros.
    nix::ioctl_none_bad!(loop_ctl_get_free, 0x4C82);
    nix::ioctl_write_ptr_bad!(loop_configure, 0x4C0A, LoopConfig);
    nix::ioctl_read_bad!(loop_get_status64, 0x4C05, LoopInfo64);
    nix::ioctl_none_bad!(loop_clr_fd, 0x4C01);
    nix::ioctl_none_bad!(loop_set_capacity, 0x4C07);
}

/// Makes `dev` take the current size of its backing file, after it grew.
pub fn refresh_capacity(dev: &Path) -> io::Result<()> {
    let device = open_device(dev, false)?;
    // SAFETY: plain ioctl on an fd we own.
    unsafe { ioctl::loop_set_capacity(device.as_raw_fd()) }
        .map(drop)
        .map_err(|e| with_context(e, format_args!("LOOP_SET_CAPACITY on {}", dev.display())))
}

/// An attached loop device, held open. While it is open, autoclear cannot detach the device, so
/// keep it until the device is mounted and drop it afterwards.
#[derive(Debug)]
pub struct LoopHandle {
    path: PathBuf,
    reused: bool,
    _device: File,
}

impl LoopHandle {
    /// The device node, e.g. `/dev/loop3`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if the device was already attached to the image before this call.
    pub fn reused(&self) -> bool {
        self.reused
    }
}

/// A loop device over `image` with the requested read-only-ness: an existing one when there is
/// one, otherwise a newly attached one with autoclear.
pub fn attach(image: &Path, readonly: bool) -> io::Result<LoopHandle> {
    let image = canonical(image)?;
    let backing = OpenOptions::new()
        .read(true)
        .write(!readonly)
        .open(&image)
        .map_err(|e| with_context(e, format_args!("open {}", image.display())))?;
    attach_opened(&image, backing, readonly)
}

/// As `attach`, over a file the caller opened (beneath its root, with no
/// symlink on the way): the device is bound to exactly that file, whatever
/// is renamed or linked into its place meanwhile. Only a regular file is
/// accepted. The kernel's name for it is used to find devices to reuse.
pub fn attach_file(backing: File, readonly: bool) -> io::Result<LoopHandle> {
    let meta = backing.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a loop device is attached only over a regular file",
        ));
    }
    let image = std::fs::read_link(format!("/proc/self/fd/{}", backing.as_raw_fd()))?;
    attach_opened(&image, backing, readonly)
}

fn attach_opened(image: &Path, backing: File, readonly: bool) -> io::Result<LoopHandle> {
    let image = image.to_path_buf();
    let meta = backing.metadata()?;
    for (dev, _) in backed_by(&image)?
        .into_iter()
        .filter(|(_, ro)| *ro == readonly)
    {
        if let Some(handle) = reuse(&dev, readonly, &meta)? {
            tracing::debug!(image = %image.display(), dev = %dev.display(), "reusing loop device");
            return Ok(handle);
        }
    }
    attach_new(&image, &backing, readonly)
}

/// Open `dev` and, now that autoclear can no longer take it from under us, check that it is
/// still bound to the same file with the same read-only-ness. `None` if it is not.
fn reuse(dev: &Path, readonly: bool, image: &std::fs::Metadata) -> io::Result<Option<LoopHandle>> {
    let device = match open_device(dev, readonly) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(None),
        Err(e) => return Err(with_context(e, format_args!("open {}", dev.display()))),
    };
    let mut info = LoopInfo64::ZERO;
    // SAFETY: the fd is open for the whole call and `info` matches the kernel's layout.
    match unsafe { ioctl::loop_get_status64(device.as_raw_fd(), &mut info) } {
        Ok(_) => {}
        Err(Errno::ENXIO) => return Ok(None),
        Err(e) => {
            return Err(with_context(
                e,
                format_args!("LOOP_GET_STATUS64 {}", dev.display()),
            ));
        }
    }
    let same = info.lo_device == image.dev()
        && info.lo_inode == image.ino()
        && (info.lo_flags & LO_FLAGS_READ_ONLY != 0) == readonly;
    Ok(same.then(|| LoopHandle {
        path: dev.to_owned(),
        reused: true,
        _device: device,
    }))
}

fn attach_new(image: &Path, backing: &File, readonly: bool) -> io::Result<LoopHandle> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(|e| with_context(e, "open /dev/loop-control"))?;
    // The device must show the image as the filesystem holds it now, not
    // as this client cached it before another node wrote it.
    crate::state::forget_cached_pages(backing);
    let mut flags = LO_FLAGS_AUTOCLEAR;
    if readonly {
        // Readers only: a writer's small writes would each go to the disk.
        flags |= LO_FLAGS_READ_ONLY | LO_FLAGS_DIRECT_IO;
    }
    let config_with = |flags: u32| LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: 0,
        info: LoopInfo64 {
            lo_flags: flags,
            ..LoopInfo64::ZERO
        },
        reserved: [0; 8],
    };
    let mut config = config_with(flags);
    // Another process may take the free device between asking and configuring it.
    for _ in 0..16 {
        // SAFETY: plain ioctl on an fd we own.
        let n = unsafe { ioctl::loop_ctl_get_free(control.as_raw_fd()) }
            .map_err(|e| with_context(e, "LOOP_CTL_GET_FREE"))?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        // The kernel also forces read-only when this fd is not writable.
        let device = open_device(&path, readonly)
            .map_err(|e| with_context(e, format_args!("open {}", path.display())))?;
        // SAFETY: `config` matches the kernel's layout and `backing` outlives the call.
        match unsafe { ioctl::loop_configure(device.as_raw_fd(), &config) } {
            Ok(_) => {
                tracing::debug!(image = %image.display(), dev = %path.display(), readonly, "attached loop device");
                return Ok(LoopHandle {
                    path,
                    reused: false,
                    _device: device,
                });
            }
            Err(Errno::EBUSY) => continue,
            // A backing filesystem that cannot do direct I/O at this
            // block size: read through its page cache, as before.
            Err(Errno::EINVAL) if config.info.lo_flags & LO_FLAGS_DIRECT_IO != 0 => {
                tracing::info!(image = %image.display(), "the image's filesystem refuses direct I/O for a loop device; it is read through the page cache");
                config = config_with(config.info.lo_flags & !LO_FLAGS_DIRECT_IO);
            }
            Err(e) => {
                return Err(with_context(
                    e,
                    format_args!("LOOP_CONFIGURE {} over {}", path.display(), image.display()),
                ));
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!("no free loop device for {}", image.display()),
    ))
}

fn open_device(dev: &Path, readonly: bool) -> io::Result<File> {
    OpenOptions::new().read(true).write(!readonly).open(dev)
}

/// Every loop device whose backing file is `image`, with its read-only flag, ordered by number.
pub fn devices_backed_by(image: &Path) -> io::Result<Vec<(PathBuf, bool)>> {
    backed_by(&canonical(image)?)
}

fn backed_by(image: &Path) -> io::Result<Vec<(PathBuf, bool)>> {
    let sys = Path::new("/sys/block");
    let entries = sys
        .read_dir()
        .map_err(|e| with_context(e, "read /sys/block"))?;
    let mut found = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|s| s.strip_prefix("loop"))
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = sys.join(&name);
        if read_backing_file(&dir)?.as_deref() != Some(image) {
            continue;
        }
        let ro = match std::fs::read(dir.join("ro")) {
            Ok(v) => v.starts_with(b"1"),
            // Detached and removed while we looked.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(with_context(e, format_args!("read {}/ro", dir.display()))),
        };
        found.push((n, ro));
    }
    found.sort_unstable();
    Ok(found
        .into_iter()
        .map(|(n, ro)| (PathBuf::from(format!("/dev/loop{n}")), ro))
        .collect())
}

/// The backing file of the loop device `dev`, as the kernel reports it (a deleted file ends in
/// " (deleted)"). `None` when `dev` is not attached or not a loop device.
pub fn backing_file(dev: &Path) -> io::Result<Option<PathBuf>> {
    let meta = std::fs::metadata(dev)
        .map_err(|e| with_context(e, format_args!("stat {}", dev.display())))?;
    if !meta.file_type().is_block_device() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a block device", dev.display()),
        ));
    }
    let (major, minor) = (
        nix::sys::stat::major(meta.rdev()),
        nix::sys::stat::minor(meta.rdev()),
    );
    read_backing_file(Path::new(&format!("/sys/dev/block/{major}:{minor}")))
}

/// Read `<sysfs device dir>/loop/backing_file`; the `loop` directory exists only while bound.
fn read_backing_file(sys_dir: &Path) -> io::Result<Option<PathBuf>> {
    let file = sys_dir.join("loop/backing_file");
    match std::fs::read(&file) {
        Ok(mut bytes) => {
            if bytes.last() == Some(&b'\n') {
                bytes.pop();
            }
            Ok(Some(std::ffi::OsString::from_vec(bytes).into()))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(with_context(e, format_args!("read {}", file.display()))),
    }
}

/// Detach `dev` (LOOP_CLR_FD); already detached is fine. For test cleanup only: on a device that
/// is still in use the kernel merely sets autoclear.
pub fn detach(dev: &Path) -> io::Result<()> {
    let device =
        File::open(dev).map_err(|e| with_context(e, format_args!("open {}", dev.display())))?;
    // SAFETY: plain ioctl on an fd we own.
    match unsafe { ioctl::loop_clr_fd(device.as_raw_fd()) } {
        Ok(_) | Err(Errno::ENXIO) => Ok(()),
        Err(e) => Err(with_context(
            e,
            format_args!("LOOP_CLR_FD {}", dev.display()),
        )),
    }
}

fn canonical(image: &Path) -> io::Result<PathBuf> {
    std::fs::canonicalize(image)
        .map_err(|e| with_context(e, format_args!("resolve {}", image.display())))
}

#[cfg(test)]
mod tests {
    use super::super::testing::MountGuard;
    use super::super::{mount_at, mount_device, read_table, unmount};
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// Detaches, on drop, every device still backed by the image; needed only if autoclear
    /// failed, since loop devices outlive the test's mount namespace.
    struct DetachGuard(PathBuf);

    impl Drop for DetachGuard {
        fn drop(&mut self) {
            for (dev, _) in devices_backed_by(&self.0).unwrap_or_default() {
                let _ = detach(&dev);
            }
        }
    }

    fn xfs_image(dir: &Path) -> PathBuf {
        let image = dir.join("cache.img");
        File::create(&image).unwrap().set_len(300 << 20).unwrap();
        let out = Command::new("mkfs.xfs")
            .arg("-q")
            .arg(&image)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::canonicalize(image).unwrap()
    }

    fn released(image: &Path) -> bool {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            if devices_backed_by(image).unwrap().is_empty() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn readonly_device_is_shared_and_released_after_last_unmount() {
        let tmp = tempfile::tempdir().unwrap();
        let image = xfs_image(tmp.path());
        let _detach = DetachGuard(image.clone());

        let first = attach(&image, true).unwrap();
        let second = attach(&image, true).unwrap();
        assert!(!first.reused());
        assert!(second.reused());
        assert_eq!(first.path(), second.path());
        let dev = first.path().to_owned();
        assert_eq!(devices_backed_by(&image).unwrap(), [(dev.clone(), true)]);
        // Readers read the image with direct I/O: one page cache, the
        // filesystem's on the device, not a second under the image file.
        let name = dev.file_name().unwrap().to_string_lossy().into_owned();
        let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap();
        assert_eq!(
            dio.trim(),
            "1",
            "{dev:?} reads its image through the page cache"
        );
        let rw = attach(&image, false).unwrap();
        let rw_name = rw
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let rw_dio = std::fs::read_to_string(format!("/sys/block/{rw_name}/loop/dio")).unwrap();
        assert_eq!(
            rw_dio.trim(),
            "0",
            "a writer's device writes through the page cache"
        );
        drop(rw);
        assert_eq!(backing_file(&dev).unwrap().as_deref(), Some(&*image));

        let dirs = [image.with_file_name("a"), image.with_file_name("b")];
        let mut guards = Vec::new();
        for (dir, handle) in dirs.iter().zip([&first, &second]) {
            std::fs::create_dir(dir).unwrap();
            mount_device(handle.path(), dir, "xfs", true, "norecovery,nouuid").unwrap();
            guards.push(MountGuard(dir.clone()));
        }
        let table = read_table().unwrap();
        for dir in &dirs {
            let m = mount_at(&table, dir).unwrap();
            assert_eq!(
                (m.fs_type.as_str(), m.source.as_str()),
                ("xfs", &*dev.to_string_lossy())
            );
            assert!(m.mount_options.iter().any(|o| o == "ro"), "{m:?}");
            assert!(
                m.has_option("norecovery") && m.has_option("nouuid"),
                "{m:?}"
            );
        }

        // Closing our handles must not detach a mounted device.
        drop((first, second));
        assert_eq!(devices_backed_by(&image).unwrap().len(), 1);
        for dir in &dirs {
            assert!(unmount(dir).unwrap());
        }
        assert!(released(&image), "{} still attached", dev.display());
        assert_eq!(backing_file(&dev).unwrap(), None);
    }

    #[test]
    fn readonly_and_writable_devices_are_kept_apart() {
        let tmp = tempfile::tempdir().unwrap();
        let image = tmp.path().join("plain.img");
        File::create(&image).unwrap().set_len(1 << 20).unwrap();
        let _detach = DetachGuard(std::fs::canonicalize(&image).unwrap());

        let rw = attach(&image, false).unwrap();
        let ro = attach(&image, true).unwrap();
        assert!(!ro.reused());
        assert_ne!(rw.path(), ro.path());
        let mut seen = devices_backed_by(&image).unwrap();
        seen.sort_by_key(|(_, ro)| *ro);
        assert_eq!(
            seen,
            [(rw.path().to_owned(), false), (ro.path().to_owned(), true)]
        );
        let again = attach(&image, false).unwrap();
        assert!(again.reused());
        assert_eq!(again.path(), rw.path());

        drop((rw, ro, again));
        assert!(released(&image));
    }

    #[test]
    fn detach_waits_for_the_last_opener() {
        let tmp = tempfile::tempdir().unwrap();
        let image = tmp.path().join("idle.img");
        File::create(&image).unwrap().set_len(1 << 20).unwrap();
        let _detach = DetachGuard(std::fs::canonicalize(&image).unwrap());

        let handle = attach(&image, true).unwrap();
        let dev = handle.path().to_owned();
        detach(&dev).unwrap();
        // Still open through the handle, so the kernel only marks it for autoclear.
        assert!(backing_file(&dev).unwrap().is_some());
        drop(handle);
        assert!(released(&image));
        detach(&dev).unwrap();
    }

    #[test]
    fn backing_file_of_non_devices() {
        assert_eq!(
            backing_file(Path::new("/etc/hostname")).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            backing_file(Path::new("/nonexistent/loop9"))
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
    }
}
