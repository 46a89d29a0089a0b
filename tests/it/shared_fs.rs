//! The shared backend's cross-node protocol on a real distributed
//! filesystem (issue #25): two GlusterFS FUSE clients of one volume stand
//! for two nodes, each with its own caches, and the cache library runs
//! against each as that node's driver would.

use std::fs;
use std::path::Path;

use modelcache_csi::cache::lease::{self, Share};
use modelcache_csi::cache::{self, Backend, Root};
use modelcache_csi::config::Config;
use modelcache_csi::error::Error;
use modelcache_csi::state;

use std::time::{Duration, Instant};

use modelcache_csi::csi::ControllerModifyVolumeRequest;
use tonic::Code;

use crate::support::fixtures::{self, FileServer};
use crate::support::gluster::Gluster;
use crate::support::harness::*;

const SID: &str = "0123456789abcdef0123456789abcdef";
const SID2: &str = "fedcba9876543210fedcba9876543210";

fn id(sid: &str) -> cache::SourceId {
    cache::SourceId::parse(sid).unwrap()
}

fn root_at(shared: &Path) -> Root {
    let cfg = Config {
        shared_paths: vec![shared.to_path_buf()],
        backends: vec![Backend::Shared],
        ..Config::default()
    };
    modelcache_csi::cache::Roots::of(&cfg).roots.remove(0)
}

fn take(root: &Root, node: &str, staging: &str) -> modelcache_csi::error::Result<bool> {
    let src = root.open_source(&id(SID))?;
    lease::acquire(
        root,
        &src,
        &id(SID),
        node,
        Path::new(staging),
        Share::Exclusive,
    )
}

/// The writer fence between a node and the sealing controller holds when
/// the writer's client caches "no such file" for the seal the controller
/// has just made, and a node reading the seal gets it: `negative-timeout`
/// stands for NFS's lookup cache (a Gluster client caches no negative
/// entries by default).
#[test]
fn a_seal_made_on_one_client_is_seen_by_a_client_that_cached_its_absence() {
    let mut g = Gluster::volume();
    let (a, b) = (g.mount(""), g.mount("negative-timeout=30"));
    let (ra, rb) = (root_at(&a), root_at(&b));
    for sid in [&id(SID), &id(SID2)] {
        fs::create_dir_all(ra.source(sid).data()).unwrap();
        fs::write(ra.source(sid).data().join("weights.bin"), b"v1 weights").unwrap();
        // Node B looks for the seal (as a stage of the writable source, or
        // a pull, does), and its client remembers that there is none.
        assert!(!rb.source(sid).seal().exists());
        cache::seal_source(&ra, sid, "test").unwrap();
        // The point of the test: B's client still answers from its cache,
        // so a check by name would miss the seal.
        assert!(
            !rb.source(sid).seal().exists(),
            "client B sees the seal by name at once: the negative cache this test needs is off"
        );
    }
    // A writable stage on B is refused, and leaves no lease behind.
    let err = take(&rb, "node-b", "/staging/b").unwrap_err();
    assert!(matches!(err, Error::Precondition(_)), "{err}");
    assert!(err.to_string().contains("is sealed"), "{err}");
    assert!(cache::writers(&ra, &id(SID)).unwrap().is_empty());
    // A node that reads the seal (to mount it, or before pulling again)
    // gets it, not the cached miss.
    let seal = cache::read_seal(&rb, &id(SID2))
        .unwrap()
        .expect("node B reads the seal");
    assert_eq!(seal.total_bytes, 10);
}

/// One writer at a time across clients, a seal refused while another
/// client's node writes, and the lease handed over once released.
#[test]
fn the_writer_lease_fences_across_clients_and_the_controller_sees_it() {
    let mut g = Gluster::volume();
    let (a, b) = (g.mount(""), g.mount(""));
    let (ra, rb) = (root_at(&a), root_at(&b));
    fs::create_dir_all(ra.source(&id(SID)).data()).unwrap();
    // Node B's client has looked at an empty writers/ before A replaces it.
    assert!(cache::writers(&rb, &id(SID)).unwrap().is_empty());
    assert!(take(&ra, "node-a", "/staging/a").unwrap());
    let err = take(&rb, "node-b", "/staging/b").unwrap_err();
    assert!(err.to_string().contains("node node-a"), "{err}");
    assert_eq!(cache::writers(&rb, &id(SID)).unwrap(), vec!["node-a"]);
    // The controller, through B's client, refuses to seal under A's writer.
    let err = cache::seal_source(&rb, &id(SID), "test").unwrap_err();
    assert!(err.to_string().contains("node-a"), "{err}");
    let src = ra.open_source(&id(SID)).unwrap();
    lease::release(&ra, &src, "node-a", Path::new("/staging/a")).unwrap();
    assert!(take(&rb, "node-b", "/staging/b").unwrap());
    let err = take(&ra, "node-a", "/staging/a").unwrap_err();
    assert!(err.to_string().contains("node node-b"), "{err}");
}

/// A record replaced by rename on one client (how every record is written)
/// is read on another whole and never as an error, though possibly in its
/// previous version for the client's cache timeout: on GlusterFS 10.3 most
/// reads right after the rename return the previous record (its
/// quick-read and md-cache), and a bare stat may see ESTALE. That is why
/// nothing that decides a fence or the bytes served is ever replaced
/// (seals, leases and references are created once); a volume record is
/// replaced only to grow its capacity (docs/design.md, *Shared
/// filesystems*).
#[test]
fn records_replaced_on_one_client_read_whole_on_another() {
    let mut g = Gluster::volume();
    let (a, b) = (g.mount(""), g.mount(""));
    let (pa, pb) = (a.join("volumes/r.json"), b.join("volumes/r.json"));
    let (mut stale_raw, mut old) = (0, 0);
    for i in 0..40u32 {
        state::write_json(&pa, &vec![i; 64]).unwrap();
        // What a bare stat by name gets on B right after A's rename.
        if fs::metadata(&pb).is_err_and(|e| state::is_stale(&e)) {
            stale_raw += 1;
        }
        let got: Vec<u32> = state::read_json(&pb).unwrap().unwrap();
        assert_eq!(got.len(), 64, "round {i}: a torn record");
        assert!(got.iter().all(|v| *v == got[0]), "round {i}: mixed record");
        assert!(got[0] <= i, "round {i}: a record from the future");
        if got[0] != i {
            old += 1;
        }
    }
    // Not asserted (the client's timing decides), reported so a change in
    // the filesystem's behaviour shows.
    eprintln!(
        "40 rounds: {stale_raw} bare stats saw ESTALE, {old} reads returned the previous record"
    );
}

/// A writer node that dies holding its lease: the source stays fenced for
/// every other node until an operator runs `cache release-writer` (from
/// any node's client), which names what it dropped and refuses a node
/// that holds nothing.
#[test]
fn an_operator_releases_the_lease_of_a_dead_writer_node() {
    let mut g = Gluster::volume();
    let (a, b) = (g.mount(""), g.mount(""));
    let (ra, rb) = (root_at(&a), root_at(&b));
    fs::create_dir_all(ra.source(&id(SID)).data()).unwrap();
    assert!(take(&ra, "node-a", "/staging/a").unwrap());
    // Node A is gone: its client too.
    g.unmount(&a);
    assert!(take(&rb, "node-b", "/staging/b").is_err());
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
            .args(["cache", "--shared-path"])
            .arg(&b)
            .args(["--backends", "shared", "--node-id", "admin-host"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["release-writer", SID, "--node", "node-x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no writer lease of node node-x")
            && err.contains("node node-a (staged at /staging/a)"),
        "{err}"
    );
    let out = cli(&["release-writer", SID, "--node", "node-a"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("node node-a (staged at /staging/a)"),
        "{said}"
    );
    assert!(take(&rb, "node-b", "/staging/b").unwrap());
}

/// Files of `n` bytes each, pseudo-random, under `dir`; returns their
/// (relative path, sha256).
fn write_files(dir: &Path, sizes: &[usize]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let name = format!("shard-{i:02}.bin");
        let bytes = fixtures::pseudo_random(0x2545_f491_4f6c_dd1du64 ^ (i as u64 + 7), *size);
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join(&name), &bytes).unwrap();
        out.push((name.clone(), fixtures::sha256_file(&dir.join(&name))));
    }
    out
}

#[track_caller]
fn assert_retryable(st: &tonic::Status) {
    assert!(
        matches!(st.code(), Code::Unavailable | Code::Aborted),
        "{:?}: {}",
        st.code(),
        st.message()
    );
}

/// Calls `f` once a second until it succeeds (up to a minute), every
/// failure meanwhile a retryable one: a server coming back.
async fn once_back<T, F: std::future::Future<Output = Result<T, tonic::Status>>>(
    mut f: impl FnMut() -> F,
) -> T {
    for _ in 0..60 {
        match f().await {
            Ok(v) => return v,
            Err(st) => assert_retryable(&st),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("still failing a minute after the server came back");
}

/// Every file read through `dir` is the origin's, byte for byte.
fn exact(dir: &Path, files: &[(String, String)]) -> bool {
    files.iter().all(|(name, sha)| {
        dir.join(name).is_file() && fixtures::sha256_file(&dir.join(name)) == *sha
    })
}

/// The Gluster server goes away mid-pull and while a pod reads the sealed
/// model: every RPC answers within seconds with a retryable code, a read
/// fails with the filesystem's error and never returns wrong bytes,
/// nothing half-pulled is sealed, and once the server is back the pull
/// completes and the reads are exact again. One node: the root's key
/// comes from its mount path, so two drivers of one volume need one path
/// in two mount namespaces (the multi-node e2e has that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_going_away_mid_pull_and_mid_read_is_retryable_and_never_wrong_bytes() {
    let mut g = Gluster::volume();
    let a = g.mount("");
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("model");
    let files = write_files(&model, &[6 << 20, 6 << 20, 6 << 20]);
    let origin = FileServer::start(&model).await;
    origin.put("manifest.json", fixtures::manifest_for(&model, true));
    let uri = format!("{}#manifest", origin.url("manifest.json"));
    // 1 MiB/s per connection: several seconds for the whole model, so the
    // server is stopped in the middle.
    origin.throttle(1 << 20);
    // 1 MiB chunks: what arrived before the server went away is kept in
    // whole chunks, for the retry to resume from.
    let na = Driver::start_node("node-a", Some(&a), &["--pull-chunk-mib", "1"]).await;
    let params = [("backend", "shared"), ("source", uri.as_str())];

    let pull = {
        let req = create_req("pvc-pull", &params, READER);
        let mut controller = na.client.controller.clone();
        tokio::spawn(async move { controller.create_volume(req).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    g.stop_server();
    let stopped = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(60), pull)
        .await
        .expect("CreateVolume answers with the server gone")
        .unwrap();
    let st = answer
        .map(|r| r.into_inner())
        .expect_err("a pull whose shared filesystem went away cannot succeed");
    assert_retryable(&st);
    eprintln!(
        "CreateVolume answered {:?} {:.1} s after the server stopped: {}",
        st.code(),
        stopped.elapsed().as_secs_f64(),
        st.message()
    );
    // Asked again while the server is away: retryable, at once.
    let t0 = Instant::now();
    let st = na
        .create(create_req("pvc-pull", &params, READER))
        .await
        .unwrap_err();
    assert_retryable(&st);
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());

    // The server returns: the same request completes, and the seal holds
    // exactly the origin's bytes.
    g.start_server();
    let asked_before = origin.requests().len();
    let vol = once_back(|| na.create(create_req("pvc-pull", &params, READER))).await;
    // It resumed: what it asked of the origin afterwards is less than the
    // model (a pull started over would ask for all of it again).
    let total: u64 = 3 * (6 << 20);
    let again = fixtures::requested_bytes(&origin.requests()[asked_before..], &model);
    eprintln!("after the server came back the pull asked the origin for {again} of {total} bytes");
    assert!(
        again < total,
        "the pull started over: {again} of {total} bytes again"
    );

    // A pod's stage and publish read it exactly.
    let (staging, target) = (na.staging("v"), na.target("pod-1"));
    na.stage(&vol.volume_id, &staging, READER).await.unwrap();
    na.publish(&vol.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    assert!(
        exact(&target, &files),
        "the pod reads the sealed model exactly"
    );

    // The server goes away while the pod reads: reads fail (the
    // filesystem's error), and never return other bytes.
    g.stop_server();
    for (name, sha) in &files {
        match fs::read(target.join(name)) {
            Err(e) => eprintln!("reading {name} with the server gone: {e}"),
            Ok(bytes) => assert_eq!(
                crate::support::reading::sha256(&bytes),
                *sha,
                "{name} read with the server gone is not the sealed file"
            ),
        }
    }
    // A stage on a fresh path (another pod's): retryable
    // answers within seconds, nothing mounted.
    let t0 = Instant::now();
    let st = na
        .stage(&vol.volume_id, &na.staging("v2"), READER)
        .await
        .unwrap_err();
    assert_retryable(&st);
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert_not_mounted(&na.staging("v2"));

    g.start_server();
    assert!(
        eventually(Duration::from_secs(60), || exact(&target, &files)),
        "reads are exact again once the server is back"
    );
    na.stage(&vol.volume_id, &na.staging("v2"), READER)
        .await
        .unwrap();
}

/// FOP counts of a Gluster volume's bricks since the last call, from
/// `gluster volume profile NAME info incremental`: {"LOOKUP": n, ...}.
fn fops(g: &Gluster) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let text = g.profile_incremental();
    // Each brick's table has rows "… <calls> <FOP>"; replica 2 counts a
    // read once (one brick) and a write or lookup on both.
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() >= 2
            && let (Some(fop), Ok(calls)) = (cols.last(), cols[cols.len() - 2].parse::<u64>())
            && fop.chars().all(|c| c.is_ascii_uppercase())
        {
            *out.entry(fop.to_string()).or_default() += calls;
        }
    }
    out
}

/// The cost of a shared root on GlusterFS against a local directory on
/// the same disk, side by side: pull throughput (a 512 MiB model from a
/// loopback origin, fetched, hashed, fsynced and sealed), stage and
/// publish latency of the sealed volume, and the calls one stage and
/// publish make on the shared filesystem. docs/benchmarks.md, *Shared
/// filesystem*:
///
///     unshare -m --propagation private cargo test --test it -- \
///       --ignored --nocapture shared_fs::bench
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: docs/benchmarks.md, shared filesystem"]
async fn bench() {
    let mut g = Gluster::volume();
    let gluster_root = g.mount("");
    let local = tempfile::Builder::new()
        .prefix("mc-bench-local-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let model = work.path().join("model");
    let sizes = [128usize << 20; 4];
    write_files(&model, &sizes);
    let total: usize = sizes.iter().sum();
    let origin = FileServer::start(&model).await;
    origin.put("manifest.json", fixtures::manifest_for(&model, true));
    const PUBLISHES: usize = 20;
    println!(
        "| run | root | pull MiB/s | stage ms (median) | publish ms (median of {PUBLISHES}) |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for run in 1..=2 {
        for (label, root) in [
            ("GlusterFS", gluster_root.as_path()),
            ("local dir", local.path()),
        ] {
            let d = Driver::start_node(&format!("bench-{run}"), Some(root), &[]).await;
            // A fresh URI each time, so every run pulls the whole model.
            let name = format!("m-{run}-{}.json", label.len());
            origin.put(&name, fixtures::manifest_for(&model, true));
            let uri = format!("{}#manifest", origin.url(&name));
            let t0 = Instant::now();
            let vol = d
                .create(create_req(
                    &format!("pvc-{run}-{label}"),
                    &[("backend", "shared"), ("source", uri.as_str())],
                    READER,
                ))
                .await
                .unwrap();
            let pull = t0.elapsed().as_secs_f64();
            let is_gluster = root == gluster_root.as_path();
            if is_gluster {
                g.profile_start();
            }
            let (mut stage, mut publish) = (Vec::new(), Vec::new());
            for i in 0..PUBLISHES {
                let staging = d.staging(&format!("s{i}"));
                let t = Instant::now();
                d.stage(&vol.volume_id, &staging, READER).await.unwrap();
                stage.push(t.elapsed().as_secs_f64() * 1e3);
                let target = d.target(&format!("p{i}"));
                let t = Instant::now();
                d.publish(&vol.volume_id, &staging, &target, READER, true)
                    .await
                    .unwrap();
                publish.push(t.elapsed().as_secs_f64() * 1e3);
                if is_gluster && i == 0 {
                    println!(
                        "<!-- {label}: calls on the shared filesystem for one stage and publish: {:?} -->",
                        fops(&g)
                    );
                }
            }
            for i in 0..PUBLISHES {
                d.unpublish(&vol.volume_id, &d.target(&format!("p{i}")))
                    .await
                    .unwrap();
                d.unstage(&vol.volume_id, &d.staging(&format!("s{i}")))
                    .await
                    .unwrap();
            }
            if is_gluster {
                println!(
                    "<!-- {label}: calls for the other {} stages and publishes, and the unpublishes and unstages: {:?} -->",
                    PUBLISHES - 1,
                    fops(&g)
                );
                g.profile_stop();
            }
            d.delete(&vol.volume_id).await.unwrap();
            let med = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                v[v.len() / 2]
            };
            println!(
                "| {run} | {label} | {:.0} | {:.1} | {:.1} |",
                total as f64 / (1 << 20) as f64 / pull,
                med(&mut stage),
                med(&mut publish)
            );
        }
    }
}

/// An XFS image made through one client (the controller's), filled by a
/// writer through another (the writer node's), is seen filled when the
/// first client attaches it again, as the seal does: that client's cached
/// pages of the empty filesystem are not what its loop device reads. Without
/// `state::forget_cached_pages` in the loop attach this fails, and the
/// multi-node e2e's `shared` flow on GlusterFS sealed an empty filesystem.
#[test]
fn an_image_filled_through_one_client_is_read_filled_through_the_client_that_made_it() {
    use modelcache_csi::mount::loopdev;
    let mut g = Gluster::volume();
    let (a, b) = (g.mount(""), g.mount(""));
    let at = tempfile::tempdir().unwrap();
    let mnt = |dev: &Path, opts: &str| {
        let st = std::process::Command::new("mount")
            .args(["-t", "xfs", "-o", opts])
            .arg(dev)
            .arg(at.path())
            .status()
            .unwrap();
        assert!(st.success(), "mount {} -o {opts}", dev.display());
    };
    let umnt = || {
        assert!(
            std::process::Command::new("umount")
                .arg(at.path())
                .status()
                .unwrap()
                .success()
        );
    };
    cache::xfs::create_image(&a.join("image.xfs"), 300 << 20).unwrap();
    // The writer, through client B.
    let dev = loopdev::attach(&b.join("image.xfs"), false).unwrap();
    mnt(dev.path(), "rw");
    fs::write(at.path().join("weights.bin"), vec![7u8; 3 << 20]).unwrap();
    umnt();
    drop(dev);
    // Client A again, as the seal's private mount and every reader's.
    let dev = loopdev::attach(&a.join("image.xfs"), true).unwrap();
    mnt(dev.path(), "ro,norecovery,nouuid");
    let got = fs::read(at.path().join("weights.bin"));
    umnt();
    drop(dev);
    let got = got.expect("client A's loop device shows the file client B's writer made");
    assert_eq!(got, vec![7u8; 3 << 20]);
}

/// Drops `path`'s cached pages (only this file's).
fn forget_cached(path: &Path) {
    let f = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // SAFETY: advice on a descriptor we own; no memory is passed.
    let r = unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    assert_eq!(r, 0, "posix_fadvise {}", path.display());
}

/// The Gluster server goes away while a source volume is being sealed:
/// the seal fails with a retryable code, nothing is sealed on the server
/// (its brick holds no seal.json), and the seal goes through once the
/// server is back, over exactly the bytes the writer wrote. The bricks are
/// killed the moment the seal has begun; a seal that still finished first
/// (its seal.json on the brick before the kill: a loaded machine can delay
/// the kill past the hashing) proves nothing either way, so the scenario
/// runs again on a new source, a few times at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_going_away_mid_seal_seals_nothing_and_the_seal_completes_after() {
    let mut g = Gluster::volume();
    let a = g.mount("");
    let na = Driver::start_node("node-a", Some(&a), &[]).await;
    for attempt in 0..3 {
        let src = na
            .create_source(&format!("pvc-src-{attempt}"), "shared")
            .await;
        let sid = src.volume_context["source"].clone();
        let staging = na.staging(&format!("src-{attempt}"));
        na.stage(&src.volume_id, &staging, WRITER).await.unwrap();
        let files = write_files(&content(&staging), &[96 << 20; 3]);
        na.unstage(&src.volume_id, &staging).await.unwrap();
        // The seal must read its bytes from the server, not from pages the
        // writer left cached on either side: from cache it could hash all of
        // them before the server goes away.
        let on_server = g.on_server(&sid).expect("the source is on the server");
        for (name, _) in &files {
            for dir in [on_server.clone(), g.on_client(&a, &on_server)] {
                forget_cached(&dir.join("data").join(name));
            }
        }
        // Found now: the kill below must not wait on a process listing.
        let bricks = g.brick_pids();

        let seal = {
            let req = ControllerModifyVolumeRequest {
                volume_id: src.volume_id.clone(),
                mutable_parameters: map(&[("sealed", "true")]),
                ..Default::default()
            };
            let mut controller = na.client.controller.clone();
            tokio::spawn(async move { controller.controller_modify_volume(req).await })
        };
        // Hashing 288 MiB read from the server takes a second or more: the
        // server goes away as soon as the seal has begun (its intent marker
        // is there).
        let begun = Instant::now();
        while !on_server.join("sealing").exists() {
            assert!(
                begun.elapsed() < Duration::from_secs(30),
                "the seal never began"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        g.kill_bricks(&bricks);
        let beaten = on_server.join("seal.json").exists();
        // And stopped as glusterd knows it, so that starting it again
        // brings the clients back.
        g.stop_server();
        let answer = tokio::time::timeout(Duration::from_secs(60), seal)
            .await
            .expect("the seal answers with the server gone")
            .unwrap()
            .map(|r| r.into_inner());
        if beaten {
            eprintln!("attempt {attempt}: the seal finished before the bricks were killed; again");
            g.start_server();
            continue;
        }
        let st = answer.expect_err("a seal whose filesystem went away mid-way cannot succeed");
        assert_retryable(&st);
        let on_server = g.on_server(&sid).expect("the source is on the server");
        assert!(on_server.join("data").is_dir(), "{}", on_server.display());
        assert!(
            !on_server.join("seal.json").exists(),
            "a seal cut short is on the server"
        );

        g.start_server();
        once_back(|| na.seal(&src.volume_id)).await;
        let clone = na
            .create_cache(&format!("pvc-clone-{attempt}"), &src.volume_id, &[])
            .await
            .unwrap();
        let s = na.staging(&format!("clone-{attempt}"));
        na.stage(&clone.volume_id, &s, READER).await.unwrap();
        assert!(
            exact(&content(&s), &files),
            "the clone holds the writer's bytes"
        );
        return;
    }
    panic!("every seal finished before its server was killed: nothing was tested");
}

/// A server that stops answering (its brick process frozen: the network
/// gone, as far as the client can tell) hangs the client until its
/// ping-timeout. The caller's deadline ends the RPC; the stage it started
/// keeps the volume until the stuck call returns, so a retry meanwhile is
/// ABORTED ("in progress") instead of running beside it; once the server
/// answers again the stage goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_keeps_the_volume_held_past_the_callers_deadline() {
    let mut g = Gluster::volume();
    g.set("network.ping-timeout", "4");
    let a = g.mount("");
    let na = Driver::start_node("node-a", Some(&a), &[]).await;
    let src = na.create_source("pvc-src", "shared").await;
    let staging = na.staging("src");
    na.stage(&src.volume_id, &staging, WRITER).await.unwrap();
    let files = write_files(&content(&staging), &[1 << 20]);
    na.unstage(&src.volume_id, &staging).await.unwrap();
    na.seal(&src.volume_id).await.unwrap();
    let clone = na
        .create_cache("pvc-clone", &src.volume_id, &[])
        .await
        .unwrap();

    g.freeze_server();
    // Past the client's 1 s caches, so the stage has to ask the server.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A client with a 1 s deadline.
    let mut req = tonic::Request::new(stage_req(
        &clone.volume_id,
        &na.staging("c1"),
        mount_cap(READER, &[]),
    ));
    req.set_timeout(Duration::from_secs(1));
    let t0 = Instant::now();
    let first = na.client.node.clone().node_stage_volume(req).await;
    let waited = t0.elapsed();
    g.thaw_server_later(Duration::from_secs(2));
    let st = first.expect_err("a stage over a hung server cannot finish in 1 s");
    assert!(
        waited < Duration::from_secs(3),
        "the caller waited {waited:?}"
    );
    eprintln!("first stage: {:?} after {waited:?}", st.code());
    // The stage is still inside the filesystem: a retry is refused.
    let st = na
        .stage(&clone.volume_id, &na.staging("c1"), READER)
        .await
        .expect_err("a retry ran beside the stuck stage");
    assert_eq!(st.code(), Code::Aborted, "{}", st.message());
    // Once the server answers, the stuck call ends and the stage works.
    let s = na.staging("c1");
    once_back(|| na.stage(&clone.volume_id, &s, READER)).await;
    assert!(exact(&content(&s), &files));
}
