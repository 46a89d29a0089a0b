//! What one model's seal can cost a node (docs/security.md, "A seal's
//! size"): a seal the driver cannot read (over the reader's bound, as a
//! model of very many long names once made; torn; or forged on a shared
//! root) costs only its own model. Pulls of other models, GetCapacity and
//! `cache ls` go on, with `--cache-capacity` set as the manifests set it.

use std::fs;

use crate::support::harness::*;
use modelcache_csi::csi::GetCapacityRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_seal_stops_nothing_but_its_own_model() {
    let d = Driver::start_with(&["--cache-capacity", "local=10G"]).await;
    let sources = d.state_dir.join("local/sources");
    // One model's seal over what any reader reads (64 MiB), another's torn.
    let over = format!("m{}", "2".repeat(31));
    fs::create_dir_all(sources.join(&over).join("data")).unwrap();
    fs::File::create(sources.join(&over).join("seal.json"))
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let torn = format!("m{}", "3".repeat(31));
    fs::create_dir_all(sources.join(&torn).join("data")).unwrap();
    fs::write(
        sources.join(&torn).join("seal.json"),
        b"{\"format\": 1, \"sou",
    )
    .unwrap();

    let model = d.dir.join("models/m");
    let want = write_model(&model, 5);
    let uri = format!("file://{}", model.display());
    let v = d
        .create(create_req("pvc-other", &[("source", &uri)], READER))
        .await
        .unwrap_or_else(|s| panic!("another model's pull: {:?}: {}", s.code(), s.message()));
    let sid = v.volume_context["source"].clone();
    d.wait_sealed(&[&sid], SEAL_BOUND).await;
    let staging = d.staging("other");
    d.stage(&v.volume_id, &staging, READER).await.unwrap();
    assert_model(&content(&staging), &want);
    d.unstage(&v.volume_id, &staging).await.unwrap();

    let cap = d
        .client
        .clone()
        .controller
        .get_capacity(GetCapacityRequest {
            parameters: map(&[("backend", "local")]),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("GetCapacity: {:?}: {}", s.code(), s.message()))
        .into_inner();
    assert!(cap.available_capacity > 0, "{cap:?}");

    // The operator sees which model is broken, and why.
    let listed = d.cli(&["ls", "--output", "json"]).json();
    let entries = listed.as_array().unwrap();
    for broken in [&over, &torn] {
        let e = entries
            .iter()
            .find(|e| e["id"] == broken.as_str())
            .unwrap_or_else(|| panic!("cache ls does not list {broken}: {listed:#}"));
        assert!(
            e["unreadable"]
                .as_str()
                .is_some_and(|w| w.contains("seal.json")),
            "{e:#}"
        );
    }
}
