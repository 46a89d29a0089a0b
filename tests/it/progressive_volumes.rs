//! Progressive volumes through CSI (issue #24): the driver binary, a model
//! on a loopback origin paced to a known rate, and a class with
//! `progressive: "true"`. CreateVolume, NodeStage and NodePublish answer
//! while the model is still arriving; the pod reads the whole tree at once,
//! each file once its bytes are verified, and never a wrong byte.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::progressive::mmap_bytes;
use crate::support::fixtures::{self, FileServer, pseudo_random};
use crate::support::harness::*;
use modelcache_csi::csi::{CreateVolumeRequest, Volume};
use tonic::Code;

const SHARDS: usize = 4;
const SHARD_BYTES: usize = 8 << 20;

/// A model of a config and four 8 MiB shards behind a manifest, served at
/// `per_connection` bytes a second on each connection.
struct Origin {
    server: FileServer,
    uri: String,
    shards: Vec<Vec<u8>>,
    _dir: tempfile::TempDir,
}

fn shard_name(i: usize) -> String {
    format!("model-0000{}-of-0000{SHARDS}.safetensors", i + 1)
}

async fn origin(per_connection: u64, seed: u64) -> Origin {
    let dir = tempfile::tempdir().unwrap();
    let shards: Vec<Vec<u8>> = (0..SHARDS)
        .map(|i| pseudo_random(seed + i as u64, SHARD_BYTES))
        .collect();
    fs::write(dir.path().join("config.json"), b"{\"layers\": 4}").unwrap();
    for (i, s) in shards.iter().enumerate() {
        fs::write(dir.path().join(shard_name(i)), s).unwrap();
    }
    let server = FileServer::start(dir.path()).await;
    server.put("m.json", fixtures::manifest_for(dir.path(), true));
    server.throttle(per_connection);
    let uri = format!("{}#manifest", server.url("m.json"));
    Origin {
        server,
        uri,
        shards,
        _dir: dir,
    }
}

async fn driver() -> Driver {
    Driver::start_with(&["--pull-chunk-mib", "1", "--pull-connections", "2"]).await
}

fn progressive_req(name: &str, uri: &str) -> CreateVolumeRequest {
    create_req(
        name,
        &[
            ("backend", "local"),
            ("source", uri),
            ("progressive", "true"),
        ],
        READER,
    )
}

/// A progressive volume of `uri` created, staged and published as `name`:
/// the volume, its model's id, its staging path and its target.
async fn published(d: &Driver, name: &str, uri: &str) -> (Volume, String, PathBuf, PathBuf) {
    let v = d
        .create(progressive_req(name, uri))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let sid = v.volume_context["source"].clone();
    let (staging, target) = (d.staging(name), d.target(name));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    (v, sid, staging, target)
}

fn seal_of(d: &Driver, sid: &str) -> PathBuf {
    d.source_dir("local", sid).join("seal.json")
}

/// The files under `dir` with their sizes, sorted.
fn listed(dir: &Path) -> Vec<(String, u64)> {
    let mut files = fixtures::tree_files(dir);
    files.sort();
    files
}

/// Published before the model is sealed; the whole tree shown at once
/// with final sizes; the first shard read before the seal (how soon, in
/// each case, is printed: the machine's figure as much as the driver's);
/// every byte exact; an mmap reader of the last shard gets it whole;
/// writes fail with EROFS; after the seal a new stage is the ordinary
/// read-only bind, and the view staged before it keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progressive_volume_is_published_before_its_model_arrives_and_reads_only_verified_bytes()
{
    // Two connections of 2 MiB/s: about 8 s for the 32 MiB.
    let o = origin(2 << 20, 40).await;
    let d = driver().await;
    let started = Instant::now();
    let v = d
        .create(progressive_req("pvc-prog", &o.uri))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let sid = v.volume_context["source"].clone();
    assert_eq!(v.capacity_bytes, (SHARDS * SHARD_BYTES + 13) as i64);
    let (staging, target) = (d.staging("prog"), d.target("prog"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let published = started.elapsed();
    assert!(
        !seal_of(&d, &sid).exists(),
        "the model sealed before the volume was published: the origin is too fast for this test"
    );
    let view = single_mount(&content(&staging));
    assert_eq!(view.fs_type, "fuse.modelcache", "{view:#?}");
    assert_mount_options(&view, &["ro", "nosuid", "nodev"]);
    assert_mount_options(&single_mount(&target), &["ro", "nosuid", "nodev"]);

    // The whole tree at once, with final sizes.
    let mut want: Vec<(String, u64)> = (0..SHARDS)
        .map(|i| (shard_name(i), SHARD_BYTES as u64))
        .collect();
    want.push(("config.json".into(), 13));
    want.sort();
    assert_eq!(listed(&target), want);
    assert_eq!(
        fs::metadata(target.join(shard_name(3))).unwrap().size(),
        SHARD_BYTES as u64
    );
    assert_erofs(&target.join("new-file"));

    // The "inference server": every shard in order, timed, each read
    // noting whether the model was sealed when it returned; and an mmap
    // reader of the last shard beside it.
    let reader = {
        let (t, seal) = (target.clone(), seal_of(&d, &sid));
        std::thread::spawn(move || {
            (0..SHARDS)
                .map(|i| {
                    let bytes = fs::read(t.join(shard_name(i)));
                    (bytes, started.elapsed(), seal.exists())
                })
                .collect::<Vec<_>>()
        })
    };
    let mapped = {
        let p = target.join(shard_name(SHARDS - 1));
        std::thread::spawn(move || mmap_bytes(&p))
    };
    assert!(
        eventually(Duration::from_secs(60), || seal_of(&d, &sid).exists()),
        "the model never sealed"
    );
    let pull_took = started.elapsed();
    let read = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    for (i, (bytes, _, _)) in read.iter().enumerate() {
        let bytes = bytes
            .as_ref()
            .unwrap_or_else(|e| panic!("{}: {e}", shard_name(i)));
        assert!(*bytes == o.shards[i], "{}: wrong bytes", shard_name(i));
    }
    let mapped = tokio::task::spawn_blocking(move || mapped.join().unwrap())
        .await
        .unwrap();
    assert!(mapped == o.shards[SHARDS - 1], "mmap: wrong bytes");
    let (first_shard, sealed_then) = (read[0].1, read[0].2);
    eprintln!(
        "published at {published:?}, first shard read at {first_shard:?}, model sealed at {pull_took:?}"
    );
    assert!(
        !sealed_then,
        "the first shard was read only once the model was sealed ({first_shard:?}; sealed at {pull_took:?})"
    );

    // A pod starting after the seal gets the ordinary read-only bind; the
    // view staged before it goes on serving its pod.
    let v2 = d
        .create(progressive_req("pvc-prog-2", &o.uri))
        .await
        .unwrap();
    assert_eq!(v2.volume_context["source"], sid);
    let (staging2, target2) = (d.staging("prog-2"), d.target("prog-2"));
    d.stage(&v2.volume_id, &staging2, READER).await.unwrap();
    d.publish(&v2.volume_id, &staging2, &target2, READER, true)
        .await
        .unwrap();
    assert_ne!(single_mount(&content(&staging2)).fs_type, "fuse.modelcache");
    assert!(fs::read(target2.join(shard_name(1))).unwrap() == o.shards[1]);
    assert!(fs::read(target.join(shard_name(2))).unwrap() == o.shards[2]);

    for (v, staging, target) in [(&v, &staging, &target), (&v2, &staging2, &target2)] {
        d.unpublish(&v.volume_id, target).await.unwrap();
        d.unstage(&v.volume_id, staging).await.unwrap();
        assert_not_mounted(target);
        assert_not_mounted(staging);
        d.delete(&v.volume_id).await.unwrap();
    }
    // Both references went with their volumes.
    let refs = d.source_dir("local", &sid).join("refs");
    assert_eq!(fs::read_dir(&refs).map(|r| r.count()).unwrap_or(0), 0);
}

/// #24 item 7: a class that says nothing of `progressive` answers a
/// model's create once every file is verified, not once the model is
/// sealed, and the volume reads every byte at once; `progressive: "false"`
/// answers only once the model is sealed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_without_progressive_is_answered_once_verified_and_false_waits_for_the_seal() {
    // Four files at once of two connections each, 512 KiB/s a connection:
    // about 8 s for the 32 MiB.
    let o = origin(512 << 10, 120).await;
    let d = driver().await;
    let started = Instant::now();
    let v = d
        .create(create_req(
            "pvc-verified",
            &[("backend", "local"), ("source", o.uri.as_str())],
            READER,
        ))
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let answered = started.elapsed();
    let sid = v.volume_context["source"].clone();
    // Every byte had arrived and been checked: nothing of the model is
    // still to come from the origin.
    let served: usize = (0..SHARDS).map(|i| o.server.gets(&shard_name(i))).sum();
    assert!(
        served >= SHARDS,
        "answered with {served} shard fetches started"
    );
    assert!(
        answered >= Duration::from_secs(6),
        "answered at {answered:?}, before the ~8 s transfer could end"
    );
    let (staging, target) = (d.staging("verified"), d.target("verified"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let kind = single_mount(&content(&staging)).fs_type;
    let t = target.clone();
    let (read, took) = tokio::task::spawn_blocking(move || {
        let at = Instant::now();
        let r: Vec<Vec<u8>> = (0..SHARDS)
            .map(|i| fs::read(t.join(shard_name(i))).unwrap())
            .collect();
        (r, at.elapsed())
    })
    .await
    .unwrap();
    for (i, b) in read.iter().enumerate() {
        assert!(*b == o.shards[i], "{}: wrong bytes", shard_name(i));
    }
    assert!(
        took < Duration::from_secs(2),
        "the volume's 32 MiB took {took:?} to read: it waited for something"
    );
    assert_erofs(&target.join("new-file"));
    assert!(
        eventually(Duration::from_secs(30), || seal_of(&d, &sid).exists()),
        "the model never sealed"
    );
    eprintln!("answered at {answered:?}, staged as {kind}, read in {took:?}");

    // "false": the seal is there when the create answers.
    let o2 = origin(4 << 20, 130).await;
    let v2 = d
        .create(create_req(
            "pvc-sealed",
            &[
                ("backend", "local"),
                ("source", o2.uri.as_str()),
                ("progressive", "false"),
            ],
            READER,
        ))
        .await
        .unwrap();
    let sid2 = v2.volume_context["source"].clone();
    assert!(
        seal_of(&d, &sid2).exists(),
        "progressive: \"false\" answered before the seal"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    assert_not_mounted(&staging);
    for v in [&v, &v2] {
        d.delete(&v.volume_id).await.unwrap();
    }
}

/// A shard whose bytes the origin corrupts on every fetch of this pull:
/// its reads fail with EIO (never a wrong byte) while other shards read
/// right, the shards after it included (the pull goes on past it); the
/// pull fails naming it, and the driver runs the pull again on its own
/// (nobody else would: the volume exists), fetching only that shard (the
/// others were verified and kept), after which it reads right. Before,
/// the pull stopped at the bad shard, so the shards after it arrived
/// only with the next run, which fetched the whole model again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_the_origin_corrupts_reads_eio_and_heals_when_the_pull_runs_again() {
    let o = origin(8 << 20, 60).await;
    // The first fetch and both re-fetches of the pull are corrupt.
    o.server.corrupt_first_byte(&shard_name(1), 3);
    let d = driver().await;
    let (v, sid, staging, target) = published(&d, "pvc-corrupt", &o.uri).await;
    let bad = target.join(shard_name(1));
    let e = tokio::task::spawn_blocking({
        let bad = bad.clone();
        move || fs::read(bad)
    })
    .await
    .unwrap()
    .expect_err("a read of a shard whose every fetch failed");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(fs::read(target.join(shard_name(0))).unwrap() == o.shards[0]);
    // The shards after the bad one arrive in the same run.
    let last = target.join(shard_name(SHARDS - 1));
    let read_last = tokio::task::spawn_blocking(move || fs::read(last));
    let last_bytes = tokio::time::timeout(Duration::from_secs(8), read_last)
        .await
        .expect("the shards after a failed one waited for the next run")
        .unwrap()
        .unwrap();
    assert!(
        last_bytes == o.shards[SHARDS - 1],
        "wrong bytes of the last shard"
    );
    // Ranges of the good shards fetched (not the one-byte reads a
    // resuming requester's access check makes).
    let gets_of_good = |o: &Origin| -> usize {
        let good: Vec<String> = (0..SHARDS)
            .filter(|i| *i != 1)
            .map(|i| format!("/{}", shard_name(i)))
            .collect();
        o.server
            .requests()
            .iter()
            .filter(|r| r.method == "GET" && good.contains(&r.raw_path))
            .filter(|r| r.header("range") != Some("bytes=0-0"))
            .count()
    };
    let good_before = gets_of_good(&o);
    assert!(!seal_of(&d, &sid).exists());
    assert!(
        d.log_text().contains("failed verification"),
        "the failure is not logged"
    );
    // The pull runs again (about 10 s later) and seals.
    assert!(
        eventually(Duration::from_secs(60), || seal_of(&d, &sid).exists()),
        "the pull never ran again"
    );
    assert!(
        fs::read(&bad).unwrap() == o.shards[1],
        "wrong bytes after the heal"
    );
    assert_eq!(
        gets_of_good(&o),
        good_before,
        "the run after the failure fetched verified shards again"
    );
    // The reference made in the first pull's area was lost with it (the
    // area of a pull the origin served garbage to is discarded); the
    // driver made it again in the sealed model.
    let refs = d.source_dir("local", &sid).join("refs");
    assert_eq!(
        fs::read_dir(&refs).map(|r| r.count()).unwrap_or(0),
        1,
        "the sealed model holds no reference of the volume"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    d.delete(&v.volume_id).await.unwrap();
}

/// What the class may not combine with `progressive`, refused with
/// INVALID_ARGUMENT naming the field.
#[tokio::test]
async fn progressive_is_refused_where_it_cannot_hold() {
    let d = driver().await;
    let key = std::process::Command::new("sh")
        .args([
            "-c",
            "openssl ecparam -name prime256v1 -genkey -noout | openssl ec -pubout 2>/dev/null",
        ])
        .output()
        .expect("openssl");
    let key = String::from_utf8(key.stdout).unwrap();
    assert!(key.contains("PUBLIC KEY"), "{key}");
    for (params, field) in [
        (
            vec![
                ("backend", "xfs"),
                ("source", "s3://bucket/m"),
                ("progressive", "true"),
            ],
            "backend: local",
        ),
        (
            vec![("backend", "local"), ("progressive", "yes")],
            "parameters.progressive",
        ),
        (
            vec![("role", "source"), ("progressive", "true")],
            "role: source",
        ),
        (
            vec![
                ("backend", "local"),
                ("source", "s3://bucket/m"),
                ("progressive", "true"),
                ("modelSignature", "required"),
                ("signaturePublicKey", key.as_str()),
            ],
            "modelSignature",
        ),
    ] {
        let e = d
            .create(create_req("pvc-bad", &params, READER))
            .await
            .expect_err("refused");
        assert_eq!(
            e.code(),
            Code::InvalidArgument,
            "{params:?}: {}",
            e.message()
        );
        assert!(e.message().contains("progressive"), "{}", e.message());
        assert!(e.message().contains(field), "{params:?}: {}", e.message());
    }
}

/// The keeper as the node pod's second container runs it.
struct KeeperProcess {
    socket: PathBuf,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl KeeperProcess {
    fn start() -> KeeperProcess {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fuse-keeper.sock");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
            .args(["fuse-keeper", "--socket"])
            .arg(&socket)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the keeper");
        assert!(
            eventually(Duration::from_secs(10), || socket.exists()),
            "the keeper never listened"
        );
        KeeperProcess {
            socket,
            child,
            _dir: dir,
        }
    }
}

impl Drop for KeeperProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// kill -9 of the node plugin while a pod waits for a shard, and again
/// after the seal, with the keeper holding the views' connections: the
/// waiting read returns the exact bytes once the new process has taken the
/// view over and the resumed pull verified them; a file opened before the
/// kill reads on; after the seal, the same across a second kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_of_the_driver_mid_fill_or_after_the_seal_never_breaks_a_pods_reads() {
    let o = origin(2 << 20, 80).await;
    let keeper = KeeperProcess::start();
    let socket = keeper.socket.to_string_lossy().into_owned();
    let mut d = Driver::start_with(&[
        "--pull-chunk-mib",
        "1",
        "--pull-connections",
        "2",
        "--fuse-keeper-socket",
        &socket,
    ])
    .await;
    let (v, sid, staging, target) = published(&d, "pvc-kill", &o.uri).await;
    // The first shard, read and still open; the third, waited for.
    let first = tokio::task::spawn_blocking({
        let p = target.join(shard_name(0));
        move || {
            let f = fs::File::open(&p).unwrap();
            let mut b = vec![0u8; SHARD_BYTES];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, 0).unwrap();
            (f, b)
        }
    })
    .await
    .unwrap();
    assert!(first.1 == o.shards[0], "first shard: wrong bytes");
    assert!(!seal_of(&d, &sid).exists(), "sealed too soon for this test");
    // The pod's read, in a process of its own as a pod's is: this one
    // spawns the new driver, and a process with a thread blocked on the
    // view cannot spawn (the child's exec waits on the parent's memory).
    let out = d.dir.join("third-shard");
    let mut waiting = std::process::Command::new("cat")
        .arg(target.join(shard_name(2)))
        .stdout(fs::File::create(&out).unwrap())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "the third shard came too soon"
    );
    d.kill_9();
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "the reader was answered by nobody"
    );
    d.restart().await;
    let status = tokio::task::spawn_blocking(move || waiting.wait().unwrap())
        .await
        .unwrap();
    assert!(
        status.success(),
        "the read that waited through the restart: {status}"
    );
    assert!(
        fs::read(&out).unwrap() == o.shards[2],
        "third shard: wrong bytes after the restart"
    );
    // A handle opened under the old process reads on.
    let mut again = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&first.0, &mut again, 4096).unwrap();
    assert!(again[..] == o.shards[0][4096..8192]);
    assert!(
        d.log_text().contains("taking a progressive view over"),
        "the view was not taken over"
    );

    assert!(
        eventually(Duration::from_secs(60), || seal_of(&d, &sid).exists()),
        "the resumed pull never sealed"
    );
    // Sealed: every gate is open. A file opened now and read while no
    // driver runs gets its bytes once the next one takes the view over.
    let shard = target.join(shard_name(1));
    let read = fs::read(&shard);
    assert!(
        read.as_ref().is_ok_and(|b| *b == o.shards[1]),
        "the second shard does not read right after the seal: {:?}",
        read.map(|b| b.len())
    );
    let open = fs::File::open(&shard).unwrap();
    d.kill_9();
    let read_across = tokio::task::spawn_blocking(move || {
        let mut b = vec![0u8; SHARD_BYTES];
        std::os::unix::fs::FileExt::read_exact_at(&open, &mut b, 0).map(|_| b)
    });
    d.restart().await;
    let read_across = read_across
        .await
        .unwrap()
        .expect("a read across the second restart");
    assert!(read_across == o.shards[1]);
    // Every shard opened anew, the first while the handle opened for
    // passthrough under the first process is still open: the kernel takes
    // one backing file per inode, so the ids outlive the processes.
    for (i, s) in o.shards.iter().enumerate() {
        let p = target.join(shard_name(i));
        let b = tokio::task::spawn_blocking(move || fs::read(p))
            .await
            .unwrap();
        assert!(
            b.unwrap() == *s,
            "{}: wrong bytes after the second restart",
            shard_name(i)
        );
    }
    drop(first);
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    assert_not_mounted(&staging);
    d.delete(&v.volume_id).await.unwrap();
    drop(d);
    drop(keeper);
}

/// A volume answered before its seal has its record written unsynced (an
/// fsync then waits seconds behind the model's writeback); the pull's
/// durable wanted record stands behind it. A crash of the machine may
/// leave that record empty: the restarted driver writes it again as it
/// resumes the pull, and the volume is served whole. Once the model is
/// sealed the wanted record is gone, and an unreadable volume record is
/// refused again, as any record the driver cannot read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_written_before_the_seal_and_cut_short_by_a_crash_is_written_again() {
    // About 8 s for the 32 MiB: the kill comes well before the seal.
    let o = origin(512 << 10, 150).await;
    let mut d = driver().await;
    let req = || progressive_req("pvc-torn", &o.uri);
    let v = d
        .create(req())
        .await
        .unwrap_or_else(|s| panic!("CreateVolume: {:?}: {}", s.code(), s.message()));
    let sid = v.volume_context["source"].clone();
    let record = d.record_path("local", &v.volume_id);
    assert!(record.is_file(), "no record at {}", record.display());
    assert!(!seal_of(&d, &sid).exists(), "sealed before the kill");
    d.kill_9();
    // What a power loss may leave of a file renamed into place unsynced.
    fs::write(&record, b"").unwrap();
    d.restart().await;
    assert!(
        eventually(Duration::from_secs(60), || seal_of(&d, &sid).exists()),
        "the resumed pull never sealed"
    );
    assert!(
        d.log_text().contains("did not survive a crash whole"),
        "the restarted driver did not say it wrote the record again"
    );
    let again: serde_json::Value = serde_json::from_slice(&fs::read(&record).unwrap())
        .unwrap_or_else(|e| panic!("the record is still unreadable: {e}"));
    assert_eq!(again["id"], v.volume_id.as_str(), "{again}");
    let same = d
        .create_until_done(&req(), None, Duration::from_secs(10))
        .await
        .expect("the create's retry");
    assert_eq!(same.volume_id, v.volume_id);
    let (staging, target) = (d.staging("torn"), d.target("torn"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    for (i, s) in o.shards.iter().enumerate() {
        let got = fs::read(target.join(shard_name(i))).unwrap();
        assert!(got == *s, "{}: wrong bytes after the crash", shard_name(i));
    }
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
    assert_not_mounted(&staging);

    // Sealed, its wanted record gone: nothing says this record may be
    // written again, and it is refused.
    d.kill_9();
    fs::write(&record, b"").unwrap();
    d.restart().await;
    let e = d
        .create(req())
        .await
        .expect_err("an unreadable record with no pull behind it");
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("not valid"), "{}", e.message());
    fs::remove_file(&record).unwrap();
}
