//! Who holds which model: one Lease per node in the driver's namespace,
//! renewed while the driver runs, listing the node's peer address and the
//! models it has sealed. A node that stops renewing (gone, or its driver
//! down) drops out when its Lease expires; an evicted model drops out at
//! the next renewal. A pull from the origin is claimed with a Lease of
//! its own, which the API creates for one node only: that node leads, the
//! others fill from it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use tracing::{debug, warn};

use crate::cache::Root;

/// The Lease annotations: where the node serves peers, what it holds.
pub const ADDRESS: &str = "modelcache.csi.io/peer-address";
pub const MODELS: &str = "modelcache.csi.io/models";
/// The SHA-256 of the certificate the node serves peers with (hex): a
/// Lease without one names no peer (peers are never dialled in the clear).
pub const CERTIFICATE: &str = "modelcache.csi.io/peer-certificate-sha256";
/// Models the node is pulling now, each with when it started
/// (`<sid>@<unix ms>`): the first to start pulls from the origin, and
/// those starting after it fill from it as its bytes arrive.
pub const PULLING: &str = "modelcache.csi.io/pulling";
/// The label every driver's peer Lease carries: the driver's name.
pub const LABEL: &str = "modelcache.csi.io/peer-of";

/// The label of a pull's claim (the driver's name); the claim is named
/// `modelcache-pull-<sid>`.
pub const CLAIM_LABEL: &str = "modelcache.csi.io/pull-claim-of";

/// Who pulls a model from the origin while other nodes fill from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This node: no other node holds a live claim.
    Leads,
    /// That node claimed it first and is pulling it now.
    Follows(String),
}

const CLAIM_PREFIX: &str = "modelcache-pull-";

fn claim_name(sid: &str) -> String {
    format!("{CLAIM_PREFIX}{sid}")
}

/// How long a Lease stands without renewal; renewed at a third of it.
const LEASE_SECONDS: i32 = 45;
const RENEW_EVERY: Duration = Duration::from_secs(15);
/// A listing is reused this long: a burst of pulls asks the API once.
const LIST_FRESH_FOR: Duration = Duration::from_secs(2);
/// At most this many models are advertised (the annotation's size bound).
const MAX_ADVERTISED: usize = 2000;

/// Another node's driver, as its Lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub node: String,
    pub addr: String,
    /// The certificate it must present.
    pub pin: super::tls::Pin,
    pub models: BTreeSet<String>,
    /// Models being pulled there, and when each started (unix ms).
    pub pulling: BTreeMap<String, u64>,
}

pub struct Directory {
    api: Api<Lease>,
    node: String,
    driver: String,
    advertise: String,
    pin: String,
    roots: Vec<Root>,
    listed: Mutex<Option<(Instant, Arc<Vec<Peer>>)>>,
    wake: tokio::sync::Notify,
    /// This node's pulls in progress: sid -> start (unix ms).
    pulling: Mutex<BTreeMap<String, u64>>,
    /// One publish at a time, so an older one never lands last.
    publishing: tokio::sync::Mutex<()>,
}

/// The Lease name of `node`: DNS-1123, with a digest when the node id had
/// to be changed to fit.
pub fn lease_name(node: &str) -> String {
    let clean: String = node
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let clean = clean.trim_matches(|c| c == '-' || c == '.').to_string();
    if clean == node && clean.len() <= 200 {
        return format!("modelcache-peer-{clean}");
    }
    use sha2::Digest;
    let h = hex::encode(sha2::Sha256::digest(node.as_bytes()));
    let head: String = clean.chars().take(100).collect();
    format!("modelcache-peer-{head}-{}", &h[..10]).replace("--", "-")
}

impl Directory {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        node: String,
        driver: &str,
        advertise: String,
        pin: String,
        roots: Vec<Root>,
    ) -> Directory {
        Directory {
            api: Api::namespaced(client, namespace),
            node,
            driver: driver.to_string(),
            advertise,
            pin,
            roots,
            listed: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            pulling: Mutex::new(BTreeMap::new()),
            publishing: tokio::sync::Mutex::new(()),
        }
    }

    /// Renews this node's Lease every `RENEW_EVERY`, and soon after a seal.
    /// First lets go of the claims a previous run of this node's driver
    /// left when it died mid-pull: nobody else would delete them.
    pub async fn run(self: Arc<Self>) {
        self.release_own_claims().await;
        loop {
            if let Err(e) = self.publish().await {
                warn!(error = %e, "could not publish this node's models to peers");
            }
            tokio::select! {
                _ = tokio::time::sleep(RENEW_EVERY) => {}
                _ = self.wake.notified() => {}
            }
        }
    }

    /// A model was sealed (or evicted): publish again now.
    pub fn changed(&self) {
        self.wake.notify_one();
    }

    /// This node starts pulling `sid` (at `started`, unix ms): published
    /// before it returns, so that a node listing after it sees it.
    pub async fn begin(&self, sid: &str, started: u64) -> anyhow::Result<()> {
        self.pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sid.to_string(), started);
        self.publish().await
    }

    /// This node's pull of `sid` ended (sealed or failed): it is no
    /// longer advertised, and this node's claim on it is let go.
    pub fn end(&self, sid: &str) {
        self.pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sid);
        self.changed();
        let (api, node, name) = (self.api.clone(), self.node.clone(), claim_name(sid));
        tokio::spawn(async move { release(&api, &node, &name).await });
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
                .holders(sid, true)
                .await
                .iter()
                .any(|p| p.node == holder && p.pulling.contains_key(sid));
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

    async fn publish(&self) -> anyhow::Result<()> {
        let _one = self.publishing.lock().await;
        let pulling = self
            .pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(sid, at)| format!("{sid}@{at}"))
            .collect::<Vec<_>>()
            .join(" ");
        let roots = self.roots.clone();
        let held = crate::offload::blocking(move || Ok(held_models(&roots))).await?;
        let models = held
            .into_iter()
            .take(MAX_ADVERTISED)
            .collect::<Vec<_>>()
            .join(" ");
        let name = lease_name(&self.node);
        let lease = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": {LABEL: self.driver},
                "annotations": {
                    ADDRESS: self.advertise,
                    CERTIFICATE: self.pin,
                    MODELS: models,
                    PULLING: pulling,
                },
            },
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": MicroTime(Timestamp::now()),
            }
        });
        self.api
            .patch(
                &name,
                &PatchParams::apply("modelcache-peer").force(),
                &Patch::Apply(&lease),
            )
            .await?;
        debug!(lease = %name, "published this node's models");
        Ok(())
    }

    /// Live peers (not this node) that hold `sid` sealed or are pulling
    /// it; `fresh` asks the API now rather than reuse a recent answer.
    pub async fn holders(&self, sid: &str, fresh: bool) -> Vec<Peer> {
        if fresh {
            *self.listed.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        match self.peers().await {
            Ok(all) => all
                .iter()
                .filter(|p| p.models.contains(sid) || p.pulling.contains_key(sid))
                .cloned()
                .collect(),
            Err(e) => {
                warn!(error = %e, "could not list peers; pulling from the origin");
                Vec::new()
            }
        }
    }

    async fn peers(&self) -> anyhow::Result<Arc<Vec<Peer>>> {
        if let Some((at, peers)) = &*self.listed.lock().unwrap_or_else(|p| p.into_inner())
            && at.elapsed() < LIST_FRESH_FOR
        {
            return Ok(peers.clone());
        }
        let leases = self
            .api
            .list(&ListParams::default().labels(&format!("{LABEL}={}", self.driver)))
            .await?;
        let now = Timestamp::now();
        let peers: Vec<Peer> = leases
            .items
            .into_iter()
            .filter_map(|l| live_peer(&l, now))
            .filter(|p| p.node != self.node)
            .collect();
        let peers = Arc::new(peers);
        *self.listed.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), peers.clone()));
        Ok(peers)
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

/// The peer a Lease describes, unless it expired or is malformed.
fn live_peer(l: &Lease, now: Timestamp) -> Option<Peer> {
    let spec = l.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0;
    let lasts = i64::from(spec.lease_duration_seconds?);
    if renewed.as_second().saturating_add(lasts) < now.as_second() {
        return None;
    }
    let ann = l.metadata.annotations.as_ref()?;
    let addr = ann.get(ADDRESS)?.clone();
    addr.parse::<std::net::SocketAddr>().ok()?;
    let pin = super::tls::parse_pin(ann.get(CERTIFICATE)?)?;
    let models = ann
        .get(MODELS)
        .map(|m| {
            m.split_whitespace()
                .filter(|s| super::is_model(s))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let pulling = ann
        .get(PULLING)
        .map(|m| {
            m.split_whitespace()
                .filter_map(|e| e.split_once('@'))
                .filter(|(s, _)| super::is_model(s))
                .filter_map(|(s, at)| Some((s.to_string(), at.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default();
    Some(Peer {
        node: spec.holder_identity.clone()?,
        addr,
        pin,
        models,
        pulling,
    })
}

/// The sealed models in `roots`, sorted.
pub fn held_models(roots: &[Root]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in roots {
        let Ok(entries) = std::fs::read_dir(r.sources_dir()) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if super::is_model(&name) && e.path().join("seal.json").is_file() {
                out.insert(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_are_dns_names() {
        assert_eq!(lease_name("node-1"), "modelcache-peer-node-1");
        let odd = lease_name("Node_1");
        assert!(odd.starts_with("modelcache-peer-node-1-"), "{odd}");
        assert_ne!(odd, lease_name("node_1"));
        assert!(lease_name(&"x".repeat(400)).len() < 253);
    }

    const PIN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn lease(renewed: Timestamp, addr: &str, models: &str) -> Lease {
        pinned_lease(renewed, addr, models, Some(PIN))
    }

    fn pinned_lease(renewed: Timestamp, addr: &str, models: &str, pin: Option<&str>) -> Lease {
        let mut ann = serde_json::json!({ADDRESS: addr, MODELS: models});
        if let Some(pin) = pin {
            ann[CERTIFICATE] = pin.into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "l", "annotations": ann},
            "spec": {"holderIdentity": "n2", "leaseDurationSeconds": 45, "renewTime": MicroTime(renewed)}
        }))
        .unwrap()
    }

    #[test]
    fn expired_or_malformed_leases_are_no_peers() {
        let now = Timestamp::now();
        let m = "m0123456789abcdef0123456789abcde";
        let p = live_peer(&lease(now, "10.0.0.2:7420", &format!("{m} junk")), now).unwrap();
        assert_eq!(p.node, "n2");
        assert_eq!(p.models.iter().collect::<Vec<_>>(), [m]);
        let old = now - k8s_openapi::jiff::SignedDuration::from_secs(60);
        assert!(live_peer(&lease(old, "10.0.0.2:7420", m), now).is_none());
        assert!(live_peer(&lease(now, "not an address", m), now).is_none());
        // No certificate, or not a digest: never dialled, so never sent the
        // token in the clear.
        let addr = "10.0.0.2:7420";
        assert!(live_peer(&pinned_lease(now, addr, m, None), now).is_none());
        assert!(live_peer(&pinned_lease(now, addr, m, Some("abc")), now).is_none());
    }
}
