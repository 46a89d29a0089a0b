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
//! while idle; last, a `ModelPrefetch` over the fleet: as drivers wrote
//! its status before (a progress line from each node, server-side apply,
//! one field manager a node: its size, and what one more write costs),
//! and as they write it now (the controller's summary, run here, counting
//! nodes labelled warm as a rollout labels them, and a line from each
//! failed node while there is room): the writes, their bytes and the
//! object's size through the rollout, how soon the summary says Ready
//! after the last node, and what is written while idle. The apiserver's
//! own metrics count what it served.
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
//!   FLEET_PREFETCH_BEFORE  the largest size to write per-node progress
//!                  lines for (the layout before), default 100
//!   FLEET_PREFETCH_SECS    how long the prefetch rollout takes, default 20
//!   FLEET_CONTROL_NODES, FLEET_CONTROL_PVCS  the part "control" (not in
//!                  the default parts): that many Nodes with the driver and
//!                  pending PVCs, each with a selected node; the
//!                  rescheduler and the driver's controller and node
//!                  plugin run as processes of the built binary: their
//!                  memory once their informers are in, and how soon the
//!                  rescheduler frees the PVCs of a node whose driver
//!                  goes. Defaults 1000 and 10000

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
        let before_max: usize = setting("FLEET_PREFETCH_BEFORE", 100);
        let small: Vec<usize> = sizes.iter().copied().filter(|n| *n <= before_max).collect();
        prefetch_status(&api, &client, &small).await?;
        let secs: u64 = setting("FLEET_PREFETCH_SECS", 20);
        // The objects of the layout before would be summarized too.
        let out = api.kubectl(&["delete", "modelprefetch", "--all"]);
        anyhow::ensure!(out.status.success(), "{out:?}");
        prefetch_crd(&api, str::to_string)?;
        tokio::spawn(modelcache_csi::prefetch::summary::run(
            client.clone(),
            PREFETCH_DRIVER.to_string(),
        ));
        for &nodes in &sizes {
            prefetch_rollout(&api, &client, nodes, Duration::from_secs(secs)).await?;
        }
    }
    if parts.contains("control") {
        let nodes: usize = setting("FLEET_CONTROL_NODES", 1000);
        let claims: usize = setting("FLEET_CONTROL_PVCS", 10000);
        control_plane(&api, &client, nodes, claims).await?;
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
    let before = Served::of(api, fleet::LEASES);
    let running: Vec<_> = dirs.iter().map(|d| tokio::spawn(d.clone().run())).collect();
    // Every directory's first publish: its Lease, its records listed.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let started = Served::of(api, fleet::LEASES);
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
    let served = Served::of(api, fleet::LEASES).since(&started);
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
    let quiet = Served::of(api, fleet::LEASES);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let idle = Served::of(api, fleet::LEASES).since(&quiet);
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
/// apiserver serves for one more line's write, at each size: how drivers
/// wrote its status before.
async fn prefetch_status(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    sizes: &[usize],
) -> anyhow::Result<()> {
    use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
    use modelcache_csi::prefetch::resource::{GROUP, KIND, PLURAL, VERSION};
    // As the CRD was: no bound on the lines.
    prefetch_crd(api, |crd| crd.replace("maxItems: 64", ""))?;
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

const PREFETCH_DRIVER: &str = "modelcache.csi.io";

/// Applies the ModelPrefetch CRD of deploy/, as `edit` leaves it, and
/// waits until it serves.
fn prefetch_crd(api: &apiserver::ApiServer, edit: impl Fn(&str) -> String) -> anyhow::Result<()> {
    let crd = include_str!("../../deploy/csi-driver/base/crd-modelprefetch.yaml");
    let out = api.kubectl_stdin(&["apply", "-f", "-"], &edit(crd));
    anyhow::ensure!(out.status.success(), "{out:?}");
    let out = api.kubectl(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/modelprefetches.modelcache.csi.io",
    ]);
    anyhow::ensure!(out.status.success(), "{out:?}");
    Ok(())
}

/// A ModelPrefetch over `nodes` simulated nodes (Node and CSINode objects)
/// rolled out in `over`: each node labelled warm in turn, as its driver
/// labels it, but one in twenty, which fail and write their line as a
/// driver does (`prefetch::failure_line`); then those turn warm too. The
/// controller's summary runs in this process.
async fn prefetch_rollout(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    nodes: usize,
    over: Duration,
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, Patch, PatchParams};
    use modelcache_csi::prefetch::resource::ModelPrefetch;
    let pool = format!("pf-{nodes}");
    let names: Vec<String> = (0..nodes).map(|i| format!("{pool}-{i:05}")).collect();
    let node_api: Api<Node> = Api::all(client.clone());
    driver_nodes(client, &names, &[("fleet", &pool)]).await?;
    let objects: Api<ModelPrefetch> = Api::all(client.clone());
    let mp = serde_json::json!({
        "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
        "metadata": {"name": pool},
        "spec": {"storageClassName": "fleet", "nodeSelector": {"matchLabels": {"fleet": pool}}},
    });
    let out = api.kubectl_stdin(&["create", "-f", "-"], &mp.to_string());
    anyhow::ensure!(out.status.success(), "{out:?}");
    let wait = |what: &'static str, done: Box<dyn Fn(&ModelPrefetch) -> bool + Send>| {
        let objects = objects.clone();
        let pool = pool.clone();
        async move {
            let start = Instant::now();
            loop {
                let now = objects.get(&pool).await?;
                if done(&now) {
                    return anyhow::Ok(start.elapsed());
                }
                anyhow::ensure!(
                    start.elapsed() < Duration::from_secs(300),
                    "{what} never came"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let desired = nodes as u32;
    wait(
        "every node counted",
        Box::new(move |m| m.status.as_ref().and_then(|s| s.desired_nodes) == Some(desired)),
    )
    .await?;
    let before = Served::settled_of(api, "modelprefetches");
    let failing = |i: usize| i % 20 == 7;
    let warm =
        serde_json::json!({"metadata": {"labels": {"warm.modelcache.csi.io/fleet": "true"}}});
    let gap = over / nodes as u32;
    let t0 = Instant::now();
    for (i, n) in names.iter().enumerate() {
        if failing(i) {
            let now = objects.get(&pool).await?;
            if let Some(line) = modelcache_csi::prefetch::failure_line(&now, n, "no space left") {
                let patch = serde_json::json!({
                    "apiVersion": "modelcache.csi.io/v1alpha1", "kind": "ModelPrefetch",
                    "metadata": {"name": pool},
                    "status": {"nodes": [line]},
                });
                objects
                    .patch_status(
                        &pool,
                        &PatchParams::apply(&format!("modelcache.csi.io/{n}")).force(),
                        &Patch::Apply(&patch),
                    )
                    .await?;
            }
        } else {
            node_api
                .patch(n, &PatchParams::default(), &Patch::Merge(&warm))
                .await?;
        }
        tokio::time::sleep_until((t0 + gap * (i as u32 + 1)).into()).await;
    }
    let failed = names
        .iter()
        .enumerate()
        .filter(|(i, _)| failing(*i))
        .count() as u32;
    let ready = desired - failed;
    wait(
        "the rollout's counts",
        Box::new(move |m| {
            m.status
                .as_ref()
                .is_some_and(|s| s.ready_nodes == Some(ready) && s.failed_nodes.is_some())
        }),
    )
    .await?;
    let rolled = t0.elapsed();
    let object = api
        .kubectl(&["get", "modelprefetch", &pool, "-o", "json"])
        .stdout
        .len();
    let listed = objects
        .get(&pool)
        .await?
        .status
        .map_or(0, |s| s.nodes.len());
    // The failed nodes retry and hold the model; as their drivers do, each
    // takes its line out.
    for (_, n) in names.iter().enumerate().filter(|(i, _)| failing(*i)) {
        node_api
            .patch(n, &PatchParams::default(), &Patch::Merge(&warm))
            .await?;
    }
    let lag = wait(
        "Ready",
        Box::new(move |m| {
            m.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        }),
    )
    .await?;
    let served = Served::settled_of(api, "modelprefetches").since(&before);
    // Only reads have their response sizes counted.
    let applies = served.verb("APPLY").0;
    let quiet = Served::settled_of(api, "modelprefetches");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let idle = Served::settled_of(api, "modelprefetches")
        .since(&quiet)
        .verb("APPLY")
        .0;
    println!(
        "ModelPrefetch rollout over {nodes} nodes in {:.1} s ({failed} failed, {listed} listed): \
         {applies} status writes ({:.1} a second); the object \
         {object} bytes as JSON; Ready {:.1} s after the last node; {idle} writes in 30 s idle; \
         what every node's watch would carry: {:.0} bytes",
        rolled.as_secs_f64(),
        applies / rolled.as_secs_f64(),
        lag.as_secs_f64(),
        applies * object as f64 * nodes as f64,
    );
    Ok(())
}

/// A Node as a GPU node's kubelet writes it: labels, conditions, capacity,
/// its addresses and the 40 images it holds (a Node of a real cluster is
/// 10 to 30 KiB, most of it `status.images`).
fn gpu_node(
    name: &str,
    extra: &[(&str, &str)],
) -> anyhow::Result<k8s_openapi::api::core::v1::Node> {
    let images: Vec<serde_json::Value> = (0..40)
        .map(|i| {
            serde_json::json!({
                "names": [
                    format!("registry.example.com/serving/vllm-openai@sha256:{i:064x}"),
                    format!("registry.example.com/serving/vllm-openai:v0.{i}.0-cu128"),
                ],
                "sizeBytes": 9_876_543_210u64 + i,
            })
        })
        .collect();
    let condition = |t: &str, status: &str| {
        serde_json::json!({
            "type": t, "status": status, "reason": format!("Kubelet{t}"),
            "message": format!("kubelet reports {t} as {status}"),
            "lastHeartbeatTime": "2026-12-07T09:00:00Z",
            "lastTransitionTime": "2026-12-01T09:00:00Z",
        })
    };
    let resources = serde_json::json!({
        "cpu": "192", "memory": "2113645876Ki", "nvidia.com/gpu": "8",
        "ephemeral-storage": "7025264456Ki", "pods": "110", "hugepages-1Gi": "0",
    });
    let mut node: k8s_openapi::api::core::v1::Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "p5.48xlarge",
            "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "topology.kubernetes.io/zone": "zone-a",
        }},
        "status": {
            "conditions": [
                condition("MemoryPressure", "False"), condition("DiskPressure", "False"),
                condition("PIDPressure", "False"), condition("Ready", "True"),
            ],
            "capacity": resources, "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": "0".repeat(32), "systemUUID": "0".repeat(36), "bootID": "0".repeat(36),
                "kernelVersion": "6.18.0", "osImage": "Ubuntu 24.04", "containerRuntimeVersion": "containerd://2.1.0",
                "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
            "images": images,
        },
    }))?;
    let labels = node.metadata.labels.get_or_insert_with(Default::default);
    for (k, v) in extra {
        labels.insert(k.to_string(), v.to_string());
    }
    Ok(node)
}

/// Each of `names` as a GPU node (`gpu_node`, with `labels` besides)
/// whose CSINode lists the driver, 32 writes at a time.
async fn driver_nodes(
    client: &kube::Client,
    names: &[String],
    labels: &[(&str, &str)],
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::storage::v1::CSINode;
    use kube::api::{Api, PostParams};
    let node_api: Api<Node> = Api::all(client.clone());
    let csinodes: Api<CSINode> = Api::all(client.clone());
    let mut writes = futures::stream::iter(names.iter().map(|n| {
        let (node_api, csinodes) = (node_api.clone(), csinodes.clone());
        async move {
            node_api
                .create(&PostParams::default(), &gpu_node(n, labels)?)
                .await?;
            let csinode: CSINode = serde_json::from_value(serde_json::json!({
                "metadata": {"name": n},
                "spec": {"drivers": [{"name": PREFETCH_DRIVER, "nodeID": n}]},
            }))?;
            csinodes.create(&PostParams::default(), &csinode).await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(32);
    while let Some(r) = writes.next().await {
        r?;
    }
    Ok(())
}

/// A process of the driver's binary with `args`, its log in `log`.
fn spawn_binary(args: &[&str], log: &std::path::Path) -> anyhow::Result<std::process::Child> {
    let out = std::fs::File::create(log)?;
    Ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
            .args(args)
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?,
    )
}

/// `VmRSS` and `VmHWM` of `pid`, in MiB.
fn memory(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

/// Processes killed when dropped, whatever ends the bench.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits, within `bound`, until `log` holds `line`; how long it took.
async fn logged(log: &std::path::Path, line: &str, bound: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(line) {
            return Ok(start.elapsed());
        }
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        anyhow::ensure!(
            start.elapsed() < bound,
            "{} never said {line:?}; it ends:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The control plane at fleet size: `nodes` Nodes whose CSINode lists the
/// driver and `claims` pending PVCs of a WaitForFirstConsumer class, each
/// with a selected node. The rescheduler, the driver's controller
/// (`--summarize-prefetches`) and one node plugin (`--prefetch`, which
/// watches its own Node, the ModelPrefetches and the StorageClasses) run
/// as processes; their memory once their informers are in; then one
/// node's driver goes (its CSINode deleted), and the time until the
/// rescheduler has freed every PVC that selected it.
async fn control_plane(
    api: &apiserver::ApiServer,
    client: &kube::Client,
    nodes: usize,
    claims: usize,
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    use k8s_openapi::api::storage::v1::CSINode;
    use kube::ResourceExt;
    use kube::api::{Api, PostParams};
    let out = api.kubectl(&["create", "namespace", "claims"]);
    anyhow::ensure!(out.status.success(), "{out:?}");
    let class = serde_json::json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "fleet-local"},
        "provisioner": PREFETCH_DRIVER,
        "volumeBindingMode": "WaitForFirstConsumer",
        "parameters": {"backend": "local"},
    });
    let out = api.kubectl_stdin(&["create", "-f", "-"], &class.to_string());
    anyhow::ensure!(out.status.success(), "{out:?}");
    let names: Vec<String> = (0..nodes).map(|i| format!("cp-{i:05}")).collect();
    let csinodes: Api<CSINode> = Api::all(client.clone());
    let t = Instant::now();
    driver_nodes(client, &names, &[]).await?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "claims");
    let mut writes = futures::stream::iter((0..claims).map(|j| {
        let pvcs = pvcs.clone();
        let node = names[j % nodes].clone();
        async move {
            let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": format!("c-{j:05}"),
                    "annotations": {
                        "volume.kubernetes.io/selected-node": node,
                        "volume.kubernetes.io/storage-provisioner": PREFETCH_DRIVER,
                    },
                },
                "spec": {
                    "storageClassName": "fleet-local",
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }))?;
            pvcs.create(&PostParams::default(), &pvc).await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(32);
    while let Some(r) = writes.next().await {
        r?;
    }
    eprintln!(
        "control: {nodes} nodes and {claims} PVCs written in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let dir = tempfile::tempdir()?;
    let kubeconfig = api.kubeconfig_path();
    let kubeconfig = kubeconfig.to_str().expect("a UTF-8 path");
    prefetch_crd(api, str::to_string)?;
    let mut children = Children(Vec::new());
    let resched_log = dir.path().join("rescheduler.log");
    children.0.push(spawn_binary(
        &[
            "rescheduler",
            "--kubeconfig",
            kubeconfig,
            "--grace-period-seconds",
            "0",
        ],
        &resched_log,
    )?);
    let synced = logged(
        &resched_log,
        "rescheduler running",
        Duration::from_secs(300),
    )
    .await?;
    let rescheduler = children.0[0].id();
    let mut plugin =
        |mode: &str, node: &str, extra: &[&str]| -> anyhow::Result<(u32, std::path::PathBuf)> {
            let state = dir.path().join(format!("{mode}-state"));
            std::fs::create_dir_all(&state)?;
            let endpoint = format!(
                "unix://{}",
                dir.path().join(format!("{mode}.sock")).display()
            );
            let log = dir.path().join(format!("{mode}.log"));
            let mut args = vec![
                "--endpoint",
                &endpoint,
                "--mode",
                mode,
                "--node-id",
                node,
                "--state-dir",
                state.to_str().expect("a UTF-8 path"),
                "--kube-api",
                "on",
                "--kubeconfig",
                kubeconfig,
            ];
            args.extend_from_slice(extra);
            let child = spawn_binary(&args, &log)?;
            let pid = child.id();
            children.0.push(child);
            Ok((pid, log))
        };
    let (controller, _) = plugin("controller", "cp-00001", &["--summarize-prefetches"])?;
    let (node_plugin, node_log) = plugin("all", "cp-00002", &["--prefetch"])?;
    logged(
        &node_log,
        "keeping ModelPrefetch models warm on this node",
        Duration::from_secs(120),
    )
    .await?;
    // What a watch of every PVC or Node has cost each once it is in.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let gone = &names[0];
    let theirs: Vec<String> = (0..claims)
        .filter(|j| j % nodes == 0)
        .map(|j| format!("c-{j:05}"))
        .collect();
    let freed = |pvcs: Api<PersistentVolumeClaim>, node: String, theirs: Vec<String>| async move {
        for name in theirs {
            let pvc = pvcs.get(&name).await?;
            if pvc.annotations().get("volume.kubernetes.io/selected-node") == Some(&node) {
                return anyhow::Ok(false);
            }
        }
        anyhow::Ok(true)
    };
    anyhow::ensure!(
        !freed(pvcs.clone(), gone.clone(), theirs.clone()).await?,
        "{gone}'s PVCs were freed already"
    );
    csinodes.delete(gone, &Default::default()).await?;
    let t0 = Instant::now();
    while !freed(pvcs.clone(), gone.clone(), theirs.clone()).await? {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(300),
            "{gone}'s PVCs were never freed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let reaction = t0.elapsed();
    for (what, pid) in [
        ("rescheduler", rescheduler),
        ("controller --summarize-prefetches", controller),
        ("node plugin --prefetch", node_plugin),
    ] {
        let (rss, hwm) = memory(pid);
        println!(
            "control, {nodes} nodes and {claims} PVCs: {what}: RSS {rss:.1} MiB, peak {hwm:.1} MiB"
        );
    }
    println!(
        "control: the rescheduler's informers were in {:.1} s after it started; it freed the \
         {} PVCs of a node whose driver went in {:.2} s (checked every 0.2 s)",
        synced.as_secs_f64(),
        theirs.len(),
        reaction.as_secs_f64()
    );
    drop(children);
    Ok(())
}
