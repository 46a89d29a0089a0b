//! What one node holds, as one small Lease per model it holds or is
//! pulling (a holder record), so that asking who holds a model reads only
//! that model's holders, whatever the cluster's size.
//!
//! A record is written when the node starts pulling a model, rewritten
//! once when it seals, deleted when the pull fails or the model is
//! evicted; it is never renewed. Whether its node is alive is the node's
//! own peer Lease's word, read for the few holders a query returns.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use sha2::Digest;

/// Every record of a driver carries this label (the driver's name).
pub const HELD_LABEL: &str = "modelcache.csi.io/held-of";
/// The model a record is about.
pub const MODEL_LABEL: &str = "modelcache.csi.io/model";
/// The node, as a digest (node names can be longer than a label value):
/// on records and on the node's peer Lease, which a query joins them by.
pub const NODE_LABEL: &str = "modelcache.csi.io/peer-node";
/// The node's buckets, one label per level: the first one, two and three
/// hex digits of its key (16, 256 and 4,096 buckets, each within the one
/// above), so that a query over a popular model's many holders can read a
/// random bucket small enough to be read whole.
pub const SHARD_LABELS: [&str; LEVELS] = [
    "modelcache.csi.io/shard",
    "modelcache.csi.io/shard-of-256",
    "modelcache.csi.io/shard-of-4096",
];
pub const LEVELS: usize = 3;
/// `sealed`, or `pulling@<unix ms>` (when the pull started).
pub const STATE: &str = "modelcache.csi.io/state";

const PREFIX: &str = "modelcache-has-";

/// What a node holds of one model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    Sealed,
    /// Pulling it since this instant (unix ms).
    Pulling(u64),
}

impl Holding {
    fn encode(self) -> String {
        match self {
            Holding::Sealed => "sealed".into(),
            Holding::Pulling(at) => format!("pulling@{at}"),
        }
    }

    fn decode(s: &str) -> Option<Holding> {
        match s.split_once('@') {
            None if s == "sealed" => Some(Holding::Sealed),
            Some(("pulling", at)) => at.parse().ok().map(Holding::Pulling),
            _ => None,
        }
    }
}

/// The label value naming `node`: a digest, short enough for any name.
pub fn node_key(node: &str) -> String {
    hex::encode(sha2::Sha256::digest(node.as_bytes()))[..20].to_string()
}

/// The bucket `node` falls into at `level` (0 for the coarsest): the
/// first `level + 1` hex digits of its key.
pub fn shard(node: &str, level: usize) -> String {
    node_key(node)[..=level].to_string()
}

/// A bucket at the finest level, drawn at random; its prefixes name the
/// buckets above it.
pub fn draw_bucket() -> String {
    let buckets = 16u32.pow(LEVELS as u32);
    format!("{:0width$x}", fastrand::u32(..buckets), width = LEVELS)
}

/// The labels naming `node`'s buckets at every level.
fn shard_labels(node: &str) -> impl Iterator<Item = (&'static str, String)> {
    (0..LEVELS).map(move |level| (SHARD_LABELS[level], shard(node, level)))
}

/// Whether `l` carries the bucket labels this driver writes: a record an
/// older driver wrote without them is written again, or finer queries
/// would never find it.
pub fn labelled(l: &Lease, node: &str) -> bool {
    let labels = l.metadata.labels.as_ref();
    shard_labels(node).all(|(k, v)| labels.and_then(|m| m.get(k)) == Some(&v))
}

/// The record of `node` holding `sid`: `modelcache-has-<sid>-<node>`,
/// with the node's name as its peer Lease writes it, so that an admission
/// policy can check that a node names only itself.
pub fn record_name(sid: &str, node: &str) -> String {
    let lease = super::lease_name(node);
    let tail = lease.strip_prefix(super::PEER_PREFIX).unwrap_or(&lease);
    format!("{PREFIX}{sid}-{tail}")
}

/// The record `node` publishes for `sid`.
pub fn record(
    driver: &str,
    node: &str,
    sid: &str,
    holding: Holding,
    owner: Option<&Owner>,
) -> serde_json::Value {
    let mut metadata = serde_json::json!({
        "name": record_name(sid, node),
        "labels": {
            HELD_LABEL: driver,
            MODEL_LABEL: sid,
            NODE_LABEL: node_key(node),
        },
        "annotations": {STATE: holding.encode()},
    });
    for (k, v) in shard_labels(node) {
        metadata["labels"][k] = v.into();
    }
    // Deleting the node's peer Lease takes its records with it.
    if let Some(o) = owner {
        metadata["ownerReferences"] = serde_json::json!([{
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "name": o.name,
            "uid": o.uid,
        }]);
    }
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {"holderIdentity": node},
    })
}

/// The node's peer Lease, which its records belong to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub name: String,
    pub uid: String,
}

/// A record as read back: whose, which model, what state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub node: String,
    pub node_key: String,
    pub sid: String,
    pub holding: Holding,
}

/// The record a Lease is, unless it is malformed.
pub fn parse(l: &Lease) -> Option<Held> {
    let labels = l.metadata.labels.as_ref()?;
    let sid = labels.get(MODEL_LABEL)?;
    if !super::super::is_model(sid) {
        return None;
    }
    let node = l.spec.as_ref()?.holder_identity.clone()?;
    let node_key = labels.get(NODE_LABEL)?.clone();
    if node_key != self::node_key(&node) {
        return None;
    }
    let holding = Holding::decode(l.metadata.annotations.as_ref()?.get(STATE)?)?;
    Some(Held {
        node,
        node_key,
        sid: sid.clone(),
        holding,
    })
}

/// The records as the API holds them: what each says, or `None` for one
/// that belongs to an older peer Lease of the node (written again, so
/// that deleting the current Lease takes it too).
pub type Known = BTreeMap<String, Option<Holding>>;

/// Whether `l` belongs to the peer Lease `owner`.
pub fn owned_by(l: &Lease, owner: Option<&Owner>) -> bool {
    let refs = l.metadata.owner_references.as_deref().unwrap_or_default();
    match owner {
        Some(o) => refs.iter().any(|r| r.uid == o.uid),
        None => refs.is_empty(),
    }
}

/// The writes that turn `known` records into `wanted` ones: records to
/// put (new, changed or another Lease's) and models whose records go.
pub fn diff(
    known: &Known,
    wanted: &BTreeMap<String, Holding>,
) -> (Vec<(String, Holding)>, Vec<String>) {
    let put = wanted
        .iter()
        .filter(|(sid, h)| known.get(*sid) != Some(&Some(**h)))
        .map(|(sid, h)| (sid.clone(), *h))
        .collect();
    let gone = known
        .keys()
        .filter(|sid| !wanted.contains_key(*sid))
        .cloned()
        .collect();
    (put, gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SID: &str = "m0123456789abcdef0123456789abcde";

    #[test]
    fn a_record_names_its_node_and_model_within_a_dns_name() {
        assert_eq!(
            record_name(SID, "node-1"),
            format!("modelcache-has-{SID}-node-1")
        );
        let long = record_name(SID, &"x".repeat(400));
        assert!(long.len() <= 253, "{}", long.len());
        assert_ne!(record_name(SID, "Node_1"), record_name(SID, "node_1"));
        assert_eq!(node_key("node-1").len(), 20);
        let buckets: Vec<String> = (0..LEVELS).map(|l| shard("node-1", l)).collect();
        for (level, b) in buckets.iter().enumerate() {
            assert_eq!(b.len(), level + 1);
            assert!(u16::from_str_radix(b, 16).is_ok());
            assert!(
                b.starts_with(&buckets[0]),
                "each bucket lies within the one above"
            );
        }
        let drawn: std::collections::BTreeSet<String> = (0..64).map(|_| draw_bucket()).collect();
        assert!(
            drawn
                .iter()
                .all(|b| b.len() == LEVELS && u16::from_str_radix(b, 16).is_ok())
        );
        assert!(drawn.len() > 32, "drawn at random: {drawn:?}");
    }

    #[test]
    fn records_read_back_as_written_and_malformed_ones_are_none() {
        for holding in [Holding::Sealed, Holding::Pulling(1_700_000_000_123)] {
            let owner = Owner {
                name: "modelcache-peer-n2".into(),
                uid: "u".into(),
            };
            let l: Lease =
                serde_json::from_value(record("d", "n2", SID, holding, Some(&owner))).unwrap();
            let held = parse(&l).unwrap();
            assert_eq!(
                (held.node.as_str(), held.sid.as_str(), held.holding),
                ("n2", SID, holding)
            );
            assert!(labelled(&l, "n2"));
            let mut older = l.clone();
            older
                .metadata
                .labels
                .as_mut()
                .unwrap()
                .remove(SHARD_LABELS[2]);
            assert!(
                !labelled(&older, "n2"),
                "a record without the finest bucket"
            );
            assert_eq!(parse(&older), Some(held), "still read: it names its holder");
        }
        let mut l: Lease =
            serde_json::from_value(record("d", "n2", SID, Holding::Sealed, None)).unwrap();
        l.spec.as_mut().unwrap().holder_identity = Some("n3".into());
        assert_eq!(
            parse(&l),
            None,
            "a record whose node label is another node's"
        );
        let mut l: Lease =
            serde_json::from_value(record("d", "n2", "not-a-model", Holding::Sealed, None))
                .unwrap();
        assert_eq!(parse(&l), None);
        l = serde_json::from_value(record("d", "n2", SID, Holding::Sealed, None)).unwrap();
        l.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(STATE.into(), "pulling@soon".into());
        assert_eq!(parse(&l), None);
    }

    #[test]
    fn only_changed_records_are_written() {
        let known: Known = [
            ("a".into(), Some(Holding::Sealed)),
            ("b".into(), Some(Holding::Pulling(1))),
            ("c".into(), Some(Holding::Sealed)),
            ("e".into(), None),
            ("f".into(), None),
        ]
        .into();
        let wanted: BTreeMap<String, Holding> = [
            ("a".into(), Holding::Sealed),
            ("b".into(), Holding::Sealed),
            ("d".into(), Holding::Pulling(2)),
            ("e".into(), Holding::Sealed),
        ]
        .into();
        let (put, gone) = diff(&known, &wanted);
        assert_eq!(
            put,
            [
                ("b".to_string(), Holding::Sealed),
                ("d".to_string(), Holding::Pulling(2)),
                ("e".to_string(), Holding::Sealed)
            ],
            "changed, new, and another Lease's"
        );
        assert_eq!(gone, ["c", "f"]);
        let same: Known = wanted.iter().map(|(k, v)| (k.clone(), Some(*v))).collect();
        assert_eq!(diff(&same, &wanted), (vec![], vec![]));
    }
}
