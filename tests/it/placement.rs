//! Who provisions which class (issue #27). external-provisioner's node
//! deployment asks GetCapacity about a claim (its name among the
//! parameters) before it takes an Immediate-binding claim; a node's driver
//! has no room for one of a shared class when a central controller
//! provisions those, which keeps every node from racing it for each shared
//! claim. CSIStorageCapacity's question (no claim) gets the real room, by
//! which the scheduler places WaitForFirstConsumer pods.

use crate::support::harness::*;
use modelcache_csi::csi::{GetCapacityRequest, Topology};

async fn capacity(d: &Driver, params: &[(&str, &str)], node: Option<&str>, claim: bool) -> i64 {
    let mut params = map(params);
    if claim {
        params.extend(map(&[
            ("csi.storage.k8s.io/pvc/name", "data"),
            ("csi.storage.k8s.io/pvc/namespace", "team-a"),
            ("csi.storage.k8s.io/pv/name", "pvc-1234"),
        ]));
    }
    d.client
        .clone()
        .controller
        .get_capacity(GetCapacityRequest {
            parameters: params,
            accessible_topology: node.map(|n| Topology {
                segments: map(&[("topology.modelcache.csi.io/node", n)]),
            }),
            ..Default::default()
        })
        .await
        .expect("GetCapacity")
        .into_inner()
        .available_capacity
}

#[tokio::test]
async fn a_node_has_no_room_for_a_shared_claim_when_a_central_controller_provisions_it() {
    let shared = [("backend", "shared"), ("role", "source")];
    let shared_xfs = [("backend", "xfs"), ("imageLocation", "shared")];
    let local = [("backend", "local"), ("role", "source")];
    let node_xfs = [("backend", "xfs")];
    let args = ["--backends", "local,shared,xfs", "--min-free", "0"];

    // Alone (the single-node e2e, a cluster without the Deployment): the
    // node's driver provisions shared volumes too, and has room for them.
    let alone = Driver::start_with(&args).await;
    for params in [&shared[..], &shared_xfs, &local, &node_xfs] {
        for claim in [false, true] {
            assert!(
                capacity(&alone, params, Some(NODE), claim).await > 0,
                "{params:?} (claim: {claim}) at a node without a central controller"
            );
        }
    }

    let node = Driver::start_with(&[&args[..], &["--shared-by-central-controller"]].concat()).await;
    for params in [&shared[..], &shared_xfs] {
        for topology in [Some(NODE), None] {
            assert_eq!(
                capacity(&node, params, topology, true).await,
                0,
                "{params:?}: a claim of it is the central controller's"
            );
            assert!(
                capacity(&node, params, topology, false).await > 0,
                "{params:?}: CSIStorageCapacity shows the real room"
            );
        }
    }
    // A shared class with a parameter the driver refuses is still no
    // node's to take: the central controller names the parameter.
    let bad_shared = [("backend", "shared"), ("role", "sauce")];
    assert_eq!(capacity(&node, &bad_shared, Some(NODE), true).await, 0);
    for params in [&local[..], &node_xfs] {
        for claim in [false, true] {
            assert!(
                capacity(&node, params, Some(NODE), claim).await > 0,
                "{params:?} (claim: {claim}) on its own node"
            );
            assert_eq!(
                capacity(&node, params, Some("another-node"), claim).await,
                0,
                "{params:?} (claim: {claim}) for another node's segment"
            );
        }
    }
}
