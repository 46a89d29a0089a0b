//! The node plugin under kubelet's load, with loose bounds a slow machine
//! still meets: a hundred concurrent publishes do not wait on each other,
//! and a publish does not grow with the node's mount table. The figures
//! these guard are in docs/benchmarks.md (`cargo bench --bench node_scale`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::harness::*;
use modelcache_csi::csi::*;
use modelcache_csi::mount::{mount_tmpfs, sweep_under};

const BURST: usize = 100;

/// How long `k` concurrent calls of `call` take, all told.
async fn burst<F, Fut>(k: usize, call: F) -> Duration
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send + 'static,
{
    let t0 = Instant::now();
    let calls: Vec<_> = (0..k).map(|i| tokio::spawn(call(i))).collect();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    t0.elapsed()
}

async fn probe_burst(d: &Driver) -> Duration {
    burst(BURST, |_| {
        let mut c = d.client.identity.clone();
        async move {
            c.probe(ProbeRequest {}).await?;
            Ok(())
        }
    })
    .await
}

/// `n` cache volumes of one pulled model, each staged.
async fn staged_volumes(d: &Driver, n: usize) -> Vec<(String, PathBuf)> {
    let model = d.dir.join("model");
    write_model(&model, 3);
    let uri = format!("file://{}", model.display());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let v = d
            .create(create_req(
                &format!("scale-{i}"),
                &[("backend", "local"), ("source", &uri)],
                READER,
            ))
            .await
            .unwrap();
        let staging = d.staging(&format!("scale-{i}"));
        d.stage(&v.volume_id, &staging, READER).await.unwrap();
        out.push((v.volume_id, staging));
    }
    out
}

/// The median of `iters` publishes, one at a time.
async fn publish_p50(
    d: &Driver,
    id: &str,
    staging: &Path,
    target: &Path,
    iters: usize,
) -> Duration {
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        d.publish(id, staging, target, READER, true).await.unwrap();
        lat.push(t0.elapsed());
        d.unpublish(id, target).await.unwrap();
    }
    lat.sort();
    lat[iters / 2]
}

/// A burst of publishes costs about a burst of Probe, not a hundred
/// publishes one after another. When each publish held a lock across a
/// read of the mount table, this test measured 5.9 to 8.4 times the Probe
/// burst (the benchmark, release build: 17); since, 1.1 to 1.2. Bound: 3
/// times, the best of three rounds.
#[tokio::test]
async fn a_hundred_concurrent_publishes_do_not_wait_on_each_other() {
    let d = Arc::new(Driver::start().await);
    let vols = Arc::new(staged_volumes(&d, BURST).await);
    let mut ratios = vec![];
    for round in 0..3 {
        nix::unistd::sync();
        let floor = probe_burst(&d).await;
        let targets: Arc<Vec<PathBuf>> = Arc::new(
            (0..BURST)
                .map(|i| d.target(&format!("r{round}-{i}")))
                .collect(),
        );
        let publish = burst(BURST, |i| {
            let (d, vols, targets) = (d.clone(), vols.clone(), targets.clone());
            async move {
                let (id, staging) = &vols[i];
                d.publish(id, staging, &targets[i], READER, true).await
            }
        })
        .await;
        for (i, t) in targets.iter().enumerate() {
            single_mount(t);
            d.unpublish(&vols[i].0, t).await.unwrap();
        }
        eprintln!("round {round}: {BURST} Probe {floor:?}, {BURST} NodePublish {publish:?}");
        ratios.push(publish.as_secs_f64() / floor.as_secs_f64());
    }
    let best = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        best <= 3.0,
        "{BURST} concurrent publishes took {best:.1} times {BURST} concurrent Probe calls \
         (rounds: {ratios:.1?}): publishes wait on each other again"
    );
}

/// A publish costs about the same with 3,000 more mounts on the node: it
/// looks up the one path it needs, never the whole table (reading it made
/// this test's publish 26.8 times slower; since, 0.8 to 1.1). The kernel's
/// own bind mount grows with the table too (6 to 113 µs at +5,000 here),
/// hence the loose bound: 3 times.
#[tokio::test]
async fn a_publish_does_not_grow_with_the_mount_table() {
    const EXTRA: usize = 3000;
    const ITERS: usize = 30;
    let d = Driver::start().await;
    let vols = staged_volumes(&d, 1).await;
    let (id, staging) = &vols[0];
    let target = d.target("t");
    let quiet = publish_p50(&d, id, staging, &target, ITERS).await;
    // Under the driver's directory: its drop unmounts them if this fails.
    let filler = d.dir.join("filler");
    let t0 = Instant::now();
    for i in 0..EXTRA {
        let p = filler.join(i.to_string());
        std::fs::create_dir_all(&p).unwrap();
        mount_tmpfs(&p, 4096).unwrap();
    }
    eprintln!("{EXTRA} tmpfs mounted in {:?}", t0.elapsed());
    let busy = publish_p50(&d, id, staging, &target, ITERS).await;
    assert_eq!(sweep_under(&filler).unwrap().len(), EXTRA);
    let ratio = busy.as_secs_f64() / quiet.as_secs_f64();
    eprintln!("publish p50: {quiet:?} quiet, {busy:?} with {EXTRA} more mounts ({ratio:.2}x)");
    assert!(
        ratio <= 3.0,
        "a publish took {ratio:.1} times longer with {EXTRA} more mounts on the node \
         ({quiet:?} -> {busy:?}): it reads the whole mount table again"
    );
}

/// A Deployment's pods share one claim, and kubelet publishes and
/// unpublishes them at once: every call succeeds the first time. (When
/// each publish held the whole volume, 46 of these 50 publishes came back
/// Aborted, and 143 of the 244 unpublishes of two 50-replica rollouts on
/// the e2e cluster, each retried by kubelet half a second later or more.)
/// One target still takes one call at a time, and a stage waits for the
/// publishes (lock::tests).
#[tokio::test]
async fn the_pods_of_one_claim_publish_and_unpublish_at_once() {
    const PODS: usize = 50;
    let d = Arc::new(Driver::start().await);
    let vols = staged_volumes(&d, 1).await;
    let (id, staging) = vols[0].clone();
    let targets: Vec<PathBuf> = (0..PODS).map(|i| d.target(&format!("pod-{i}"))).collect();
    let all = |unpublish: bool| {
        let calls: Vec<_> = targets
            .iter()
            .map(|t| {
                let (d, id, staging, t) = (d.clone(), id.clone(), staging.clone(), t.clone());
                tokio::spawn(async move {
                    match unpublish {
                        false => d.publish(&id, &staging, &t, READER, true).await,
                        true => d.unpublish(&id, &t).await,
                    }
                })
            })
            .collect();
        async move {
            let mut failed = vec![];
            for c in calls {
                if let Err(s) = c.await.unwrap() {
                    failed.push(format!("{:?}: {}", s.code(), s.message()));
                }
            }
            failed
        }
    };
    let failed = all(false).await;
    assert!(
        failed.is_empty(),
        "{} of {PODS} publishes failed: {failed:#?}",
        failed.len()
    );
    for t in &targets {
        assert_mount_options(&single_mount(t), &["ro"]);
    }
    let failed = all(true).await;
    assert!(
        failed.is_empty(),
        "{} of {PODS} unpublishes failed: {failed:#?}",
        failed.len()
    );
    for t in &targets {
        assert_not_mounted(t);
    }
}
