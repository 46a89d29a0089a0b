//! Who pulls a model from the origin: a Lease per pull (a claim), which
//! the API creates for one node only, so that one node leads and the
//! others fill from it.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use tracing::{debug, warn};

use super::records::Holding;
use super::{Directory, LEASE_SECONDS};

/// The label of a pull's claim (the driver's name); the claim is named
/// `modelcache-pull-<sid>`.
pub const CLAIM_LABEL: &str = "modelcache.csi.io/pull-claim-of";

const CLAIM_PREFIX: &str = "modelcache-pull-";

/// Who pulls a model from the origin while other nodes fill from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This node: no other node holds a live claim.
    Leads,
    /// That node claimed it first and is pulling it now.
    Follows(String),
}

fn claim_name(sid: &str) -> String {
    format!("{CLAIM_PREFIX}{sid}")
}

impl Directory {
    /// Lets go of this node's claim on `sid`.
    pub(super) async fn let_go(&self, sid: &str) {
        release(&self.api, &self.node, &claim_name(sid)).await;
    }

    /// Deletes the claims this node holds but no pull of this process
    /// made (a previous run's, cut short).
    pub async fn release_own_claims(&self) {
        let lp = ListParams::default().labels(&format!("{CLAIM_LABEL}={}", self.driver));
        let claims = match self.api.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                debug!(error = %e, "could not list pull claims");
                return;
            }
        };
        let mine: Vec<String> = {
            let pulling = self.pulling.lock().unwrap_or_else(|p| p.into_inner());
            claims
                .into_iter()
                .filter(|l| {
                    l.spec.as_ref().and_then(|s| s.holder_identity.as_deref())
                        == Some(self.node.as_str())
                })
                .filter_map(|l| l.metadata.name)
                .filter(|n| {
                    n.strip_prefix(CLAIM_PREFIX)
                        .is_none_or(|sid| !pulling.contains_key(sid))
                })
                .collect()
        };
        for name in mine {
            release(&self.api, &self.node, &name).await;
        }
    }

    /// Claims the pull of `sid` from the origin, after `begin`. The API
    /// creates the claim's Lease for one node only, so exactly one of the
    /// nodes starting at once leads. Comparing start times on the node
    /// Leases cannot promise that: a node that announced late with an
    /// early clock and one that listed before it announced both see
    /// nobody ahead. A claim whose holder no longer advertises the pull
    /// (failed, gone) is taken over, by one node, through the Lease's
    /// resourceVersion. When the API cannot be asked, this node leads:
    /// peer fill only saves origin bytes, it never stops a pull.
    pub async fn claim(&self, sid: &str) -> Claim {
        let name = claim_name(sid);
        for _ in 0..4 {
            let mine = serde_json::from_value::<Lease>(serde_json::json!({
                "metadata": {"name": name, "labels": {CLAIM_LABEL: self.driver}},
                "spec": {
                    "holderIdentity": self.node,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "acquireTime": MicroTime(Timestamp::now()),
                },
            }))
            .expect("a claim is a Lease");
            match self.api.create(&PostParams::default(), &mine).await {
                Ok(_) => return Claim::Leads,
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => {
                    warn!(error = %e, "could not claim the pull; pulling from the origin");
                    return Claim::Leads;
                }
            }
            let current = match self.api.get_opt(&name).await {
                Ok(Some(l)) => l,
                // Released in between: claim it again.
                Ok(None) => continue,
                Err(e) => {
                    warn!(error = %e, "could not read the pull's claim; pulling from the origin");
                    return Claim::Leads;
                }
            };
            let holder = current
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.clone())
                .unwrap_or_default();
            if holder == self.node {
                return Claim::Leads;
            }
            let live = self
                .holder(sid, &holder)
                .await
                .is_some_and(|p| matches!(p.holding, Holding::Pulling(_)));
            if live {
                return Claim::Follows(holder);
            }
            let take = serde_json::json!({
                "metadata": {"resourceVersion": current.metadata.resource_version},
                "spec": {"holderIdentity": self.node, "acquireTime": MicroTime(Timestamp::now())},
            });
            match self
                .api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&take))
                .await
            {
                Ok(_) => {
                    debug!(claim = %name, stale = %holder, "took over a stale claim");
                    return Claim::Leads;
                }
                // Another node took it over first, or it was released.
                Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {}
                Err(e) => {
                    warn!(error = %e, "could not take over the pull's claim; pulling from the origin");
                    return Claim::Leads;
                }
            }
        }
        Claim::Leads
    }
}

/// Deletes `name` if `node` still holds it (a claim taken over since is
/// the new holder's).
async fn release(api: &Api<Lease>, node: &str, name: &str) {
    let Ok(Some(l)) = api.get_opt(name).await else {
        return;
    };
    if l.spec.and_then(|s| s.holder_identity).as_deref() != Some(node) {
        return;
    }
    let only_this = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: l.metadata.resource_version,
            uid: None,
        }),
        ..DeleteParams::default()
    };
    if let Err(e) = api.delete(name, &only_this).await {
        debug!(claim = %name, error = %e, "claim not released");
    }
}
