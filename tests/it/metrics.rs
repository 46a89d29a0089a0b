//! The /metrics endpoint of the real binary: pulls, cache hits, RPC latency
//! and errors, and staged/published volumes taken from the mount table.

use crate::support::harness::*;
use tonic::Code;

/// The value of the first sample whose line starts with `series`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A scrape once the volume gauges show `staged` and `published` (they
/// follow the mount table in the background, a moment after a change),
/// and each of `also` shows its value.
async fn scrape_when(port: u16, staged: f64, published: f64, also: &[(&str, f64)]) -> String {
    let t0 = std::time::Instant::now();
    let mut want = vec![
        ("modelcache_volumes{state=\"staged\"}", staged),
        ("modelcache_volumes{state=\"published\"}", published),
    ];
    want.extend_from_slice(also);
    loop {
        let text = http_get(port, "/metrics");
        let now: Vec<Option<f64>> = want.iter().map(|(s, _)| value(&text, s)).collect();
        if want.iter().zip(&now).all(|((_, v), got)| *got == Some(*v)) {
            return text;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "after 5 s the series {want:?} show {now:?}:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn metrics_follow_pulls_rpcs_and_mounts() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Driver::start_with(&["--metrics-address", &addr]).await;
    let model = d.dir.join("model");
    write_model(&model, 7);
    let uri = format!("file://{}", model.display());
    let v1 = d
        .create(create_req("m1", &[("source", &uri)], READER))
        .await
        .expect("pull");
    // Answered once every file was verified; a cache hit is of the sealed
    // model, and the pull counts once it is sealed.
    d.wait_sealed(&[&v1.volume_context["source"]], SEAL_BOUND)
        .await;
    d.create(create_req("m2", &[("source", &uri)], READER))
        .await
        .expect("hit");
    let bad = d
        .create(create_req("m3", &[("colour", "red")], READER))
        .await;
    assert_code(bad, Code::InvalidArgument, "parameters.colour");
    let staging = d.dir.join("kubelet/globalmount");
    let target = d.dir.join("kubelet/pods/p1/mount");
    d.stage(&v1.volume_id, &staging, READER).await.unwrap();
    d.publish(&v1.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();

    let health = http_get(port, "/healthz");
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("ok\n"),
        "{health}"
    );
    // The counters are the job's, which may end a moment after its
    // volume was answered: the scrape waits for them too (5 s at most).
    let text = scrape_when(
        port,
        1.0,
        1.0,
        &[
            (
                "modelcache_pulls_total{scheme=\"file\",outcome=\"sealed\"}",
                1.0,
            ),
            ("modelcache_cache_hits_total{scheme=\"file\"}", 1.0),
        ],
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        value(&text, "modelcache_pull_bytes_total{scheme=\"file\"}").unwrap() >= (1 << 20) as f64
    );
    assert_eq!(
        value(
            &text,
            "modelcache_rpc_errors_total{method=\"CreateVolume\",code=\"InvalidArgument\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        value(
            &text,
            "modelcache_rpc_duration_seconds_count{method=\"NodeStageVolume\"}"
        )
        .unwrap()
            >= 1.0
    );
    assert!(
        value(&text, "modelcache_cache_used_bytes{backend=\"local\"}").unwrap() >= (1 << 20) as f64
    );
    assert!(value(&text, "modelcache_cache_free_bytes{backend=\"local\"}").unwrap() > 0.0);
    // Never a URI or a path in a label.
    assert!(!text.contains(&uri), "a URI leaked into a label");

    d.unpublish(&v1.volume_id, &target).await.unwrap();
    d.unstage(&v1.volume_id, &staging).await.unwrap();
    scrape_when(port, 0.0, 0.0, &[]).await;
}

/// A burst at both paths of the real driver: every answer right, and the
/// CSI calls made meanwhile answered as quickly as without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_at_the_metrics_port_leaves_csi_calls_alone() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Driver::start_with(&["--metrics-address", &addr]).await;
    let model = d.dir.join("model");
    write_model(&model, 9);
    let uri = format!("file://{}", model.display());
    d.create(create_req("m1", &[("source", &uri)], READER))
        .await
        .expect("pull");
    let burst: Vec<_> = (0..80)
        .map(|i| {
            std::thread::spawn(move || {
                let path = if i % 2 == 0 { "/healthz" } else { "/metrics" };
                (path, http_get(port, path))
            })
        })
        .collect();
    let mut slowest = std::time::Duration::ZERO;
    for _ in 0..20 {
        let t = std::time::Instant::now();
        d.client
            .identity
            .clone()
            .probe(modelcache_csi::csi::ProbeRequest {})
            .await
            .expect("Probe during the burst");
        d.list_all(0).await;
        slowest = slowest.max(t.elapsed());
    }
    for b in burst {
        let (path, answer) = b.join().unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    assert!(
        slowest < std::time::Duration::from_secs(2),
        "a CSI call took {slowest:?} during the burst"
    );
}
