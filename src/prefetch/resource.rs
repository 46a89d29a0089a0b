//! The `ModelPrefetch` custom resource (deploy/csi-driver/base/
//! crd-modelprefetch.yaml): "keep the model of StorageClass C warm on the
//! nodes matching S", and a failed node's line in its status. Pure: types, the
//! label selector, and what a node should do.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::core::ClusterResourceScope;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "modelcache.csi.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "ModelPrefetch";
pub const PLURAL: &str = "modelprefetches";

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ModelPrefetch {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: PrefetchSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PrefetchStatus>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrefetchSpec {
    /// The StorageClass (of this driver) whose `source` is pulled, with its
    /// parameters and provisioner secret: what a PVC of that class would
    /// pull, so such a PVC on a warm node binds at once.
    pub storage_class_name: String,
    /// The nodes to warm; every node of the driver when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrefetchStatus {
    /// A line for each node whose pull failed (at most
    /// `LISTED_FAILURES`), each written by that node's driver.
    #[serde(default)]
    pub nodes: Vec<NodeStatus>,
    /// The controller's summary (`summary`): selected nodes that run the
    /// driver, those of them that hold the model, those whose line says
    /// they failed, and the `Ready` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_nodes: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_nodes: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_nodes: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum Phase {
    #[default]
    Pending,
    Pulling,
    Ready,
    Failed,
}

/// One node's line, written by that node's driver alone (server-side apply,
/// a list keyed by `node`). Drivers write Failed; Pending, Pulling and
/// Ready lines are older drivers' (a Ready one still counts).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    pub node: String,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated: Option<String>,
}

impl kube::Resource for ModelPrefetch {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Whether `selector` selects a node with `labels`, as Kubernetes reads a
/// LabelSelector (no selector: every node). An operator it does not know
/// is an error, not a silent match.
pub fn selects(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    let Some(sel) = selector else {
        return Ok(true);
    };
    for (k, v) in sel.match_labels.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Ok(false);
        }
    }
    for e in sel.match_expressions.iter().flatten() {
        let values = e.values.as_deref().unwrap_or_default();
        let have = labels.get(&e.key);
        let ok = match e.operator.as_str() {
            "In" => have.is_some_and(|v| values.contains(v)),
            "NotIn" => !have.is_some_and(|v| values.contains(v)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            other => {
                return Err(format!(
                    "spec.nodeSelector.matchExpressions: operator {other:?} is not one of In, \
                     NotIn, Exists, DoesNotExist"
                ));
            }
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The cache volume that holds a prefetch's model on a node: its name
/// carries the object's uid, so a prefetch deleted and created again under
/// the same name is a new volume, and the old one is released.
pub fn volume_name(mp: &ModelPrefetch) -> String {
    format!(
        "prefetch-{}-{}",
        mp.metadata.name.as_deref().unwrap_or_default(),
        mp.metadata.uid.as_deref().unwrap_or_default()
    )
}

pub const VOLUME_PREFIX: &str = "prefetch-";

/// `status.nodes` takes at most this many lines (the CRD's `maxItems`).
pub const LINES_AT_MOST: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelector {
        LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: (!values.is_empty())
                    .then(|| values.iter().map(|v| v.to_string()).collect()),
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn selectors_read_as_kubernetes_reads_them() {
        let gpu = labels(&[("gpu", "a100"), ("zone", "z1")]);
        let plain = labels(&[("zone", "z1")]);
        let by_label = LabelSelector {
            match_labels: Some(labels(&[("gpu", "a100")])),
            ..Default::default()
        };
        let cases = [
            (None, &gpu, Ok(true)),
            (None, &plain, Ok(true)),
            (Some(by_label.clone()), &gpu, Ok(true)),
            (Some(by_label), &plain, Ok(false)),
            (Some(expr("gpu", "In", &["a100", "h100"])), &gpu, Ok(true)),
            (Some(expr("gpu", "In", &["h100"])), &gpu, Ok(false)),
            (Some(expr("gpu", "NotIn", &["a100"])), &gpu, Ok(false)),
            (Some(expr("gpu", "NotIn", &["a100"])), &plain, Ok(true)),
            (Some(expr("gpu", "Exists", &[])), &gpu, Ok(true)),
            (Some(expr("gpu", "Exists", &[])), &plain, Ok(false)),
            (Some(expr("gpu", "DoesNotExist", &[])), &plain, Ok(true)),
            (Some(LabelSelector::default()), &plain, Ok(true)),
        ];
        for (i, (sel, l, want)) in cases.into_iter().enumerate() {
            assert_eq!(selects(sel.as_ref(), l), want, "case {i}");
        }
        let e = selects(Some(&expr("gpu", "Gt", &["1"])), &gpu).unwrap_err();
        assert!(e.contains("operator \"Gt\""), "{e}");
    }

    #[test]
    fn the_status_line_reads_as_the_crd_declares_it() {
        let line = NodeStatus {
            node: "n1".into(),
            phase: Phase::Pulling,
            bytes: Some(5),
            total_bytes: Some(10),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&line).unwrap(),
            serde_json::json!({"node": "n1", "phase": "Pulling", "bytes": 5, "totalBytes": 10})
        );
        let mp: ModelPrefetch = serde_json::from_value(serde_json::json!({
            "apiVersion": "modelcache.csi.io/v1alpha1",
            "kind": "ModelPrefetch",
            "metadata": {"name": "m", "uid": "u1"},
            "spec": {"storageClassName": "sc", "nodeSelector": {"matchLabels": {"gpu": "a100"}}}
        }))
        .unwrap();
        assert_eq!(mp.spec.storage_class_name, "sc");
        assert_eq!(volume_name(&mp), "prefetch-m-u1");
    }

    #[test]
    fn the_crd_bounds_the_lines_as_the_code_does() {
        let crd = include_str!("../../deploy/csi-driver/base/crd-modelprefetch.yaml");
        assert!(
            crd.contains(&format!("maxItems: {LINES_AT_MOST}")),
            "the CRD's status.nodes maxItems is not {LINES_AT_MOST}"
        );
        const { assert!(2 * super::super::LISTED_FAILURES <= LINES_AT_MOST) };
    }
}
