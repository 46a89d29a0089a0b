//! What reading a published model costs against reading the same files
//! directly, on the same disk, in the same run: throughput and page cache
//! per byte read, for each kind of volume the node hands a pod. fio jobs
//! model how loaders read (docs/benchmarks.md, *Read paths*).
//!
//! Not a test: `unshare -m --propagation private cargo test --test it --
//! --ignored --exact read_paths::bench --nocapture`, as root, with fio
//! installed (Debian: `apt-get install fio`) and nothing else running (it
//! drops the page cache before each job). The loader job's safetensors
//! comes from PyPI through tests/scripts/deps/safetensors.sh.

use std::path::{Path, PathBuf};
use std::process::Command;

use modelcache_csi::csi::CapacityRange;
use modelcache_csi::requests::{WRITER, create_req};
use serde_json::Value;

use crate::support::fixtures::{self, FileServer};
use crate::support::gluster::Gluster;
use crate::support::harness::*;

const SHARDS: usize = 8;
/// The directory of the model that holds its shards (a subPath's).
const WEIGHTS: &str = "weights";
const SHARD_BYTES: usize = 128 << 20;

/// One reading job: its name, and fio's arguments after the files.
struct Job {
    name: &'static str,
    args: &'static [&'static str],
    /// One fio job per file, all at once (parallel loaders), or one job
    /// reading the files one after the other.
    per_file: bool,
}

/// The loader's job: safetensors' own `safe_open` and `get_tensor`, not fio.
/// The kind read through a GlusterFS client mount.
const GLUSTER: &str = "shared on GlusterFS (FUSE client)";

const LOADER: &str = "safetensors safe_open, every tensor (mmap)";

const JOBS: &[Job] = &[
    Job {
        name: "sequential, buffered, 1 MiB",
        args: &["--rw=read", "--bs=1M", "--ioengine=psync"],
        per_file: false,
    },
    Job {
        name: "1 MiB read, 16 MiB skipped, buffered",
        args: &["--rw=read:16M", "--bs=1M", "--ioengine=psync"],
        per_file: false,
    },
    Job {
        name: "mmap, sequential",
        args: &["--rw=read", "--bs=1M", "--ioengine=mmap"],
        per_file: false,
    },
    Job {
        name: "O_DIRECT, 4 MiB",
        args: &["--rw=read", "--bs=4M", "--ioengine=psync", "--direct=1"],
        per_file: false,
    },
    Job {
        name: "io_uring QD32, O_DIRECT 1 MiB, 8 files at once",
        args: &[
            "--rw=read",
            "--bs=1M",
            "--ioengine=io_uring",
            "--iodepth=32",
            "--direct=1",
        ],
        per_file: true,
    },
    Job {
        name: "random 4 KiB, O_DIRECT, io_uring QD32 (IOPS)",
        args: &[
            "--rw=randread",
            "--bs=4k",
            "--ioengine=io_uring",
            "--iodepth=32",
            "--direct=1",
            "--runtime=4",
            "--time_based",
        ],
        per_file: false,
    },
    Job {
        name: LOADER,
        args: &[],
        per_file: false,
    },
];

fn drop_caches() {
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop the page cache (root?)");
}

/// `Cached:` of /proc/meminfo, in bytes.
fn page_cache() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix("Cached:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("Cached: in /proc/meminfo")
        * 1024
}

struct Outcome {
    bytes_per_s: f64,
    iops: f64,
    /// Page cache growth over bytes read.
    cache_per_byte: f64,
    bytes_read: f64,
}

fn read(job: &Job, files: &[PathBuf], python: &Path) -> Outcome {
    if job.name == LOADER {
        load(python, files)
    } else {
        fio(job, files)
    }
}

/// Runs `cmd` from a dropped page cache; its output and the page cache's
/// growth.
fn measured(cmd: &mut Command) -> (std::process::Output, u64) {
    drop_caches();
    let before = page_cache();
    let out = cmd.output().expect("run the reader");
    let after = page_cache();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, after.saturating_sub(before))
}

fn load(python: &Path, files: &[PathBuf]) -> Outcome {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bench/safetensors_load.py");
    let (out, grown) = measured(Command::new(python).arg(script).args(files));
    let v: Value = serde_json::from_slice(&out.stdout).expect("the loader's JSON");
    let bytes = v["bytes"].as_f64().unwrap();
    Outcome {
        bytes_per_s: bytes / v["seconds"].as_f64().unwrap(),
        iops: 0.0,
        cache_per_byte: grown as f64 / bytes,
        bytes_read: bytes,
    }
}

fn fio(job: &Job, files: &[PathBuf]) -> Outcome {
    let mut cmd = Command::new("fio");
    cmd.args(["--output-format=json", "--group_reporting", "--readonly"]);
    cmd.args(job.args);
    if job.per_file {
        for (i, f) in files.iter().enumerate() {
            cmd.arg(format!("--name=f{i}"));
            cmd.arg(format!("--filename={}", f.display()));
        }
    } else {
        let list: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        cmd.args([
            "--name=all".to_string(),
            format!("--filename={}", list.join(":")),
            "--file_service_type=sequential".to_string(),
        ]);
    }
    let (out, grown) = measured(&mut cmd);
    let v: Value = serde_json::from_slice(&out.stdout).expect("fio's JSON");
    let read = &v["jobs"][0]["read"];
    let io_bytes = read["io_bytes"].as_f64().unwrap();
    Outcome {
        bytes_per_s: read["bw_bytes"].as_f64().unwrap(),
        iops: read["iops"].as_f64().unwrap(),
        cache_per_byte: grown as f64 / io_bytes,
        bytes_read: io_bytes,
    }
}

/// A sealed source of `backend` holding the shards under `weights/`, and a
/// cache volume of it published read-only: the source's id and the
/// directory a pod would see.
async fn published(d: &Driver, backend: &str, shards: &Path) -> (String, PathBuf) {
    let mut req = create_req(&format!("bench-{backend}"), &[("backend", backend)], WRITER);
    if backend == "xfs" {
        req.capacity_range = Some(CapacityRange {
            required_bytes: (SHARDS * SHARD_BYTES) as i64 + 256 * MIB,
            limit_bytes: 0,
        });
    }
    let src = d.create(req).await.unwrap();
    let (s, t) = (
        d.staging(&format!("{backend}-w")),
        d.target(&format!("{backend}-w")),
    );
    d.stage(&src.volume_id, &s, WRITER).await.unwrap();
    d.publish(&src.volume_id, &s, &t, WRITER, false)
        .await
        .unwrap();
    std::fs::create_dir(t.join(WEIGHTS)).unwrap();
    for e in std::fs::read_dir(shards).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), t.join(WEIGHTS).join(e.file_name())).unwrap();
    }
    d.unpublish(&src.volume_id, &t).await.unwrap();
    d.unstage(&src.volume_id, &s).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();
    let c = d
        .create_cache(&format!("bench-{backend}-r"), &src.volume_id, &[])
        .await
        .unwrap();
    (src.volume_id, read_only(d, &c.volume_id, backend).await)
}

/// Volume `id` staged and published read-only as kubelet would; its target.
async fn read_only(d: &Driver, id: &str, name: &str) -> PathBuf {
    let (s, t) = (d.staging(name), d.target(name));
    d.stage(id, &s, READER).await.unwrap();
    d.publish(id, &s, &t, READER, true).await.unwrap();
    t
}

/// A progressive volume of the shards, pulled from a paced origin on
/// loopback, published while its model arrives and read once it is sealed:
/// the view a pod staged before the seal keeps (FUSE, each verified file
/// passed through to its backing file).
async fn progressive(d: &Driver, raw: &Path) -> (FileServer, PathBuf) {
    let origin = FileServer::start(raw).await;
    origin.put("m.json", fixtures::manifest_for(raw, true));
    // Slow enough that the view is staged long before the seal.
    origin.throttle(8 << 20);
    let uri = format!("{}#manifest", origin.url("m.json"));
    let req = create_req(
        "bench-progressive",
        &[
            ("backend", "local"),
            ("source", &uri),
            ("progressive", "true"),
        ],
        READER,
    );
    let v = d.create(req).await.unwrap();
    let t = read_only(d, &v.volume_id, "progressive").await;
    assert!(
        fstype(&t).starts_with("fuse"),
        "the progressive volume was staged after its seal (a bind mount), not as a view: {}",
        fstype(&t)
    );
    d.wait_sealed(
        &[&v.volume_context["source"]],
        std::time::Duration::from_secs(600),
    )
    .await;
    (origin, t.join(WEIGHTS))
}

/// The filesystem type the kernel reports for the mount at `dir`.
fn fstype(dir: &Path) -> String {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = dir.to_string_lossy();
    table
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(&*dir))
        .and_then(|l| l.split(" - ").nth(1))
        .and_then(|r| r.split(' ').next())
        .unwrap_or("none")
        .to_string()
}

/// A safetensors file of `SHARD_BYTES`: a header padded to 4 KiB naming 16
/// byte tensors, then their bytes, pseudo-random from `seed`.
fn safetensors_shard(seed: u64) -> Vec<u8> {
    const HEAD: usize = 4096;
    const TENSORS: usize = 16;
    let each = (SHARD_BYTES - HEAD) / TENSORS;
    let mut header = serde_json::Map::new();
    for t in 0..TENSORS {
        header.insert(
            format!("layer.{t}.weight"),
            serde_json::json!({"dtype": "U8", "shape": [each], "data_offsets": [t * each, (t + 1) * each]}),
        );
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(HEAD - 8, b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&fixtures::pseudo_random(seed, each * TENSORS));
    out
}

/// The same image through a loop device that reads its file through the
/// page cache: the driver's read-only device without `LO_FLAGS_DIRECT_IO`.
struct BufferedLoop {
    dev: String,
    dir: PathBuf,
}

impl BufferedLoop {
    fn mount(image: &Path, dir: &Path) -> BufferedLoop {
        let out = Command::new("losetup")
            .args(["--find", "--show", "--read-only", "--direct-io=off"])
            .arg(image)
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup: {out:?}");
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        std::fs::create_dir_all(dir).unwrap();
        let st = Command::new("mount")
            .args(["-t", "xfs", "-o", "ro,norecovery,nouuid", &dev])
            .arg(dir)
            .status()
            .unwrap();
        assert!(st.success(), "mount {dev}");
        BufferedLoop {
            dev,
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for BufferedLoop {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

#[tokio::test]
#[ignore = "a benchmark: run alone, as root, with fio"]
async fn bench() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let raw = work.path().join("raw");
    let shards = raw.join(WEIGHTS);
    std::fs::create_dir_all(&shards).unwrap();
    for i in 0..SHARDS {
        let bytes = safetensors_shard(0x9e37_79b9 ^ i as u64);
        std::fs::write(shards.join(format!("model-{i:05}.safetensors")), bytes).unwrap();
    }
    let python = loader_python();
    let d = Driver::start().await;
    let (local_src, local) = published(&d, "local", &shards).await;
    let (xfs_src, xfs) = published(&d, "xfs", &shards).await;
    let image = find_image(&d.dir).expect("the xfs source's image");
    let buffered = BufferedLoop::mount(&image, &work.path().join("xfs-buffered"));
    let sub = d
        .create_cache("bench-sub-path", &local_src, &[("subPath", WEIGHTS)])
        .await
        .unwrap();
    let sub = read_only(&d, &sub.volume_id, "sub-path").await;
    let (_origin, view) = progressive(&d, &raw).await;
    // A `shared` root's model is a bind mount of the directory on the
    // filesystem's client mount (as `local` is of its own): read there.
    let mut gluster = Gluster::volume();
    let on_gluster = gluster.mount("").join(WEIGHTS);
    std::fs::create_dir(&on_gluster).unwrap();
    for e in std::fs::read_dir(&shards).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), on_gluster.join(e.file_name())).unwrap();
    }

    let kinds: [(&str, PathBuf); 7] = [
        ("the files themselves", shards.clone()),
        ("local (bind mount)", local.join(WEIGHTS)),
        ("local, subPath", sub),
        ("progressive view, sealed (FUSE passthrough)", view),
        ("xfs (loop, direct I/O)", xfs.join(WEIGHTS)),
        (
            "xfs (loop through the page cache)",
            buffered.dir.join(WEIGHTS),
        ),
        (GLUSTER, on_gluster),
    ];
    let files = |dir: &Path| -> Vec<PathBuf> {
        (0..SHARDS)
            .map(|i| dir.join(format!("model-{i:05}.safetensors")))
            .collect()
    };
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    // [job][kind]: each run's ratio against the files, and cache per byte.
    let mut ratios = vec![vec![Vec::new(); kinds.len()]; JOBS.len()];
    let mut caches = vec![vec![Vec::new(); kinds.len()]; JOBS.len()];
    // [job]: the GlusterFS client's own cache per byte read. On this one
    // host the brick's cache is in /proc/meminfo's growth too; on a node
    // the brick is elsewhere.
    let mut client = vec![Vec::new(); JOBS.len()];
    println!("| run | job | volume | MB/s (IOPS) | against the files | page cache per byte read |");
    println!("|---|---|---|---|---|---|");
    for run in 1..=runs {
        for (j, job) in JOBS.iter().enumerate() {
            // The files first, then the volumes in an order that turns
            // each run, so that none always follows the same one.
            let mut order: Vec<usize> = (1..kinds.len()).collect();
            let turn = run % order.len();
            order.rotate_left(turn);
            order.insert(0, 0);
            let mut base = 0.0;
            for k in order {
                let (label, dir) = &kinds[k];
                let o = read(job, &files(dir), &python);
                let iops = job.args.contains(&"--rw=randread");
                let value = if iops { o.iops } else { o.bytes_per_s };
                if k == 0 {
                    base = value;
                }
                ratios[j][k].push(value / base);
                caches[j][k].push(o.cache_per_byte);
                if *label == GLUSTER {
                    let resident: u64 =
                        files(dir).iter().map(|f| fixtures::resident_bytes(f)).sum();
                    client[j].push(resident as f64 / o.bytes_read);
                }
                let figure = if iops {
                    format!("{:.0} IOPS", o.iops)
                } else {
                    format!("{:.0}", o.bytes_per_s / 1e6)
                };
                println!(
                    "| {run} | {} | {label} | {figure} | {:.2}x | {:.2} |",
                    job.name,
                    value / base,
                    o.cache_per_byte
                );
            }
        }
    }
    println!(
        "\nMedians of {runs} runs: throughput against the files read in the same run, and page cache per byte read\n"
    );
    let head: Vec<&str> = kinds[1..].iter().map(|(l, _)| *l).collect();
    println!("| job | the files (page cache) | {} |", head.join(" | "));
    println!("|---|---|{}", "---|".repeat(head.len()));
    for (j, job) in JOBS.iter().enumerate() {
        let cells: Vec<String> = (1..kinds.len())
            .map(|k| {
                format!(
                    "{:.2}x, {:.2}",
                    median(&ratios[j][k]),
                    median(&caches[j][k])
                )
            })
            .collect();
        println!(
            "| {} | {:.2} | {} |",
            job.name,
            median(&caches[j][0]),
            cells.join(" | ")
        );
    }
    println!(
        "\n{GLUSTER}: the client's own page cache per byte read (fincore through its mount)\n"
    );
    for (j, job) in JOBS.iter().enumerate() {
        println!("| {} | {:.2} |", job.name, median(&client[j]));
    }
    drop(buffered);
    drop(gluster);

    // Eight pods of one model on one node, each through a volume of its
    // own, all reading at once.
    let mut pods: Vec<(&str, Vec<PathBuf>)> = vec![("the files themselves", vec![shards; PODS])];
    for (label, backend, src) in [
        ("local (bind mount)", "local", &local_src),
        ("xfs (loop, direct I/O)", "xfs", &xfs_src),
    ] {
        let mut dirs = Vec::new();
        for p in 0..PODS {
            let name = format!("pod-{backend}-{p}");
            let v = d.create_cache(&name, src, &[]).await.unwrap();
            dirs.push(read_only(&d, &v.volume_id, &name).await.join(WEIGHTS));
        }
        pods.push((label, dirs));
    }
    let model = (SHARDS * SHARD_BYTES) as f64;
    println!(
        "\n{PODS} pods reading one model at once, each through its own volume (buffered, 1 MiB, each pod the {SHARDS} files in turn)\n"
    );
    // Then with the readers' memory (their page cache included) held to
    // half the model, as on a node whose memory the model does not fit.
    let half = (SHARDS * SHARD_BYTES / 2) as u64;
    println!(
        "| run | volume | memory | MB/s, all pods | against the files | page cache per model | disk reads per model |"
    );
    println!("|---|---|---|---|---|---|---|");
    for limit in [None, Some(half)] {
        for run in 1..=runs {
            let mut base = 0.0;
            for (label, dirs) in &pods {
                let o = fio_pods(dirs.iter().map(|d| files(d)).collect(), limit);
                if base == 0.0 {
                    base = o.bytes_per_s;
                }
                let memory = limit.map_or("the node's".to_string(), |l| format!("{} MiB", l >> 20));
                println!(
                    "| {run} | {label} | {memory} | {:.0} | {:.2}x | {:.2} | {:.2} |",
                    o.bytes_per_s / 1e6,
                    o.bytes_per_s / base,
                    o.cache / model,
                    o.disk / model
                );
            }
        }
    }
}

/// A memory cgroup limited to `bytes` (v2, else v1's memory controller),
/// removed on drop.
struct MemoryLimit(PathBuf);

impl MemoryLimit {
    fn new(bytes: u64) -> MemoryLimit {
        let name = format!("mc-read-paths-{}", std::process::id());
        let (dir, knob) = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            (Path::new("/sys/fs/cgroup").join(name), "memory.max")
        } else {
            (
                Path::new("/sys/fs/cgroup/memory").join(name),
                "memory.limit_in_bytes",
            )
        };
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(knob), bytes.to_string()).unwrap();
        MemoryLimit(dir)
    }

    /// `cmd`, run inside the cgroup.
    fn wrap(&self, cmd: &Command) -> Command {
        let mut inside = Command::new("sh");
        inside
            .arg("-c")
            .arg("echo $$ > \"$0\"/cgroup.procs && exec \"$@\"")
            .arg(&self.0)
            .arg(cmd.get_program())
            .args(cmd.get_args());
        inside
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Pods reading one model at once in the pods bench.
const PODS: usize = 8;

struct PodsOutcome {
    bytes_per_s: f64,
    /// Page cache growth, bytes.
    cache: f64,
    /// Bytes the node's disks read meanwhile.
    disk: f64,
}

/// One fio job per pod, each reading its files in turn, all at once, in a
/// memory cgroup of `memory` bytes when given.
fn fio_pods(pods: Vec<Vec<PathBuf>>, memory: Option<u64>) -> PodsOutcome {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--output-format=json",
        "--group_reporting",
        "--readonly",
        "--rw=read",
        "--bs=1M",
        "--ioengine=psync",
        "--file_service_type=sequential",
    ]);
    for (i, files) in pods.iter().enumerate() {
        let list: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        cmd.arg(format!("--name=pod{i}"));
        cmd.arg(format!("--filename={}", list.join(":")));
    }
    let limit = memory.map(MemoryLimit::new);
    if let Some(l) = &limit {
        cmd = l.wrap(&cmd);
    }
    drop_caches();
    let disk_before = disk_read_bytes();
    let (out, grown) = measured(&mut cmd);
    drop(limit);
    let disk = disk_read_bytes() - disk_before;
    let v: Value = serde_json::from_slice(&out.stdout).expect("fio's JSON");
    PodsOutcome {
        bytes_per_s: v["jobs"][0]["read"]["bw_bytes"].as_f64().unwrap(),
        cache: grown as f64,
        disk: disk as f64,
    }
}

/// Bytes read by the node's whole disks (`/proc/diskstats`, loop devices
/// and partitions left out: a loop device's reads reach its disk too).
fn disk_read_bytes() -> u64 {
    let stats = std::fs::read_to_string("/proc/diskstats").unwrap();
    stats
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = *f.get(2)?;
            let whole = Path::new("/sys/block").join(name).exists();
            let virtual_dev =
                name.starts_with("loop") || name.starts_with("ram") || name.starts_with("dm-");
            (whole && !virtual_dev).then(|| f.get(5)?.parse::<u64>().ok())?
        })
        .sum::<u64>()
        * 512
}

/// The python of safetensors' pinned venv (installed on first use).
fn loader_python() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/safetensors.sh");
    let out = Command::new(script).output().unwrap();
    assert!(out.status.success(), "safetensors.sh: {out:?}");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The one `image.xfs` under `dir`.
fn find_image(dir: &Path) -> Option<PathBuf> {
    let out = Command::new("find")
        .arg(dir)
        .args(["-name", "image.xfs", "-type", "f"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .map(PathBuf::from)
}
