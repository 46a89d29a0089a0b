//! On a node: applies VolumeAttributesClass changes (sealing, pinning) to
//! this node's node-local volumes, which the central controller and its
//! external-resizer cannot reach, and records each outcome on the PV
//! (`controller::node_report`), where the central controller reads it back
//! for the resizer, and as an event on the PVC.
//!
//! Kubernetes offers no node-side ControllerModifyVolume: external-resizer
//! has no node-deployment mode. The user's gesture stays the same on every
//! backend (point the PVC at the sealing class); only who acts differs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::runtime::controller::{Action, Controller};
use tracing::{Instrument, info, info_span, warn};

use crate::cache::VolumeId;
use crate::error::{Error, Result};
use crate::kubeapi::EventType;
use crate::provision::Agent;
use crate::provision::node_report::{ANNOTATION, Outcome, Report};

/// How soon a refused or failed change is tried again: a writer may have
/// gone by then. The central resizer asks at least this often.
const RETRY: Duration = Duration::from_secs(10);
/// A change still being applied after this is recorded as running.
const RUNNING_AFTER: Duration = Duration::from_secs(2);

type Ctx = Agent;

/// The change a PVC asks for: a class it names but does not have yet, on
/// the PV it is bound to.
#[derive(Debug, PartialEq, Eq)]
struct Pending {
    class: String,
    pv: String,
}

fn pending(pvc: &PersistentVolumeClaim) -> Option<Pending> {
    let spec = pvc.spec.as_ref()?;
    let class = spec
        .volume_attributes_class_name
        .clone()
        .filter(|c| !c.is_empty())?;
    let status = pvc.status.as_ref()?;
    if status.phase.as_deref() != Some("Bound")
        || status.current_volume_attributes_class_name.as_deref() == Some(class.as_str())
    {
        return None;
    }
    let pv = spec.volume_name.clone().filter(|v| !v.is_empty())?;
    Some(Pending { class, pv })
}

/// The volume id of `pv` when it is one of this node's node-local volumes.
fn ours(pv: &PersistentVolume, ctx: &Ctx) -> Option<String> {
    let csi = pv.spec.as_ref()?.csi.as_ref()?;
    if csi.driver != ctx.driver() {
        return None;
    }
    let id = VolumeId::parse(&csi.volume_handle)?;
    let root = ctx.ctx.roots.for_id(&id).ok()?;
    (root.node.as_deref() == Some(ctx.node.as_str())).then(|| csi.volume_handle.clone())
}

/// Runs until the process ends.
pub async fn run(agent: Agent) {
    let (store, pvcs) = crate::kubeapi::slim_pvcs(agent.kube.client());
    let ctx = Arc::new(agent);
    info!(node = %ctx.node, "applying VolumeAttributesClass changes to this node's volumes");
    Controller::for_stream(pvcs, store)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

async fn reconcile(pvc: Arc<PersistentVolumeClaim>, ctx: Arc<Ctx>) -> Result<Action> {
    let Some(p) = pending(&pvc) else {
        return Ok(Action::await_change());
    };
    let pv = match ctx.kube.pv(&p.pv).await {
        Ok(pv) => pv,
        Err(Error::NotFound(_)) => return Ok(Action::await_change()),
        Err(e) => return Err(e),
    };
    let Some(volume_id) = ours(&pv, &ctx) else {
        return Ok(Action::await_change());
    };
    let span = info_span!(
        "NodeModifyVolume",
        volume.id = %volume_id,
        pvc = %format!("{}/{}", pvc.namespace().unwrap_or_default(), pvc.name_any()),
        class = %p.class
    );
    apply(&pvc, &pv, &p, &volume_id, &ctx)
        .instrument(span)
        .await
}

async fn apply(
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    p: &Pending,
    volume_id: &str,
    ctx: &Ctx,
) -> Result<Action> {
    let class = match ctx.kube.volume_attributes_class(&p.class).await {
        Ok(c) => c,
        // external-resizer says so on the PVC; nothing for us to apply.
        Err(Error::NotFound(_)) => return Ok(Action::await_change()),
        Err(e) => return Err(e),
    };
    if class.driver_name != ctx.driver() {
        return Ok(Action::await_change());
    }
    let parameters: BTreeMap<String, String> = class.parameters.unwrap_or_default();
    let before = Report::from_annotations(pv.metadata.annotations.as_ref());
    if before
        .as_ref()
        .is_some_and(|r| r.parameters == parameters && r.outcome == Outcome::Applied)
    {
        return Ok(Action::await_change());
    }
    let pv_name = pv.name_any();
    let attributes = parameters.clone().into_iter().collect();
    let modify = ctx.provisioner.modify(volume_id, &attributes);
    tokio::pin!(modify);
    // A seal hashes every file: one that takes a while says so, so the PVC
    // does not read as stuck. A quick answer (a refusal while a writer
    // holds the source) is recorded as itself, never as "running".
    let result = tokio::select! {
        r = &mut modify => r,
        _ = tokio::time::sleep(RUNNING_AFTER) => {
            let running = Report::running(&ctx.node, parameters.clone());
            // Only news: the change itself must not be abandoned over it.
            if let Err(e) = ctx.kube.annotate_pv(&pv_name, ANNOTATION, &running.to_json()).await {
                warn!(error = %e, "could not record that the change is running");
            }
            modify.await
        }
    };
    let report = Report::of(&ctx.node, parameters, &result);
    ctx.kube
        .annotate_pv(&pv_name, ANNOTATION, &report.to_json())
        .await?;
    // One event per change of outcome, not one per retry.
    let news = before.as_ref().is_none_or(|b| {
        (&b.parameters, b.outcome, &b.message)
            != (&report.parameters, report.outcome, &report.message)
    });
    let (type_, reason) = match report.outcome {
        Outcome::Applied => (EventType::Normal, "NodeModified"),
        Outcome::Refused => (EventType::Warning, "NodeModifyRefused"),
        Outcome::Invalid => (EventType::Warning, "NodeModifyInvalid"),
        Outcome::Running | Outcome::Failed => (EventType::Warning, "NodeModifyFailed"),
    };
    let shown = report
        .parameters
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let note = match &result {
        Ok(()) => format!("node {} applied {shown} (class {})", ctx.node, p.class),
        Err(e) => format!("node {}: {e}", ctx.node),
    };
    match &result {
        Ok(()) => info!("applied"),
        Err(e) => warn!(error = %e, "not applied"),
    }
    if news {
        ctx.kube
            .pvc_event(pvc, type_, reason, "ModifyVolume", note)
            .await;
    }
    Ok(match report.outcome {
        Outcome::Applied | Outcome::Invalid => Action::await_change(),
        Outcome::Running | Outcome::Refused | Outcome::Failed => Action::requeue(RETRY),
    })
}

fn error_policy(_pvc: Arc<PersistentVolumeClaim>, err: &Error, _ctx: Arc<Ctx>) -> Action {
    warn!(error = %err, "applying a VolumeAttributesClass change failed; retrying");
    Action::requeue(RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, PersistentVolumeClaimStatus};

    fn pvc(
        class: Option<&str>,
        current: Option<&str>,
        phase: &str,
        pv: &str,
    ) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            spec: Some(PersistentVolumeClaimSpec {
                volume_attributes_class_name: class.map(Into::into),
                volume_name: Some(pv.into()).filter(|v: &String| !v.is_empty()),
                ..Default::default()
            }),
            status: Some(PersistentVolumeClaimStatus {
                phase: Some(phase.into()),
                current_volume_attributes_class_name: current.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_bound_claim_short_of_its_class_is_pending() {
        let want = |c: &str, p: &str| {
            Some(Pending {
                class: c.into(),
                pv: p.into(),
            })
        };
        let cases = [
            (
                pvc(Some("sealed"), None, "Bound", "pv1"),
                want("sealed", "pv1"),
            ),
            (
                pvc(Some("sealed"), Some("open"), "Bound", "pv1"),
                want("sealed", "pv1"),
            ),
            (pvc(Some("sealed"), Some("sealed"), "Bound", "pv1"), None),
            (pvc(None, Some("sealed"), "Bound", "pv1"), None),
            (pvc(Some(""), None, "Bound", "pv1"), None),
            (pvc(Some("sealed"), None, "Pending", "pv1"), None),
            (pvc(Some("sealed"), None, "Bound", ""), None),
            (PersistentVolumeClaim::default(), None),
        ];
        for (i, (claim, expected)) in cases.into_iter().enumerate() {
            assert_eq!(pending(&claim), expected, "case {i}");
        }
    }
}
