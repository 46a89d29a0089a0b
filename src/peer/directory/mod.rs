//! Who holds which model. Each node keeps a small Lease in the driver's
//! namespace, renewed while the driver runs, saying where it serves peers
//! and with which certificate; and one holder record per model it holds
//! or is pulling (`records`). Asking who holds a model lists that model's
//! records (a bounded page) and the peer Leases of the nodes they name, so
//! its cost follows the page, not the cluster. A node that stops renewing
//! (gone, or its driver down) drops out when its Lease expires; an
//! evicted model's record is deleted. A pull from the origin is claimed
//! with a Lease of its own (`claim`).

mod claim;
pub mod records;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use tracing::{debug, warn};

pub use claim::{CLAIM_LABEL, Claim};
use records::{Holding, Owner};

use crate::cache::Root;

/// The peer Lease annotations: where the node serves peers, and the
/// SHA-256 of the certificate it serves them with (hex). A Lease without
/// one names no peer (peers are never dialled in the clear).
pub const ADDRESS: &str = "modelcache.csi.io/peer-address";
pub const CERTIFICATE: &str = "modelcache.csi.io/peer-certificate-sha256";
/// The label every driver's peer Lease carries: the driver's name.
pub const LABEL: &str = "modelcache.csi.io/peer-of";

const PEER_PREFIX: &str = "modelcache-peer-";
/// How long a Lease stands without renewal; renewed at a third of it.
const LEASE_SECONDS: i32 = 45;
const RENEW_EVERY: Duration = Duration::from_secs(15);
/// This node's records are listed again this often, so that one deleted
/// behind its back comes back.
const RELIST_EVERY: Duration = Duration::from_secs(600);
/// A model's holders are reused this long: a burst of pulls asks once.
const LIST_FRESH_FOR: Duration = Duration::from_secs(2);
/// At most this many sealed models are published per node.
const MAX_ADVERTISED: usize = 512;
/// A query reads at most this many of a model's holders, so that its cost
/// is bounded whatever the cluster's size.
pub const HOLDERS_ASKED: u32 = 16;
/// A bucket's holders are a page of their own when they are at least this
/// many; fewer are filled up from the page of the bucket above.
const ENOUGH_IN_BUCKET: usize = 4;
/// Past this many record writes in one publish, writes are this far
/// apart, so that a fleet of nodes starting with full caches does not
/// flood the API.
const WRITES_AT_ONCE: usize = 8;
const WRITE_GAP: Duration = Duration::from_millis(50);

/// Another node's driver holding or pulling a model, as its record and
/// its peer Lease say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub node: String,
    pub addr: String,
    /// The certificate it must present.
    pub pin: super::tls::Pin,
    /// What it holds of the model asked about.
    pub holding: Holding,
}

impl Peer {
    pub fn sealed(&self) -> bool {
        self.holding == Holding::Sealed
    }

    /// When its pull started (unix ms), while it pulls.
    pub fn pulling_since(&self) -> Option<u64> {
        match self.holding {
            Holding::Pulling(at) => Some(at),
            Holding::Sealed => None,
        }
    }
}

/// Where a live node serves peers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Endpoint {
    node: String,
    addr: String,
    pin: super::tls::Pin,
}

/// A model's holders, and when the API said so.
type Asked = (Instant, Arc<Vec<Peer>>);

/// The records this node has published, as far as it knows.
#[derive(Default)]
struct Published {
    /// `None` until listed (at start, after an error, now and then).
    records: Option<records::Known>,
    listed: Option<Instant>,
    owner: Option<Owner>,
}

pub struct Directory {
    api: Api<Lease>,
    nodes: Api<Node>,
    /// The Node object's uid, once read: its peer Lease belongs to it, so
    /// that a node removed from the cluster takes its Lease and records
    /// with it. `None` where the node has no Node object (tests).
    node_uid: tokio::sync::OnceCell<Option<String>>,
    node: String,
    driver: String,
    advertise: String,
    pin: String,
    roots: Vec<Root>,
    /// Recent answers, by model.
    asked: Mutex<HashMap<String, Asked>>,
    wake: tokio::sync::Notify,
    /// This node's pulls in progress: sid -> start (unix ms).
    pulling: Mutex<BTreeMap<String, u64>>,
    /// One publish at a time, so an older one never lands last.
    publishing: tokio::sync::Mutex<Published>,
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
        return format!("{PEER_PREFIX}{clean}");
    }
    use sha2::Digest;
    let h = hex::encode(sha2::Sha256::digest(node.as_bytes()));
    let head: String = clean.chars().take(100).collect();
    format!("{PEER_PREFIX}{head}-{}", &h[..10]).replace("--", "-")
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
            api: Api::namespaced(client.clone(), namespace),
            nodes: Api::all(client),
            node_uid: tokio::sync::OnceCell::new(),
            node,
            driver: driver.to_string(),
            advertise,
            pin,
            roots,
            asked: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
            pulling: Mutex::new(BTreeMap::new()),
            publishing: tokio::sync::Mutex::new(Published::default()),
        }
    }

    /// Renews this node's Lease every `RENEW_EVERY`, and publishes its
    /// records soon after a seal or an eviction. First lets go of the
    /// claims a previous run of this node's driver left when it died
    /// mid-pull: nobody else would delete them.
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
        self.write_now(sid, Some(Holding::Pulling(started))).await
    }

    /// This node's pull of `sid` ended, `sealed` or failed. Its record
    /// says so before its claim is let go: a node that finds the claim
    /// free, having seen this pull under way, then finds the record sealed
    /// or gone when it looks again, and never takes a finished pull for a
    /// failed one.
    pub fn end(self: &Arc<Self>, sid: &str, sealed: bool) -> tokio::task::JoinHandle<()> {
        self.pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sid);
        let (me, sid) = (self.clone(), sid.to_string());
        tokio::spawn(async move {
            if let Err(e) = me.write_now(&sid, sealed.then_some(Holding::Sealed)).await {
                debug!(error = %e, sid, "pull's end not published; the next publish writes it");
                me.changed();
            }
            me.let_go(&sid).await;
        })
    }

    /// Writes `sid`'s record now, unless a pull of it started or ended
    /// since the caller decided `holding` (that pull's own write wins).
    async fn write_now(&self, sid: &str, holding: Option<Holding>) -> anyhow::Result<()> {
        let mut published = self.publishing.lock().await;
        if published.owner.is_none() {
            published.owner = Some(self.renew().await?);
        }
        if !self.still(sid, holding) {
            return Ok(());
        }
        self.write_one(&mut published, sid, holding).await
    }

    /// Whether `holding` still says what this node does with `sid`: a
    /// sealed copy always does.
    fn still(&self, sid: &str, holding: Option<Holding>) -> bool {
        let pulling = self
            .pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sid)
            .copied();
        match holding {
            Some(Holding::Pulling(at)) => pulling == Some(at),
            None => pulling.is_none(),
            Some(Holding::Sealed) => true,
        }
    }

    /// Renews this node's peer Lease, then brings its records in line
    /// with what it holds and pulls: pulls first, then what went, then
    /// sealed models, `WRITE_GAP` apart after the first few (a node
    /// starting with a full cache), each under the lock on its own so that
    /// a pull starting meanwhile is published at once.
    async fn publish(&self) -> anyhow::Result<()> {
        let (put, gone) = {
            let mut published = self.publishing.lock().await;
            let owner = self.renew().await?;
            if published.owner.as_ref() != Some(&owner) {
                // A new Lease (first run, or deleted): its records went
                // with the old one, or never were.
                published.records = None;
                published.owner = Some(owner);
            }
            if published
                .listed
                .is_none_or(|at| at.elapsed() > RELIST_EVERY)
            {
                published.records = None;
            }
            if published.records.is_none() {
                let owner = published.owner.clone();
                published.records = Some(self.own_records(owner.as_ref()).await?);
                published.listed = Some(Instant::now());
            }
            let wanted = self.wanted().await?;
            records::diff(
                published.records.as_ref().unwrap_or(&BTreeMap::new()),
                &wanted,
            )
        };
        let (pulls, sealed): (Vec<_>, Vec<_>) = put
            .into_iter()
            .partition(|(_, h)| matches!(h, Holding::Pulling(_)));
        let ops = pulls
            .into_iter()
            .map(|(sid, h)| (sid, Some(h)))
            .chain(gone.into_iter().map(|sid| (sid, None)))
            .chain(sealed.into_iter().map(|(sid, h)| (sid, Some(h))));
        for (i, (sid, holding)) in ops.enumerate() {
            if i >= WRITES_AT_ONCE {
                tokio::time::sleep(WRITE_GAP).await;
            }
            let mut published = self.publishing.lock().await;
            // A pull that started or ended since the plan is its own
            // publish's to write.
            if self.still(&sid, holding) {
                self.write_one(&mut published, &sid, holding).await?;
            }
        }
        Ok(())
    }

    /// Puts `sid`'s record (or deletes it, for `None`), and notes what the
    /// API now holds.
    async fn write_one(
        &self,
        published: &mut Published,
        sid: &str,
        holding: Option<Holding>,
    ) -> anyhow::Result<()> {
        let name = records::record_name(sid, &self.node);
        let written = match holding {
            Some(h) => {
                let rec =
                    records::record(&self.driver, &self.node, sid, h, published.owner.as_ref());
                let apply = PatchParams::apply("modelcache-peer").force();
                self.api
                    .patch(&name, &apply, &Patch::Apply(&rec))
                    .await
                    .map(drop)
            }
            None => match self.api.delete(&name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                r => r.map(drop),
            },
        };
        if let Err(e) = written {
            // Unknown now: listed again at the next publish.
            published.records = None;
            return Err(e.into());
        }
        if let Some(known) = published.records.as_mut() {
            match holding {
                Some(h) => known.insert(sid.to_string(), Some(h)),
                None => known.remove(sid),
            };
        }
        debug!(sid, state = ?holding, "published");
        Ok(())
    }

    /// This node's peer Lease, renewed: where it serves peers, nothing
    /// that grows with what it holds.
    async fn renew(&self) -> anyhow::Result<Owner> {
        let name = lease_name(&self.node);
        let node_uid = self
            .node_uid
            .get_or_init(|| async {
                match self.nodes.get_metadata_opt(&self.node).await {
                    Ok(m) => m.and_then(|m| m.metadata.uid),
                    Err(e) => {
                        debug!(error = %e, "could not read this node's Node; its peer Lease belongs to none");
                        None
                    }
                }
            })
            .await;
        let lease = peer_lease(
            &self.driver,
            &self.node,
            &self.advertise,
            &self.pin,
            node_uid.as_deref(),
        );
        let applied = self
            .api
            .patch(
                &name,
                &PatchParams::apply("modelcache-peer").force(),
                &Patch::Apply(&lease),
            )
            .await?;
        Ok(Owner {
            name,
            uid: applied.metadata.uid.unwrap_or_default(),
        })
    }

    /// What this node's records should say: its sealed models, and the
    /// pulls it has under way.
    async fn wanted(&self) -> anyhow::Result<BTreeMap<String, Holding>> {
        let roots = self.roots.clone();
        let held = crate::offload::blocking(move || Ok(held_models(&roots))).await?;
        let mut wanted: BTreeMap<String, Holding> = self
            .pulling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(sid, at)| (sid.clone(), Holding::Pulling(*at)))
            .collect();
        for sid in held.into_iter().take(MAX_ADVERTISED) {
            wanted.insert(sid, Holding::Sealed);
        }
        Ok(wanted)
    }

    /// The records the API holds for this node; those to write again (of
    /// another of its peer Leases than `owner`, or without today's bucket
    /// labels) as `None`.
    async fn own_records(&self, owner: Option<&Owner>) -> anyhow::Result<records::Known> {
        let selector = format!(
            "{}={},{}={}",
            records::HELD_LABEL,
            self.driver,
            records::NODE_LABEL,
            records::node_key(&self.node)
        );
        let listed = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await?;
        Ok(listed
            .items
            .iter()
            .filter_map(|l| {
                let h = records::parse(l).filter(|h| h.node == self.node)?;
                let current = records::owned_by(l, owner) && records::labelled(l, &self.node);
                Some((h.sid, current.then_some(h.holding)))
            })
            .collect())
    }

    /// Live peers (not this node) that hold `sid` sealed or are pulling
    /// it, `HOLDERS_ASKED` at most; `fresh` asks the API now rather than
    /// reuse a recent answer.
    pub async fn holders(&self, sid: &str, fresh: bool) -> Vec<Peer> {
        if !fresh
            && let Some((at, peers)) = self
                .asked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(sid)
            && at.elapsed() < LIST_FRESH_FOR
        {
            return peers.to_vec();
        }
        match self.ask(sid).await {
            Ok(peers) => {
                let peers = Arc::new(peers);
                let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
                asked.retain(|_, (at, _)| at.elapsed() < LIST_FRESH_FOR);
                asked.insert(sid.to_string(), (Instant::now(), peers.clone()));
                peers.to_vec()
            }
            Err(e) => {
                warn!(error = %e, "could not list peers; pulling from the origin");
                Vec::new()
            }
        }
    }

    /// One page of `sid`'s records, joined with their nodes' live peer
    /// Leases. The page is drawn at random from the model's holders, so
    /// that a popular model's followers spread over all of them instead of
    /// all reading the first names: a random bucket of the coarsest level,
    /// and while a bucket holds more than a page, a random bucket within it
    /// at the next level. A bucket naming fewer than `ENOUGH_IN_BUCKET`
    /// holders is filled up from the page above it (for the coarsest, any
    /// bucket's first page). Its cost is at most one page per level, at
    /// any cluster size.
    async fn ask(&self, sid: &str) -> anyhow::Result<Vec<Peer>> {
        let of_model = format!(
            "{}={},{}={sid}",
            records::HELD_LABEL,
            self.driver,
            records::MODEL_LABEL
        );
        let page = ListParams::default().limit(HOLDERS_ASKED);
        let holders = |listed: &[Lease]| -> Vec<records::Held> {
            listed
                .iter()
                .filter_map(records::parse)
                .filter(|h| h.sid == sid && h.node != self.node)
                .collect()
        };
        let bucket = records::draw_bucket();
        let mut above = Vec::new();
        let mut level = 0;
        let held = loop {
            let selector = format!(
                "{of_model},{}={}",
                records::SHARD_LABELS[level],
                &bucket[..=level]
            );
            let listed = self.api.list(&page.clone().labels(&selector)).await?;
            let whole = listed
                .metadata
                .continue_
                .as_deref()
                .is_none_or(str::is_empty);
            let here = holders(&listed.items);
            if here.len() < ENOUGH_IN_BUCKET {
                if level == 0 {
                    above = holders(&self.api.list(&page.labels(&of_model)).await?.items);
                }
                break filled(here, above);
            }
            if whole || level + 1 == records::LEVELS {
                break here;
            }
            above = here;
            level += 1;
        };
        debug!(
            model = sid,
            level,
            holders = held.len(),
            "asked who holds the model"
        );
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let live = self
            .endpoints(held.iter().map(|h| h.node_key.as_str()))
            .await?;
        Ok(held.into_iter().filter_map(|h| joined(h, &live)).collect())
    }

    /// `node`, if it is alive and holds or pulls `sid`: asked by name,
    /// whichever page its record would fall on.
    pub async fn holder(&self, sid: &str, node: &str) -> Option<Peer> {
        let record = match self.api.get_opt(&records::record_name(sid, node)).await {
            Ok(r) => r?,
            Err(e) => {
                warn!(error = %e, peer = node, "could not read a peer's record");
                return None;
            }
        };
        let held = records::parse(&record).filter(|h| h.sid == sid && h.node == node)?;
        let live = self
            .endpoints(std::iter::once(held.node_key.as_str()))
            .await
            .ok()?;
        joined(held, &live)
    }

    /// The live peer Leases of the nodes keyed, by key: one request.
    async fn endpoints<'a>(
        &self,
        keys: impl Iterator<Item = &'a str>,
    ) -> anyhow::Result<HashMap<String, Endpoint>> {
        let keys: BTreeSet<&str> = keys.collect();
        let selector = format!(
            "{LABEL}={},{} in ({})",
            self.driver,
            records::NODE_LABEL,
            keys.into_iter().collect::<Vec<_>>().join(",")
        );
        let leases = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await?;
        let now = Timestamp::now();
        Ok(leases
            .items
            .iter()
            .filter_map(|l| {
                let key = l
                    .metadata
                    .labels
                    .as_ref()?
                    .get(records::NODE_LABEL)?
                    .clone();
                Some((key, live_endpoint(l, now)?))
            })
            .filter(|(key, e)| *key == records::node_key(&e.node))
            .collect())
    }
}

/// The peer Lease `node`'s driver writes: where it serves peers, the
/// certificate it pins, renewed now; owned by its Node when `node_uid`
/// names it.
pub fn peer_lease(
    driver: &str,
    node: &str,
    advertise: &str,
    pin: &str,
    node_uid: Option<&str>,
) -> serde_json::Value {
    let mut lease = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(node),
            "labels": {LABEL: driver, records::NODE_LABEL: records::node_key(node)},
            "annotations": {ADDRESS: advertise, CERTIFICATE: pin},
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": MicroTime(Timestamp::now()),
        }
    });
    if let Some(uid) = node_uid {
        lease["metadata"]["ownerReferences"] = serde_json::json!([{
            "apiVersion": "v1", "kind": "Node", "name": node, "uid": uid,
        }]);
    }
    lease
}

/// A thin bucket's holders, then the page above's others, one page at most.
fn filled(here: Vec<records::Held>, above: Vec<records::Held>) -> Vec<records::Held> {
    let mut page = here;
    for h in above {
        if page.len() >= HOLDERS_ASKED as usize {
            break;
        }
        if !page.iter().any(|p| p.node == h.node) {
            page.push(h);
        }
    }
    page
}

/// A record's node as a peer, if its Lease is live.
fn joined(h: records::Held, live: &HashMap<String, Endpoint>) -> Option<Peer> {
    let e = live.get(&h.node_key).filter(|e| e.node == h.node)?;
    Some(Peer {
        node: h.node,
        addr: e.addr.clone(),
        pin: e.pin,
        holding: h.holding,
    })
}

/// Where the node of a peer Lease serves, unless the Lease expired or is
/// malformed.
fn live_endpoint(l: &Lease, now: Timestamp) -> Option<Endpoint> {
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
    Some(Endpoint {
        node: spec.holder_identity.clone()?,
        addr,
        pin,
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
    fn a_thin_bucket_is_filled_from_the_page_above_without_repeats() {
        let held = |node: &str| records::Held {
            node: node.into(),
            node_key: records::node_key(node),
            sid: "m".into(),
            holding: records::Holding::Sealed,
        };
        let above: Vec<_> = (0..20).map(|i| held(&format!("n{i}"))).collect();
        let page = filled(vec![held("n7"), held("x")], above.clone());
        let names: Vec<&str> = page.iter().map(|h| h.node.as_str()).collect();
        assert_eq!(names.len(), HOLDERS_ASKED as usize);
        assert_eq!(&names[..4], ["n7", "x", "n0", "n1"]);
        assert_eq!(names.iter().filter(|n| **n == "n7").count(), 1);
        assert_eq!(filled(Vec::new(), Vec::new()), Vec::new());
        assert_eq!(filled(vec![held("x")], Vec::new()), vec![held("x")]);
    }

    #[test]
    fn lease_names_are_dns_names() {
        assert_eq!(lease_name("node-1"), "modelcache-peer-node-1");
        let odd = lease_name("Node_1");
        assert!(odd.starts_with("modelcache-peer-node-1-"), "{odd}");
        assert_ne!(odd, lease_name("node_1"));
        assert!(lease_name(&"x".repeat(400)).len() < 253);
    }

    const PIN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn lease(renewed: Timestamp, addr: &str, pin: Option<&str>) -> Lease {
        let mut ann = serde_json::json!({ADDRESS: addr});
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
        let addr = "10.0.0.2:7420";
        let e = live_endpoint(&lease(now, addr, Some(PIN)), now).unwrap();
        assert_eq!((e.node.as_str(), e.addr.as_str()), ("n2", addr));
        let old = now - k8s_openapi::jiff::SignedDuration::from_secs(60);
        assert!(live_endpoint(&lease(old, addr, Some(PIN)), now).is_none());
        assert!(live_endpoint(&lease(now, "not an address", Some(PIN)), now).is_none());
        // No certificate, or not a digest: never dialled, so never sent the
        // token in the clear.
        assert!(live_endpoint(&lease(now, addr, None), now).is_none());
        assert!(live_endpoint(&lease(now, addr, Some("abc")), now).is_none());
    }
}
