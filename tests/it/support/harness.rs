//! The harness for the integration tests: the real `modelcache-csi` binary
//! started as a child process in a fresh temp dir, driven over its Unix
//! socket with the generated client, and torn down so that nothing it
//! mounted or attached outlives the test, even when the test panics.
//!
//! Tests run as root inside `unshare -m --propagation private`, so mounts
//! made here never reach the host; loop devices are global, which is why
//! `Drop` detaches those backed by files under the temp dir.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use modelcache_csi::client::Client;
use modelcache_csi::csi::volume_capability::access_mode::Mode;
use modelcache_csi::csi::*;
use modelcache_csi::mount::{self, MountEntry, loopdev};
use tonic::Status;

pub const NODE: &str = "node-1";
pub const MIB: i64 = 1 << 20;
/// The smallest XFS image the driver makes (mkfs.xfs refuses less); sparse.
pub const XFS_BYTES: i64 = 300 * MIB;

/// One running driver (controller and node in one process) and its temp dir.
pub struct Driver {
    /// Canonical temp dir holding everything below.
    pub dir: PathBuf,
    /// The node this driver serves (`--node-id`).
    pub node_id: String,
    pub state_dir: PathBuf,
    pub shared_dir: PathBuf,
    pub socket: PathBuf,
    pub client: Client,
    extra_args: Vec<String>,
    env: Vec<(String, String)>,
    /// The network namespace (a name under /run/netns) it runs in, if not
    /// this process's.
    netns: Option<String>,
    log: PathBuf,
    child: Child,
    // Dropped last, after `Drop::drop` has unmounted everything under it.
    _tmp: tempfile::TempDir,
}

impl Driver {
    /// Starts the driver with every backend (local, xfs, shared).
    pub async fn start() -> Driver {
        Driver::start_with(&[]).await
    }

    /// Starts the driver with extra command-line arguments.
    pub async fn start_with(extra_args: &[&str]) -> Driver {
        Driver::start_with_env(extra_args, &[]).await
    }

    /// Starts the driver with Kubernetes API access to `api` (as its
    /// admin), and extra command-line arguments.
    pub async fn start_against(api: &super::apiserver::ApiServer, extra_args: &[&str]) -> Driver {
        let kubeconfig = api.kubeconfig_path();
        let mut args = vec![
            "--kube-api",
            "on",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ];
        args.extend_from_slice(extra_args);
        Driver::start_with(&args).await
    }

    /// Starts the driver with extra arguments and environment variables
    /// (the credentials an admin gives the driver's pod, say).
    pub async fn start_with_env(extra_args: &[&str], env: &[(&str, &str)]) -> Driver {
        Driver::start_node_with_env(NODE, None, extra_args, env, None).await
    }

    /// Starts the driver as node `node_id`, with its own state dir and, when
    /// given, another driver's `--shared-path` (two nodes sharing one
    /// filesystem). Drop the drivers sharing a path before its owner.
    pub async fn start_node(node_id: &str, shared: Option<&Path>, extra_args: &[&str]) -> Driver {
        Driver::start_node_with_env(node_id, shared, extra_args, &[], None).await
    }

    /// As `start_node`, in network namespace `netns` (`ip netns add`):
    /// a node behind a link of its own.
    pub async fn start_node_in(netns: &str, node_id: &str, extra_args: &[&str]) -> Driver {
        Driver::start_node_with_env(node_id, None, extra_args, &[], Some(netns)).await
    }

    async fn start_node_with_env(
        node_id: &str,
        shared: Option<&Path>,
        extra_args: &[&str],
        env: &[(&str, &str)],
        netns: Option<&str>,
    ) -> Driver {
        let tmp = tempfile::Builder::new()
            .prefix("mc-test-")
            .tempdir()
            .expect("create temp dir");
        let dir = fs::canonicalize(tmp.path()).expect("resolve temp dir");
        let state_dir = dir.join("state");
        let shared_dir = shared.map_or_else(|| dir.join("shared"), Path::to_path_buf);
        fs::create_dir_all(&shared_dir).expect("create shared dir");
        let socket = dir.join("csi.sock");
        let log = dir.join("driver.log");
        let mut extra_args: Vec<String> = extra_args.iter().map(|s| s.to_string()).collect();
        extra_args.splice(0..0, ["--node-id".to_string(), node_id.to_string()]);
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let netns = netns.map(str::to_string);
        let mut child = spawn(
            &socket,
            &state_dir,
            &shared_dir,
            &log,
            &extra_args,
            &env,
            netns.as_deref(),
        );
        let client = match connect(&mut child, &socket, &log).await {
            Ok(c) => c,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{e}");
            }
        };
        Driver {
            dir,
            node_id: node_id.to_string(),
            state_dir,
            shared_dir,
            socket,
            client,
            extra_args,
            env,
            netns,
            log,
            child,
            _tmp: tmp,
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the driver: a node whose
    /// process hangs, its sockets open and silent.
    pub fn freeze(&self, frozen: bool) {
        let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) on our own child's pid, with no memory passed.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "signal {sig} to the driver");
    }

    /// SIGKILL: no handler runs, no cleanup; mounts and leases stay as they are.
    pub fn kill_9(&mut self) {
        self.child.kill().expect("kill -9 driver");
        self.child.wait().expect("reap driver");
    }

    /// Starts the driver again on the same directories and reconnects.
    pub async fn restart(&mut self) {
        if self.child.try_wait().expect("wait for driver").is_none() {
            self.kill_9();
        }
        // The stale socket would accept nothing; the new process replaces it.
        let _ = fs::remove_file(&self.socket);
        self.child = spawn(
            &self.socket,
            &self.state_dir,
            &self.shared_dir,
            &self.log,
            &self.extra_args,
            &self.env,
            self.netns.as_deref(),
        );
        match connect(&mut self.child, &self.socket, &self.log).await {
            Ok(c) => self.client = c,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `secs` for the process to exit; its status, or None.
    pub fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().expect("wait for driver") {
                return Some(st);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A staging path as kubelet would pass it (not created: the driver makes it).
    pub fn staging(&self, name: &str) -> PathBuf {
        self.dir.join("kubelet/staging").join(name)
    }

    /// A pod's target path (not created: the driver makes it).
    pub fn target(&self, name: &str) -> PathBuf {
        self.dir.join("kubelet/pods").join(name).join("mount")
    }

    /// The JSON record of a volume on the node-local `backend`.
    pub fn record_path(&self, backend: &str, volume_id: &str) -> PathBuf {
        self.state_dir
            .join(backend)
            .join("volumes")
            .join(format!("{}.json", uuid_of(volume_id)))
    }

    /// The directory of a node-local source on `backend`.
    pub fn source_dir(&self, backend: &str, source_id: &str) -> PathBuf {
        self.state_dir.join(backend).join("sources").join(source_id)
    }

    // Thin wrappers over the RPCs. Each clones the client (cheap: one
    // shared channel), so they take `&self` and can run concurrently.

    /// CreateVolume as external-provisioner sends it: tried again while
    /// the answer is Aborted (another operation holds the volume, such as
    /// a restarted driver's own resume of its pull) or Unavailable, for up
    /// to `bound`; each call with `deadline`, when given. The last answer.
    pub async fn create_until_done(
        &self,
        req: &CreateVolumeRequest,
        deadline: Option<Duration>,
        bound: Duration,
    ) -> Result<Volume, Status> {
        let until = Instant::now() + bound;
        loop {
            let mut call = tonic::Request::new(req.clone());
            if let Some(d) = deadline {
                call.set_timeout(d);
            }
            match self.client.clone().controller.create_volume(call).await {
                Err(s)
                    if matches!(s.code(), tonic::Code::Aborted | tonic::Code::Unavailable)
                        && Instant::now() < until =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                r => {
                    return r.map(|v| {
                        v.into_inner()
                            .volume
                            .expect("CreateVolume returned no volume")
                    });
                }
            }
        }
    }

    pub async fn create(&self, req: CreateVolumeRequest) -> Result<Volume, Status> {
        let resp = self.client.clone().controller.create_volume(req).await?;
        Ok(resp
            .into_inner()
            .volume
            .expect("CreateVolume returned no volume"))
    }

    /// A writable source volume on `backend`.
    pub async fn create_source(&self, name: &str, backend: &str) -> Volume {
        let mut req = create_req(name, &[("backend", backend)], WRITER);
        if backend == "xfs" {
            req.capacity_range = Some(CapacityRange {
                required_bytes: XFS_BYTES,
                limit_bytes: 0,
            });
        }
        self.create(req).await.expect("create source volume")
    }

    /// A read-only cache volume cloned from `source_id`.
    pub async fn create_cache(
        &self,
        name: &str,
        source_id: &str,
        params: &[(&str, &str)],
    ) -> Result<Volume, Status> {
        self.create(clone_req(name, params, source_id, READER))
            .await
    }

    pub async fn delete(&self, volume_id: &str) -> Result<(), Status> {
        let req = DeleteVolumeRequest {
            volume_id: volume_id.into(),
            ..Default::default()
        };
        self.client.clone().controller.delete_volume(req).await?;
        Ok(())
    }

    /// ControllerModifyVolume sealed=true.
    pub async fn seal(&self, volume_id: &str) -> Result<(), Status> {
        let req = ControllerModifyVolumeRequest {
            volume_id: volume_id.into(),
            mutable_parameters: map(&[("sealed", "true")]),
            ..Default::default()
        };
        self.client
            .clone()
            .controller
            .controller_modify_volume(req)
            .await?;
        Ok(())
    }

    pub async fn stage(&self, volume_id: &str, staging: &Path, mode: Mode) -> Result<(), Status> {
        self.stage_req(stage_req(volume_id, staging, mount_cap(mode, &[])))
            .await
    }

    pub async fn stage_req(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        self.client.clone().node.node_stage_volume(req).await?;
        Ok(())
    }

    pub async fn unstage(&self, volume_id: &str, staging: &Path) -> Result<(), Status> {
        let req = NodeUnstageVolumeRequest {
            volume_id: volume_id.into(),
            staging_target_path: path_str(staging),
        };
        self.client.clone().node.node_unstage_volume(req).await?;
        Ok(())
    }

    /// NodePublish with the given access mode, no mount flags.
    pub async fn publish(
        &self,
        volume_id: &str,
        staging: &Path,
        target: &Path,
        mode: Mode,
        readonly: bool,
    ) -> Result<(), Status> {
        self.publish_req(publish_req(
            volume_id,
            staging,
            target,
            mount_cap(mode, &[]),
            readonly,
        ))
        .await
    }

    pub async fn publish_req(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        self.client.clone().node.node_publish_volume(req).await?;
        Ok(())
    }

    pub async fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), Status> {
        let req = NodeUnpublishVolumeRequest {
            volume_id: volume_id.into(),
            target_path: path_str(target),
        };
        self.client.clone().node.node_unpublish_volume(req).await?;
        Ok(())
    }

    /// Every volume, walking ListVolumes pages of `max_entries`.
    pub async fn list_all(&self, max_entries: i32) -> Vec<Volume> {
        let mut out = Vec::new();
        let mut token = String::new();
        loop {
            let page = self
                .client
                .clone()
                .controller
                .list_volumes(ListVolumesRequest {
                    max_entries,
                    starting_token: token,
                })
                .await
                .expect("ListVolumes")
                .into_inner();
            if max_entries > 0 {
                assert!(page.entries.len() <= max_entries as usize, "{page:?}");
            }
            out.extend(page.entries.into_iter().filter_map(|e| e.volume));
            if page.next_token.is_empty() {
                return out;
            }
            token = page.next_token;
        }
    }
}

// ---- the operator's CLI: what a user watches on a node ----

/// How long a model may take to seal after a create answered before its
/// seal (a class without `progressive` answers once every file is
/// verified; the seal follows): far more than the moment it takes, so
/// that only a seal that never comes fails.
pub const SEAL_BOUND: Duration = Duration::from_secs(60);

/// What one run of `modelcache-csi cache ...` said.
pub struct CliRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl From<std::process::Output> for CliRun {
    fn from(out: std::process::Output) -> CliRun {
        CliRun {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl CliRun {
    /// Its stdout as JSON; fails the test if the run failed.
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        assert!(self.ok, "failed: {}{}", self.stdout, self.stderr);
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

/// `modelcache-csi cache ARGS` on a node's roots, as a separate process.
fn run_cli(state_dir: &Path, shared_dir: &Path, node_id: &str, args: &[String]) -> CliRun {
    Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
        .arg("cache")
        .arg("--state-dir")
        .arg(state_dir)
        .arg("--shared-path")
        .arg(shared_dir)
        .arg("--node-id")
        .arg(node_id)
        .args(args)
        .output()
        .expect("run modelcache-csi cache")
        .into()
}

/// The sealed models in a `cache ls --output json` listing.
fn sealed_in(listing: &serde_json::Value) -> Vec<serde_json::Value> {
    listing
        .as_array()
        .expect("cache ls --output json lists an array")
        .iter()
        .filter(|e| e["kind"] == "model" && e["sealed"] == true)
        .cloned()
        .collect()
}

impl Driver {
    /// `modelcache-csi cache ARGS` on this driver's roots, run as its own
    /// process, as an operator runs it in the node plugin's container.
    pub fn cli(&self, args: &[&str]) -> CliRun {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        run_cli(&self.state_dir, &self.shared_dir, &self.node_id, &args)
    }

    /// The sealed models `cache ls --output json` lists now.
    #[track_caller]
    pub fn models(&self) -> Vec<serde_json::Value> {
        sealed_in(&self.cli(&["ls", "--output", "json"]).json())
    }

    /// Polls `cache ls` (off the runtime, every 100 ms) until `done` holds
    /// of the sealed models it lists, or `bound` passes: Ok with that
    /// listing, or Err saying what it listed last (or how it failed).
    pub async fn sealed_within(
        &self,
        bound: Duration,
        done: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Result<Vec<serde_json::Value>, String> {
        let deadline = Instant::now() + bound;
        let last = loop {
            let (state, shared, node) = (
                self.state_dir.clone(),
                self.shared_dir.clone(),
                self.node_id.clone(),
            );
            let run = tokio::task::spawn_blocking(move || {
                let ls = ["ls", "--output", "json"].map(String::from);
                run_cli(&state, &shared, &node, &ls)
            })
            .await
            .expect("run cache ls");
            // A failed listing is not an answer: the next poll asks again.
            let last = match run.ok {
                true => {
                    let models = sealed_in(&run.json());
                    if done(&models) {
                        return Ok(models);
                    }
                    format!("{models:#?}")
                }
                false => format!("cache ls failed: {}{}", run.stdout, run.stderr),
            };
            if Instant::now() > deadline {
                break last;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Err(last)
    }

    /// Waits, at most `bound`, until `cache ls` lists every one of `sids`
    /// as a sealed model (a create may answer before its model's seal);
    /// then every sealed model it lists.
    pub async fn wait_sealed(&self, sids: &[&str], bound: Duration) -> Vec<serde_json::Value> {
        let all_in = |m: &[serde_json::Value]| sids.iter().all(|s| m.iter().any(|e| e["id"] == *s));
        self.sealed_within(bound, all_in)
            .await
            .unwrap_or_else(|last| {
                panic!("{sids:?} not all sealed after {bound:?}; cache ls lists: {last}")
            })
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let leftovers = clean_up(&self.dir);
        if std::thread::panicking() {
            eprintln!(
                "---- driver log ({}) ----\n{}",
                self.log.display(),
                self.log_text()
            );
            if !leftovers.is_empty() {
                eprintln!("cleaned up after the failed test: {leftovers:#?}");
            }
        }
    }
}

fn spawn(
    socket: &Path,
    state_dir: &Path,
    shared_dir: &Path,
    log: &Path,
    extra_args: &[String],
    env: &[(String, String)],
    netns: Option<&str>,
) -> Child {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let log_file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open driver log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_modelcache-csi"));
    if let Some(ns) = netns {
        let ns = fs::File::open(format!("/run/netns/{ns}"))
            .unwrap_or_else(|e| panic!("open network namespace {ns}: {e}"));
        // SAFETY: between fork and exec only setns(2) runs, on a
        // descriptor opened before the fork and kept open by the closure.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    cmd.arg("--endpoint")
        .arg(format!("unix://{}", socket.display()))
        .arg("--state-dir")
        .arg(state_dir)
        .arg("--shared-path")
        .arg(shared_dir)
        .args(extra_args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("RUST_LOG", "modelcache_csi=debug,info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("dup log"))
        .stderr(log_file)
        .spawn()
        .expect("start modelcache-csi")
}

/// Polls the socket until the driver accepts; fails fast if it died.
async fn connect(child: &mut Child, socket: &Path, log: &Path) -> Result<Client, String> {
    let log_text = || fs::read_to_string(log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().expect("wait for driver") {
            return Err(format!("driver exited with {status}:\n{}", log_text()));
        }
        if let Ok(client) = Client::connect(socket.to_path_buf()).await {
            return Ok(client);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "driver did not accept on {} within 20 s:\n{}",
                socket.display(),
                log_text()
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Unmounts everything under `dir` (deepest first, lazily, since a killed
/// driver may have left anything) and detaches loop devices backed by files
/// under it. Returns what it had to clean, for the failure report.
pub fn clean_up(dir: &Path) -> Vec<String> {
    let mut cleaned = Vec::new();
    match mount::sweep_under(dir) {
        Ok(removed) => cleaned.extend(removed.iter().map(|m| format!("mount {}", m.display()))),
        Err(e) => eprintln!("unmount under {}: {e}", dir.display()),
    }
    for (dev, backing) in loop_devices_under(dir) {
        if let Err(e) = loopdev::detach(&dev) {
            eprintln!("detach {}: {e}", dev.display());
        }
        cleaned.push(format!("{} over {}", dev.display(), backing.display()));
    }
    cleaned
}

/// Loop devices whose backing file lies under `dir` (deleted or not).
pub fn loop_devices_under(dir: &Path) -> Vec<(PathBuf, PathBuf)> {
    let Ok(entries) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_prefix("loop")?.parse::<u32>().ok()?;
            let dev = PathBuf::from("/dev").join(&name);
            let backing = loopdev::backing_file(&dev).ok()??;
            backing.starts_with(dir).then_some((dev, backing))
        })
        .collect()
}

// ---- requests: the library's builders, shared with the demo and the rootless tier ----

pub use modelcache_csi::requests::*;

// ---- assertions ----

/// Every mount stacked exactly at `path` (bottom first).
pub fn mounts_at(path: &Path) -> Vec<MountEntry> {
    let Ok(path) = fs::canonicalize(path) else {
        return Vec::new();
    };
    mount::read_table()
        .expect("read mountinfo")
        .into_iter()
        .filter(|m| m.mount_point == path)
        .collect()
}

/// The one mount at `path`; fails if there is none or more than one.
#[track_caller]
pub fn single_mount(path: &Path) -> MountEntry {
    let mut at = mounts_at(path);
    assert_eq!(at.len(), 1, "mounts at {}: {at:#?}", path.display());
    at.pop().unwrap()
}

#[track_caller]
pub fn assert_not_mounted(path: &Path) {
    let at = mounts_at(path);
    assert!(
        at.is_empty(),
        "still mounted at {}: {at:#?}",
        path.display()
    );
}

/// Every mount at or below `dir`.
pub fn mounts_below(dir: &Path) -> Vec<MountEntry> {
    let table = mount::read_table().expect("read mountinfo");
    mount::mounts_under(&table, dir)
        .into_iter()
        .cloned()
        .collect()
}

/// Per-mount options (not the superblock's) include every one of `opts`.
#[track_caller]
pub fn assert_mount_options(m: &MountEntry, opts: &[&str]) {
    for o in opts {
        assert!(
            m.mount_options.iter().any(|x| x == o),
            "mount at {} lacks per-mount option {o}: {m:#?}",
            m.mount_point.display()
        );
    }
}

/// Asserts writing `path` fails with EROFS, and nothing else.
#[track_caller]
pub fn assert_erofs(path: &Path) {
    match fs::write(path, b"written through a read-only mount") {
        Ok(()) => panic!(
            "wrote {} through a mount that must be read-only",
            path.display()
        ),
        Err(e) => assert_eq!(
            e.raw_os_error(),
            Some(libc::EROFS),
            "writing {}: {e}",
            path.display()
        ),
    }
}

/// Polls `cond` every 20 ms until it holds or `timeout` passes.
pub fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- models ----

/// The files of a small generated model: relative path and bytes.
pub struct Model {
    pub files: Vec<(String, Vec<u8>)>,
}

/// Writes a model tree into `dir` (created if needed): two small JSON files,
/// one in a nested directory, a tokenizer two levels down, and a 1 MiB
/// weights file of deterministic pseudo-random bytes (`seed` varies them).
pub fn write_model(dir: &Path, seed: u64) -> Model {
    let mut weights = vec![0u8; 1 << 20];
    // xorshift64: cheap, deterministic, and no two seeds agree.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in weights.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let files = vec![
        (
            "config.json".to_string(),
            format!("{{\"hidden_size\": 384, \"seed\": {seed}}}\n").into_bytes(),
        ),
        ("model.safetensors".to_string(), weights),
        (
            "1_Pooling/config.json".to_string(),
            b"{\"pooling_mode_mean_tokens\": true}\n".to_vec(),
        ),
        (
            "tokenizer/vocab/vocab.txt".to_string(),
            b"[PAD]\n[UNK]\nhello\nworld\n".to_vec(),
        ),
    ];
    for (rel, bytes) in &files {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().unwrap()).expect("create model dir");
        fs::write(&path, bytes).expect("write model file");
    }
    Model { files }
}

/// Every file of `model` reads back byte for byte under `dir`.
#[track_caller]
pub fn assert_model(dir: &Path, model: &Model) {
    for (rel, bytes) in &model.files {
        let path = dir.join(rel);
        let got = fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        assert!(
            got == *bytes,
            "{} differs: {} bytes read, {} expected",
            path.display(),
            got.len(),
            bytes.len()
        );
    }
}

/// A free TCP port on loopback (for --metrics-address).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 GET on loopback; the whole response, head included.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Where a staged volume's content is mounted: beneath its staging path,
/// which is a tmpfs of its own (see `node::ops::CONTENT`). Asserts the
/// wrapper is there.
#[track_caller]
pub fn content(staging: &Path) -> PathBuf {
    let wrapper = single_mount(staging);
    assert_eq!(wrapper.fs_type, "tmpfs", "staging wrapper: {wrapper:#?}");
    staging.join("volume")
}
