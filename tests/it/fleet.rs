//! What asking who holds a model costs the apiserver as the cluster grows
//! (issue #46): a simulated fleet of nodes in a real apiserver, each with
//! its peer Lease and the records of what it holds, as their drivers write
//! them, and one real node's directory asking who holds the model every
//! node holds. The apiserver's own metrics count what it served. The
//! figures at 1,000 nodes are the benchmark's (`cargo bench --bench
//! fleet`, docs/benchmarks.md).

use std::collections::BTreeMap;

use crate::support::apiserver::ApiServer;
use crate::support::fleet::{self, Layout};
use modelcache_csi::peer::directory::HOLDERS_ASKED;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_who_holds_a_model_costs_the_same_at_ten_and_at_two_hundred_nodes() {
    let api = ApiServer::start().expect("start apiserver");
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path()))
        .await
        .unwrap();
    let mut cost = Vec::new();
    for nodes in [10, 200] {
        let ns = format!("fleet-{nodes}");
        fleet::populate(&api, &client, &ns, nodes, 5, Layout::Records).await;
        let (served, holders) = fleet::ask(&api, &client, &ns, Layout::Records).await;
        let (lists, list_bytes) = served.verb("LIST");
        let (requests, bytes) = served.ours();
        println!(
            "{nodes} nodes: {holders} holders named; {lists} LISTs of {list_bytes} bytes; \
             {requests} requests of {bytes} bytes in all ({:?})",
            served.0
        );
        // Every holder of a small fleet; a page of a large one's (this
        // node's shard's, when it has enough).
        if nodes <= HOLDERS_ASKED as usize {
            assert_eq!(holders, nodes, "{served:?}");
        } else {
            assert!(
                (4..=HOLDERS_ASKED as usize).contains(&holders),
                "{holders} holders"
            );
        }
        assert!(lists <= 3.0, "{lists} LISTs to ask once");
        cost.push(bytes);
    }
    assert!(
        cost[1] <= 2.0 * cost[0],
        "asking cost {} bytes at 200 nodes, over twice the {} at 10",
        cost[1],
        cost[0]
    );

    // The same 200 nodes with one Lease each listing its models: asking
    // reads them all.
    fleet::populate(&api, &client, "legacy-200", 200, 5, Layout::Annotations).await;
    let (served, holders) = fleet::ask(&api, &client, "legacy-200", Layout::Annotations).await;
    let (_, legacy) = served.ours();
    println!("200 nodes, one Lease each listing its models: {holders} holders, {legacy} bytes");
    assert_eq!(holders, 200);
    assert!(
        legacy > 2.0 * cost[1],
        "records ({} bytes) should cost far less than every node's Lease ({legacy})",
        cost[1]
    );
}

/// A popular model's followers each read a page drawn at random from its
/// holders, not the same first names: across many asks, pages name more
/// holders than 16 fixed pages of 16 could (how pages were drawn before,
/// by the asker's shard), and no holder is on most pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_popular_models_askers_spread_over_its_holders() {
    const NODES: usize = 800;
    const ASKS: usize = 160;
    let api = ApiServer::start().expect("start apiserver");
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path()))
        .await
        .unwrap();
    fleet::populate(&api, &client, "popular", NODES, 0, Layout::Records).await;
    let mut named: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..ASKS {
        let peers = fleet::probe(&client, "popular", &format!("asker-{i}"))
            .holders(fleet::POPULAR, true)
            .await;
        assert!(
            (4..=HOLDERS_ASKED as usize).contains(&peers.len()),
            "ask {i} named {} holders",
            peers.len()
        );
        for p in peers {
            *named.entry(p.node).or_default() += 1;
        }
    }
    let busiest = named.values().max().copied().unwrap_or_default();
    println!(
        "{ASKS} asks over {NODES} holders named {} of them; the busiest on {busiest} pages",
        named.len()
    );
    let fixed = HOLDERS_ASKED as usize * 16;
    assert!(
        named.len() > fixed,
        "{} holders named: pages as fixed as 16 shards' first pages",
        named.len()
    );
    assert!(
        busiest < ASKS / 4,
        "one holder on {busiest} of {ASKS} pages"
    );
}

/// A node removed from the cluster takes its peer Lease and records with
/// it: the Node owns the Lease, the Lease owns the records (the garbage
/// collector, which this apiserver runs without, does the rest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_records_belong_to_its_lease_and_the_lease_to_its_node() {
    let api = ApiServer::start().expect("start apiserver");
    let client = modelcache_csi::server::kube_client(Some(&api.kubeconfig_path()))
        .await
        .unwrap();
    let out = api.kubectl_stdin(
        &["apply", "-f", "-"],
        r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"gpu-7"}}"#,
    );
    assert!(out.status.success(), "{out:?}");
    let jsonpath = |kind: &str, name: &str, path: &str| {
        let out = api.kubectl(&[
            "-n",
            "default",
            "get",
            kind,
            name,
            "-o",
            &format!("jsonpath={path}"),
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let node_uid = jsonpath("node", "gpu-7", "{.metadata.uid}");
    let dir = fleet::probe(&client, "default", "gpu-7");
    dir.begin(fleet::POPULAR, 1).await.unwrap();
    let lease = "modelcache-peer-gpu-7";
    assert_eq!(
        jsonpath(
            "lease",
            lease,
            "{.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].uid}"
        ),
        format!("Node/{node_uid}")
    );
    let lease_uid = jsonpath("lease", lease, "{.metadata.uid}");
    let record = modelcache_csi::peer::directory::records::record_name(fleet::POPULAR, "gpu-7");
    assert_eq!(
        jsonpath(
            "lease",
            &record,
            "{.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].uid}"
        ),
        format!("Lease/{lease_uid}")
    );
}
