//! What discovery and coordination cost the apiserver as the cluster
//! grows (issue #46): a simulated fleet in a real etcd + kube-apiserver,
//! each node holding a popular model and others, written as drivers write
//! them: with holder records (one small peer Lease per node, one record
//! per model it holds), and with the one-Lease-per-node layout the
//! directory had before (every held model in one annotation). For each
//! size and layout: what one node asking who holds the popular model makes
//! the apiserver serve, and the size of a node's peer Lease; then a
//! rollout: every node of the records fleet starting one new model at
//! once (begin, ask, claim), through the library's directories, each
//! running (renewing its Lease) as a driver's does, and what they ask for
//! while idle; last, a
//! `ModelPrefetch` whose status has a progress line from each node, as
//! the nodes' drivers write them (server-side apply, one field manager a
//! node): its size, and what one more progress write costs. The
//! apiserver's own metrics count what it served.
//!
//! Run: `cargo bench --bench fleet` (builds or reuses etcd and
//! kube-apiserver as the integration tests do). Settings (environment):
//!   FLEET_NODES    fleet sizes, default "10,100,1000"
//!   FLEET_MODELS   models each node holds, default 200
//!   FLEET_RECORD_MODELS  the same for the records fleet, default
//!                  FLEET_MODELS (a record per model is an object each,
//!                  and none of them but the asked model's is read)
//!   FLEET_ROLLOUT  the largest size to roll a model out to, default 1000
//!   FLEET_CSV      where the table goes as CSV, default target/fleet.csv
//!   FLEET_PARTS    which parts run, default "ask,rollout,prefetch"

#[path = "../it/support/apiserver.rs"]
#[allow(dead_code)]
mod apiserver;
#[path = "../it/support/fleet.rs"]
#[allow(dead_code)]
mod fleet;

use std::time::{Duration, Instant};

use anyhow::Context;
use fleet::{Layout, Served};
use futures::StreamExt;
use modelcache_csi::peer::directory::Claim;

fn setting<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let sizes: Vec<usize> = std::env::var("FLEET_NODES")
        .unwrap_or_else(|_| "10,100,1000".into())
        .split(',')
        .map(|s| s.trim().parse().context("FLEET_NODES"))
        .collect::<anyhow::Result<_>>()?;
    let models: usize = setting("FLEET_MODELS", 200);
    let record_models: usize = setting("FLEET_RECORD_MODELS", models);
    let rollout_max: usize = setting("FLEET_ROLLOUT", 1000);
    let csv = std::env::var("FLEET_CSV").unwrap_or_else(|_| "target/fleet.csv".into());
    let parts = std::env::var("FLEET_PARTS").unwrap_or_else(|_| "ask,rollout,prefetch".into());

    let api = apiserver::ApiServer::start()?;
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path())).await?;
    if parts.contains("ask") {
        ask(&api, &client, &sizes, (models, record_models), &csv).await?;
    }
    if parts.contains("rollout") {
        for &nodes in sizes.iter().filter(|n| **n <= rollout_max) {
            rollout(&api, &client, nodes).await?;
        }
    }
    if parts.contains("prefetch") {
        prefetch_status(&api, &client, &sizes).await?;
    }
    Ok(())
}

/// One node asking who holds the model every node holds, at each size and
/// layout (`models` a node with one Lease each, `record_models` with
/// records); the table also goes to `csv`.
async fn ask(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    sizes: &[usize],
    (models, record_models): (usize, usize),
    csv: &str,
) -> anyhow::Result<()> {
    let mut rows = vec![
        "layout,nodes,models_per_node,lists,list_bytes,requests,bytes,holders,lease_bytes"
            .to_string(),
    ];
    println!(
        "{:<12} {:>6} {:>6} {:>12} {:>14} {:>12} {:>8} {:>11}",
        "layout", "nodes", "LISTs", "LIST bytes", "all bytes", "requests", "holders", "Lease bytes"
    );
    for &nodes in sizes {
        for layout in [Layout::Annotations, Layout::Records] {
            let (ns, models) = match layout {
                Layout::Records => (format!("records-{nodes}"), record_models),
                Layout::Annotations => (format!("annotations-{nodes}"), models),
            };
            let t = Instant::now();
            fleet::populate(api, client, &ns, nodes, models - 1, layout).await;
            eprintln!(
                "{ns}: wrote the fleet in {:.1} s",
                t.elapsed().as_secs_f64()
            );
            let (served, holders) = fleet::ask(api, client, &ns, layout).await;
            let (lists, list_bytes) = served.verb("LIST");
            let (requests, bytes) = served.ours();
            let lease = api.kubectl(&[
                "-n",
                &ns,
                "get",
                "lease",
                "modelcache-peer-sim-00000",
                "-o",
                "json",
            ]);
            let lease_bytes = lease.stdout.len();
            println!(
                "{:<12} {nodes:>6} {lists:>6} {list_bytes:>12} {bytes:>14} {requests:>12} {holders:>8} {lease_bytes:>11}",
                format!("{layout:?}")
            );
            rows.push(format!(
                "{layout:?},{nodes},{models},{lists},{list_bytes},{requests},{bytes},{holders},{lease_bytes}"
            ));
        }
    }
    std::fs::write(csv, rows.join("\n") + "\n").with_context(|| csv.to_string())?;
    Ok(())
}

/// Every node of a fleet of `nodes` starting one model at once, each
/// with its directory running (renewing its Lease) as a driver's does;
/// then what the directories ask for while idle.
async fn rollout(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    nodes: usize,
) -> anyhow::Result<()> {
    let ns = format!("rollout-{nodes}");
    let out = api.kubectl(&["create", "namespace", &ns]);
    anyhow::ensure!(out.status.success(), "{out:?}");
    let sid = "m00000000000000000000000000000ff";
    let dirs: Vec<_> = (0..nodes)
        .map(|n| std::sync::Arc::new(fleet::probe(client, &ns, &format!("sim-{n:05}"))))
        .collect();
    let before = Served::now(api);
    let running: Vec<_> = dirs.iter().map(|d| tokio::spawn(d.clone().run())).collect();
    // Every directory's first publish: its Lease, its records listed.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let started = Served::now(api);
    let (n0, b0) = started.since(&before).ours();
    println!("{nodes} directories starting: {n0} requests, {b0} bytes read");
    let t = Instant::now();
    let claims: Vec<Claim> = futures::stream::iter(dirs.iter().map(|d| async move {
        d.begin(sid, 1).await.expect("begin");
        let _ = d.holders(sid, true).await;
        d.claim(sid).await
    }))
    .buffer_unordered(64)
    .collect()
    .await;
    let took = t.elapsed();
    let served = Served::now(api).since(&started);
    let (requests, bytes) = served.ours();
    let leads = claims.iter().filter(|c| **c == Claim::Leads).count();
    println!(
        "rollout to {nodes} nodes: {leads} leader(s); {requests} requests, {bytes} bytes read \
         ({:.0} bytes, {:.1} requests a node) in {:.1} s; by verb: {:?}",
        bytes / nodes as f64,
        requests / nodes as f64,
        took.as_secs_f64(),
        served.0
    );
    let quiet = Served::now(api);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let idle = Served::now(api).since(&quiet);
    let (n, b) = idle.ours();
    println!(
        "{nodes} directories idle for 60 s: {n} requests ({:.2} a node a minute), {b} bytes read; by verb: {:?}",
        n / nodes as f64,
        idle.0
    );
    for r in running {
        r.abort();
    }
    Ok(())
}

/// A `ModelPrefetch`'s size with one progress line a node, and what the
/// apiserver serves for one more line's write, at each size.
async fn prefetch_status(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    sizes: &[usize],
) -> anyhow::Result<()> {
    use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
    use modelcache_csi::prefetch::resource::{GROUP, KIND, PLURAL, VERSION};
    let crd = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/csi-driver/base/crd-modelprefetch.yaml"
    );
    let out = api.kubectl(&["apply", "-f", crd]);
    anyhow::ensure!(out.status.success(), "{out:?}");
    let out = api.kubectl(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modelprefetches.modelcache.csi.io",
    ]);
    anyhow::ensure!(out.status.success(), "{out:?}");
    let gvk = kube::api::GroupVersionKind::gvk(GROUP, VERSION, KIND);
    let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, PLURAL);
    let mps: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let line = |name: &str, n: usize| {
        serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": KIND,
            "metadata": {"name": name},
            "status": {"nodes": [{
                "node": format!("sim-{n:05}"),
                "phase": "Pulling",
                "bytes": 1_234_567_890u64 + n as u64,
                "totalBytes": 140_000_000_000u64,
                "revision": "0123456789abcdef0123456789abcdef01234567",
                "updated": "2026-12-07T06:00:00.123456789Z",
            }]},
        })
    };
    for &nodes in sizes {
        let name = format!("fleet-{nodes}");
        let mp: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": KIND,
            "metadata": {"name": name},
            "spec": {"storageClassName": "fleet"},
        }))?;
        mps.create(&PostParams::default(), &mp).await?;
        let mut writes = futures::stream::iter((0..nodes).map(|n| {
            let (mps, name, patch) = (mps.clone(), name.clone(), line(&name, n));
            async move {
                let manager = format!("{GROUP}/sim-{n:05}");
                mps.patch_status(
                    &name,
                    &PatchParams::apply(&manager).force(),
                    &Patch::Apply(&patch),
                )
                .await
            }
        }))
        .buffer_unordered(32);
        while let Some(r) = writes.next().await {
            r?;
        }
        let object = api
            .kubectl(&["get", "modelprefetch", &name, "-o", "json"])
            .stdout
            .len();
        let manager = format!("{GROUP}/sim-00000");
        let back = mps
            .patch_status(
                &name,
                &PatchParams::apply(&manager).force(),
                &Patch::Apply(&line(&name, 0)),
            )
            .await?;
        println!(
            "ModelPrefetch over {nodes} nodes: {object} bytes as JSON; one node's progress write \
             returns the whole object, {} bytes",
            serde_json::to_vec(&back)?.len()
        );
    }
    Ok(())
}
