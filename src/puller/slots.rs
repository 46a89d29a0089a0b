//! Pull slots (`--pull-parallel-models`), shared fairly between
//! namespaces: a free slot goes to the waiting pulls in turn by namespace,
//! so one tenant's queue of pulls cannot starve another's. A pull may give
//! its slot back early (the engine does when its transfer is slow and
//! others wait), which is how slow origins are kept from holding every
//! slot of a node.
//!
//! Never holds its lock across an await: a grant is a value sent through a
//! oneshot channel, and a slot dropped anywhere, granted or in flight,
//! passes on to the next waiter.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The slots of one engine.
#[derive(Clone)]
pub struct Slots {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    free: usize,
    /// Waiting pulls by namespace ("" for pulls no tenant asked for).
    queues: BTreeMap<String, VecDeque<oneshot::Sender<Slot>>>,
    /// The namespace served last: the next grant goes to the one after it.
    turn: Option<String>,
}

/// One slot, given back (to the next waiter) when dropped.
pub struct Slot {
    inner: Option<Arc<Inner>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            release(&inner);
        }
    }
}

impl Slots {
    pub fn new(n: usize) -> Slots {
        Slots {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    free: n.max(1),
                    ..Default::default()
                }),
            }),
        }
    }

    /// Waits for a slot for a pull of namespace `ns`.
    pub async fn acquire(&self, ns: &str) -> Slot {
        let rx = {
            let mut st = self.inner.lock();
            if st.free > 0 && st.queues.is_empty() {
                st.free -= 1;
                return Slot {
                    inner: Some(self.inner.clone()),
                };
            }
            let (tx, rx) = oneshot::channel();
            st.queues.entry(ns.to_string()).or_default().push_back(tx);
            rx
        };
        // The sender lives in the queue until a slot is sent through it;
        // it is dropped unsent only if every `Slots` is gone.
        rx.await.unwrap_or(Slot { inner: None })
    }

    /// Pulls waiting for a slot now.
    pub fn waiting(&self) -> usize {
        let st = self.inner.lock();
        st.queues
            .values()
            .flat_map(|q| q.iter())
            .filter(|tx| !tx.is_closed())
            .count()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Hands a freed slot to the next waiter, in turn by namespace, or keeps
/// it free when nobody (alive) waits.
fn release(inner: &Arc<Inner>) {
    let mut st = inner.lock();
    loop {
        let after = st.turn.clone().map_or(Bound::Unbounded, Bound::Excluded);
        let next = st
            .queues
            .range::<String, _>((after, Bound::Unbounded))
            .map(|(ns, _)| ns.clone())
            .next()
            .or_else(|| st.queues.keys().next().cloned());
        let Some(ns) = next else {
            st.free += 1;
            return;
        };
        let queue = st.queues.get_mut(&ns).expect("a listed queue");
        let tx = queue.pop_front().expect("queues are never left empty");
        if queue.is_empty() {
            st.queues.remove(&ns);
        }
        st.turn = Some(ns);
        let slot = Slot {
            inner: Some(inner.clone()),
        };
        match tx.send(slot) {
            Ok(()) => return,
            // That waiter is gone: take the slot back without releasing it
            // (the lock is ours) and try the next.
            Err(mut unsent) => unsent.inner = None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Namespace a queues three pulls before b and c queue one each: the
    /// freed slots go a, b, c, a, a, not a, a, a, b, c.
    #[tokio::test]
    async fn freed_slots_go_round_the_namespaces() {
        let slots = Slots::new(1);
        let held = slots.acquire("x").await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for ns in ["a", "a", "a", "b", "c"] {
            let (s, o) = (slots.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let slot = s.acquire(ns).await;
                o.lock().unwrap().push(ns);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(slot);
            }));
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(slots.waiting(), 5);
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["a", "b", "c", "a", "a"]);
        assert_eq!(slots.waiting(), 0);
    }

    /// A waiter that gave up does not swallow the slot.
    #[tokio::test]
    async fn a_gone_waiter_passes_its_turn_on() {
        let slots = Slots::new(1);
        let held = slots.acquire("a").await;
        let gone = {
            let s = slots.clone();
            tokio::spawn(async move {
                let _slot = s.acquire("b").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        gone.abort();
        let _ = gone.await;
        let next = {
            let s = slots.clone();
            tokio::spawn(async move { s.acquire("c").await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(held);
        let slot = tokio::time::timeout(Duration::from_secs(2), next)
            .await
            .expect("the slot reached the live waiter")
            .unwrap();
        drop(slot);
        // Free again for an immediate taker.
        tokio::time::timeout(Duration::from_secs(1), slots.acquire("d"))
            .await
            .expect("the slot was returned");
    }
}
