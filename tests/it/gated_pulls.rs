//! A gated model at the CSI socket (docs/security.md, "Who may read a
//! model"): a Hub-like origin whose listing is public and whose content
//! needs a token, paced so that a pull is still running while others ask.
//! A requester without the token never joins another requester's running
//! pull, never gets a volume answered before the seal, and never resumes
//! work an earlier pull left; the token holder still does all three.

use std::fs;

use crate::support::fixtures::{HUB_REPO, HubServer, pseudo_random};
use crate::support::harness::*;
use modelcache_csi::csi::CreateVolumeRequest;
use tonic::Code;

const TOKEN: &str = "team-a-token";
const SHARDS: usize = 3;
const SHARD_BYTES: usize = 8 << 20;

fn shard(i: usize) -> String {
    format!("model-0000{}-of-0000{SHARDS}.safetensors", i + 1)
}

/// A gated repo of a config and three 8 MiB shards, each answer sent at
/// `rate` bytes a second.
async fn hub(rate: u64) -> (HubServer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), b"{\"layers\": 3}").unwrap();
    for i in 0..SHARDS {
        fs::write(
            dir.path().join(shard(i)),
            pseudo_random(70 + i as u64, SHARD_BYTES),
        )
        .unwrap();
    }
    let hub = HubServer::start(dir.path()).await;
    hub.gate(TOKEN);
    hub.throttle(rate);
    (hub, dir)
}

/// CreateVolume of the gated repo, with `token` as the class's
/// provisioner secret (`hfToken`), `progressive` or not.
fn req(hub: &HubServer, name: &str, token: Option<&str>, progressive: bool) -> CreateVolumeRequest {
    let uri = format!("hf://{HUB_REPO}");
    let endpoint = hub.endpoint();
    let mut params = vec![
        ("backend", "local"),
        ("source", uri.as_str()),
        ("hfEndpoint", endpoint.as_str()),
    ];
    if progressive {
        params.push(("progressive", "true"));
    }
    let mut r = create_req(name, &params, READER);
    if let Some(t) = token {
        r.secrets = [("hfToken".to_string(), t.to_string())].into();
    }
    r
}

/// A create refused as the Hub refuses the requester: gated, never a
/// volume.
#[track_caller]
fn refused_as_gated(what: &str, r: Result<modelcache_csi::csi::Volume, tonic::Status>) {
    match r {
        Ok(v) => panic!("{what}: got volume {} of a gated model", v.volume_id),
        Err(s) => assert!(
            s.code() == Code::FailedPrecondition && s.message().contains("gated"),
            "{what}: {:?}: {}",
            s.code(),
            s.message()
        ),
    }
}

/// GETs of a shard's content (the CDN path its LFS pointer redirects to).
fn shard_gets(hub: &HubServer) -> usize {
    hub.requests()
        .iter()
        .filter(|r| r.raw_path.contains("/cdn-lfs/"))
        .count()
}

/// While the token holder's pull runs, a create without the token (or
/// with a wrong one) is refused on a progressive class and on the default
/// one (answered once verified), and so is it once the model is sealed.
/// Without the access check before a pull is joined, the progressive
/// creates were answered at the listing and the default one once the
/// holder's files were verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requester_without_access_never_joins_a_gated_pull() {
    // Two connections of 1 MiB/s: about 12 s for the 24 MiB.
    let (hub, _dir) = hub(1 << 20).await;
    let d = Driver::start_with(&["--pull-chunk-mib", "1", "--pull-connections", "2"]).await;
    let a = d
        .create(req(&hub, "pvc-a", Some(TOKEN), true))
        .await
        .unwrap_or_else(|s| panic!("the token holder's create: {:?}: {}", s.code(), s.message()));
    let sid = a.volume_context["source"].clone();
    for (name, token, progressive) in [
        ("pvc-b", None, true),
        ("pvc-b-guess", Some("a-guess"), true),
        ("pvc-b-default", None, false),
    ] {
        refused_as_gated(name, d.create(req(&hub, name, token, progressive)).await);
    }
    assert!(
        !d.source_dir("local", &sid).join("seal.json").exists(),
        "the model sealed before the other requesters asked: the origin is too fast for this test"
    );
    // The holder's own pull goes on and seals; a second volume of its own
    // joins or hits it.
    d.wait_sealed(&[&sid], SEAL_BOUND).await;
    d.create(req(&hub, "pvc-a-2", Some(TOKEN), false))
        .await
        .unwrap_or_else(|s| {
            panic!(
                "the holder's second create: {:?}: {}",
                s.code(),
                s.message()
            )
        });
    refused_as_gated(
        "a hit",
        d.create(req(&hub, "pvc-b-sealed", None, false)).await,
    );
}

/// Work a pull left (the driver killed once the first shard was verified
/// and durable) is resumed only by a requester that proves its access:
/// one without the token is refused, and the holder's create fetches only
/// what was missing. Without the check the first shard was readable in the
/// other requester's progressive view, though the origin had answered it
/// only 401s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_a_gated_pull_left_is_resumed_only_by_a_requester_with_access() {
    // Two connections of 1 MiB/s: the first shard in about 4 s.
    let (hub, _dir) = hub(1 << 20).await;
    let mut d = Driver::start_with(&["--pull-chunk-mib", "1", "--pull-connections", "2"]).await;
    let a = d
        .create(req(&hub, "pvc-a", Some(TOKEN), true))
        .await
        .unwrap_or_else(|s| panic!("the token holder's create: {:?}: {}", s.code(), s.message()));
    // The first shard read whole through the holder's view: verified.
    let (staging, target) = (d.staging("a"), d.target("a"));
    d.stage(&a.volume_id, &staging, READER).await.unwrap();
    d.publish(&a.volume_id, &staging, &target, READER, true)
        .await
        .unwrap();
    let first = fs::read(target.join(shard(0))).expect("the first shard");
    assert_eq!(first.len(), SHARD_BYTES);
    d.unpublish(&a.volume_id, &target).await.unwrap();
    d.unstage(&a.volume_id, &staging).await.unwrap();
    let sid = a.volume_context["source"].clone();
    assert!(
        !d.source_dir("local", &sid).join("seal.json").exists(),
        "the model sealed before the kill: the origin is too fast for this test"
    );
    d.kill_9();
    d.restart().await;
    // A refusal takes a round trip to a Hub far away, as it would: time
    // in which a view of the left work, had it been handed out, is read.
    hub.refuse_after(std::time::Duration::from_millis(500));

    let gets = shard_gets(&hub);
    refused_as_gated(
        "the other requester, progressive",
        d.create(req(&hub, "pvc-b", None, true)).await,
    );
    refused_as_gated(
        "the other requester, default class",
        d.create(req(&hub, "pvc-b-default", None, false)).await,
    );
    assert_eq!(
        shard_gets(&hub),
        gets,
        "a refused requester's pull reached the content"
    );
    // The holder resumes: the first shard is not fetched again.
    let first_gets = |h: &HubServer| {
        let sha = crate::support::fixtures::sha256_file(&_dir.path().join(shard(0)));
        h.gets(&format!("cdn-lfs/{sha}"))
    };
    let before = first_gets(&hub);
    d.create(req(&hub, "pvc-a-again", Some(TOKEN), false))
        .await
        .unwrap_or_else(|s| panic!("the holder's resume: {:?}: {}", s.code(), s.message()));
    d.wait_sealed(&[&sid], SEAL_BOUND).await;
    assert_eq!(
        first_gets(&hub),
        before,
        "the holder's resume fetched the verified shard again"
    );
}
