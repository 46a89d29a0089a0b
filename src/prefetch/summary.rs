//! The controller's summary of each ModelPrefetch: of the nodes it selects
//! that run this driver, how many hold the model (their warm label says
//! so) and how many failed (their own lines), kept in its status as counts
//! and a `Ready` condition, so that `kubectl get` shows a rollout's
//! progress and `kubectl wait --for=condition=Ready` waits for it.
//!
//! Only the controller sees which nodes should hold the model (the
//! selector against every Node whose CSINode lists the driver), so the
//! summary is the controller's. It is written when it changes, at most once
//! every `WRITE_GAP` unless Ready turns: a rollout over a thousand nodes
//! is a few writes a minute, each of them seen by every node's watch.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

use super::labels;
use super::resource::{self, ModelPrefetch, NodeStatus, Phase};

/// Every summary is looked at again this often, whatever changed.
const RESYNC: Duration = Duration::from_secs(60);
/// The field manager of the summary's fields (nodes own their lines).
const MANAGER: &str = "modelcache.csi.io/controller";
/// The condition `kubectl wait` waits on.
pub const READY: &str = "Ready";
/// Nodes named in a message, at most (the rest are counted).
const NAMED: usize = 5;
/// Between two writes of one summary, at least, unless Ready turns.
const WRITE_GAP: Duration = Duration::from_secs(5);
/// A line of a node the object does not select is taken out once it is
/// this old (younger, its node may only be missing from the informers).
const STALE_AFTER: Duration = Duration::from_secs(120);

/// A ModelPrefetch's summary: counts and its Ready condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Selected nodes that run the driver.
    pub desired: u32,
    /// Of those, the ones that hold the model.
    pub ready: u32,
    /// Of those, the ones whose line says their pull failed (at most the
    /// lines the status lists).
    pub failed: u32,
    pub is_ready: bool,
    pub reason: &'static str,
    pub message: String,
}

/// The summary of `mp` over `nodes`: each node running `driver`, with
/// its labels.
pub fn summarize(
    mp: &ModelPrefetch,
    nodes: &BTreeMap<String, BTreeMap<String, String>>,
    driver: &str,
) -> Summary {
    let not = |reason, message: String| Summary {
        desired: 0,
        ready: 0,
        failed: 0,
        is_ready: false,
        reason,
        message,
    };
    let selector = mp.spec.node_selector.as_ref();
    // An invalid selector is invalid with no node to try it on too.
    if let Err(m) = resource::selects(selector, &BTreeMap::new()) {
        return not("InvalidSelector", m);
    }
    let class = &mp.spec.storage_class_name;
    if !labels::labelable(class) {
        return not(
            "ClassNameTooLong",
            format!(
                "spec.storageClassName: {class:?} has {} characters, and a node says it holds a \
                 class's model with the label {}<class>, whose name takes at most 63: give the \
                 StorageClass a shorter name",
                class.len(),
                labels::prefix(driver)
            ),
        );
    }
    let mut desired = Vec::new();
    for (name, labels) in nodes {
        match resource::selects(selector, labels) {
            Ok(true) => desired.push((name.as_str(), labels)),
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
    let phase = |n: &str| lines.get(n).map(|l| l.phase);
    let warm = format!("{}{class}", labels::prefix(driver));
    // A line that says Ready is an older driver's way of saying it.
    let holds = |n: &str, labels: &BTreeMap<String, String>| {
        labels.get(&warm).is_some_and(|v| v == "true") || phase(n) == Some(Phase::Ready)
    };
    let ready = desired.iter().filter(|(n, l)| holds(n, l)).count();
    let failed: Vec<&str> = desired
        .iter()
        .filter(|(n, l)| !holds(n, l) && phase(n) == Some(Phase::Failed))
        .map(|(n, _)| *n)
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
        // Past the listed lines, nodes fail in their logs only.
        let at_least = if lines.len() >= super::LISTED_FAILURES {
            "at least "
        } else {
            ""
        };
        (
            false,
            "Failed",
            format!(
                "{at_least}{} of {total} selected nodes failed; {first}: {why}",
                failed.len()
            ),
        )
    } else {
        let waiting: Vec<&str> = desired
            .iter()
            .filter(|(n, l)| !holds(n, l))
            .map(|(n, _)| *n)
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
        failed: failed.len() as u32,
        is_ready,
        reason,
        message,
    }
}

/// The nodes whose lines the controller takes out of `mp`'s status: nodes
/// it no longer selects, that no longer run the driver or left the
/// cluster, whose line was written `STALE_AFTER` before `now` or earlier.
/// Such a node cannot take its own line out, and each line holds one of
/// the places `LISTED_FAILURES` keeps for failures. None while the
/// selector is invalid: every node's line says so then.
pub fn stale_lines(
    mp: &ModelPrefetch,
    nodes: &BTreeMap<String, BTreeMap<String, String>>,
    now: k8s_openapi::jiff::Timestamp,
) -> Vec<String> {
    let selector = mp.spec.node_selector.as_ref();
    if resource::selects(selector, &BTreeMap::new()).is_err() {
        return Vec::new();
    }
    let old = |l: &NodeStatus| {
        l.updated
            .as_deref()
            .and_then(|at| at.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .is_none_or(|at| {
                now.duration_since(at)
                    .try_into()
                    .is_ok_and(|age: Duration| age >= STALE_AFTER)
            })
    };
    mp.status
        .iter()
        .flat_map(|s| s.nodes.iter())
        .filter(|l| {
            let selected = nodes
                .get(&l.node)
                .is_some_and(|labels| resource::selects(selector, labels) == Ok(true));
            !selected && old(l)
        })
        .map(|l| l.node.clone())
        .collect()
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
        && st.failed_nodes.unwrap_or(0) == s.failed
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
    /// When each summary was last written, by the object's name.
    written: Mutex<HashMap<String, Instant>>,
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
#[error("writing the status of ModelPrefetch {name}: {why}")]
struct WriteFailed {
    name: String,
    why: String,
}

async fn reconcile(mp: Arc<ModelPrefetch>, ctx: Arc<Ctx>) -> Result<Action, WriteFailed> {
    let name = mp.name_any();
    let api = Api::<ModelPrefetch>::all(ctx.client.clone());
    let lines = mp.status.as_ref().map_or(0, |s| s.nodes.len());
    if lines > resource::LINES_AT_MOST {
        // Older drivers' lines, one a node: past the CRD's bound no line
        // can change, not even to go, so they go together, and failed
        // nodes write theirs again at their next try.
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"nodes": null}})),
        )
        .await
        .map_err(|e| WriteFailed {
            name: name.clone(),
            why: e.to_string(),
        })?;
        info!(prefetch = %name, lines, "took out older drivers' lines past the CRD's bound");
        return Ok(Action::await_change());
    }
    let nodes = ctx.driver_nodes();
    for node in stale_lines(&mp, &nodes, k8s_openapi::jiff::Timestamp::now()) {
        // As the line's own field manager: the apply takes out what it owns.
        super::report(&ctx.client, &node, &name, None)
            .await
            .map_err(|e| WriteFailed {
                name: name.clone(),
                why: e.to_string(),
            })?;
        info!(prefetch = %name, %node, "took out the line of a node not selected or gone");
    }
    let s = summarize(&mp, &nodes, &ctx.driver);
    if says(&mp, &s) {
        return Ok(Action::requeue(RESYNC));
    }
    if let Some(wait) = too_soon(&ctx, &mp, &s) {
        return Ok(Action::requeue(wait));
    }
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", resource::GROUP, resource::VERSION),
        "kind": resource::KIND,
        "metadata": {"name": name},
        "status": {
            "desiredNodes": s.desired,
            "readyNodes": s.ready,
            "failedNodes": s.failed,
            "conditions": [condition(&mp, &s)],
        },
    });
    api.patch_status(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|e| WriteFailed {
        name: name.clone(),
        why: e.to_string(),
    })?;
    ctx.written
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(name.clone(), Instant::now());
    info!(prefetch = %name, ready = s.ready, failed = s.failed, desired = s.desired, reason = s.reason, "summary written");
    Ok(Action::requeue(RESYNC))
}

/// How long `mp`'s summary waits before it is written again: counts move
/// at most every `WRITE_GAP`, while Ready turning is written at once.
fn too_soon(ctx: &Ctx, mp: &ModelPrefetch, s: &Summary) -> Option<Duration> {
    let turns = mp
        .status
        .iter()
        .flat_map(|st| st.conditions.iter())
        .find(|c| c.type_ == READY)
        .is_none_or(|c| c.status != status_word(s.is_ready));
    if turns {
        return None;
    }
    let written = ctx.written.lock().unwrap_or_else(|p| p.into_inner());
    WRITE_GAP.checked_sub(written.get(&mp.name_any())?.elapsed())
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
        written: Mutex::new(HashMap::new()),
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

    const DRIVER: &str = "modelcache.csi.io";
    /// The label a node carries once it holds class `c`'s model.
    const WARM: (&str, &str) = ("warm.modelcache.csi.io/c", "true");

    #[test]
    fn ready_once_every_selected_node_with_the_driver_is_warm() {
        let cluster = nodes(&[
            ("a", &[("pool", "gpu"), WARM]),
            ("b", &[("pool", "gpu")]),
            ("c", &[("pool", "cpu")]),
        ]);
        let s = summarize(&prefetch(gpus(), &[]), &cluster, DRIVER);
        assert_eq!(
            (s.desired, s.ready, s.failed, s.is_ready, s.reason),
            (2, 1, 0, false, "Pulling")
        );
        assert!(s.message.contains("waiting for b"), "{}", s.message);
        // Another driver's warm label is not this one's.
        let other = nodes(&[("b", &[("pool", "gpu"), ("warm.other.csi.io/c", "true")])]);
        assert_eq!(summarize(&prefetch(gpus(), &[]), &other, DRIVER).ready, 0);
        // Lines of nodes the selector does not pick do not count.
        let cluster = nodes(&[
            ("a", &[("pool", "gpu"), WARM]),
            ("b", &[("pool", "gpu"), WARM]),
            ("c", &[("pool", "cpu")]),
        ]);
        let s = summarize(
            &prefetch(gpus(), &[("c", Phase::Failed, "x")]),
            &cluster,
            DRIVER,
        );
        assert_eq!(
            (s.desired, s.ready, s.failed, s.is_ready, s.reason),
            (2, 2, 0, true, "Ready")
        );
    }

    #[test]
    fn an_older_drivers_ready_line_counts_and_a_warm_node_has_not_failed() {
        let cluster = nodes(&[("a", &[]), ("b", &[WARM])]);
        let mp = prefetch(
            None,
            &[("a", Phase::Ready, ""), ("b", Phase::Failed, "earlier")],
        );
        let s = summarize(&mp, &cluster, DRIVER);
        assert_eq!((s.ready, s.failed, s.reason), (2, 0, "Ready"));
    }

    #[test]
    fn a_failed_node_no_node_or_a_bad_selector_is_said_with_its_reason() {
        let cluster = nodes(&[("a", &[("pool", "gpu"), WARM]), ("b", &[("pool", "gpu")])]);
        let failed = prefetch(gpus(), &[("b", Phase::Failed, "not enough free storage")]);
        let s = summarize(&failed, &cluster, DRIVER);
        assert_eq!((s.is_ready, s.failed, s.reason), (false, 1, "Failed"));
        assert!(
            s.message
                .starts_with("1 of 2 selected nodes failed; b: not enough free storage"),
            "{}",
            s.message
        );

        let none = summarize(&prefetch(gpus(), &[]), &nodes(&[("c", &[])]), DRIVER);
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
            let s = summarize(&prefetch(bad.clone(), &[]), &cluster, DRIVER);
            assert_eq!(s.reason, "InvalidSelector");
            assert!(s.message.contains("Near"), "{}", s.message);
        }
    }

    #[test]
    fn failures_past_the_listed_lines_are_counted_as_a_floor() {
        let names: Vec<String> = (0..100).map(|i| format!("n{i:03}")).collect();
        let cluster = names.iter().map(|n| (n.clone(), BTreeMap::new())).collect();
        let lines: Vec<(&str, Phase, &str)> = names[..super::super::LISTED_FAILURES]
            .iter()
            .map(|n| (n.as_str(), Phase::Failed, "no space"))
            .collect();
        let s = summarize(&prefetch(None, &lines), &cluster, DRIVER);
        assert_eq!(s.failed as usize, super::super::LISTED_FAILURES);
        assert!(
            s.message
                .starts_with("at least 32 of 100 selected nodes failed; n000: no space"),
            "{}",
            s.message
        );
    }

    #[test]
    fn a_class_name_no_label_can_carry_is_refused_by_field() {
        let mut mp = prefetch(None, &[]);
        mp.spec.storage_class_name = "x".repeat(64);
        let s = summarize(&mp, &nodes(&[("a", &[])]), DRIVER);
        assert_eq!((s.is_ready, s.reason), (false, "ClassNameTooLong"));
        assert!(
            s.message.starts_with("spec.storageClassName: ") && s.message.contains("64 characters"),
            "{}",
            s.message
        );
    }

    #[test]
    fn many_waiting_nodes_are_named_a_few_and_counted() {
        let names: Vec<String> = (0..40).map(|i| format!("node-{i:02}")).collect();
        let cluster = names.iter().map(|n| (n.clone(), BTreeMap::new())).collect();
        let s = summarize(&prefetch(None, &[]), &cluster, DRIVER);
        assert!(s.message.ends_with("node-04 and 35 more"), "{}", s.message);
    }

    #[test]
    fn an_unchanged_summary_is_not_written_again() {
        let cluster = nodes(&[("a", &[WARM])]);
        let mut mp = prefetch(None, &[]);
        let s = summarize(&mp, &cluster, DRIVER);
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

    #[test]
    fn old_lines_of_nodes_not_selected_or_gone_are_taken_out() {
        let now: k8s_openapi::jiff::Timestamp = "2026-12-07T10:00:00Z".parse().unwrap();
        let at = |s: &str| Some(s.to_string());
        let mut mp = prefetch(gpus(), &[]);
        let line = |n: &str, updated: Option<String>| NodeStatus {
            node: n.into(),
            phase: Phase::Failed,
            updated,
            ..Default::default()
        };
        mp.status.as_mut().unwrap().nodes = vec![
            line("kept", at("2020-01-01T00:00:00Z")),
            line("cpu", at("2026-12-07T09:57:59Z")),
            line("gone", None),
            line("young", at("2026-12-07T09:59:00Z")),
        ];
        let cluster = nodes(&[("kept", &[("pool", "gpu")]), ("cpu", &[("pool", "cpu")])]);
        assert_eq!(stale_lines(&mp, &cluster, now), ["cpu", "gone"]);
        mp.spec.node_selector = Some(LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "pool".into(),
                operator: "Near".into(),
                values: None,
            }]),
            ..Default::default()
        });
        assert!(stale_lines(&mp, &cluster, now).is_empty());
    }
}
