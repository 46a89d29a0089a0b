//! A real GlusterFS volume on this host, mounted by several native FUSE
//! clients, each standing for one node's mount of the shared filesystem.
//!
//! Needs Debian's glusterfs-server and glusterfs-client (tests/scripts/test.sh
//! installs them). glusterd is started when none runs and left running for
//! the other tests; the volume, its brick and every mount go on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub struct Gluster {
    name: String,
    dir: tempfile::TempDir,
    mounts: Vec<PathBuf>,
}

/// One gluster command at a time from this process: glusterd refuses a
/// second transaction while one runs ("Another transaction is in
/// progress"), and tests run in parallel.
fn gluster(args: &[&str]) -> std::io::Result<std::process::Output> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    Command::new("gluster")
        .arg("--mode=script")
        .args(args)
        .output()
}

fn ok(out: std::io::Result<std::process::Output>, what: &str) {
    let out = out.unwrap_or_else(|e| {
        panic!("{what}: cannot run it ({e}); install glusterfs-server and glusterfs-client")
    });
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn hostname() -> String {
    String::from_utf8(Command::new("hostname").output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string()
}

fn glusterd_up() {
    // Tests run side by side: two that both found no glusterd would both
    // start one, and the second fails on the first's port.
    static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = STARTING.lock().unwrap_or_else(|p| p.into_inner());
    let running = || {
        Command::new("pgrep")
            .args(["-x", "glusterd"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !running() {
        let st = Command::new("glusterd")
            .arg("--log-file=/tmp/modelcache-it-glusterd.log")
            .status()
            .expect("glusterd (Debian's glusterfs-server) is not installed");
        // One left by another process may have come up meanwhile.
        assert!(st.success() || running(), "glusterd did not start");
    }
    let t0 = Instant::now();
    while !gluster(&["volume", "list"]).is_ok_and(|o| o.status.success()) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "glusterd does not answer"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Gluster {
    /// A one-brick volume, started, not yet mounted.
    pub fn volume() -> Gluster {
        static N: AtomicU32 = AtomicU32::new(0);
        glusterd_up();
        let name = format!(
            "mcit-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::Builder::new()
            .prefix("mc-gluster-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let brick = dir.path().join("brick");
        std::fs::create_dir(&brick).unwrap();
        let host = hostname();
        // force: a brick on the root filesystem.
        ok(
            gluster(&[
                "volume",
                "create",
                &name,
                &format!("{host}:{}", brick.display()),
                "force",
            ]),
            "volume create",
        );
        ok(gluster(&["volume", "start", &name]), "volume start");
        Gluster {
            name,
            dir,
            mounts: Vec::new(),
        }
    }

    /// Mounts the volume once more (another client, another "node") with
    /// the FUSE client's `options` (comma-separated, may be empty).
    pub fn mount(&mut self, options: &str) -> PathBuf {
        let at = self.dir.path().join(format!("m{}", self.mounts.len()));
        std::fs::create_dir(&at).unwrap();
        let log = self
            .dir
            .path()
            .join(format!("client{}.log", self.mounts.len()));
        let mut opts = format!("log-file={}", log.display());
        if !options.is_empty() {
            opts = format!("{opts},{options}");
        }
        let host = hostname();
        // output(): mount.glusterfs prints the client's pid.
        ok(
            Command::new("mount")
                .args(["-t", "glusterfs", "-o", &opts])
                .arg(format!("{host}:/{}", self.name))
                .arg(&at)
                .output(),
            "mount -t glusterfs",
        );
        self.mounts.push(at.clone());
        at
    }

    /// Stops the volume's brick processes: every client loses its server.
    pub fn stop_server(&self) {
        ok(
            gluster(&["volume", "stop", &self.name, "force"]),
            "volume stop",
        );
    }

    /// Starts the bricks again; clients reconnect by themselves.
    pub fn start_server(&self) {
        ok(
            gluster(&["volume", "start", &self.name, "force"]),
            "volume start",
        );
    }

    /// Starts counting the bricks' file operations (`volume profile`).
    pub fn profile_start(&self) {
        ok(
            gluster(&["volume", "profile", &self.name, "start"]),
            "profile start",
        );
        let _ = self.profile_incremental();
    }

    pub fn profile_stop(&self) {
        ok(
            gluster(&["volume", "profile", &self.name, "stop"]),
            "profile stop",
        );
    }

    /// The bricks' operation counts since the last call, as gluster prints them.
    pub fn profile_incremental(&self) -> String {
        let out = gluster(&["volume", "profile", &self.name, "info", "incremental"]).unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Where a client mounted at `mount` sees what the server holds at
    /// `on_server` (a path under the brick).
    pub fn on_client(&self, mount: &Path, on_server: &Path) -> PathBuf {
        let brick = self.dir.path().join("brick");
        mount.join(on_server.strip_prefix(&brick).unwrap_or(on_server))
    }

    /// The server's copy of a directory named `name` (the first found,
    /// depth first), read from the brick, past every client.
    pub fn on_server(&self, name: &str) -> Option<PathBuf> {
        let mut stack = vec![self.dir.path().join("brick")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).ok()?.flatten() {
                let p = e.path();
                if e.file_name() == ".glusterfs" || !p.is_dir() {
                    continue;
                }
                if e.file_name() == name {
                    return Some(p);
                }
                stack.push(p);
            }
        }
        None
    }

    /// Sets a volume option (`gluster volume set`).
    pub fn set(&self, key: &str, value: &str) {
        ok(
            gluster(&["volume", "set", &self.name, key, value]),
            "volume set",
        );
    }

    /// The brick processes' pids, from their command lines (they name the
    /// brick's directory).
    pub fn brick_pids(&self) -> Vec<i32> {
        let brick = self.dir.path().join("brick");
        let out = Command::new("pgrep")
            .args(["-f", &format!("glusterfsd.*{}", brick.display())])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Kills the bricks `pids` (SIGKILL), as when the server crashes:
    /// clients see their connections reset at once, where `stop_server`
    /// goes through glusterd first. `start_server` brings them back.
    pub fn kill_bricks(&self, pids: &[i32]) {
        assert!(!pids.is_empty(), "no brick process to kill");
        for &p in pids {
            // SAFETY: a signal to a brick process of this test's volume.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }

    /// Freezes the bricks (SIGSTOP): connections stay open and nothing
    /// answers, as when the network to the server is gone.
    pub fn freeze_server(&self) {
        let pids = self.brick_pids();
        assert!(!pids.is_empty(), "no brick process to freeze");
        for p in pids {
            // SAFETY: a signal to a brick process of this test's volume.
            unsafe { libc::kill(p, libc::SIGSTOP) };
        }
    }

    /// Lets the frozen bricks run again after `after`, from a thread.
    pub fn thaw_server_later(&self, after: std::time::Duration) {
        let pids = self.brick_pids();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            for p in pids {
                // SAFETY: as in freeze_server.
                unsafe { libc::kill(p, libc::SIGCONT) };
            }
        });
    }

    /// Unmounts one client (a node gone with its mount).
    pub fn unmount(&mut self, at: &std::path::Path) {
        if let Some(i) = self.mounts.iter().position(|m| m == at) {
            umount(&self.mounts.remove(i));
        }
    }
}

fn umount(m: &std::path::Path) {
    if !Command::new("umount")
        .arg(m)
        .status()
        .is_ok_and(|s| s.success())
    {
        let _ = Command::new("umount").arg("-l").arg(m).status();
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        for m in self.mounts.iter().rev() {
            umount(m);
        }
        let _ = gluster(&["volume", "stop", &self.name, "force"]);
        let _ = gluster(&["volume", "delete", &self.name]);
    }
}
