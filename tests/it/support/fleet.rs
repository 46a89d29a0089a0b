//! A simulated fleet in a real apiserver: each node's peer Lease and the
//! records of what it holds, written as its driver writes them (or, for
//! comparison, one Lease per node listing every model it holds, as the
//! directory did before records), and what one node's discovery of a
//! model costs the apiserver, read from the apiserver's own metrics.
//!
//! Shared by the regression test (tests/it/fleet.rs) and the benchmark
//! (tests/bench/fleet.rs).

use std::collections::BTreeMap;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{ListParams, PostParams};
use modelcache_csi::peer::directory::records::{self, Holding, NODE_LABEL};
use modelcache_csi::peer::directory::{Directory, LABEL, peer_lease};

use super::apiserver::ApiServer;

pub const DRIVER: &str = "fleet.csi.test";
pub const PIN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
/// The model every simulated node holds: a rollout's model, once done.
pub const POPULAR: &str = "m0000000000000000000000000000001";

/// How nodes say what they hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A small peer Lease per node and a record per model it holds.
    Records,
    /// One Lease per node whose annotation lists every model it holds.
    Annotations,
}

pub const LEASES: &str = "leases";

/// What the apiserver served for one resource (Leases unless said), by
/// verb: (requests, bytes).
#[derive(Clone, Debug, Default)]
pub struct Served(pub BTreeMap<String, (f64, f64)>);

impl Served {
    /// What was served so far for `resource` (a plural, as in its URL).
    pub fn of(api: &ApiServer, resource: &str) -> Served {
        let wanted = format!("resource=\"{resource}\"");
        let out = api.kubectl(&["get", "--raw", "/metrics"]);
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut by_verb: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for line in text.lines() {
            let (is_count, rest) = if let Some(r) = line.strip_prefix("apiserver_request_total{") {
                (true, r)
            } else if let Some(r) = line.strip_prefix("apiserver_response_sizes_sum{") {
                (false, r)
            } else {
                continue;
            };
            if !rest.contains(&wanted) {
                continue;
            }
            let Some(verb) = rest
                .split("verb=\"")
                .nth(1)
                .and_then(|v| v.split('"').next())
            else {
                continue;
            };
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            let e = by_verb.entry(verb.to_string()).or_default();
            if is_count {
                e.0 += value;
            } else {
                e.1 += value;
            }
        }
        Served(by_verb)
    }

    /// Read until two reads agree: a request's metrics are recorded as
    /// its answer goes out, so the last one can land just after its
    /// client has it (20 reads at most, 100 ms apart).
    pub fn settled(api: &ApiServer) -> Served {
        Served::settled_of(api, LEASES)
    }

    /// `of`, read until two reads agree.
    pub fn settled_of(api: &ApiServer, resource: &str) -> Served {
        let mut last = Served::of(api, resource);
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let next = Served::of(api, resource);
            if next.0 == last.0 {
                return next;
            }
            last = next;
        }
        last
    }

    /// What was served between `before` and this.
    pub fn since(&self, before: &Served) -> Served {
        Served(
            self.0
                .iter()
                .map(|(verb, (n, b))| {
                    let (n0, b0) = before.0.get(verb).copied().unwrap_or_default();
                    (verb.clone(), (n - n0, b - b0))
                })
                .filter(|(_, (n, _))| *n > 0.0)
                .collect(),
        )
    }

    pub fn verb(&self, verb: &str) -> (f64, f64) {
        self.0.get(verb).copied().unwrap_or_default()
    }

    /// Every verb but the apiserver's own identity Lease's renewals (PUT).
    pub fn ours(&self) -> (f64, f64) {
        self.0
            .iter()
            .filter(|(v, _)| v.as_str() != "PUT")
            .fold((0.0, 0.0), |(n, b), (_, (vn, vb))| (n + vn, b + vb))
    }
}

/// The id of the `i`th other model of node `n`.
fn model(n: usize, i: usize) -> String {
    format!("m{:015x}{:016x}", n + 1, i + 2)
}

fn node_name(n: usize) -> String {
    format!("sim-{n:05}")
}

/// The objects node `n` of a fleet writes: it holds `POPULAR` and
/// `others` other models.
fn objects(n: usize, others: usize, layout: Layout) -> Vec<serde_json::Value> {
    let node = node_name(n);
    let addr = format!("10.{}.{}.{}:7420", n >> 16 & 255, n >> 8 & 255, n & 255);
    // As a driver writes it, standing for an hour: writing a large fleet
    // takes minutes.
    let mut lease = peer_lease(DRIVER, &node, &addr, PIN, None);
    lease["spec"]["leaseDurationSeconds"] = 3600.into();
    let held = std::iter::once(POPULAR.to_string()).chain((0..others).map(|i| model(n, i)));
    match layout {
        Layout::Records => std::iter::once(lease)
            .chain(held.map(|sid| records::record(DRIVER, &node, &sid, Holding::Sealed, None)))
            .collect(),
        Layout::Annotations => {
            // One Lease listing every model, as the directory wrote it
            // before records.
            let ann = &mut lease["metadata"]["annotations"];
            ann["modelcache.csi.io/models"] = held.collect::<Vec<_>>().join(" ").into();
            ann["modelcache.csi.io/pulling"] = "".into();
            lease["metadata"]["labels"]
                .as_object_mut()
                .expect("labels")
                .remove(NODE_LABEL);
            vec![lease]
        }
    }
}

/// Writes a fleet of `nodes` nodes, each holding `POPULAR` and `others`
/// other models, into namespace `ns` (created), 32 writes at a time.
pub async fn populate(
    api: &ApiServer,
    client: &kube::Client,
    ns: &str,
    nodes: usize,
    others: usize,
    layout: Layout,
) {
    let out = api.kubectl(&["create", "namespace", ns]);
    assert!(out.status.success(), "{out:?}");
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let all: Vec<serde_json::Value> = (0..nodes)
        .flat_map(|n| objects(n, others, layout))
        .collect();
    let mut writes = futures::stream::iter(all.into_iter().map(|o| {
        let leases = leases.clone();
        async move {
            let lease: Lease = serde_json::from_value(o).expect("a Lease");
            leases.create(&PostParams::default(), &lease).await
        }
    }))
    .buffer_unordered(32);
    while let Some(r) = writes.next().await {
        r.expect("create a simulated node's Lease");
    }
}

/// One node's directory in namespace `ns`, holding nothing.
pub fn probe(client: &kube::Client, ns: &str, node: &str) -> Directory {
    Directory::new(
        client.clone(),
        ns,
        node.to_string(),
        DRIVER,
        "127.0.0.1:7420".to_string(),
        PIN.to_string(),
        Vec::new(),
    )
}

/// What the apiserver served for one node asking who holds `POPULAR`,
/// and how many live holders it was told of.
pub async fn ask(
    api: &ApiServer,
    client: &kube::Client,
    ns: &str,
    layout: Layout,
) -> (Served, usize) {
    let before = Served::settled(api);
    let holders = match layout {
        Layout::Records => probe(client, ns, "probe")
            .holders(POPULAR, true)
            .await
            .len(),
        // The query every pull made before records: every peer Lease.
        Layout::Annotations => {
            let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
            let listed = leases
                .list(&ListParams::default().labels(&format!("{LABEL}={DRIVER}")))
                .await
                .expect("list peer Leases");
            listed
                .items
                .iter()
                .filter(|l| {
                    l.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get("modelcache.csi.io/models"))
                        .is_some_and(|m| m.split(' ').any(|s| s == POPULAR))
                })
                .count()
        }
    };
    (Served::settled(api).since(&before), holders)
}
