//! Whether a PVC's selected node should be cleared: a pure function of what
//! the informers show, so every path is unit-tested without a cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;

use super::Config;

pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
const PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
const PROVISIONER_BETA: &str = "volume.beta.kubernetes.io/storage-provisioner";

/// Everything `decide` looks at, gathered from the informers.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub pvc: PersistentVolumeClaim,
    /// The provisioner of the PVC's StorageClass, if the class exists.
    pub class_provisioner: Option<String>,
    pub node_exists: bool,
    pub node_labels: BTreeMap<String, String>,
    /// The node's CSINode lists this driver.
    pub driver_registered: bool,
    /// How long the node's Ready condition has not been True; `None` while
    /// it is. A node whose kubelet died keeps its CSINode, so registration
    /// alone cannot tell a live driver from a dead node's record.
    pub node_not_ready_for: Option<Duration>,
    /// Some PV's claimRef points at this PVC.
    pub pv_bound: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not ours to touch, or fine as it is.
    Ignore,
    /// The driver should come; look again after this long.
    Wait(Duration),
    Reschedule {
        /// A short label for metrics: node-missing, node-not-selected, node-not-ready, driver-missing.
        reason: &'static str,
        message: String,
    },
}

/// Decides for one PVC; `waited` is how long it has been seen like this.
pub fn decide(cfg: &Config, o: &Observed, waited: Duration) -> Decision {
    let pvc = &o.pvc;
    let bound = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_ref())
        .is_some()
        || pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    if bound || o.pv_bound || pvc.metadata.deletion_timestamp.is_some() {
        return Decision::Ignore;
    }
    let ann = pvc.annotations();
    let provisioner = ann
        .get(PROVISIONER)
        .or_else(|| ann.get(PROVISIONER_BETA))
        .cloned()
        .or_else(|| o.class_provisioner.clone());
    if provisioner.as_deref() != Some(cfg.driver_name.as_str()) {
        return Decision::Ignore;
    }
    let Some(node) = ann.get(SELECTED_NODE) else {
        return Decision::Ignore;
    };
    if o.driver_registered && o.node_not_ready_for.is_none() {
        return Decision::Ignore;
    }
    if !o.node_exists {
        return Decision::Reschedule {
            reason: "node-missing",
            message: format!(
                "node {node} selected for this claim does not exist; cleared {SELECTED_NODE} so the scheduler picks another node"
            ),
        };
    }
    let unmatched: Vec<String> = cfg
        .node_selector
        .iter()
        .filter(|(k, v)| o.node_labels.get(*k) != Some(*v))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if !unmatched.is_empty() {
        return Decision::Reschedule {
            reason: "node-not-selected",
            message: format!(
                "node {node} does not match the {} node selector ({}), so its driver will never run there; cleared {SELECTED_NODE} so the scheduler picks another node",
                cfg.driver_name,
                unmatched.join(", ")
            ),
        };
    }
    if let Some(down) = o.node_not_ready_for.filter(|_| o.driver_registered) {
        // The node's own record says since when, which may predate this PVC.
        let waited = waited.max(down);
        if waited < cfg.grace {
            return Decision::Wait(cfg.grace - waited);
        }
        return Decision::Reschedule {
            reason: "node-not-ready",
            message: format!(
                "node {node} has not been Ready for {}s, so its {} driver cannot provision this claim; cleared {SELECTED_NODE} so the scheduler picks another node",
                waited.as_secs(),
                cfg.driver_name
            ),
        };
    }
    if waited < cfg.grace {
        return Decision::Wait(cfg.grace - waited);
    }
    Decision::Reschedule {
        reason: "driver-missing",
        message: format!(
            "the {} driver has not been registered on node {node} for {}s; cleared {SELECTED_NODE} so the scheduler picks another node",
            cfg.driver_name,
            waited.as_secs()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;

    fn cfg() -> Config {
        Config {
            driver_name: "modelcache.csi.io".into(),
            node_selector: BTreeMap::from([("kubernetes.io/os".into(), "linux".into())]),
            grace: Duration::from_secs(300),
            resync: Duration::from_secs(30),
            instance: None,
        }
    }

    fn pending(provisioner: &str, node: Option<&str>) -> Observed {
        let mut pvc = PersistentVolumeClaim::default();
        pvc.metadata.name = Some("p".into());
        let mut ann = BTreeMap::from([(PROVISIONER.to_string(), provisioner.to_string())]);
        if let Some(n) = node {
            ann.insert(SELECTED_NODE.into(), n.into());
        }
        pvc.metadata.annotations = Some(ann);
        pvc.spec = Some(PersistentVolumeClaimSpec::default());
        Observed {
            pvc,
            node_exists: true,
            node_labels: BTreeMap::from([("kubernetes.io/os".into(), "linux".into())]),
            ..Observed::default()
        }
    }

    #[test]
    fn every_path() {
        let c = cfg();
        let long = Duration::from_secs(301);
        // Not ours, bound, or no selected node: untouched.
        assert_eq!(
            decide(&c, &pending("other.csi.io", Some("n1")), long),
            Decision::Ignore
        );
        assert_eq!(
            decide(&c, &pending("modelcache.csi.io", None), long),
            Decision::Ignore
        );
        let mut bound = pending("modelcache.csi.io", Some("n1"));
        bound.pvc.spec.as_mut().unwrap().volume_name = Some("pv".into());
        assert_eq!(decide(&c, &bound, long), Decision::Ignore);
        let mut pv = pending("modelcache.csi.io", Some("n1"));
        pv.pv_bound = true;
        assert_eq!(decide(&c, &pv, long), Decision::Ignore);
        // The class decides when the annotation is absent.
        let mut by_class = pending("x", Some("n1"));
        by_class
            .pvc
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(PROVISIONER);
        by_class.class_provisioner = Some("modelcache.csi.io".into());
        by_class.node_exists = false;
        assert!(matches!(
            decide(&c, &by_class, long),
            Decision::Reschedule {
                reason: "node-missing",
                ..
            }
        ));
        // 1. registered: untouched.
        let mut ok = pending("modelcache.csi.io", Some("n1"));
        ok.driver_registered = true;
        assert_eq!(decide(&c, &ok, long), Decision::Ignore);
        // 2. node missing: at once.
        let mut gone = pending("modelcache.csi.io", Some("n1"));
        gone.node_exists = false;
        assert!(matches!(
            decide(&c, &gone, Duration::ZERO),
            Decision::Reschedule {
                reason: "node-missing",
                ..
            }
        ));
        // 3. outside the selector: at once, naming the label.
        let mut other = pending("modelcache.csi.io", Some("n1"));
        other.node_labels.clear();
        match decide(&c, &other, Duration::ZERO) {
            Decision::Reschedule { reason, message } => {
                assert_eq!(reason, "node-not-selected");
                assert!(message.contains("kubernetes.io/os=linux"), "{message}");
            }
            d => panic!("{d:?}"),
        }
        // 4. should run but does not: wait out the grace, then reschedule.
        let waiting = pending("modelcache.csi.io", Some("n1"));
        assert_eq!(
            decide(&c, &waiting, Duration::from_secs(100)),
            Decision::Wait(Duration::from_secs(200))
        );
        assert!(matches!(
            decide(&c, &waiting, long),
            Decision::Reschedule {
                reason: "driver-missing",
                ..
            }
        ));
        // 5. registered on a node that is not Ready: the CSINode of a dead
        // node outlives it. Grace counts from the node's own transition.
        let mut dead = pending("modelcache.csi.io", Some("n1"));
        dead.driver_registered = true;
        dead.node_not_ready_for = Some(Duration::from_secs(60));
        assert_eq!(
            decide(&c, &dead, Duration::from_secs(10)),
            Decision::Wait(Duration::from_secs(240))
        );
        dead.node_not_ready_for = Some(long);
        match decide(&c, &dead, Duration::ZERO) {
            Decision::Reschedule { reason, message } => {
                assert_eq!(reason, "node-not-ready");
                assert!(message.contains("not been Ready for 301s"), "{message}");
            }
            d => panic!("{d:?}"),
        }
        // Being deleted: untouched.
        let mut deleting = gone.clone();
        deleting.pvc.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        assert_eq!(decide(&c, &deleting, long), Decision::Ignore);
    }
}
