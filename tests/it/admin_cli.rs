//! `modelcache-csi cache`: the operator's CLI, run as a separate process on
//! the state directory of a running driver, as `kubectl exec` into the
//! node plugin would: ls, show, verify (directory and XFS image), pin,
//! unpin, evict (refused while in use or pinned), prefetch (a later
//! CreateVolume of the model fetches nothing).

use std::fs;
use std::process::Command;

use crate::support::harness::*;

#[tokio::test]
async fn an_operator_sees_verifies_pins_and_evicts_what_the_node_caches() {
    let d = Driver::start().await;
    let dir = d.dir.join("model");
    let model = write_model(&dir, 7);
    let uri = format!("file://{}", dir.display());
    let v = d
        .create(create_req(
            "pvc-cli",
            &[("backend", "local"), ("source", &uri)],
            READER,
        ))
        .await
        .expect("create from the model URI");

    // ls: the pulled model, its origin, size, files and the volume using it
    // (once sealed: the create answered once every file was verified).
    let m = d
        .wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    assert_eq!(m.len(), 1, "{m:?}");
    let id = m[0]["id"].as_str().unwrap().to_string();
    assert_eq!(m[0]["origin"], uri.as_str());
    assert_eq!(m[0]["files"], model.files.len());
    let bytes: usize = model.files.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(m[0]["bytes"], bytes);
    assert_eq!(m[0]["volumes"], serde_json::json!([v.volume_id]));
    assert_eq!(m[0]["pinned"], false);
    let table = d.cli(&["ls"]);
    assert!(table.ok && table.stdout.contains(&id) && table.stdout.contains("LAST USED"));
    let shown = d.cli(&["show", &id]);
    assert!(
        shown.ok
            && shown.stdout.contains("model.safetensors")
            && shown.stdout.contains(&v.volume_id),
        "{}",
        shown.stdout
    );

    // evict refuses a model in use, and names who uses it.
    let r = d.cli(&["evict", &id]);
    assert!(!r.ok, "evicted a model in use: {}", r.stdout);
    assert!(
        r.stderr.contains(&v.volume_id) && r.stderr.contains("in use"),
        "{}",
        r.stderr
    );

    // verify: clean, then a flipped byte is reported with the file's name.
    let report = d.cli(&["verify", &id, "--output", "json"]).json();
    assert_eq!(report["mismatches"], serde_json::json!([]));
    let weights = d
        .source_dir("local", &id)
        .join("data")
        .join("model.safetensors");
    let mut b = fs::read(&weights).unwrap();
    b[4096] ^= 1;
    fs::write(&weights, &b).unwrap();
    let r = d.cli(&["verify", &id]);
    assert!(!r.ok, "a flipped byte went unnoticed");
    assert!(
        r.stdout.contains("model.safetensors: sha256") && r.stderr.contains("does not match"),
        "{}{}",
        r.stdout,
        r.stderr
    );

    // pin and unpin; a pinned model is not evicted even when unused.
    d.delete(&v.volume_id).await.unwrap();
    assert!(d.cli(&["pin", &id]).ok);
    assert_eq!(d.models()[0]["pinned"], true);
    let r = d.cli(&["evict", &id]);
    assert!(!r.ok && r.stderr.contains("pinned"), "{}", r.stderr);
    assert!(d.cli(&["unpin", &id]).ok);
    let gone = d.cli(&["evict", &id, "--output", "json"]).json();
    assert_eq!(gone["id"], id.as_str());
    assert!(d.models().is_empty());
    assert!(!d.source_dir("local", &id).exists());

    // Nonsense is refused with the field named.
    let r = d.cli(&["show", "../etc"]);
    assert!(!r.ok && r.stderr.contains("ID"), "{}", r.stderr);
    let r = d.cli(&["evict", &format!("m{}", "f".repeat(31))]);
    assert!(
        !r.ok && r.stderr.contains("none of this node's roots"),
        "{}",
        r.stderr
    );
}

#[tokio::test]
async fn a_prefetched_model_is_ready_for_the_next_volume_at_no_cost() {
    let d = Driver::start().await;
    let dir = d.dir.join("model");
    write_model(&dir, 8);
    let uri = format!("file://{}", dir.display());
    // Parameters are checked as a class's are, before anything is pulled.
    for (param, field) in [
        ("s3PathStyle=maybe", "--param s3PathStyle"),
        ("backend=xfs", "--param backend"),
    ] {
        let r = d.cli(&["prefetch", &uri, "--param", param]);
        assert!(
            !r.ok && r.stderr.contains(field),
            "{param}: {}{}",
            r.stdout,
            r.stderr
        );
    }
    assert!(d.models().is_empty(), "a refused prefetch pulled");
    // Not a terminal: plain progress lines on stderr, the outcome on stdout.
    let r = d.cli(&["prefetch", &uri, "--pin"]);
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("pulling file://"), "{}", r.stderr);
    assert!(
        r.stdout.contains("pulled, verified and sealed"),
        "{}",
        r.stdout
    );
    let m = d.models();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0]["pinned"], true);
    let again = d.cli(&["prefetch", &uri, "--output", "json"]).json();
    assert_eq!(again["already_cached"], true);

    let v = d
        .create(create_req(
            "pvc-after-prefetch",
            &[("backend", "local"), ("source", &uri)],
            READER,
        ))
        .await
        .expect("create after prefetch");
    assert_eq!(
        v.volume_context.get("model").map(String::as_str),
        Some(uri.as_str())
    );
    let m = d.models();
    assert_eq!(m.len(), 1, "the volume pulled a model of its own: {m:?}");
    let prefetched = m.iter().find(|e| e["id"] == again["id"]).unwrap();
    assert!(
        prefetched["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x == v.volume_id.as_str()),
        "the volume does not use the prefetched model: {m:?}"
    );
}

#[tokio::test]
async fn verify_reads_an_xfs_image_through_a_read_only_mount() {
    let d = Driver::start().await;
    let dir = d.dir.join("model");
    write_model(&dir, 9);
    let uri = format!("file://{}", dir.display());
    let v = d
        .create(create_req(
            "pvc-xfs-cli",
            &[("backend", "xfs"), ("source", &uri)],
            READER,
        ))
        .await
        .expect("create an xfs volume from the model URI");
    // Listed at once: an xfs volume answers only once its model is sealed.
    let m = d.models();
    let id = m[0]["id"].as_str().unwrap().to_string();
    assert_eq!(m[0]["backend"], "xfs");
    let report = d.cli(&["verify", &id, "--output", "json"]).json();
    assert_eq!(report["mismatches"], serde_json::json!([]));
    assert_eq!(report["files"], 4);
    // Nothing of the check stays mounted or attached.
    assert!(
        mounts_below(&d.state_dir).is_empty(),
        "{:?}",
        mounts_below(&d.state_dir)
    );
    assert!(loop_devices_under(&d.state_dir).is_empty());
    d.delete(&v.volume_id).await.unwrap();
}

/// The `cache` verbs take only the flags they use, before or after the
/// verb, and find the node's roots on a host with no node name given.
#[tokio::test]
async fn cache_flags_are_its_own_and_follow_the_verb() {
    let d = Driver::start().await;
    let dir = d.dir.join("model");
    write_model(&dir, 7);
    let uri = format!("file://{}", dir.display());
    let v = d
        .create(create_req("m1", &[("source", &uri)], READER))
        .await
        .expect("pull");
    // Answered once every file was verified: ls shows it once sealed.
    d.wait_sealed(&[&v.volume_context["source"]], SEAL_BOUND)
        .await;
    let bin = env!("CARGO_BIN_EXE_modelcache-csi");
    let help = Command::new(bin)
        .args(["cache", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.lines().count() < 45
            && !help.contains("--peer-listen")
            && !help.contains("--endpoint"),
        "cache --help shows the server's flags:\n{help}"
    );
    // After the verb, no --node-id and no NODE_ID or NODE_NAME: the
    // host's name stands in, and the model is listed.
    let out = Command::new(bin)
        .args(["cache", "ls", "--output", "json", "--state-dir"])
        .arg(&d.state_dir)
        .env_remove("NODE_ID")
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    let r = CliRun::from(out);
    let listed = r.json();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "model"
                && e["origin"].as_str().is_some_and(|o| o.contains("model"))),
        "{listed}"
    );
    assert_eq!(
        listed,
        d.cli(&["ls", "--output", "json"]).json(),
        "flags before and after the verb differ"
    );
}
