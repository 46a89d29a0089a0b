//! The driver's side of the puller benchmark (`tests/bench/pull.sh`), built
//! as a Cargo example; not a test.
//!
//! `create`: connects to a running driver's socket (waiting for it to come
//! up, untimed), then times one CreateVolume of a cache volume whose
//! `source` is an `s3://` URI: resolve, parallel ranged download, fsync,
//! sha256 of every byte, seal. Prints one JSON line with the wall-clock
//! seconds, the volume id and the sealed source id.
//!
//! `sha256`: the hasher's bound on this CPU: hashes an in-memory buffer with
//! the same `sha2` crate, features and update size (1 MiB) as the engine's
//! read-back hasher, and prints MB/s per wall-clock second and per second of
//! this thread's CPU time (the one that other processes' load does not
//! change).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use modelcache_csi::client::Client;
use modelcache_csi::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode};
use modelcache_csi::csi::{CreateVolumeRequest, VolumeCapability};
use sha2::{Digest, Sha256};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Time one CreateVolume pulling an s3:// model.
    Create {
        /// The driver's Unix socket.
        #[arg(long)]
        socket: PathBuf,
        /// The volume (PVC) name.
        #[arg(long)]
        name: String,
        /// s3://bucket/prefix
        #[arg(long)]
        source: String,
        /// http://127.0.0.1:PORT
        #[arg(long)]
        s3_endpoint: String,
        #[arg(long, env = "BENCH_S3_ACCESS_KEY")]
        access_key: String,
        #[arg(long, env = "BENCH_S3_SECRET_KEY", hide_env_values = true)]
        secret_key: String,
        /// Seconds to wait for the socket to accept (untimed).
        #[arg(long, default_value_t = 30)]
        wait: u64,
    },
    /// Measure sha2's throughput on this CPU, as the engine uses it.
    Sha256 {
        /// MiB hashed per pass.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        #[arg(long, default_value_t = 3)]
        passes: usize,
    },
}

async fn connect(socket: PathBuf, wait: Duration) -> anyhow::Result<Client> {
    let deadline = Instant::now() + wait;
    loop {
        match Client::connect(socket.clone()).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= deadline => {
                return Err(e).with_context(|| format!("connect to {}", socket.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn create(
    socket: PathBuf,
    name: String,
    source: String,
    s3_endpoint: String,
    access_key: String,
    secret_key: String,
    wait: Duration,
) -> anyhow::Result<()> {
    let client = connect(socket, wait).await?;
    let parameters: HashMap<String, String> = [
        ("backend", "local"),
        ("source", source.as_str()),
        ("s3Endpoint", s3_endpoint.as_str()),
        ("s3Region", "us-east-1"),
        ("s3PathStyle", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let secrets: HashMap<String, String> = [
        ("awsAccessKeyID".to_string(), access_key),
        ("awsSecretAccessKey".to_string(), secret_key),
    ]
    .into();
    let req = CreateVolumeRequest {
        name,
        parameters,
        secrets,
        volume_capabilities: vec![VolumeCapability {
            access_mode: Some(AccessMode {
                mode: access_mode::Mode::SingleNodeReaderOnly as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }],
        ..Default::default()
    };
    let started = Instant::now();
    let resp = client
        .controller
        .clone()
        .create_volume(req)
        .await
        .context("CreateVolume")?
        .into_inner();
    let seconds = started.elapsed().as_secs_f64();
    let Some(volume) = resp.volume else {
        bail!("CreateVolume answered without a volume");
    };
    let out = serde_json::json!({
        "seconds": seconds,
        "volume_id": volume.volume_id,
        "source": volume.volume_context.get("source"),
        "capacity_bytes": volume.capacity_bytes,
    });
    println!("{out}");
    Ok(())
}

fn sha256_speed(mib: usize, passes: usize) {
    // Not zeros: the hash does not care, but make it look like weights.
    let mut buf = vec![0u8; mib << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..passes.max(1) {
        let (started, cpu0) = (Instant::now(), thread_cpu_seconds());
        let mut h = Sha256::new();
        for c in buf.chunks(1 << 20) {
            h.update(c);
        }
        let digest = h.finalize();
        let (secs, cpu_secs) = (started.elapsed().as_secs_f64(), thread_cpu_seconds() - cpu0);
        std::hint::black_box(digest);
        wall.push(buf.len() as f64 / secs / 1e6);
        cpu.push(buf.len() as f64 / cpu_secs / 1e6);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{}",
        serde_json::json!({
            "sha256_mb_per_s": median(&mut wall),
            "sha256_mb_per_cpu_s": median(&mut cpu),
            "mib": mib,
        })
    );
}

fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Create {
            socket,
            name,
            source,
            s3_endpoint,
            access_key,
            secret_key,
            wait,
        } => {
            create(
                socket,
                name,
                source,
                s3_endpoint,
                access_key,
                secret_key,
                Duration::from_secs(wait),
            )
            .await
        }
        Cmd::Sha256 { mib, passes } => {
            sha256_speed(mib, passes);
            Ok(())
        }
    }
}
