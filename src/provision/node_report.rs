//! What a node says about a VolumeAttributesClass change it applied to one
//! of its node-local volumes, as it records it on the PV, and how the
//! central controller answers ControllerModifyVolume from that record.
//!
//! The central external-resizer calls ControllerModifyVolume on the central
//! controller, which cannot reach a volume that lives in one node's state
//! dir. The node's driver applies the change itself (`modify_agent`) and
//! writes the outcome here; the central controller reports it back to the
//! resizer, so the PVC's status and events say what the node did.
//!
//! The record is on the PV, not the PVC: tenants may write their PVCs'
//! annotations, and a forged "applied" would read as sealed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The PV annotation holding a node's [`Report`] as JSON.
pub const ANNOTATION: &str = "modelcache.csi.io/node-modify";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// The change is in effect (a seal, a pin).
    Applied,
    /// The node is applying it now (a seal hashes every file).
    Running,
    /// Not now: a writer still holds the source. The node tries again.
    Refused,
    /// Never, as asked: a new VolumeAttributesClass is needed.
    Invalid,
    /// Something went wrong on the node; it tries again.
    Failed,
}

/// One node's last word on one volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub node: String,
    /// The mutable parameters (the class's) this outcome is for.
    pub parameters: BTreeMap<String, String>,
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl Report {
    /// The record of applying `parameters` on `node` with `result`.
    pub fn of(node: &str, parameters: BTreeMap<String, String>, result: &Result<()>) -> Report {
        let (outcome, message) = match result {
            Ok(()) => (Outcome::Applied, String::new()),
            Err(e @ Error::Precondition(_)) | Err(e @ Error::Busy(_)) => {
                (Outcome::Refused, e.to_string())
            }
            Err(e @ Error::Invalid { .. }) => (Outcome::Invalid, e.to_string()),
            Err(e) => (Outcome::Failed, e.to_string()),
        };
        Report {
            node: node.to_string(),
            parameters,
            outcome,
            message,
        }
    }

    pub fn running(node: &str, parameters: BTreeMap<String, String>) -> Report {
        Report {
            node: node.to_string(),
            parameters,
            outcome: Outcome::Running,
            message: String::new(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The report in a PV's annotations; an unreadable one counts as none.
    pub fn from_annotations(annotations: Option<&BTreeMap<String, String>>) -> Option<Report> {
        serde_json::from_str(annotations?.get(ANNOTATION)?).ok()
    }
}

fn show(p: &BTreeMap<String, String>) -> String {
    if p.is_empty() {
        return "no parameters".into();
    }
    p.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The central controller's answer to ControllerModifyVolume(`wanted`) for
/// volume `volume`, which lives on node `node`, given that node's report.
/// Waiting is `Unavailable`, which external-resizer retries; a refusal and
/// an invalid change carry the node's own words and code.
pub fn answer(
    volume: &str,
    node: &str,
    wanted: &BTreeMap<String, String>,
    report: Option<&Report>,
) -> Result<()> {
    let Some(r) = report.filter(|r| &r.parameters == wanted) else {
        let last = report
            .map(|r| format!("; its last report is for {}", show(&r.parameters)))
            .unwrap_or_default();
        return Err(Error::Transient(format!(
            "volume {volume} lives on node {node}, whose driver applies VolumeAttributesClass \
             changes to it (--modify-node-local-volumes, set in deploy/csi-driver's node \
             DaemonSet); it has not reported applying {}{last}. If this lasts, check that \
             the driver runs on {node} and its log",
            show(wanted)
        )));
    };
    let on = |m: &str| format!("on node {}: {m}", r.node);
    match r.outcome {
        Outcome::Applied => Ok(()),
        Outcome::Running => Err(Error::Transient(on(&format!(
            "applying {} to volume {volume}",
            show(wanted)
        )))),
        Outcome::Refused => Err(Error::Precondition(on(&r.message))),
        Outcome::Invalid => Err(Error::invalid("mutable_parameters", on(&r.message))),
        Outcome::Failed => Err(Error::Transient(on(&format!(
            "{}; it tries again",
            r.message
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed() -> BTreeMap<String, String> {
        BTreeMap::from([("sealed".to_string(), "true".to_string())])
    }

    fn report(outcome: Outcome, message: &str) -> Report {
        Report {
            node: "n2".into(),
            parameters: sealed(),
            outcome,
            message: message.into(),
        }
    }

    #[test]
    fn answers_follow_the_node() {
        use tonic::Code;
        let cases: [(Option<Report>, Result<(), Code>); 7] = [
            (None, Err(Code::Unavailable)),
            (Some(report(Outcome::Applied, "")), Ok(())),
            (Some(report(Outcome::Running, "")), Err(Code::Unavailable)),
            (
                Some(report(Outcome::Refused, "still staged on node(s) n2")),
                Err(Code::FailedPrecondition),
            ),
            (
                Some(report(Outcome::Invalid, "x")),
                Err(Code::InvalidArgument),
            ),
            (
                Some(report(Outcome::Failed, "disk")),
                Err(Code::Unavailable),
            ),
            // A report of another class's parameters is not this answer.
            (
                Some(Report {
                    parameters: BTreeMap::from([("pinned".into(), "true".into())]),
                    ..report(Outcome::Applied, "")
                }),
                Err(Code::Unavailable),
            ),
        ];
        for (r, want) in cases {
            let got = answer("local.x.y", "n2", &sealed(), r.as_ref());
            match (&got, want) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(code)) => {
                    assert_eq!(tonic::Status::from(e.replay()).code(), code, "{r:?}: {e}");
                    assert!(e.to_string().contains("n2"), "names the node: {e}");
                }
                _ => panic!("{r:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn a_refusal_carries_the_nodes_words() {
        let e = answer(
            "local.x.y",
            "n2",
            &sealed(),
            Some(&report(Outcome::Refused, "writer pod on n2")),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "on node n2: writer pod on n2");
    }

    #[test]
    fn outcomes_are_classified_by_error() {
        let p = sealed();
        let cases = [
            (Ok(()), Outcome::Applied),
            (Err(Error::Precondition("w".into())), Outcome::Refused),
            (Err(Error::Busy("busy".into())), Outcome::Refused),
            (Err(Error::invalid("f", "m")), Outcome::Invalid),
            (Err(Error::Internal("i".into())), Outcome::Failed),
        ];
        for (result, want) in cases {
            assert_eq!(Report::of("n", p.clone(), &result).outcome, want);
        }
    }

    #[test]
    fn the_record_round_trips_and_junk_is_no_report() {
        let r = report(Outcome::Refused, "m");
        let a = BTreeMap::from([(ANNOTATION.to_string(), r.to_json())]);
        assert_eq!(Report::from_annotations(Some(&a)), Some(r));
        let junk = BTreeMap::from([(ANNOTATION.to_string(), "{not json".to_string())]);
        assert_eq!(Report::from_annotations(Some(&junk)), None);
        assert_eq!(Report::from_annotations(None), None);
    }
}
