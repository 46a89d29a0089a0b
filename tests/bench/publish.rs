//! NodePublishVolume of a cache volume against `cp -r` of the same model
//! into a fresh directory (the copy-per-pod approach), at each model size.
//!
//! Drives the real driver in-process over its Unix socket, as the demo does.
//! Per size: write a generated model into a source volume through its
//! read-write mount, seal it, create one cache volume and stage it once;
//! then time N publishes, each to a fresh target (each followed by an
//! untimed unpublish), and M runs of `cp -r` from the staged volume into a
//! fresh directory on the same filesystem (each preceded by an untimed
//! `sync`; `cp -r` + `sync` is reported too, as the copy is not durable
//! before). Every byte and mount is removed at the end, also on error.
//!
//! Run as root: `cargo bench --bench publish`. Settings (environment):
//!   BENCH_SIZES           model sizes, default "100MB,2GiB"
//!   BENCH_PUBLISH_ITERS   publishes per size, default 50
//!   BENCH_CP_ITERS        copies per size, default 10 below 1 GiB, else 5
//!   BENCH_DIR             where the scratch directory goes, default /var/tmp
//!   BENCH_DROP_CACHES=1   drop the page cache before each copy (cold reads)

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use modelcache_csi::demo::harness::{self, InProcessDriver, Namespace, WorkDir};
use modelcache_csi::demo::model::{self, GIB, MIB};
use modelcache_csi::mount::mountinfo;

/// Shards like Hugging Face checkpoints: a 2 GiB model is two files.
const SHARD_BYTES: u64 = GIB;

struct Settings {
    sizes: Vec<(String, u64)>,
    publish_iters: usize,
    cp_iters: Option<usize>,
    dir: PathBuf,
    drop_caches: bool,
}

fn parse_size(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().with_context(|| format!("size {s:?}"))?;
    let mult = match unit {
        "" | "B" => 1,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "MiB" => MIB,
        "GiB" => GIB,
        _ => anyhow::bail!("size {s:?}: use a unit of B, MB, GB, MiB or GiB"),
    };
    Ok(n * mult)
}

fn env_usize(name: &str) -> anyhow::Result<Option<usize>> {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().with_context(|| format!("{name}={v:?}")))
        .transpose()
}

impl Settings {
    fn from_env() -> anyhow::Result<Settings> {
        let sizes = std::env::var("BENCH_SIZES").unwrap_or_else(|_| "100MB,2GiB".into());
        Ok(Settings {
            sizes: sizes
                .split(',')
                .map(|s| Ok((s.trim().to_string(), parse_size(s)?)))
                .collect::<anyhow::Result<_>>()?,
            publish_iters: env_usize("BENCH_PUBLISH_ITERS")?.unwrap_or(50).max(1),
            cp_iters: env_usize("BENCH_CP_ITERS")?.map(|n| n.max(1)),
            dir: std::env::var_os("BENCH_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/var/tmp".into()),
            drop_caches: std::env::var("BENCH_DROP_CACHES").is_ok_and(|v| v == "1"),
        })
    }

    fn cp_iters_for(&self, bytes: u64) -> usize {
        self.cp_iters.unwrap_or(if bytes < GIB { 10 } else { 5 })
    }
}

/// Median and p95 (nearest rank) of a sample.
struct Summary {
    median: Duration,
    p95: Duration,
    n: usize,
    /// In the order they were taken.
    samples: Vec<Duration>,
}

fn summarize(samples: Vec<Duration>) -> Summary {
    let mut v = samples.clone();
    v.sort();
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    };
    let rank = (0.95 * n as f64).ceil() as usize;
    Summary {
        median,
        p95: v[rank.clamp(1, n) - 1],
        n,
        samples,
    }
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 100.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.0}")
    }
}

struct SizeResult {
    label: String,
    bytes: u64,
    files: usize,
    write: Duration,
    seal: Duration,
    stage: Duration,
    publish: Summary,
    cp: Summary,
    cp_sync: Summary,
    resident_before_cp: Option<u64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<ExitCode> {
    harness::require_root()?;
    let ns = match harness::enter_private_mount_namespace().await? {
        Namespace::ChildExited(code) => return Ok(ExitCode::from(code.clamp(0, 255) as u8)),
        Namespace::Private => "private mount namespace".to_string(),
        Namespace::Shared(why) => format!("host mount namespace: {why}"),
    };
    let s = Settings::from_env()?;
    let largest = s.sizes.iter().map(|(_, b)| *b).max().unwrap_or(0);
    let free = modelcache_csi::cache::free_bytes(&s.dir)?;
    // The source and one copy exist at once; keep a margin for the rest of the machine.
    anyhow::ensure!(
        free > 2 * largest + GIB,
        "{} has {} MiB free; the {} MiB model needs {} MiB (source + one copy + 1 GiB)",
        s.dir.display(),
        free / MIB,
        largest / MIB,
        (2 * largest + GIB) / MIB
    );

    let work = WorkDir::create(&s.dir, "modelcache-bench")?;
    println!("# NodePublishVolume vs cp -r\n");
    for line in machine(work.path()) {
        println!("{line}");
    }
    println!("- scratch dir: {} ({ns})", work.path().display());
    println!(
        "- page cache: {}\n",
        if s.drop_caches {
            "dropped before each copy (BENCH_DROP_CACHES=1)"
        } else {
            "left warm (the model was just written and sealed)"
        }
    );

    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let watcher = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            flag.store(true, Ordering::Relaxed);
            eprintln!("interrupted: stopping after the current step, then cleaning up");
        }
    });
    let driver = InProcessDriver::start(work.path(), "bench-node").await?;
    let mut results = Vec::new();
    let mut outcome = Ok(());
    for (label, bytes) in &s.sizes {
        let mut undo = Undo::default();
        let r = one_size(&driver, work.path(), &s, label, *bytes, &stop, &mut undo).await;
        let cleaned = undo.run(&driver).await;
        match (r, cleaned) {
            (Ok(r), Ok(())) => results.push(r),
            (Err(e), _) | (Ok(_), Err(e)) => {
                outcome = Err(e);
                break;
            }
        }
    }
    watcher.abort();
    let stopped = driver.stop().await;
    let swept = work.remove();
    outcome?;
    stopped?;
    swept?;

    println!("\n## Results\n");
    println!(
        "| model | files | publish median (ms) | publish p95 (ms) | cp -r median (ms) | cp -r p95 (ms) \
         | cp -r + sync median (ms) | cp -r + sync p95 (ms) | cp -r / publish | cp -r + sync / publish |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &results {
        let p = r.publish.median.as_secs_f64();
        println!(
            "| {} ({:.1} MiB) | {} | {} | {} | {} | {} | {} | {} | {:.0}x | {:.0}x |",
            r.label,
            r.bytes as f64 / MIB as f64,
            r.files,
            ms(r.publish.median),
            ms(r.publish.p95),
            ms(r.cp.median),
            ms(r.cp.p95),
            ms(r.cp_sync.median),
            ms(r.cp_sync.p95),
            r.cp.median.as_secs_f64() / p,
            r.cp_sync.median.as_secs_f64() / p,
        );
    }
    println!(
        "\n| model | publishes | copies | model write (ms) | seal (ms) | stage once (ms) | model in page cache before the first copy |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        let resident = match r.resident_before_cp {
            Some(b) => format!("{:.0}%", 100.0 * b as f64 / r.bytes as f64),
            None => "unknown (fincore failed)".into(),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {resident} |",
            r.label,
            r.publish.n,
            r.cp.n,
            ms(r.write),
            ms(r.seal),
            ms(r.stage),
        );
    }
    println!("\nCopies, in the order taken (ms):\n");
    for r in &results {
        let list = |s: &Summary| {
            s.samples
                .iter()
                .map(|d| ms(*d))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("- {} cp -r: {}", r.label, list(&r.cp));
        println!("- {} cp -r + sync: {}", r.label, list(&r.cp_sync));
    }
    println!("\nload average at the end: {}", loadavg());
    println!("all scratch data removed: {}", !work_exists(&s.dir));
    Ok(ExitCode::SUCCESS)
}

fn work_exists(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()).any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("modelcache-bench-")
            })
        })
        .unwrap_or(false)
}

/// What one size created, undone newest first whatever happened.
#[derive(Default)]
struct Undo {
    volumes: Vec<String>,
    staged: Vec<(String, PathBuf)>,
    published: Vec<(String, PathBuf)>,
    dirs: Vec<PathBuf>,
}

impl Undo {
    async fn run(self, d: &InProcessDriver) -> anyhow::Result<()> {
        let mut first_error = None;
        let mut note = |r: anyhow::Result<()>| {
            if let Err(e) = r {
                eprintln!("cleanup: {e:#}");
                first_error.get_or_insert(e);
            }
        };
        for (id, t) in self.published.iter().rev() {
            note(d.unpublish(id, t).await);
        }
        for (id, st) in self.staged.iter().rev() {
            note(d.unstage(id, st).await);
        }
        for id in self.volumes.iter().rev() {
            note(d.delete(id).await);
        }
        for dir in &self.dirs {
            if dir.exists() {
                note(
                    std::fs::remove_dir_all(dir)
                        .with_context(|| format!("remove {}", dir.display())),
                );
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

async fn timed<T>(f: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<(T, Duration)> {
    let start = Instant::now();
    let out = f.await?;
    Ok((out, start.elapsed()))
}

fn check(stop: &AtomicBool) -> anyhow::Result<()> {
    anyhow::ensure!(!stop.load(Ordering::Relaxed), "interrupted");
    Ok(())
}

async fn one_size(
    d: &InProcessDriver,
    work: &Path,
    s: &Settings,
    label: &str,
    bytes: u64,
    stop: &Arc<AtomicBool>,
    undo: &mut Undo,
) -> anyhow::Result<SizeResult> {
    let tag = label.to_ascii_lowercase();
    eprintln!("[{label}] writing and sealing the source");

    let src = d.create_source(&format!("bench-src-{tag}")).await?;
    let src_id = src.volume_id.clone();
    undo.volumes.push(src_id.clone());
    let (w_staging, w_target) = (
        work.join("staging").join(format!("src-{tag}")),
        work.join("writer").join(&tag),
    );
    undo.staged.push((src_id.clone(), w_staging.clone()));
    d.stage(&src_id, &w_staging).await?;
    undo.published.push((src_id.clone(), w_target.clone()));
    d.publish(&src_id, &w_staging, &w_target, true).await?;
    let (dir, flag) = (w_target.clone(), stop.clone());
    let (model, write) = timed(async move {
        let m = tokio::task::spawn_blocking(move || {
            model::write(&dir, bytes, SHARD_BYTES, 0x5eed, &flag)
        })
        .await??;
        Ok(m)
    })
    .await?;
    d.unpublish(&src_id, &w_target).await?;
    undo.published.pop();
    d.unstage(&src_id, &w_staging).await?;
    undo.staged.pop();
    check(stop)?;
    let ((), seal) = timed(d.seal(&src_id)).await?;

    let cache = d
        .create_cache(&format!("bench-cache-{tag}"), &src_id)
        .await?;
    let id = cache.volume_id.clone();
    undo.volumes.push(id.clone());
    let staging = work.join("staging").join(format!("cache-{tag}"));
    undo.staged.push((id.clone(), staging.clone()));
    let ((), stage) = timed(d.stage(&id, &staging)).await?;
    // The volume is mounted beneath its staging path, which is a small tmpfs
    // of its own (node::ops).
    let content = staging.join(modelcache_csi::mount::STAGING_CONTENT);
    let main_inode = std::fs::metadata(content.join(&model.main_file))?.ino();

    eprintln!("[{label}] {} publishes", s.publish_iters);
    let pods = work.join("pods").join(&tag);
    undo.dirs.push(pods.clone());
    let mut publishes = Vec::with_capacity(s.publish_iters);
    for i in 0..s.publish_iters {
        check(stop)?;
        let target = pods.join(format!("pod-{i}")).join("model");
        undo.published.push((id.clone(), target.clone()));
        let ((), t) = timed(d.publish(&id, &staging, &target, false)).await?;
        publishes.push(t);
        // The pod sees the sealed bytes, not a copy of them.
        let seen = std::fs::metadata(target.join(&model.main_file))?.ino();
        anyhow::ensure!(
            seen == main_inode,
            "target {} shows another file",
            target.display()
        );
        d.unpublish(&id, &target).await?;
        undo.published.pop();
    }

    let copies = s.cp_iters_for(bytes);
    eprintln!("[{label}] {copies} copies with cp -r");
    let copies_dir = work.join("copies").join(&tag);
    std::fs::create_dir_all(&copies_dir)?;
    undo.dirs.push(copies_dir.clone());
    let mut resident_before_cp = None;
    let (mut cp, mut cp_sync) = (Vec::new(), Vec::new());
    for i in 0..copies {
        check(stop)?;
        let dst = copies_dir.join(format!("pod-{i}"));
        // Untimed: the previous copy's removal and any other dirty data go first.
        sh("sync", &[])?;
        if s.drop_caches {
            std::fs::write("/proc/sys/vm/drop_caches", "3")
                .context("BENCH_DROP_CACHES=1: write /proc/sys/vm/drop_caches")?;
        }
        if i == 0 {
            resident_before_cp = resident_bytes(&model, &content);
        }
        let start = Instant::now();
        let (src_arg, dst_arg) = (content.display().to_string(), dst.display().to_string());
        tokio::task::spawn_blocking(move || sh("cp", &["-r", &src_arg, &dst_arg])).await??;
        let copied = start.elapsed();
        tokio::task::spawn_blocking(|| sh("sync", &[])).await??;
        cp.push(copied);
        cp_sync.push(start.elapsed());
        let got = std::fs::metadata(dst.join(&model.main_file))?;
        anyhow::ensure!(
            got.len() == std::fs::metadata(content.join(&model.main_file))?.len(),
            "cp -r produced a short copy"
        );
        std::fs::remove_dir_all(&dst)?;
    }

    Ok(SizeResult {
        label: label.to_string(),
        bytes: model.total_bytes,
        files: model.files.len(),
        write,
        seal,
        stage,
        publish: summarize(publishes),
        cp: summarize(cp),
        cp_sync: summarize(cp_sync),
        resident_before_cp,
    })
}

fn sh(cmd: &str, args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new(cmd)
        .args(args)
        .status()
        .with_context(|| format!("run {cmd}"))?;
    anyhow::ensure!(status.success(), "{cmd} {}: {status}", args.join(" "));
    Ok(())
}

/// Bytes of the model's files in the page cache, by `fincore`.
fn resident_bytes(m: &model::Model, dir: &Path) -> Option<u64> {
    let files: Vec<PathBuf> = m
        .files
        .iter()
        .filter_map(|f| f.file_name().map(|n| dir.join(n)))
        .collect();
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .args(&files)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().parse::<u64>().ok())
        .sum()
}

fn read_trim(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn loadavg() -> String {
    read_trim("/proc/loadavg").unwrap_or_else(|| "unknown".into())
}

/// What the figures depend on: CPUs, memory, kernel, and the disk under `dir`.
fn machine(dir: &Path) -> Vec<String> {
    let cpu = read_trim("/proc/cpuinfo")
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = read_trim("/proc/meminfo")
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or("unknown".into(), |kb| {
            format!("{:.1} GiB", kb as f64 / (1024.0 * 1024.0))
        });
    let kernel = read_trim("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".into());
    let cp = Command::new("cp")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(String::from)
        })
        .unwrap_or_else(|| "unknown".into());
    vec![
        format!("- cpu: {nproc} x {cpu}"),
        format!("- memory: {mem}"),
        format!("- kernel: {kernel}"),
        format!("- disk: {}", disk(dir)),
        format!("- cp: {cp}"),
        format!("- load average at start: {}", loadavg()),
    ]
}

/// The filesystem and block device under `dir`, as /proc and /sys show them.
fn disk(dir: &Path) -> String {
    let Ok(table) = mountinfo::read_table() else {
        return "unknown".into();
    };
    let Some(m) = table
        .iter()
        .filter(|m| dir.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count())
    else {
        return "unknown".into();
    };
    let mut out = format!(
        "{} on {} mounted at {}",
        m.fs_type,
        m.source,
        m.mount_point.display()
    );
    // A partition's queue attributes live on its parent disk.
    let mut dev = PathBuf::from(format!("/sys/dev/block/{}:{}", m.major, m.minor));
    if let Ok(real) = std::fs::canonicalize(&dev) {
        dev = if real.join("partition").exists() {
            real.parent().map(Path::to_path_buf).unwrap_or(real)
        } else {
            real
        };
        let name = dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let rotational = read_trim(dev.join("queue/rotational")).unwrap_or_default();
        let model = read_trim(dev.join("device/model"));
        let kind = if name.starts_with("vd") {
            "virtio-blk".to_string()
        } else if name.starts_with("nvme") {
            "NVMe".to_string()
        } else {
            model.unwrap_or_else(|| "block device".into())
        };
        out += &format!(
            "; device {name}: {kind}, rotational={rotational} (as the guest sees it; the host's medium is not visible)"
        );
    }
    out
}
