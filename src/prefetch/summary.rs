//! The controller's summary of each ModelPrefetch: of the nodes it selects
//! that run this driver, how many hold the model Ready, kept in its status
//! as counts and a `Ready` condition, so that `kubectl get` shows a
//! rollout's progress and `kubectl wait --for=condition=Ready` waits for it.
//!
//! Nodes write their own lines (`prefetch`); only the controller sees which
//! nodes should have written one (the selector against every Node whose
//! CSINode lists the driver), so the summary is the controller's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSINode;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tracing::{info, warn};

use super::resource::{self, ModelPrefetch, NodeStatus, Phase};

/// Every summary is looked at again this often, whatever changed.
const RESYNC: Duration = Duration::from_secs(60);
/// The field manager of the summary's fields (nodes own their lines).
const MANAGER: &str = "modelcache.csi.io/controller";
/// The condition `kubectl wait` waits on.
pub const READY: &str = "Ready";
/// Nodes named in a message, at most (the rest are counted).
const NAMED: usize = 5;

/// A ModelPrefetch's summary: counts and its Ready condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Selected nodes that run the driver.
    pub desired: u32,
    /// Of those, the ones whose line says Ready.
    pub ready: u32,
    pub is_ready: bool,
    pub reason: &'static str,
    pub message: String,
}

/// The summary of `mp` over `nodes`: each node running the driver, with
/// its labels.
pub fn summarize(
    mp: &ModelPrefetch,
    nodes: &BTreeMap<String, BTreeMap<String, String>>,
) -> Summary {
    let not = |reason, message: String| Summary {
        desired: 0,
        ready: 0,
        is_ready: false,
        reason,
        message,
    };
    let selector = mp.spec.node_selector.as_ref();
    // An invalid selector is invalid with no node to try it on too.
    if let Err(m) = resource::selects(selector, &BTreeMap::new()) {
        return not("InvalidSelector", m);
    }
    let mut desired = Vec::new();
    for (name, labels) in nodes {
        match resource::selects(selector, labels) {
            Ok(true) => desired.push(name.as_str()),
            Ok(false) => {}
            Err(m) => return not("InvalidSelector", m),
        }
    }
    if desired.is_empty() {
        return not(
            "NoNodes",
            "no node that runs the driver matches spec.nodeSelector".into(),
        );
    }
    let lines: BTreeMap<&str, &NodeStatus> = mp
        .status
        .iter()
        .flat_map(|s| s.nodes.iter())
        .map(|l| (l.node.as_str(), l))
        .collect();
    let phase = |n: &str| lines.get(n).map_or(Phase::Pending, |l| l.phase);
    let ready = desired.iter().filter(|n| phase(n) == Phase::Ready).count();
    let failed: Vec<&str> = desired
        .iter()
        .copied()
        .filter(|n| phase(n) == Phase::Failed)
        .collect();
    let total = desired.len();
    let (is_ready, reason, message) = if ready == total {
        (
            true,
            "Ready",
            format!("the model is ready on all {total} selected nodes"),
        )
    } else if let Some(first) = failed.first() {
        let why = lines
            .get(first)
            .and_then(|l| l.message.as_deref())
            .unwrap_or("no reason given");
        (
            false,
            "Failed",
            format!(
                "{} of {total} selected nodes failed; {first}: {why}",
                failed.len()
            ),
        )
    } else {
        let waiting: Vec<&str> = desired
            .iter()
            .copied()
            .filter(|n| phase(n) != Phase::Ready)
            .collect();
        (
            false,
            "Pulling",
            format!(
                "{ready} of {total} selected nodes hold the model; waiting for {}",
                named(&waiting)
            ),
        )
    };
    Summary {
        desired: total as u32,
        ready: ready as u32,
        is_ready,
        reason,
        message,
    }
}

/// `nodes`, the first few by name and the rest counted.
fn named(nodes: &[&str]) -> String {
    let mut s = nodes[..nodes.len().min(NAMED)].join(", ");
    if nodes.len() > NAMED {
        s.push_str(&format!(" and {} more", nodes.len() - NAMED));
    }
    s
}

/// Whether `mp`'s status says `s` already.
fn says(mp: &ModelPrefetch, s: &Summary) -> bool {
    let Some(st) = &mp.status else {
        return false;
    };
    let cond = st.conditions.iter().find(|c| c.type_ == READY);
    st.desired_nodes == Some(s.desired)
        && st.ready_nodes == Some(s.ready)
        && cond.is_some_and(|c| {
            c.status == status_word(s.is_ready)
                && c.reason == s.reason
                && c.message == s.message
                && c.observed_generation == mp.metadata.generation
        })
}

fn status_word(ready: bool) -> String {
    if ready { "True" } else { "False" }.to_string()
}

/// The Ready condition for `s`, keeping when it last changed if its status
/// did not.
fn condition(mp: &ModelPrefetch, s: &Summary) -> Condition {
    let status = status_word(s.is_ready);
    let since = mp
        .status
        .iter()
        .flat_map(|st| st.conditions.iter())
        .find(|c| c.type_ == READY && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    Condition {
        type_: READY.to_string(),
        status,
        reason: s.reason.to_string(),
        message: s.message.clone(),
        last_transition_time: since,
        observed_generation: mp.metadata.generation,
    }
}

struct Ctx {
    client: Client,
    driver: String,
    /// Nodes' metadata only: their labels are all a selector reads.
    nodes: Store<PartialObjectMeta<Node>>,
    csinodes: Store<CSINode>,
}

impl Ctx {
    /// The nodes whose CSINode lists the driver, with their labels.
    fn driver_nodes(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.csinodes
            .state()
            .iter()
            .filter(|c| c.spec.drivers.iter().any(|d| d.name == self.driver))
            .filter_map(|c| {
                let node = self.nodes.get(&reflector::ObjectRef::new(&c.name_any()))?;
                Some((node.name_any(), node.labels().clone()))
            })
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("writing the summary of ModelPrefetch {name}: {source}")]
struct WriteFailed {
    name: String,
    source: kube::Error,
}

async fn reconcile(mp: Arc<ModelPrefetch>, ctx: Arc<Ctx>) -> Result<Action, WriteFailed> {
    let name = mp.name_any();
    let s = summarize(&mp, &ctx.driver_nodes());
    if says(&mp, &s) {
        return Ok(Action::requeue(RESYNC));
    }
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", resource::GROUP, resource::VERSION),
        "kind": resource::KIND,
        "metadata": {"name": name},
        "status": {
            "desiredNodes": s.desired,
            "readyNodes": s.ready,
            "conditions": [condition(&mp, &s)],
        },
    });
    Api::<ModelPrefetch>::all(ctx.client.clone())
        .patch_status(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| WriteFailed {
            name: name.clone(),
            source,
        })?;
    info!(prefetch = %name, ready = s.ready, desired = s.desired, reason = s.reason, "summary written");
    Ok(Action::requeue(RESYNC))
}

fn error_policy(_mp: Arc<ModelPrefetch>, err: &WriteFailed, _ctx: Arc<Ctx>) -> Action {
    warn!(error = %err, "retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Runs until the process ends.
pub async fn run(client: Client, driver: String) {
    let all = watcher::Config::default();
    let (nodes, nodes_changed) = crate::kubeapi::informer(watcher(
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        all.clone(),
    ));
    let (csinodes, csinodes_changed) =
        crate::kubeapi::informer(watcher(Api::<CSINode>::all(client.clone()), all));
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        driver,
        nodes: nodes.clone(),
        csinodes: csinodes.clone(),
    });
    // A summary over informers not yet listed would count too few nodes.
    let (nodes_changed, csinodes_changed) = (nodes_changed.boxed(), csinodes_changed.boxed());
    let changed = futures::stream::select(nodes_changed, csinodes_changed);
    let (tx, rx) = futures::channel::mpsc::channel::<()>(1);
    tokio::spawn(async move {
        let mut tx = tx;
        let mut changed = changed;
        while changed.next().await.is_some() {
            // Full: a resummary is queued already.
            let _ = tx.try_send(());
        }
    });
    for (what, store_ready) in [
        ("nodes", nodes.wait_until_ready().await.is_ok()),
        ("csinodes", csinodes.wait_until_ready().await.is_ok()),
    ] {
        if !store_ready {
            warn!(what, "informer never became ready");
        }
    }
    info!(driver = %ctx.driver, "summarizing ModelPrefetches");
    Controller::new(
        Api::<ModelPrefetch>::all(client),
        watcher::Config::default(),
    )
    // A node joining, leaving, relabelled or (un)registering the driver
    // changes which nodes every prefetch selects.
    .reconcile_all_on(rx)
    .run(reconcile, error_policy, ctx)
    .for_each(|_| async {})
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn prefetch(selector: Option<LabelSelector>, lines: &[(&str, Phase, &str)]) -> ModelPrefetch {
        let mut mp = ModelPrefetch::default();
        mp.spec.storage_class_name = "c".into();
        mp.spec.node_selector = selector;
        mp.status = Some(resource::PrefetchStatus {
            nodes: lines
                .iter()
                .map(|(n, p, m)| NodeStatus {
                    node: n.to_string(),
                    phase: *p,
                    message: (!m.is_empty()).then(|| m.to_string()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        });
        mp
    }

    fn nodes(spec: &[(&str, &[(&str, &str)])]) -> BTreeMap<String, BTreeMap<String, String>> {
        spec.iter()
            .map(|(n, labels)| {
                (
                    n.to_string(),
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                )
            })
            .collect()
    }

    fn gpus() -> Option<LabelSelector> {
        Some(LabelSelector {
            match_labels: Some([("pool".to_string(), "gpu".to_string())].into()),
            ..Default::default()
        })
    }

    #[test]
    fn ready_once_every_selected_node_with_the_driver_is() {
        let cluster = nodes(&[
            ("a", &[("pool", "gpu")]),
            ("b", &[("pool", "gpu")]),
            ("c", &[("pool", "cpu")]),
        ]);
        let pulling = prefetch(
            gpus(),
            &[("a", Phase::Ready, ""), ("b", Phase::Pulling, "")],
        );
        let s = summarize(&pulling, &cluster);
        assert_eq!(
            (s.desired, s.ready, s.is_ready, s.reason),
            (2, 1, false, "Pulling")
        );
        assert!(s.message.contains("waiting for b"), "{}", s.message);
        // A node that never wrote its line is waited for too.
        let silent = prefetch(gpus(), &[("a", Phase::Ready, "")]);
        assert_eq!(summarize(&silent, &cluster).reason, "Pulling");
        // Lines of nodes the selector does not pick do not count.
        let done = prefetch(
            gpus(),
            &[
                ("a", Phase::Ready, ""),
                ("b", Phase::Ready, ""),
                ("c", Phase::Failed, "x"),
            ],
        );
        let s = summarize(&done, &cluster);
        assert_eq!(
            (s.desired, s.ready, s.is_ready, s.reason),
            (2, 2, true, "Ready")
        );
    }

    #[test]
    fn a_failed_node_no_node_or_a_bad_selector_is_said_with_its_reason() {
        let cluster = nodes(&[("a", &[("pool", "gpu")]), ("b", &[("pool", "gpu")])]);
        let failed = prefetch(
            gpus(),
            &[
                ("a", Phase::Ready, ""),
                ("b", Phase::Failed, "not enough free storage"),
            ],
        );
        let s = summarize(&failed, &cluster);
        assert_eq!((s.is_ready, s.reason), (false, "Failed"));
        assert!(
            s.message.contains("b: not enough free storage"),
            "{}",
            s.message
        );

        let none = summarize(&prefetch(gpus(), &[]), &nodes(&[("c", &[])]));
        assert_eq!((none.desired, none.reason), (0, "NoNodes"));

        let bad = Some(LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "pool".into(),
                operator: "Near".into(),
                values: None,
            }]),
            ..Default::default()
        });
        for cluster in [nodes(&[]), cluster] {
            let s = summarize(&prefetch(bad.clone(), &[]), &cluster);
            assert_eq!(s.reason, "InvalidSelector");
            assert!(s.message.contains("Near"), "{}", s.message);
        }
    }

    #[test]
    fn many_waiting_nodes_are_named_a_few_and_counted() {
        let names: Vec<String> = (0..40).map(|i| format!("node-{i:02}")).collect();
        let cluster = names.iter().map(|n| (n.clone(), BTreeMap::new())).collect();
        let s = summarize(&prefetch(None, &[]), &cluster);
        assert!(s.message.ends_with("node-04 and 35 more"), "{}", s.message);
    }

    #[test]
    fn an_unchanged_summary_is_not_written_again() {
        let cluster = nodes(&[("a", &[])]);
        let mut mp = prefetch(None, &[("a", Phase::Ready, "")]);
        let s = summarize(&mp, &cluster);
        assert!(!says(&mp, &s));
        let st = mp.status.as_mut().unwrap();
        st.desired_nodes = Some(1);
        st.ready_nodes = Some(1);
        st.conditions = vec![condition(&prefetch(None, &[]), &s)];
        assert!(says(&mp, &s));
        // Its transition time stays while its status does.
        let kept = mp.status.as_ref().unwrap().conditions[0]
            .last_transition_time
            .clone();
        assert_eq!(condition(&mp, &s).last_transition_time, kept);
    }
}
