//! What the driver's PVC informers cost when tenants make PVCs fat: a PVC
//! may carry 256 KiB of annotations and stay Pending for free, and the
//! node agent (`--modify-node-local-volumes`) watches every PVC of the
//! cluster from every node. Against a real kube-apiserver, 2,000 Pending
//! PVCs with 64 KiB of annotations each (128 MiB in all) must leave the
//! driver's resident memory under `RSS_BOUND`.

use crate::support::apiserver;
use crate::support::harness::*;

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::PostParams;
use kube::{Api, Client};

const PVCS: usize = 2_000;
const FAT: usize = 64 << 10;
/// The driver, idle, is well under 64 MiB; whole PVC objects would add
/// the 128 MiB of annotations and more.
const RSS_BOUND: u64 = 96 << 20;

fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

async fn client(api: &apiserver::ApiServer) -> Client {
    let kc = kube::config::Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    Client::try_from(
        kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap(),
    )
    .unwrap()
}

fn fat_pvc(i: usize) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": format!("fat-{i}"),
            "annotations": {"team.example/notes": format!("{i}-{}", "x".repeat(FAT))},
            "labels": {"team.example/tier": "fat"},
        },
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": "none-such",
        },
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fat_pending_pvcs_stay_out_of_the_drivers_memory() {
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let d = Driver::start_against(&api, &["--modify-node-local-volumes"]).await;
    let idle = rss_of(d.pid());
    let c = client(&api).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(c, "default");
    let t0 = Instant::now();
    let mut pending = futures::stream::iter((0..PVCS).map(|i| {
        let pvcs = pvcs.clone();
        async move { pvcs.create(&PostParams::default(), &fat_pvc(i)).await }
    }))
    .buffer_unordered(8);
    while let Some(r) = pending.next().await {
        r.expect("create a fat PVC");
    }
    let created = t0.elapsed();
    // The watch has seen the last one when a fresh list agrees on the
    // count; then give the informer a moment to store them all.
    let listed = pvcs.list_metadata(&Default::default()).await.unwrap();
    assert_eq!(listed.items.len(), PVCS);
    let mut peak = 0;
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(10) {
        peak = peak.max(rss_of(d.pid()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mib = |b: u64| b as f64 / 1048576.0;
    eprintln!(
        "{PVCS} PVCs of {} KiB created in {:.1}s; driver RSS idle {:.1} MiB, after {:.1} MiB (bound {:.0} MiB)",
        FAT >> 10,
        created.as_secs_f64(),
        mib(idle),
        mib(peak),
        mib(RSS_BOUND)
    );
    assert!(
        peak < RSS_BOUND,
        "the driver holds {:.1} MiB with {PVCS} fat PVCs in the cluster",
        mib(peak)
    );
}

/// The job sweeper's question about an inline volume's pod, asked with
/// only `list pods` (the driver may not get one): there, deleting, gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_volumes_pod_is_found_by_listing() {
    use k8s_openapi::api::core::v1::Pod;
    use modelcache_csi::error::Error;
    let api = apiserver::ApiServer::start().expect("start apiserver");
    let c = client(&api).await;
    let kube = modelcache_csi::kubeapi::KubeApi::new(c.clone(), "modelcache.csi.io", None);
    let pods: Api<Pod> = Api::namespaced(c, "default");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "reader", "finalizers": ["example.com/hold"]},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    assert!(!kube.pod_deleting("default", "reader").await.unwrap());
    pods.delete("reader", &Default::default()).await.unwrap();
    // The finalizer holds it, being deleted: the pull is no longer wanted.
    assert!(kube.pod_deleting("default", "reader").await.unwrap());
    let e = kube.pod_deleting("default", "absent").await.unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
}
