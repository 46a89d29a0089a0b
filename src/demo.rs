//! The `demo` command: the real driver, in-process on a scratch directory,
//! fills a source volume with a generated model, seals it, and publishes
//! three cache volumes from it; then shows they share one copy on disk, are
//! read-only, and read back exactly what the seal recorded.
//!
//! It must leave nothing behind, even when a step fails or it is
//! interrupted: it runs in a private mount namespace, undoes every step it
//! took, and finally unmounts and removes whatever is left in its directory.

pub mod harness;
pub mod model;

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::csi::Volume;
use harness::{InProcessDriver, Namespace, WorkDir};
use model::MIB;

const CACHES: usize = 3;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Size of the generated model.safetensors, in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub model_mib: u64,
    /// Where to create the demo's temporary directory [default: $TMPDIR or /tmp].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Stay in the caller's mount namespace (mounts are still removed at the end).
    #[arg(long)]
    pub no_unshare: bool,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    harness::require_root()?;
    let ns = if args.no_unshare {
        "the caller's mount namespace (--no-unshare)".to_string()
    } else {
        match harness::enter_private_mount_namespace().await? {
            Namespace::ChildExited(0) => return Ok(()),
            // The child has printed its own error.
            Namespace::ChildExited(code) => std::process::exit(code),
            Namespace::Private => "a private mount namespace".to_string(),
            Namespace::Shared(why) => format!("the caller's mount namespace: {why}"),
        }
    };

    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = WorkDir::create(&parent, "modelcache-demo")?;
    println!(
        "modelcache-csi demo: {CACHES} read-only cache volumes from one sealed {} MiB model",
        args.model_mib
    );
    println!("work dir {}, in {ns}\n", work.path().display());

    let driver = InProcessDriver::start(work.path(), "demo-node").await?;
    let mut ledger = Ledger::default();
    let mut timings = Timings::default();
    // Ctrl-C lets the running step finish (long ones stop early), so no
    // call or writer is still busy in the directory while it is torn down.
    let stop = Arc::new(AtomicBool::new(false));
    timings.stop = stop.clone();
    let watcher = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            stop.store(true, Ordering::Relaxed);
            println!("\ninterrupted: stopping after the current step");
        }
    });
    let outcome = steps(&driver, work.path(), &args, &mut ledger, &mut timings).await;
    watcher.abort();
    if let Err(e) = &outcome {
        println!("\nFAILED: {e:#}\ncleaning up");
    }

    let started = Instant::now();
    let (done, mut problems) = teardown(driver, &ledger).await;
    let swept = match work.remove() {
        Ok(n) => n,
        Err(e) => {
            problems.push(format!("{e:#}"));
            0
        }
    };
    timings.add("cleanup", started.elapsed());

    println!("\ntimings");
    timings.print();
    println!(
        "\ncleanup: {done}; {} left-over mount(s) swept; work dir removed",
        swept
    );
    outcome?;
    anyhow::ensure!(problems.is_empty(), "cleanup: {}", problems.join("; "));
    Ok(())
}

/// What exists right now and must be undone, recorded before each call
/// that creates it, so a call that fails halfway is undone too.
#[derive(Default)]
struct Ledger {
    volumes: Vec<String>,
    staged: Vec<(String, PathBuf)>,
    published: Vec<(String, PathBuf)>,
}

/// Each step's duration; the place every step starts, so also where an
/// interrupt takes effect.
#[derive(Default)]
struct Timings {
    steps: Vec<(String, Duration)>,
    stop: Arc<AtomicBool>,
}

impl Timings {
    fn add(&mut self, step: impl Into<String>, d: Duration) {
        self.steps.push((step.into(), d));
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.stop.load(Ordering::Relaxed), "interrupted");
        Ok(())
    }

    async fn time<T>(
        &mut self,
        step: impl Into<String>,
        f: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        self.check()?;
        let start = Instant::now();
        // A step cut short by the interrupt fails with its own words; say why.
        let out = f.await.map_err(|e| self.check().err().unwrap_or(e))?;
        self.add(step, start.elapsed());
        Ok(out)
    }

    fn print(&self) {
        let width = self.steps.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
        for (step, d) in &self.steps {
            println!("  {step:<width$}  {:>9.1} ms", d.as_secs_f64() * 1e3);
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

async fn steps(
    d: &InProcessDriver,
    work: &Path,
    args: &DemoArgs,
    ledger: &mut Ledger,
    t: &mut Timings,
) -> anyhow::Result<()> {
    let staging = |name: &str| work.join("staging").join(name);
    let target = |pod: &str| work.join("pods").join(pod).join("model");

    // 1. A source volume, written through its read-write mount as a Job would.
    let src = t
        .time("create source", d.create_source("demo-source"))
        .await?;
    let src_id = src.volume_id.clone();
    ledger.volumes.push(src_id.clone());
    let (s_staging, s_target) = (staging("source"), target("writer"));
    ledger.staged.push((src_id.clone(), s_staging.clone()));
    t.time("stage source (rw)", d.stage(&src_id, &s_staging))
        .await?;
    ledger.published.push((src_id.clone(), s_target.clone()));
    t.time(
        "publish source (rw)",
        d.publish(&src_id, &s_staging, &s_target, true),
    )
    .await?;
    let weights = args.model_mib * MIB;
    let (dir, stop) = (s_target.clone(), t.stop.clone());
    let model = t
        .time(
            "write model",
            blocking(move || Ok(model::write(&dir, weights, u64::MAX, 42, &stop)?)),
        )
        .await?;
    t.time("unpublish source", d.unpublish(&src_id, &s_target))
        .await?;
    ledger.published.pop();
    t.time("unstage source", d.unstage(&src_id, &s_staging))
        .await?;
    ledger.staged.pop();
    let names: Vec<String> = model
        .files
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    println!("1. source volume {src_id}");
    println!(
        "   a writer filled it through a read-write mount: {} ({})",
        names.join(", "),
        mib(model.total_bytes)
    );

    // 2. Sealed: from now on the bytes can never change.
    t.time("seal", d.seal(&src_id)).await?;
    let seal = d.seal_of(&src)?;
    let main = seal
        .files
        .iter()
        .find(|f| f.path == model.main_file)
        .context("the seal does not list the weights file")?
        .clone();
    println!(
        "2. sealed: {} files, {}; {} sha256 {}",
        seal.files.len(),
        mib(seal.total_bytes),
        main.path,
        main.sha256
    );

    // 3. Three cache volumes, each staged and published read-only for its own pod.
    let mut targets = Vec::new();
    for i in 1..=CACHES {
        let name = format!("cache-{i}");
        let vol: Volume = t
            .time(
                format!("create {name} (clone)"),
                d.create_cache(&format!("demo-{name}"), &src_id),
            )
            .await?;
        let id = vol.volume_id;
        ledger.volumes.push(id.clone());
        let (st, tg) = (staging(&name), target(&format!("pod-{i}")));
        ledger.staged.push((id.clone(), st.clone()));
        t.time(format!("stage {name}"), d.stage(&id, &st)).await?;
        ledger.published.push((id.clone(), tg.clone()));
        t.time(format!("publish {name}"), d.publish(&id, &st, &tg, false))
            .await?;
        targets.push((format!("pod-{i}"), tg));
    }
    println!("3. {CACHES} cache volumes created from it, each staged and published read-only:");
    for (pod, tg) in &targets {
        println!(
            "   {pod}  {}",
            tg.strip_prefix(work).unwrap_or(tg).display()
        );
    }

    // (a) One copy: the same inode behind every path, and the disk holds it once.
    println!(
        "\n(a) one copy on disk: {} through the store and every pod (paths below the work dir)",
        main.path
    );
    let mut paths = vec![(
        "store".to_string(),
        d.source_data_dir(&src)?.join(&main.path),
    )];
    paths.extend(
        targets
            .iter()
            .map(|(p, tg)| (p.clone(), tg.join(&main.path))),
    );
    let mut identities = Vec::new();
    for (who, p) in &paths {
        let m = std::fs::metadata(p).with_context(|| format!("stat {}", p.display()))?;
        let dev = format!("{}:{}", libc::major(m.dev()), libc::minor(m.dev()));
        let shown = p.strip_prefix(work).unwrap_or(p);
        println!(
            "   {who:<6} dev {dev:<6} inode {:<10} {}",
            m.ino(),
            shown.display()
        );
        identities.push((m.dev(), m.ino()));
    }
    identities.dedup();
    anyhow::ensure!(
        identities.len() == 1,
        "the paths show different files: the volumes are copies"
    );
    let state = d.cfg.state_dir.clone();
    let used = blocking(move || Ok(harness::disk_usage(&state)?)).await?;
    let visible = model.total_bytes * (1 + CACHES as u64);
    println!(
        "   {} of model bytes visible (source + {CACHES} pods); the driver's state dir uses {} \
         on disk = {:.2}x the model (a copy per pod would be {}x)",
        mib(visible),
        mib(used),
        used as f64 / model.total_bytes as f64,
        1 + CACHES
    );

    // (b) Read-only: a pod cannot change what the others read.
    println!("\n(b) read-only: a pod's write is refused by the kernel");
    for (pod, tg) in &targets {
        let probe = tg.join("written-by-pod");
        match std::fs::File::create(&probe) {
            Err(e) if e.raw_os_error() == Some(libc::EROFS) => {
                let shown = probe.strip_prefix(work).unwrap_or(&probe);
                println!("   {pod}  create {}: {e}", shown.display())
            }
            Err(e) => anyhow::bail!("{pod}: create {}: expected EROFS, got {e}", probe.display()),
            Ok(_) => anyhow::bail!("{pod}: create {} succeeded: not read-only", probe.display()),
        }
    }

    // (c) Verified: what a pod reads is what was sealed.
    println!("\n(c) verified: every file read through every pod matches the seal");
    for (pod, tg) in &targets {
        t.check()?;
        let (root, files, stop) = (tg.clone(), seal.files.clone(), t.stop.clone());
        let checked = blocking(move || {
            for f in &files {
                anyhow::ensure!(!stop.load(Ordering::Relaxed), "interrupted");
                let (size, sha) = crate::cache::manifest::hash_file(&root.join(&f.path))?;
                anyhow::ensure!(
                    size == f.size && sha == f.sha256,
                    "{} read back as {size} bytes, sha256 {sha}; the seal says {} bytes, {}",
                    f.path,
                    f.size,
                    f.sha256
                );
            }
            Ok(files.len())
        })
        .await?;
        println!(
            "   {pod}  {checked} files match; {} sha256 {}… as sealed",
            main.path,
            &main.sha256[..16]
        );
    }
    Ok(())
}

/// Undoes what the ledger lists, newest first, carrying on past failures.
/// Returns a summary and the failures.
async fn teardown(d: InProcessDriver, ledger: &Ledger) -> (String, Vec<String>) {
    let mut problems = Vec::new();
    let mut count = [0usize; 3];
    for (id, target) in ledger.published.iter().rev() {
        match d.unpublish(id, target).await {
            Ok(()) => count[0] += 1,
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    for (id, staging) in ledger.staged.iter().rev() {
        match d.unstage(id, staging).await {
            Ok(()) => count[1] += 1,
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    // Newest first: the caches go before the source they read.
    for id in ledger.volumes.iter().rev() {
        match d.delete(id).await {
            Ok(()) => count[2] += 1,
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    let stopped = match d.stop().await {
        Ok(()) => "server stopped",
        Err(e) => {
            problems.push(format!("stop the server: {e:#}"));
            "server did not stop cleanly"
        }
    };
    let summary = format!(
        "{} unpublished, {} unstaged, {} volumes deleted, {stopped}",
        count[0], count[1], count[2]
    );
    (summary, problems)
}
