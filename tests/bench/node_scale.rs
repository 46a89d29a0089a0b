//! The node plugin at scale: bursts of concurrent calls, a large mount
//! table, many volumes. Every figure is a ratio to a floor measured in the
//! same run, so the numbers mean the same on a fast and a slow machine.
//!
//! Drives the real driver in-process over its Unix socket (local backend,
//! real bind mounts) in a private mount namespace, as `publish.rs` does:
//! 1. **Bursts.** K concurrent NodePublish of K distinct cache volumes of one
//!    model (each staged), then K concurrent NodeUnpublish, then K
//!    concurrent NodeStage of K fresh volumes of one model; against K
//!    concurrent Probe calls, the floor of the socket and the runtime.
//!    1b: publish bursts of 1 to K calls, each against a Probe burst.
//!    1c: one volume published at 50 targets at once and unpublished (a
//!    Deployment's replicas sharing a claim), Aborted retried as kubelet
//!    does.
//! 2. **Mount table.** NodePublish one at a time with the table as it is,
//!    then with up to M extra tmpfs mounts in the namespace (each pod adds
//!    several on a real node: secrets, tokens, its volumes), beside the
//!    kernel's own bind mount, which grows with the table too.
//! 3. **Volumes.** NodePublish, NodeGetVolumeStats, GetCapacity, ListVolumes
//!    (pages of 100, per volume listed), a `/metrics` scrape right after a
//!    change and how long its gauges take to show it, with 10 cache volumes,
//!    then with V over 100 models; and the process's RSS.
//!
//! Run as root: `cargo bench --bench node_scale`. Settings (environment):
//!   BENCH_BURST        K, default 100
//!   BENCH_ROUNDS       bursts of each kind, default 5 (medians reported)
//!   BENCH_MOUNTS       M, default 5000
//!   BENCH_VOLUMES      V, default 1000
//!   BENCH_ITERS        calls per one-at-a-time figure, default 50
//!   BENCH_DIR          scratch directory parent, default /var/tmp
//!   BENCH_CLAIM        pods sharing one volume in 1c, default 50
//!   BENCH_VERBOSE      set: each round's figures on stderr
//!   BENCH_CSV          a file for the points of 1b and 2, which
//!                      tests/bench/plot_node_scale.py plots
//! Prints a Markdown report; every mount and file is removed at the end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use modelcache_csi::csi::*;
use modelcache_csi::demo::harness::{self, InProcessDriver, Namespace, WorkDir};

struct Settings {
    burst: usize,
    rounds: usize,
    mounts: usize,
    volumes: usize,
    iters: usize,
    dir: PathBuf,
    csv: Option<PathBuf>,
    claim: usize,
}

fn env(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v:?}")),
        Err(_) => Ok(default),
    }
}

impl Settings {
    fn from_env() -> anyhow::Result<Settings> {
        Ok(Settings {
            burst: env("BENCH_BURST", 100)?.max(1),
            rounds: env("BENCH_ROUNDS", 5)?.max(1),
            mounts: env("BENCH_MOUNTS", 5000)?,
            volumes: env("BENCH_VOLUMES", 1000)?.max(10),
            iters: env("BENCH_ITERS", 50)?.max(1),
            dir: std::env::var_os("BENCH_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/var/tmp".into()),
            csv: std::env::var_os("BENCH_CSV").map(PathBuf::from),
            claim: env("BENCH_CLAIM", 50)?.max(1),
        })
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn median_f(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn quantile(mut v: Vec<Duration>, q: f64) -> Duration {
    v.sort();
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn ms_f(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Figures for the plot (`BENCH_CSV`): one line per point, its series
/// first.
struct Csv(Option<std::fs::File>);

impl Csv {
    fn row(&mut self, series: &str, values: &[f64]) {
        use std::io::Write;
        if let Some(f) = &mut self.0 {
            let values: Vec<String> = values.iter().map(|v| format!("{v:.4}")).collect();
            let _ = writeln!(f, "{series},{}", values.join(","));
        }
    }
}

/// What one burst of K concurrent calls came to.
#[derive(Clone, Copy)]
struct Burst {
    wall: Duration,
    p50: Duration,
    p99: Duration,
}

/// Runs `k` calls of `call` at once; each returns its own latency.
async fn burst<F, Fut>(k: usize, call: F) -> anyhow::Result<Burst>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let start = Instant::now();
    let tasks: Vec<_> = (0..k)
        .map(|i| {
            let fut = call(i);
            tokio::spawn(async move {
                let t = Instant::now();
                fut.await.map(|()| t.elapsed())
            })
        })
        .collect();
    let mut lat = Vec::with_capacity(k);
    for t in tasks {
        lat.push(t.await??);
    }
    let wall = start.elapsed();
    Ok(Burst {
        wall,
        p50: quantile(lat.clone(), 0.5),
        p99: quantile(lat, 0.99),
    })
}

/// Calls `call` until it is not Aborted, waiting as kubelet does between
/// tries (0.5 s, doubling); counts the Aborted answers.
async fn as_kubelet<F, Fut>(
    aborted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    call: F,
) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let (t0, mut wait) = (Instant::now(), Duration::from_millis(500));
    loop {
        match call().await {
            Ok(()) => return Ok(()),
            Err(s) if s.code() == tonic::Code::Aborted => {
                aborted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                anyhow::ensure!(
                    t0.elapsed() + wait < CLAIM_DEADLINE,
                    "still Aborted after {:.1} s of kubelet's retries",
                    t0.elapsed().as_secs_f64()
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(122));
            }
            Err(s) => return Err(s.into()),
        }
    }
}

/// How long section 1c waits for a call kubelet retries.
const CLAIM_DEADLINE: Duration = Duration::from_secs(20);

/// Medians over rounds of wall time, p50 and p99.
fn summary(rounds: &[Burst]) -> (Duration, Duration, Duration) {
    (
        median(rounds.iter().map(|b| b.wall).collect()),
        median(rounds.iter().map(|b| b.p50).collect()),
        median(rounds.iter().map(|b| b.p99).collect()),
    )
}

/// A model: a source volume with one file, sealed.
async fn model(d: &InProcessDriver, name: &str) -> anyhow::Result<Volume> {
    let src = d.create_source(name).await?;
    std::fs::write(
        d.source_data_dir(&src)?.join("weights.bin"),
        name.as_bytes(),
    )?;
    d.seal(&src.volume_id).await?;
    Ok(src)
}

struct Node<'a> {
    d: &'a InProcessDriver,
    dir: PathBuf,
}

impl Node<'_> {
    fn staging(&self, vol: &Volume) -> PathBuf {
        // kubelet's layout, which the volume gauges go by.
        self.dir
            .join("staging")
            .join(&vol.volume_id)
            .join("globalmount")
    }
    fn target(&self, tag: &str, i: usize) -> PathBuf {
        self.dir.join("pods").join(format!("{tag}-{i}"))
    }

    async fn caches(&self, tag: &str, of: &Volume, n: usize) -> anyhow::Result<Vec<Volume>> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            out.push(
                self.d
                    .create_cache(&format!("{tag}-{i}"), &of.volume_id)
                    .await?,
            );
        }
        Ok(out)
    }

    fn publish_req(&self, vol: &Volume, target: &Path) -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: self.staging(vol).display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(harness::mount_capability(
                volume_capability::access_mode::Mode::SingleNodeReaderOnly,
            )),
            readonly: true,
            ..Default::default()
        }
    }

    /// One publish and unpublish at a time; the publishes' latencies.
    async fn publish_each(&self, vols: &[Volume], iters: usize) -> anyhow::Result<Vec<Duration>> {
        let mut lat = Vec::with_capacity(iters);
        for i in 0..iters {
            let vol = &vols[i % vols.len()];
            let target = self.target("each", i);
            let t = Instant::now();
            self.d
                .client()
                .node
                .node_publish_volume(self.publish_req(vol, &target))
                .await?;
            lat.push(t.elapsed());
            self.d.unpublish(&vol.volume_id, &target).await?;
        }
        Ok(lat)
    }

    async fn stats_each(&self, vols: &[Volume], iters: usize) -> anyhow::Result<Vec<Duration>> {
        let target = self.target("stats", 0);
        let vol = &vols[vols.len() / 2];
        self.d
            .client()
            .node
            .node_publish_volume(self.publish_req(vol, &target))
            .await?;
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            self.d
                .client()
                .node
                .node_get_volume_stats(NodeGetVolumeStatsRequest {
                    volume_id: vol.volume_id.clone(),
                    volume_path: target.display().to_string(),
                    staging_target_path: self.staging(vol).display().to_string(),
                })
                .await?;
            lat.push(t.elapsed());
        }
        self.d.unpublish(&vol.volume_id, &target).await?;
        Ok(lat)
    }
}

async fn timed<F, Fut>(iters: usize, f: F) -> anyhow::Result<Vec<Duration>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f().await?;
        lat.push(t.elapsed());
    }
    Ok(lat)
}

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// `GET /metrics` over HTTP, as Prometheus scrapes it: the published
/// volumes it shows.
async fn scrape(addr: std::net::SocketAddr) -> anyhow::Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await?;
    anyhow::ensure!(
        body.starts_with(b"HTTP/1.1 200"),
        "metrics answered {:?}",
        String::from_utf8_lossy(&body[..body.len().min(40)])
    );
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix("modelcache_volumes{state=\"published\"} "))
        .and_then(|v| v.trim().parse().ok())
        .context("no published-volumes gauge in the scrape")
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
    match harness::enter_private_mount_namespace().await? {
        Namespace::ChildExited(code) => return Ok(ExitCode::from(code.clamp(0, 255) as u8)),
        Namespace::Private => {}
        Namespace::Shared(why) => anyhow::bail!(
            "this bench adds thousands of mounts and needs a private mount namespace: {why}"
        ),
    }
    let s = Settings::from_env()?;
    let work = WorkDir::create(&s.dir, "modelcache-scale")?;
    let r = scenarios(&s, work.path()).await;
    let swept = harness::sweep_mounts(work.path())?;
    work.remove()?;
    if swept > 0 {
        eprintln!("removed {swept} mounts left under the scratch directory");
    }
    r.map(|()| ExitCode::SUCCESS)
}

async fn scenarios(s: &Settings, dir: &Path) -> anyhow::Result<()> {
    let d = InProcessDriver::start(dir, "scale-node").await?;
    let metrics = modelcache_csi::metrics::bind("127.0.0.1:0".parse()?)?;
    let metrics_addr = metrics.local_addr()?;
    tokio::spawn(modelcache_csi::metrics::serve(
        metrics,
        d.metrics.clone(),
        std::sync::Arc::new(|_| None),
        std::sync::Arc::new(Vec::new),
    ));
    let r = scenarios_on(s, dir, &d, metrics_addr).await;
    let stopped = d.stop().await;
    r.and(stopped)
}

async fn scenarios_on(
    s: &Settings,
    dir: &Path,
    d: &InProcessDriver,
    metrics: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let n = Node {
        d,
        dir: dir.to_path_buf(),
    };
    let k = s.burst;
    let mut csv = Csv(match &s.csv {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("BENCH_CSV={}", p.display()))?)
        }
        None => None,
    });
    println!("# The node plugin at scale\n");
    println!(
        "- {} cores; kernel {}; K = {k} concurrent calls, {} rounds (medians); M = {} extra mounts; V = {} volumes over 100 models",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        s.rounds,
        s.mounts,
        s.volumes
    );
    println!(
        "- mount table at start: {} entries\n",
        modelcache_csi::mount::read_table()?.len()
    );

    // 1. Bursts.
    let one = model(d, "burst-model").await?;
    let vols = n.caches("burst", &one, k).await?;
    for v in &vols {
        d.stage(&v.volume_id, &n.staging(v)).await?;
    }
    // Each kind's burst right after a Probe burst of its own: this
    // machine's speed drifts from second to second, and the ratio is taken
    // within the pair. Round 0 warms the blocking pool and is not counted.
    let probe = || {
        let c = d.client().identity;
        // Whatever the calls before left for the disk to write is written
        // first, so neither call of the pair waits for it.
        nix::unistd::sync();
        burst(k, move |_| {
            let mut c = c.clone();
            async move {
                c.probe(ProbeRequest {}).await?;
                Ok(())
            }
        })
    };
    let info = || {
        let c = d.client().identity;
        burst(k, move |_| {
            let mut c = c.clone();
            async move {
                c.get_plugin_info(GetPluginInfoRequest {}).await?;
                Ok(())
            }
        })
    };
    let (mut probes, mut pubs, mut unpubs, mut stages) = (vec![], vec![], vec![], vec![]);
    let mut infos = vec![];
    for round in 0..=s.rounds {
        let c = d.client();
        let reqs: Vec<_> = vols
            .iter()
            .enumerate()
            .map(|(i, v)| n.publish_req(v, &n.target(&format!("burst{round}"), i)))
            .collect();
        nix::unistd::sync();
        let transport = info().await?;
        let floor = probe().await?;
        let publish = burst(k, |i| {
            let (mut c, req) = (c.node.clone(), reqs[i].clone());
            async move {
                c.node_publish_volume(req).await?;
                Ok(())
            }
        })
        .await?;
        let floor2 = probe().await?;
        let unpublish = burst(k, |i| {
            let mut c = c.node.clone();
            let req = NodeUnpublishVolumeRequest {
                volume_id: reqs[i].volume_id.clone(),
                target_path: reqs[i].target_path.clone(),
            };
            async move {
                c.node_unpublish_volume(req).await?;
                Ok(())
            }
        })
        .await?;
        // Fresh volumes of one model, staged at once: the first stages the
        // model, the rest join it.
        let fresh = n.caches(&format!("stage{round}"), &one, k).await?;
        let stage_reqs: Vec<_> = fresh
            .iter()
            .map(|v| NodeStageVolumeRequest {
                volume_id: v.volume_id.clone(),
                staging_target_path: n.staging(v).display().to_string(),
                volume_capability: Some(harness::mount_capability(
                    volume_capability::access_mode::Mode::SingleNodeReaderOnly,
                )),
                ..Default::default()
            })
            .collect();
        // kubelet makes the staging directory before NodeStage (and
        // writes its vol_data.json beside it): its cost, not the driver's.
        for v in &fresh {
            std::fs::create_dir_all(n.staging(v))?;
        }
        let floor3 = probe().await?;
        let stage = burst(k, |i| {
            let (mut c, req) = (c.node.clone(), stage_reqs[i].clone());
            async move {
                c.node_stage_volume(req).await?;
                Ok(())
            }
        })
        .await?;
        for v in &fresh {
            d.unstage(&v.volume_id, &n.staging(v)).await?;
            d.delete(&v.volume_id).await?;
        }
        if std::env::var_os("BENCH_VERBOSE").is_some() {
            eprintln!(
                "round {round}: probe {} publish {} probe {} unpublish {} probe {} stage {} (ms, all done)",
                ms(floor.wall),
                ms(publish.wall),
                ms(floor2.wall),
                ms(unpublish.wall),
                ms(floor3.wall),
                ms(stage.wall)
            );
        }
        if round > 0 {
            pubs.push((publish, floor.wall));
            unpubs.push((unpublish, floor2.wall));
            stages.push((stage, floor3.wall));
            probes.push((floor, floor.wall));
            infos.push((transport, floor.wall));
        }
    }
    println!("## 1. Bursts of {k} concurrent calls\n");
    println!(
        "| calls | all done (ms) | p50 per call (ms) | p99 per call (ms) | all done ÷ the Probe burst before it |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (name, b) in [
        ("GetPluginInfo (no disk, for scale)", &infos),
        ("Probe (the floor: writes a file per root)", &probes),
        ("NodePublish, distinct volumes", &pubs),
        ("NodeUnpublish", &unpubs),
        ("NodeStage, one model", &stages),
    ] {
        let bursts: Vec<Burst> = b.iter().map(|(b, _)| *b).collect();
        let ratio = median_f(
            b.iter()
                .map(|(b, f)| b.wall.as_secs_f64() / f.as_secs_f64())
                .collect(),
        );
        let (w, p50, p99) = summary(&bursts);
        println!(
            "| {name} | {} | {} | {} | {ratio:.2} |",
            ms(w),
            ms(p50),
            ms(p99)
        );
    }

    // 1b. Publish bursts against concurrency.
    println!(
        "\n## 1b. NodePublish bursts against concurrency (medians of {} rounds)\n",
        s.rounds
    );
    println!(
        "| concurrent calls | Probe burst, all done (ms) | NodePublish burst, all done (ms) | p50 per call (ms) | p99 per call (ms) | ÷ Probe |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut levels: Vec<usize> = [1, 10, 25, 50, 100, 200]
        .into_iter()
        .filter(|l| *l < k)
        .collect();
    levels.push(k);
    for &level in &levels {
        let mut rounds = vec![];
        for round in 0..=s.rounds {
            let c = d.client();
            let reqs: Vec<_> = vols[..level]
                .iter()
                .enumerate()
                .map(|(i, v)| n.publish_req(v, &n.target(&format!("level{level}-{round}"), i)))
                .collect();
            nix::unistd::sync();
            let floor = burst(level, |_| {
                let mut c = c.identity.clone();
                async move {
                    c.probe(ProbeRequest {}).await?;
                    Ok(())
                }
            })
            .await?;
            let publish = burst(level, |i| {
                let (mut c, req) = (c.node.clone(), reqs[i].clone());
                async move {
                    c.node_publish_volume(req).await?;
                    Ok(())
                }
            })
            .await?;
            for r in &reqs {
                d.unpublish(&r.volume_id, Path::new(&r.target_path)).await?;
            }
            if round > 0 {
                rounds.push((publish, floor.wall));
            }
        }
        let bursts: Vec<Burst> = rounds.iter().map(|(b, _)| *b).collect();
        let (w, p50, p99) = summary(&bursts);
        let floor = median(rounds.iter().map(|(_, f)| *f).collect());
        let ratio = median_f(
            rounds
                .iter()
                .map(|(b, f)| b.wall.as_secs_f64() / f.as_secs_f64())
                .collect(),
        );
        println!(
            "| {level} | {} | {} | {} | {} | {ratio:.2} |",
            ms(floor),
            ms(w),
            ms(p50),
            ms(p99)
        );
        csv.row(
            "concurrency",
            &[level as f64, ms_f(floor), ms_f(w), ms_f(p50), ms_f(p99)],
        );
    }

    // 1c. One claim, several pods: a Deployment's replicas share a PVC.
    let pods = s.claim.min(k);
    println!(
        "\n## 1c. One volume published at {pods} targets at once, then unpublished (Aborted retried as kubelet does: 0.5 s, doubling; given up after {} s)\n",
        CLAIM_DEADLINE.as_secs()
    );
    println!(
        "| calls | all done (ms) | p50 per call (ms) | p99 per call (ms) | Aborted answers per round |"
    );
    println!("|---|---:|---:|---:|---:|");
    let shared = &vols[0];
    let aborted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (mut pubs, mut unpubs, mut aborts) = (vec![], vec![], [0, 0]);
    let mut gave_up = None;
    let rounds = s.rounds.min(3);
    for round in 0..=rounds {
        let c = d.client();
        let reqs: Vec<_> = (0..pods)
            .map(|i| n.publish_req(shared, &n.target(&format!("claim{round}"), i)))
            .collect();
        let before = aborted.load(std::sync::atomic::Ordering::Relaxed);
        let publish = burst(pods, |i| {
            let (c, req, aborted) = (c.node.clone(), reqs[i].clone(), aborted.clone());
            as_kubelet(aborted, move || {
                let (mut c, req) = (c.clone(), req.clone());
                async move { c.node_publish_volume(req).await.map(|_| ()) }
            })
        })
        .await;
        let between = aborted.load(std::sync::atomic::Ordering::Relaxed);
        let unpublish = burst(pods, |i| {
            let (c, aborted) = (c.node.clone(), aborted.clone());
            let req = NodeUnpublishVolumeRequest {
                volume_id: reqs[i].volume_id.clone(),
                target_path: reqs[i].target_path.clone(),
            };
            as_kubelet(aborted, move || {
                let (mut c, req) = (c.clone(), req.clone());
                async move { c.node_unpublish_volume(req).await.map(|_| ()) }
            })
        })
        .await;
        let after = aborted.load(std::sync::atomic::Ordering::Relaxed);
        match (publish, unpublish) {
            (Ok(p), Ok(u)) if round > 0 => {
                pubs.push(p);
                unpubs.push(u);
                aborts[0] += between - before;
                aborts[1] += after - between;
            }
            (Ok(_), Ok(_)) => {}
            (p, u) => {
                gave_up = Some(format!(
                    "round {round}: {} publish and {} unpublish answers Aborted; {}",
                    between - before,
                    after - between,
                    p.err()
                        .or(u.err())
                        .map(|e| format!("{e:#}"))
                        .unwrap_or_default()
                ));
                for r in &reqs {
                    let _ = d.unpublish(&r.volume_id, Path::new(&r.target_path)).await;
                }
                break;
            }
        }
    }
    match &gave_up {
        Some(why) => println!("| NodePublish, NodeUnpublish | did not finish | | | {why} |"),
        None => {
            for (name, b, a) in [
                ("NodePublish", &pubs, aborts[0]),
                ("NodeUnpublish", &unpubs, aborts[1]),
            ] {
                let (w, p50, p99) = summary(b);
                let a = a as f64 / rounds as f64;
                println!(
                    "| {name} | {} | {} | {} | {a:.0} |",
                    ms(w),
                    ms(p50),
                    ms(p99)
                );
                csv.row(&format!("claim-{name}"), &[ms_f(w), a]);
            }
        }
    }

    // 2. Mount table: steps up to M extra mounts; at each, a publish and
    // the kernel's own bind mount, which grows with the table too.
    println!("\n## 2. One at a time, against the mount table (p50, ms)\n");
    println!(
        "| mount table | NodePublish | ÷ quiet | the kernel's bind + remount ro + unmount | NodePublish minus that |"
    );
    println!("|---|---:|---:|---:|---:|");
    let filler = dir.join("filler");
    std::fs::create_dir_all(&filler)?;
    let (bind_src, bind_dst) = (dir.join("bind-src"), dir.join("bind-dst"));
    std::fs::create_dir_all(&bind_src)?;
    std::fs::create_dir_all(&bind_dst)?;
    let kernel_bind = || -> anyhow::Result<Duration> {
        let mut lat = Vec::with_capacity(s.iters);
        for _ in 0..s.iters {
            let t = Instant::now();
            modelcache_csi::mount::bind_readonly(&bind_src, &bind_dst, Default::default())?;
            modelcache_csi::mount::unmount(&bind_dst)?;
            lat.push(t.elapsed());
        }
        Ok(median(lat))
    };
    let mut quiet = None;
    let mut mounted = 0;
    let steps: Vec<usize> = [0, s.mounts / 5, s.mounts / 2, s.mounts]
        .into_iter()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for step in steps {
        while mounted < step {
            let p = filler.join(mounted.to_string());
            std::fs::create_dir(&p)?;
            nix::mount::mount(
                Some("tmpfs"),
                &p,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=4k"),
            )
            .with_context(|| format!("mount tmpfs on {}", p.display()))?;
            mounted += 1;
        }
        let publish = median(n.publish_each(&vols, s.iters).await?);
        let kernel = kernel_bind()?;
        let entries = modelcache_csi::mount::read_table()?.len();
        let base = *quiet.get_or_insert(publish);
        let what = match step {
            0 => format!("{entries} entries"),
            _ => format!("{entries} entries (+{step} tmpfs)"),
        };
        println!(
            "| {what} | {} | {:.2} | {} | {} |",
            ms(publish),
            publish.as_secs_f64() / base.as_secs_f64(),
            ms(kernel),
            ms(publish.saturating_sub(kernel))
        );
        csv.row(
            "mounts",
            &[step as f64, entries as f64, ms_f(publish), ms_f(kernel)],
        );
    }
    let swept = harness::sweep_mounts(&filler)?;
    anyhow::ensure!(
        swept == s.mounts,
        "{swept} of {} filler mounts removed",
        s.mounts
    );

    // 3. Volumes: 10, then V over 100 models.
    println!("\n## 3. Calls against the number of volumes (p50, ms)\n");
    let models: Vec<Volume> = {
        let mut m = vec![];
        for i in 0..100 {
            m.push(model(d, &format!("m{i}")).await?);
        }
        m
    };
    let mut rows = vec![];
    let mut all: Vec<Volume> = vec![];
    for want in [10, s.volumes] {
        while all.len() < want {
            let i = all.len();
            let v = d
                .create_cache(&format!("many-{i}"), &models[i % models.len()].volume_id)
                .await?;
            d.stage(&v.volume_id, &n.staging(&v)).await?;
            all.push(v);
        }
        let rss = rss_mib();
        let publish = median(n.publish_each(&all, s.iters).await?);
        let stats = median(n.stats_each(&all, s.iters).await?);
        let cap = median(
            timed(s.iters, || {
                let mut c = d.client().controller;
                async move {
                    c.get_capacity(GetCapacityRequest {
                        parameters: HashMap::from([("backend".into(), "local".into())]),
                        ..Default::default()
                    })
                    .await?;
                    Ok(())
                }
            })
            .await?,
        );
        let list = median(
            timed(s.iters.min(10), || {
                let c = d.client().controller;
                async move {
                    let mut token = String::new();
                    loop {
                        let r = c
                            .clone()
                            .list_volumes(ListVolumesRequest {
                                max_entries: 100,
                                starting_token: token,
                            })
                            .await?
                            .into_inner();
                        if r.next_token.is_empty() {
                            return Ok(());
                        }
                        token = r.next_token;
                    }
                }
            })
            .await?,
        ) / want as u32;
        // A changing call before each scrape: the scrape's cost right
        // after it, and how long the gauges take to show it.
        let (mut scrapes, mut follows) = (vec![], vec![]);
        let (t, v) = (n.target("scrape", 0), &all[0]);
        // Past the settling time of the changes before.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut shown = scrape(metrics).await?;
        for i in 0..s.iters.min(20) {
            let publish = i % 2 == 0;
            if publish {
                d.client()
                    .node
                    .node_publish_volume(n.publish_req(v, &t))
                    .await?;
            } else {
                d.unpublish(&v.volume_id, &t).await?;
            }
            let want = if publish { shown + 1 } else { shown - 1 };
            let t0 = Instant::now();
            shown = scrape(metrics).await?;
            scrapes.push(t0.elapsed());
            while shown != want {
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "the gauges show {shown} published, not {want}, 30 s after the change"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
                shown = scrape(metrics).await?;
            }
            follows.push(t0.elapsed());
        }
        let scraped = median(scrapes);
        let followed = median(follows);
        rows.push((want, publish, stats, cap, list, scraped, followed, rss));
    }
    println!(
        "| volumes | NodePublish | NodeGetVolumeStats | GetCapacity | ListVolumes (all pages, per volume) | /metrics after a change | gauges follow a change in | RSS (MiB) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (v, p, st, c, l, m, f, rss) in &rows {
        println!(
            "| {v} | {} | {} | {} | {} | {} | {} | {rss:.0} |",
            ms(*p),
            ms(*st),
            ms(*c),
            ms(*l),
            ms(*m),
            ms(*f)
        );
    }
    let (a, b) = (&rows[0], &rows[1]);
    let r = |x: Duration, y: Duration| y.as_secs_f64() / x.as_secs_f64();
    println!(
        "| ratio | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | |",
        r(a.1, b.1),
        r(a.2, b.2),
        r(a.3, b.3),
        r(a.4, b.4),
        r(a.5, b.5),
        r(a.6, b.6)
    );
    Ok(())
}
