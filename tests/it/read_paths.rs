//! What reading a published model costs against reading the same files
//! directly, on the same disk, in the same run: throughput and page cache
//! per byte read, for each kind of volume the node hands a pod. fio jobs
//! model how loaders read (docs/benchmarks.md, *Read paths*).
//!
//! Not a test: `unshare -m --propagation private cargo test --test it --
//! --ignored --exact read_paths::bench --nocapture`, as root, with fio
//! installed (Debian: `apt-get install fio`) and nothing else running (it
//! drops the page cache before each job).

use std::path::{Path, PathBuf};
use std::process::Command;

use modelcache_csi::csi::CapacityRange;
use modelcache_csi::requests::{WRITER, create_req};
use serde_json::Value;

use crate::support::fixtures;
use crate::support::harness::*;

const SHARDS: usize = 8;
const SHARD_BYTES: usize = 128 << 20;

/// One fio job: its name, and its arguments after the files.
struct Job {
    name: &'static str,
    args: &'static [&'static str],
    /// One fio job per file, all at once (parallel loaders), or one job
    /// reading the files one after the other.
    per_file: bool,
}

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
    drop_caches();
    let before = page_cache();
    let out = cmd.output().expect("run fio (apt-get install fio)");
    let after = page_cache();
    assert!(
        out.status.success(),
        "fio: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("fio's JSON");
    let read = &v["jobs"][0]["read"];
    let io_bytes = read["io_bytes"].as_f64().unwrap();
    Outcome {
        bytes_per_s: read["bw_bytes"].as_f64().unwrap(),
        iops: read["iops"].as_f64().unwrap(),
        cache_per_byte: after.saturating_sub(before) as f64 / io_bytes,
    }
}

/// A sealed source of `backend` holding the shards, and a cache volume of
/// it published read-only: the directory a pod would see.
async fn published(d: &Driver, backend: &str, shards: &Path) -> PathBuf {
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
    for e in std::fs::read_dir(shards).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), t.join(e.file_name())).unwrap();
    }
    d.unpublish(&src.volume_id, &t).await.unwrap();
    d.unstage(&src.volume_id, &s).await.unwrap();
    d.seal(&src.volume_id).await.unwrap();
    let c = d
        .create_cache(&format!("bench-{backend}-r"), &src.volume_id, &[])
        .await
        .unwrap();
    let (s, t) = (d.staging(backend), d.target(backend));
    d.stage(&c.volume_id, &s, READER).await.unwrap();
    d.publish(&c.volume_id, &s, &t, READER, true).await.unwrap();
    t
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
    std::fs::create_dir_all(&raw).unwrap();
    for i in 0..SHARDS {
        let bytes = fixtures::pseudo_random(0x9e37_79b9 ^ i as u64, SHARD_BYTES);
        std::fs::write(raw.join(format!("model-{i:05}.safetensors")), bytes).unwrap();
    }
    let d = Driver::start().await;
    let local = published(&d, "local", &raw).await;
    let xfs = published(&d, "xfs", &raw).await;
    let image = find_image(&d.dir).expect("the xfs source's image");
    let buffered = BufferedLoop::mount(&image, &work.path().join("xfs-buffered"));

    let kinds: [(&str, PathBuf); 4] = [
        ("the files themselves", raw.clone()),
        ("local (bind mount)", local),
        ("xfs (loop, direct I/O)", xfs),
        ("xfs (loop through the page cache)", buffered.dir.clone()),
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
                let o = fio(job, &files(dir));
                let iops = job.args.contains(&"--rw=randread");
                let value = if iops { o.iops } else { o.bytes_per_s };
                if k == 0 {
                    base = value;
                }
                ratios[j][k].push(value / base);
                caches[j][k].push(o.cache_per_byte);
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
    drop(buffered);
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
