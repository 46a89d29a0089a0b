//! What discovery and coordination cost the apiserver as the cluster
//! grows (issue #46): a simulated fleet in a real etcd + kube-apiserver,
//! each node holding a popular model and others, written as drivers write
//! them: with holder records (one small peer Lease per node, one record
//! per model it holds), and with the one-Lease-per-node layout the
//! directory had before (every held model in one annotation). For each
//! size and layout: what one node asking who holds the popular model makes
//! the apiserver serve, and the size of a node's peer Lease; then a
//! rollout: every node of the records fleet starting one new model at
//! once (begin, ask, claim), through the library's directory. The
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

#[path = "../it/support/apiserver.rs"]
#[allow(dead_code)]
mod apiserver;
#[path = "../it/support/fleet.rs"]
#[allow(dead_code)]
mod fleet;

use std::time::Instant;

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

    let api = apiserver::ApiServer::start()?;
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path())).await?;
    let mut rows = vec![
        "layout,nodes,models_per_node,lists,list_bytes,requests,bytes,holders,lease_bytes"
            .to_string(),
    ];
    println!(
        "{:<12} {:>6} {:>6} {:>12} {:>14} {:>12} {:>8} {:>11}",
        "layout", "nodes", "LISTs", "LIST bytes", "all bytes", "requests", "holders", "Lease bytes"
    );
    for &nodes in &sizes {
        for layout in [Layout::Annotations, Layout::Records] {
            let ns = format!(
                "{}-{nodes}",
                if layout == Layout::Records {
                    "records"
                } else {
                    "annotations"
                }
            );
            let models = match layout {
                Layout::Records => record_models,
                Layout::Annotations => models,
            };
            let t = Instant::now();
            fleet::populate(&api, &client, &ns, nodes, models - 1, layout).await;
            eprintln!(
                "{ns}: wrote the fleet in {:.1} s",
                t.elapsed().as_secs_f64()
            );
            let (served, holders) = fleet::ask(&api, &client, &ns, layout).await;
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
            rows.push(format!("{layout:?},{nodes},{models},{lists},{list_bytes},{requests},{bytes},{holders},{lease_bytes}"));
        }
    }
    std::fs::write(&csv, rows.join("\n") + "\n").with_context(|| csv.clone())?;

    // A rollout: every node of a fleet starts one new model at once.
    for &nodes in sizes.iter().filter(|n| **n <= rollout_max) {
        let ns = format!("records-{nodes}");
        let sid = "m00000000000000000000000000000ff";
        let dirs: Vec<_> = (0..nodes)
            .map(|n| fleet::probe(&client, &ns, &format!("sim-{n:05}")))
            .collect();
        let before = Served::now(&api);
        let t = Instant::now();
        let claims: Vec<Claim> = futures::stream::iter(dirs.iter().map(|d| async move {
            d.begin(sid, 1).await.expect("begin");
            let _ = d.holders(sid, true).await;
            d.claim(sid).await
        }))
        .buffer_unordered(64)
        .collect()
        .await;
        let served = Served::now(&api).since(&before);
        let (requests, bytes) = served.ours();
        let leads = claims.iter().filter(|c| **c == Claim::Leads).count();
        println!(
            "rollout to {nodes} nodes: {leads} leader(s); {requests} requests, {bytes} bytes \
             ({:.0} bytes a node) in {:.1} s; by verb: {:?}",
            bytes / nodes as f64,
            t.elapsed().as_secs_f64(),
            served.0
        );
    }
    Ok(())
}
