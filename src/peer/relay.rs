//! Which copies a pull asks for each chunk, in what order, and which of
//! them it waits for: every pull under way relays a share of the chunks.
//!
//! Pulls that start together move through a file in step, so a pull
//! seldom holds a chunk before another asks for it. Asked first whatever
//! it holds, the leader (the one pull that takes the model from the
//! origin) serves every follower: 3.10 copies uploaded to three followers
//! on 25 MB/s links (`fanout_links::bench`). Dealt round the pulls
//! started earlier, the first followers carry 1 + 1/2 + … + 1/(n−1)
//! copies: 5.87 measured at 16 nodes.
//!
//! So every chunk travels a tree of the pulls ordered by their rank for
//! it. A rank is a hash of the chunk and the node's name: every node
//! computes the same ranks without a word between them, and each pull
//! has each place in the order for an even share of the chunks. The
//! lowest takes the chunk from the leader; the pull at place p waits for
//! it at place (p - 1) / `FAN_OUT`. A pull waits only on the leader,
//! which waits on nobody, and on a pull that ranks lower than itself for
//! that chunk: waits for a chunk form chains down the ranks that end at
//! the leader, never a cycle, whatever each node knows of the others.
//! The leader uploads about one copy, and each follower about one, spread
//! over the chunks it relays.

use sha2::{Digest, Sha256};

/// One copy to ask for a chunk, and whether it is asked to wait for the
/// chunk (a pull that has not reached it yet holds the request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask {
    pub copy: usize,
    pub wait: bool,
}

/// `node`'s rank for chunk `idx` of `path`: the first 8 bytes of a
/// sha256, the same on every node and every version of the driver.
pub fn rank(node: &str, path: &str, idx: u64) -> u64 {
    let mut h = Sha256::new();
    h.update(path.as_bytes());
    h.update([0]);
    h.update(idx.to_be_bytes());
    h.update(node.as_bytes());
    let d = h.finalize();
    u64::from_be_bytes(d[..8].try_into().expect("a sha256 has 32 bytes"))
}

/// The copies to ask for chunk `idx`, in order: `sealed` copies striped by
/// chunk, never waited for; then, among `pulling` (each with its rank for
/// this chunk, against this node's `mine`), this node's relay in the tree
/// of the chunk's ranks, waited for, then the `leaders` waited for, then
/// two other pulls (striped by chunk), not waited for. When this node
/// ranks lowest, the lowest other pull is asked first without a wait: it
/// may hold the chunk already (it started earlier).
pub fn deal(
    sealed: &[usize],
    pulling: &[(usize, u64)],
    leaders: &[usize],
    mine: u64,
    idx: usize,
) -> Vec<Ask> {
    let ask = |copy, wait| Ask { copy, wait };
    let mut order: Vec<Ask> = (0..sealed.len())
        .map(|k| ask(sealed[(idx + k) % sealed.len()], false))
        .collect();
    let mut by_rank = pulling.to_vec();
    by_rank.sort_by_key(|&(copy, r)| (r, copy));
    // This node's place among the pulls by rank: the first takes the chunk
    // from the leader, place p from the pull at place (p - 1) / FAN_OUT,
    // which ranks lower. A pull serves each chunk to at most FAN_OUT
    // others, and they pass it on.
    let place = by_rank.iter().filter(|&&(_, r)| r < mine).count();
    let first = match place {
        0 => by_rank.first().map(|&(c, _)| ask(c, false)),
        p => Some(ask(by_rank[(p - 1) / FAN_OUT].0, true)),
    };
    order.extend(first);
    order.extend(leaders.iter().map(|&c| ask(c, true)));
    // A few others, not waited for, in case one holds it already: asking
    // every pull each round costs each a request per chunk and node.
    let rest: Vec<usize> = by_rank
        .iter()
        .map(|&(c, _)| c)
        .filter(|&c| first.is_none_or(|f| f.copy != c))
        .collect();
    order.extend((0..rest.len().min(NOT_WAITED)).map(|k| ask(rest[(idx + k) % rest.len()], false)));
    order
}

/// How many pulls one pull serves each chunk to: with one relay per chunk
/// serving every other pull, a chunk of 8 MiB took 31 followers 26 s on
/// 10 MB/s links, past the engine's 30 s stall window once waits were
/// added, and 27 of 32 pulls stalled.
pub const FAN_OUT: usize = 4;

/// How many pulls besides the relay and the leader are asked for a chunk,
/// without waiting for it.
const NOT_WAITED: usize = 2;

#[cfg(test)]
mod tests {
    use super::{Ask, deal, rank};

    fn ask(copy: usize, wait: bool) -> Ask {
        Ask { copy, wait }
    }

    #[test]
    fn the_relay_is_waited_for_only_when_it_ranks_lower() {
        // Leader 9; pulls 4 (rank 10) and 5 (rank 30).
        let pulling = [(4, 10), (5, 30)];
        assert_eq!(
            deal(&[], &pulling, &[9], 20, 0),
            [ask(4, true), ask(9, true), ask(5, false)]
        );
        // This node relays the chunk: the leader, after a pull not waited for.
        assert_eq!(
            deal(&[], &pulling, &[9], 5, 0),
            [ask(4, false), ask(9, true), ask(5, false)]
        );
        // The first follower has only the leader to take from.
        assert_eq!(deal(&[], &[], &[9], 7, 7), [ask(9, true)]);
        // Sealed copies come first, striped, never waited for.
        assert_eq!(
            deal(&[1, 2], &[(4, 1)], &[9], 2, 1),
            [ask(2, false), ask(1, false), ask(4, true), ask(9, true)]
        );
    }

    /// Each node relays an even share of the chunks, and no two pulls ever
    /// wait on each other for one chunk, whatever each knows of the other
    /// pulls.
    /// Past `FAN_OUT` pulls below it, a pull waits on its parent in the
    /// tree of ranks, not on the lowest.
    #[test]
    fn a_chunk_travels_a_tree_of_ranks() {
        let pulling: Vec<(usize, u64)> = (0..12).map(|i| (i, 10 * i as u64)).collect();
        // Place 9 (nine pulls rank lower): its parent is place 2.
        assert_eq!(deal(&[], &pulling, &[99], 85, 0)[0], ask(2, true));
        // Places 1 to 4 wait on the lowest.
        assert_eq!(deal(&[], &pulling, &[99], 35, 0)[0], ask(0, true));
        // Each pull is the parent of at most FAN_OUT others.
        let mut children = [0usize; 12];
        for mine in 1..=12u64 {
            let first = deal(&[], &pulling, &[99], mine * 10 - 5, 0)[0];
            children[first.copy] += 1;
        }
        assert!(
            children.iter().all(|&c| c <= super::FAN_OUT),
            "{children:?}"
        );
    }

    #[test]
    fn relays_are_shared_evenly_and_waits_never_cycle() {
        let nodes: Vec<String> = (0..16).map(|i| format!("node-{i}")).collect();
        let chunks = 4096u64;
        let mut relayed = vec![0u64; nodes.len()];
        for idx in 0..chunks {
            let r: Vec<u64> = nodes
                .iter()
                .map(|n| rank(n, "model.safetensors", idx))
                .collect();
            let lowest = (0..nodes.len()).min_by_key(|&i| r[i]).unwrap();
            relayed[lowest] += 1;
            // Each node knows some of the others (a different subset per
            // node): it waits only on the lowest it knows, if lower than
            // its own, so following the waits strictly lowers the rank.
            for me in 0..nodes.len() {
                let known: Vec<(usize, u64)> = (0..nodes.len())
                    .filter(|&o| o != me && !(o * 7 + me * 3 + idx as usize).is_multiple_of(5))
                    .map(|o| (o, r[o]))
                    .collect();
                let order = deal(&[], &known, &[99], r[me], idx as usize);
                if let Some(first) = order.first().filter(|a| a.wait && a.copy != 99) {
                    assert!(r[first.copy] < r[me], "a wait up the ranks");
                }
            }
        }
        let fair = chunks / nodes.len() as u64;
        for (i, n) in relayed.iter().enumerate() {
            assert!(
                n.abs_diff(fair) < fair / 4,
                "node {i} relays {n} of {chunks} chunks; a fair share is {fair}"
            );
        }
        assert_ne!(rank("a", "f", 0), rank("a", "f", 1));
        assert_ne!(rank("a", "f", 0), rank("b", "f", 0));
    }
}
