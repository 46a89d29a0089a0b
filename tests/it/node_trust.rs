//! The node and the cache against a tenant (issue #9, points 6, 8 and 9):
//! an unsealed source has one writer across every node; records read from
//! a shared root cannot be forged into a mount of a host path; writable
//! mounts carry neither setuid programs nor device files, and copies do not
//! recreate them; sizes and a disk reserve are enforced at CreateVolume.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;

use crate::support::harness::*;
use modelcache_csi::csi::volume_capability::access_mode::Mode;
use modelcache_csi::csi::{CapacityRange, GetCapacityRequest};
use modelcache_csi::mount::loopdev::devices_backed_by;
use tonic::Code;

fn xfs_shared_source_req(name: &str) -> modelcache_csi::csi::CreateVolumeRequest {
    let mut req = create_req(
        name,
        &[("backend", "xfs"), ("imageLocation", "shared")],
        WRITER,
    );
    req.capacity_range = Some(CapacityRange {
        required_bytes: XFS_BYTES,
        limit_bytes: 0,
    });
    req
}

#[track_caller]
fn assert_nothing_mounted_at(path: &Path) {
    assert!(mounts_at(path).is_empty(), "{:#?}", mounts_at(path));
}

/// Two node plugins (separate processes, node ids and state dirs) share one
/// `--shared-path`. An unsealed XFS image there is staged writable by one
/// of them at one staging path at a time; the lease survives a kill -9.
#[tokio::test]
async fn xfs_shared_source_has_one_writer_across_nodes() {
    let a = Driver::start_node("node-a", None, &[]).await;
    let mut b = Driver::start_node("node-b", Some(&a.shared_dir), &[]).await;
    let src = a
        .create(xfs_shared_source_req("pvc-one-writer"))
        .await
        .unwrap();
    let id = &src.volume_id;
    let sid = &src.volume_context["source"];
    let image = a.shared_dir.join("xfs/sources").join(sid).join("image.xfs");
    let (sa, sb) = (a.staging("src"), b.staging("src"));

    a.stage(id, &sa, WRITER).await.unwrap();
    fs::write(content(&sa).join("written-on-a"), b"a").unwrap();
    a.stage(id, &sa, WRITER)
        .await
        .expect("a retry is idempotent");

    // Another node is refused, naming the holder, and mounts nothing.
    let st = assert_code(
        b.stage(id, &sb, WRITER).await,
        Code::FailedPrecondition,
        "node-a",
    );
    assert!(st.message().contains(&sa.display().to_string()), "{st:?}");
    assert_nothing_mounted_at(&sb);
    assert_eq!(devices_backed_by(&image).unwrap().len(), 1);
    // So is the same node at a second staging path.
    let sa2 = a.staging("src-again");
    assert_code(
        a.stage(id, &sa2, WRITER).await,
        Code::FailedPrecondition,
        "node-a",
    );
    assert_nothing_mounted_at(&sa2);
    // Unstaging a path that never held the source does not open it.
    b.unstage(id, &sb).await.unwrap();
    a.unstage(id, &sa2).await.unwrap();
    assert_code(
        b.stage(id, &sb, WRITER).await,
        Code::FailedPrecondition,
        "node-a",
    );
    // A read-only access mode does not get a view of an unsealed image.
    for mode in [Mode::MultiNodeReaderOnly, Mode::SingleNodeReaderOnly] {
        assert_code(
            b.stage(id, &sb, mode).await,
            Code::FailedPrecondition,
            "seal it first",
        );
        assert_nothing_mounted_at(&sb);
    }

    // Once A lets go, B can write, and A in turn is refused.
    a.unstage(id, &sa).await.unwrap();
    b.stage(id, &sb, WRITER).await.unwrap();
    assert_eq!(fs::read(content(&sb).join("written-on-a")).unwrap(), b"a");
    assert_mount_options(&single_mount(&content(&sb)), &["rw", "nosuid", "nodev"]);
    assert_code(
        a.stage(id, &sa, WRITER).await,
        Code::FailedPrecondition,
        "node-b",
    );

    // The lease is on disk, not in the process: it survives kill -9.
    b.kill_9();
    b.restart().await;
    assert_code(
        a.stage(id, &sa, WRITER).await,
        Code::FailedPrecondition,
        "node-b",
    );
    assert_code(a.seal(id).await, Code::FailedPrecondition, "node-b");
    b.unstage(id, &sb).await.unwrap();
    a.seal(id).await.unwrap();
    assert!(mounts_below(&a.dir).is_empty() && mounts_below(&b.dir).is_empty());
}

/// The directory backend on a shared filesystem follows the same rule for
/// every mode but MULTI_NODE_MULTI_WRITER, which asks for writers on
/// several nodes and gets them (a network filesystem takes them).
#[tokio::test]
async fn shared_directory_source_has_one_writer_unless_multi_writer() {
    let a = Driver::start_node("node-a", None, &[]).await;
    let b = Driver::start_node("node-b", Some(&a.shared_dir), &[]).await;
    let src = a.create_source("pvc-dir-writer", "shared").await;
    let id = &src.volume_id;
    let (sa, sb) = (a.staging("src"), b.staging("src"));
    a.stage(id, &sa, WRITER).await.unwrap();
    assert_code(
        b.stage(id, &sb, WRITER).await,
        Code::FailedPrecondition,
        "node-a",
    );
    assert_code(
        b.stage(id, &sb, Mode::MultiNodeMultiWriter).await,
        Code::FailedPrecondition,
        "node-a",
    );
    assert_code(
        b.stage(id, &sb, Mode::MultiNodeReaderOnly).await,
        Code::FailedPrecondition,
        "seal it first",
    );
    a.unstage(id, &sa).await.unwrap();

    let multi = Mode::MultiNodeMultiWriter;
    let req = create_req("pvc-dir-multi", &[("backend", "shared")], multi);
    let m = a.create(req).await.unwrap();
    a.stage(&m.volume_id, &sa, multi).await.unwrap();
    b.stage(&m.volume_id, &sb, multi).await.unwrap();
    // ...but never with a single-node writer at the same time.
    let sa2 = a.staging("third");
    assert_code(
        a.stage(&m.volume_id, &sa2, multi).await,
        Code::FailedPrecondition,
        "node-a",
    );
    assert_code(
        a.seal(&m.volume_id).await,
        Code::FailedPrecondition,
        "node-a, node-b",
    );
    a.unstage(&m.volume_id, &sa).await.unwrap();
    b.unstage(&m.volume_id, &sb).await.unwrap();
    a.seal(&m.volume_id).await.unwrap();
}

/// Writes `value` as JSON at `path`, creating its directory.
fn forge(path: &Path, value: serde_json::Value) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
}

/// Records, seals and layouts written by hand into a shared root, as a
/// tenant who can write the shared filesystem would: each is refused with
/// an error naming what was forged, and nothing of the host is mounted.
#[tokio::test]
async fn forged_state_in_a_shared_root_is_refused() {
    let d = Driver::start().await;
    // A host directory the tenant would like to see.
    let host = d.dir.join("host-secret");
    fs::create_dir_all(host.join("data")).unwrap();
    fs::write(host.join("data/shadow"), b"root:secret").unwrap();
    forge(
        &host.join("seal.json"),
        serde_json::json!({"format": 1, "source": "0000000000000000000000000000000a",
            "origin": "forged", "sealed_unix": 0, "total_bytes": 0,
            "files": [], "dirs": [], "symlinks": []}),
    );

    let real = d.create_source("pvc-real", "shared").await;
    let key = real.volume_id.split('.').nth(1).unwrap().to_string();
    let shared = d.shared_dir.clone();
    let seal = |sid: &str| {
        serde_json::json!({"format": 1, "source": sid, "origin": "forged",
            "sealed_unix": 0, "total_bytes": 0, "files": [], "dirs": [], "symlinks": []})
    };
    let record = |uuid: &str, source: &str, extra: serde_json::Value| {
        let mut v = serde_json::json!({
            "id": format!("shared.{key}.{uuid}"), "name": format!("forged-{uuid}"),
            "backend": "shared", "role": "cache", "source": source,
            "capacity_bytes": 1, "request": "{}", "created_unix": 0});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };

    // (uuid, what the error must name)
    let mut cases: Vec<(String, &str)> = Vec::new();
    let uuid = |n: u8| format!("{n:032x}");

    // 1. A record naming a host path, in a shared root.
    forge(
        &shared.join(format!("volumes/{}.json", uuid(1))),
        record(
            &uuid(1),
            "x000000000000000000000000000000a",
            serde_json::json!({"external": {"kind": "dir", "path": "/etc"}}),
        ),
    );
    cases.push((uuid(1), "host path"));
    // 2. A source id that climbs out of the root.
    forge(
        &shared.join(format!("volumes/{}.json", uuid(2))),
        record(
            &uuid(2),
            "../../../../../../../../etc",
            serde_json::json!({}),
        ),
    );
    cases.push((uuid(2), "source id"));
    // 3. A well-formed source whose data is a link to the host.
    let sid3 = "0000000000000000000000000000000b";
    fs::create_dir_all(shared.join("sources").join(sid3)).unwrap();
    forge(
        &shared.join("sources").join(sid3).join("seal.json"),
        seal(sid3),
    );
    symlink(
        host.join("data"),
        shared.join("sources").join(sid3).join("data"),
    )
    .unwrap();
    forge(
        &shared.join(format!("volumes/{}.json", uuid(3))),
        record(&uuid(3), sid3, serde_json::json!({})),
    );
    cases.push((uuid(3), "symlink"));
    // 4. A source directory that is itself a link to the host.
    let sid4 = "0000000000000000000000000000000a";
    symlink(&host, shared.join("sources").join(sid4)).unwrap();
    forge(
        &shared.join(format!("volumes/{}.json", uuid(4))),
        record(&uuid(4), sid4, serde_json::json!({})),
    );
    cases.push((uuid(4), "symlink"));
    // 5. A subPath that climbs out of the source.
    let sid5 = "0000000000000000000000000000000c";
    fs::create_dir_all(shared.join("sources").join(sid5).join("data")).unwrap();
    forge(
        &shared.join("sources").join(sid5).join("seal.json"),
        seal(sid5),
    );
    forge(
        &shared.join(format!("volumes/{}.json", uuid(5))),
        record(
            &uuid(5),
            sid5,
            serde_json::json!({"sub_path": "../../../.."}),
        ),
    );
    cases.push((uuid(5), "subPath"));
    // 6. A record whose id claims another root.
    let mut other = record(&uuid(6), sid5, serde_json::json!({}));
    other["id"] = format!("local.{key}.{}", uuid(6)).into();
    forge(&shared.join(format!("volumes/{}.json", uuid(6))), other);
    cases.push((uuid(6), "another storage root"));
    // 7. A seal listing paths outside the source.
    let sid7 = "0000000000000000000000000000000d";
    fs::create_dir_all(shared.join("sources").join(sid7).join("data")).unwrap();
    let mut s7 = seal(sid7);
    s7["files"] =
        serde_json::json!([{"path": "../../../../etc/passwd", "size": 1, "sha256": "00"}]);
    forge(&shared.join("sources").join(sid7).join("seal.json"), s7);
    forge(
        &shared.join(format!("volumes/{}.json", uuid(7))),
        record(&uuid(7), sid7, serde_json::json!({})),
    );
    cases.push((uuid(7), "seal"));
    // 8. A record that is a link to a host file.
    symlink(
        "/etc/hostname",
        shared.join(format!("volumes/{}.json", uuid(8))),
    )
    .unwrap();
    cases.push((uuid(8), "symlink"));

    for (i, (u, fragment)) in cases.iter().enumerate() {
        let id = format!("shared.{key}.{u}");
        let (s, t) = (d.staging(&format!("f{i}")), d.target(&format!("f{i}")));
        let st = assert_code(
            d.stage(&id, &s, READER).await,
            Code::FailedPrecondition,
            fragment,
        );
        assert!(
            st.message().contains(&shared.display().to_string()),
            "case {i}: the error names no file: {st:?}"
        );
        let st = d.publish(&id, &s, &t, READER, true).await.unwrap_err();
        assert_eq!(st.code(), Code::FailedPrecondition, "case {i}: {st:?}");
        assert!(mounts_below(&d.dir.join("kubelet")).is_empty(), "case {i}");
    }
    // A well-formed record still stages, and listing skips forged records
    // (3, 4 and 7 are well-formed records over a forged layout or seal).
    let listed: Vec<String> = d
        .list_all(0)
        .await
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    assert!(listed.contains(&real.volume_id), "{listed:?}");
    for n in [1, 2, 5, 6, 8] {
        assert!(
            !listed.iter().any(|v| v.ends_with(&uuid(n))),
            "{n}: {listed:?}"
        );
    }
    let s = d.staging("real");
    d.stage(&real.volume_id, &s, WRITER).await.unwrap();
    d.unstage(&real.volume_id, &s).await.unwrap();
    assert_eq!(fs::read(host.join("data/shadow")).unwrap(), b"root:secret");
}

/// An XFS image in a shared root that is a link to a file outside it is
/// never attached, for a writer or a reader.
#[tokio::test]
async fn forged_xfs_image_link_is_not_attached() {
    let d = Driver::start().await;
    let src = d
        .create(xfs_shared_source_req("pvc-xfs-forged"))
        .await
        .unwrap();
    let sid = &src.volume_context["source"];
    let dir = d.shared_dir.join("xfs/sources").join(sid);
    // The tenant's "host" image: a real XFS filesystem outside the root.
    let host_image = d.dir.join("host.img");
    fs::rename(dir.join("image.xfs"), &host_image).unwrap();
    symlink(&host_image, dir.join("image.xfs")).unwrap();
    let s = d.staging("xfs");
    assert_code(
        d.stage(&src.volume_id, &s, WRITER).await,
        Code::FailedPrecondition,
        "symlink",
    );
    assert_nothing_mounted_at(&s);
    assert!(devices_backed_by(&host_image).unwrap().is_empty());
    // Sealing does not mount it in private either.
    assert_code(
        d.seal(&src.volume_id).await,
        Code::FailedPrecondition,
        "symlink",
    );
    assert!(devices_backed_by(&host_image).unwrap().is_empty());
    assert_eq!(fs::metadata(&host_image).unwrap().mode() & 0o777, 0o644);
}

/// A writable source is mounted nosuid,nodev, staged and published; a
/// copy of a source refuses device nodes and fifos and drops setuid bits.
#[tokio::test]
async fn writable_mounts_and_copies_carry_no_setuid_or_devices() {
    let d = Driver::start().await;
    let src = d.create_source("pvc-suid", "local").await;
    let id = &src.volume_id;
    let (s, t) = (d.staging("suid"), d.target("suid"));
    d.stage(id, &s, WRITER).await.unwrap();
    d.publish(id, &s, &t, WRITER, false).await.unwrap();
    for m in [single_mount(&content(&s)), single_mount(&t)] {
        assert_mount_options(&m, &["rw", "nosuid", "nodev"]);
    }
    // What a root pod can leave in its source.
    fs::write(t.join("suid-shell"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(t.join("suid-shell"), fs::Permissions::from_mode(0o6755)).unwrap();
    let dev = t.join("null-dev");
    nix::sys::stat::mknod(
        &dev,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    // nodev: the node exists but cannot be opened through the mount.
    assert_eq!(
        fs::File::open(&dev).unwrap_err().raw_os_error(),
        Some(libc::EACCES)
    );
    d.unpublish(id, &t).await.unwrap();
    d.unstage(id, &s).await.unwrap();

    let copy = |name: &str| clone_req(name, &[("role", "source")], id, WRITER);
    let st = assert_code(
        d.create(copy("pvc-copy")).await,
        Code::FailedPrecondition,
        "null-dev",
    );
    assert!(st.message().contains("device node"), "{st:?}");
    let sid = &src.volume_context["source"];
    let left: Vec<_> = fs::read_dir(d.state_dir.join("local/sources"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != sid)
        .flat_map(|n| {
            let dir = d.state_dir.join("local/sources").join(n);
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().path())
        })
        .collect();
    assert!(left.is_empty(), "a refused copy left {left:?}");

    fs::remove_file(d.source_dir("local", sid).join("data/null-dev")).unwrap();
    let c = d.create(copy("pvc-copy")).await.unwrap();
    let copied = d
        .source_dir("local", &c.volume_context["source"])
        .join("data/suid-shell");
    assert_eq!(fs::read(&copied).unwrap(), b"#!/bin/sh\n");
    assert_eq!(fs::metadata(&copied).unwrap().mode() & 0o7777, 0o755);
}

/// A writable source is never promised more than the filesystem has free
/// beyond the reserve: 4 EiB is refused, naming the figures.
#[tokio::test]
async fn source_larger_than_free_space_is_refused() {
    let d = Driver::start().await;
    for backend in ["local", "shared", "xfs"] {
        let mut req = create_req(
            &format!("pvc-huge-{backend}"),
            &[("backend", backend)],
            WRITER,
        );
        req.capacity_range = Some(CapacityRange {
            required_bytes: 4 << 60,
            limit_bytes: 0,
        });
        let st = assert_code(
            d.create(req).await,
            Code::ResourceExhausted,
            "4611686018427387904 bytes were requested",
        );
        assert!(st.message().contains("usable"), "{st:?}");
    }
    assert!(d.list_all(0).await.is_empty());
}

/// `--min-free` keeps a reserve the driver never fills: with all of the
/// disk reserved, a pull and a new source are refused with
/// RESOURCE_EXHAUSTED, and GetCapacity reports nothing to spare.
#[tokio::test]
async fn min_free_reserve_refuses_pulls_and_sources() {
    let d = Driver::start_with(&["--min-free", "100%"]).await;
    let st = assert_code(
        d.create(create_req("pvc-src", &[("backend", "local")], WRITER))
            .await,
        Code::ResourceExhausted,
        "kept free by --min-free",
    );
    assert!(st.message().contains("0 bytes usable"), "{st:?}");
    let model = d.dir.join("models/m");
    write_model(&model, 3);
    let uri = format!("file://{}", model.display());
    let st = assert_code(
        d.create(create_req("pvc-pull", &[("source", &uri)], READER))
            .await,
        Code::ResourceExhausted,
        "kept free by --min-free",
    );
    assert!(st.message().contains("the model needs"), "{st:?}");
    let cap = d
        .client
        .clone()
        .controller
        .get_capacity(GetCapacityRequest {
            parameters: map(&[("backend", "local")]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.available_capacity, 0);

    // Without the reserve the same requests go through.
    let d = Driver::start_with(&["--min-free", "0"]).await;
    d.create(create_req("pvc-src", &[("backend", "local")], WRITER))
        .await
        .unwrap();
    write_model(&d.dir.join("models/m"), 3);
    let uri = format!("file://{}", d.dir.join("models/m").display());
    d.create(create_req("pvc-pull", &[("source", &uri)], READER))
        .await
        .unwrap();
}

/// Inodes are not free: a model of 20,000 empty files lists 0 bytes, but
/// costs a block and an inode each. It is charged against
/// `--cache-capacity` (refused under 40M, which its blocks exceed), and
/// `--min-free-inodes` keeps the node's inodes the way `--min-free` keeps
/// its blocks.
#[tokio::test]
async fn empty_files_cost_blocks_and_inodes() {
    let d = Driver::start_with(&["--cache-capacity", "local=40M", "--min-free", "0"]).await;
    let model = d.dir.join("models/empty");
    for i in 0..20_000 {
        let dir = model.join(format!("d{}", i % 20));
        if i < 20 {
            std::fs::create_dir_all(&dir).unwrap();
        }
        std::fs::write(dir.join(format!("f{i}")), b"").unwrap();
    }
    let uri = format!("file://{}", model.display());
    let st = assert_code(
        d.create(create_req("pvc-empty", &[("source", &uri)], READER))
            .await,
        Code::ResourceExhausted,
        "--cache-capacity",
    );
    assert!(st.message().contains("a block at least"), "{st:?}");

    // Every inode the filesystem has is kept free: refused, naming the flag.
    let d = Driver::start_with(&["--min-free", "0", "--min-free-inodes", "100%"]).await;
    let small = d.dir.join("models/small");
    write_model(&small, 4);
    let uri = format!("file://{}", small.display());
    assert_code(
        d.create(create_req("pvc-inodes", &[("source", &uri)], READER))
            .await,
        Code::ResourceExhausted,
        "--min-free-inodes",
    );
    // With no inode reserve the same pull goes through.
    let d = Driver::start_with(&["--min-free", "0", "--min-free-inodes", "0"]).await;
    write_model(&d.dir.join("models/small"), 4);
    let uri = format!("file://{}", d.dir.join("models/small").display());
    d.create(create_req("pvc-inodes", &[("source", &uri)], READER))
        .await
        .unwrap();
}

/// A local user of the node cannot walk the state directory to a tenant's
/// model (security third pass L-4): the directory is root's alone (0700),
/// while a pod still reads the model through the volume the driver
/// mounts. Before, the tree was 0755 and the files 0644.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_user_reads_no_model_but_a_pod_reads_its_volume() {
    let d = Driver::start().await;
    let model = d.dir.join("models/m");
    write_model(&model, 11);
    let uri = format!("file://{}", model.display());
    let v = d
        .create(create_req("pvc-private", &[("source", &uri)], READER))
        .await
        .expect("pull");
    let sid = v.volume_context["source"].clone();
    d.wait_sealed(&[&sid], SEAL_BOUND).await;
    assert_eq!(fs::metadata(&d.state_dir).unwrap().mode() & 0o777, 0o700);
    let file = fs::read_dir(d.source_dir("local", &sid).join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_file())
        .expect("a model file");
    // `nobody`, as any local user or unprivileged pod process would.
    let as_nobody = |path: &Path| {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
            .arg(path)
            .output()
            .unwrap()
    };
    let out = as_nobody(&file);
    assert!(!out.status.success(), "nobody read {}", file.display());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    let (staging, target) = (d.staging("private"), d.target("private"));
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    d.publish(&v.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let through = target.join(file.file_name().unwrap());
    let out = as_nobody(&through);
    assert!(
        out.status.success(),
        "a pod's user cannot read its volume: {out:?}"
    );
    d.unpublish(&v.volume_id, &target).await.unwrap();
    d.unstage(&v.volume_id, &staging).await.unwrap();
}
