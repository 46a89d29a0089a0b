//! A crash of the driver (kill -9), not of the machine, loses nothing the
//! kernel still holds: a pull answered once verified writes through the
//! page cache and makes its files durable only at their end, and what it
//! wrote meanwhile is said, unsynced, for a restart on the same boot
//! (`puller::engine::resume::Written`). The restarted driver resumes after
//! it instead of fetching every file in flight again.

use std::fs;
use std::time::{Duration, Instant};

use crate::support::fixtures::{self, FileServer, pseudo_random};
use crate::support::harness::*;

const FILES: usize = 4;
const FILE_BYTES: usize = 32 << 20;
const CHUNK: u64 = 8 << 20;

/// Bytes of model files the origin was asked for (ranges, or whole), but
/// the one-byte reads a resuming requester proves its access with.
fn asked(o: &FileServer, dir: &std::path::Path) -> u64 {
    let transfers: Vec<_> = o
        .requests()
        .into_iter()
        .filter(|r| r.header("range") != Some("bytes=0-0"))
        .collect();
    fixtures::requested_bytes(&transfers, dir)
}

async fn origin(per_connection: u64) -> (FileServer, tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..FILES {
        fs::write(
            dir.path().join(format!("shard-{i}.bin")),
            pseudo_random(300 + i as u64, FILE_BYTES),
        )
        .unwrap();
    }
    let o = FileServer::start(dir.path()).await;
    o.put("m.json", fixtures::manifest_for(dir.path(), true));
    o.throttle(per_connection);
    let uri = format!("{}#manifest", o.url("m.json"));
    (o, dir, uri)
}

async fn driver() -> Driver {
    Driver::start_with(&["--pull-chunk-mib", "8", "--pull-connections", "2"]).await
}

/// kill -9 mid-transfer, and again the moment every file was verified
/// (the create's answer, before the files are durable): each restart
/// fetches at most two chunks per file again. Before, nothing written
/// since the last fsync counted, and a kill after the last byte fetched
/// most of the model again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_the_driver_costs_at_most_two_chunks_a_file() {
    let total = (FILES * FILE_BYTES) as u64;
    // Mid-transfer: 2 MiB/s a connection, 4 s a chunk, about 8 s in all:
    // killed once a chunk of a file is written, with others in flight.
    let (o, dir, uri) = origin(2 << 20).await;
    let mut d = driver().await;
    let req = create_req("pvc-crash", &[("source", &uri)], READER);
    let c = d.client.clone();
    let first = tokio::spawn({
        let r = req.clone();
        async move { c.controller.clone().create_volume(r).await }
    });
    let written = Instant::now() + Duration::from_secs(60);
    while !said_written(&d.state_dir) {
        assert!(Instant::now() < written, "no chunk was ever written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    d.kill_9();
    let _ = first.await;
    let before = asked(&o, dir.path());
    d.restart().await;
    let v = d
        .create_until_done(&req, None, Duration::from_secs(120))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let again = asked(&o, dir.path()) - before;
    let refetched = (before + again).saturating_sub(total);
    eprintln!(
        "mid-transfer kill: {before} bytes asked before, {again} after; {refetched} asked twice"
    );
    assert!(
        refetched <= 2 * CHUNK * FILES as u64,
        "the restart fetched {refetched} bytes again (at most 2 chunks of each of {FILES} files)"
    );
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;

    // The moment every file is verified: the create answers then, before
    // the files are durable.
    let (o, dir, uri) = origin(8 << 20).await;
    let mut d = driver().await;
    let req = create_req("pvc-crash-late", &[("source", &uri)], READER);
    d.create(req.clone())
        .await
        .unwrap_or_else(|s| panic!("{:?}: {}", s.code(), s.message()));
    d.kill_9();
    let before = asked(&o, dir.path());
    d.restart().await;
    let v = d
        .create_until_done(&req, None, Duration::from_secs(120))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let again = asked(&o, dir.path()) - before;
    eprintln!("kill at the answer: {before} bytes asked before, {again} after");
    assert!(
        again <= 2 * CHUNK * FILES as u64,
        "a kill after the last byte fetched {again} of {total} bytes again"
    );
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    let data = d
        .source_dir("local", &v.volume_context["source"])
        .join("data");
    for i in 0..FILES {
        let name = format!("shard-{i}.bin");
        assert!(
            fs::read(data.join(&name)).unwrap() == fs::read(dir.path().join(&name)).unwrap(),
            "{name}: the seal holds other bytes than the origin's"
        );
    }
}

/// Whether the pull said a chunk written (its kill point: the test is of
/// what a restart makes of what was said).
fn said_written(state: &std::path::Path) -> bool {
    let sources = state.join("local/sources");
    fs::read_dir(&sources)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".pull-"))
        .flat_map(|e| {
            fs::read_dir(e.path().join("state"))
                .into_iter()
                .flatten()
                .flatten()
        })
        .any(|f| {
            f.file_name().to_string_lossy().ends_with(".written.json")
                && fs::read_to_string(f.path()).is_ok_and(|t| t.contains("\"done\": [\n"))
        })
}
