//! On each node: labels its Node `warm.<driver>/<class>: "true"` for each
//! StorageClass of this driver whose model the node holds sealed, so that
//! a Deployment's preferred node affinity lands pods where their model
//! already is. The labels follow the cache: added once a class's model is
//! sealed here, removed once it is evicted, the class deleted, or its
//! `source` changed. The node writes only its own Node and only these
//! labels (deploy/'s admission policy holds it to that).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::provision::params::SOURCE;
use crate::provision::{Agent, ClassModel};

/// How often the cache is looked at: a seal or an eviction shows within
/// this.
const EVERY: Duration = Duration::from_secs(5);
/// How often the Node's labels are read again, in case someone else
/// changed them.
const REREAD: Duration = Duration::from_secs(300);

/// The label prefix of `driver`'s warm labels.
pub fn prefix(driver: &str) -> String {
    format!("warm.{driver}/")
}

/// Whether `class` fits a label's name (at most 63 characters); a class
/// name is otherwise already a valid one.
pub fn labelable(class: &str) -> bool {
    class.len() <= 63
}

/// Runs until the process ends.
pub async fn run(agent: Agent) {
    let (classes, changed) = crate::kubeapi::informer(watcher(
        Api::<StorageClass>::all(agent.kube.client()),
        watcher::Config::default(),
    ));
    let wake = Arc::new(tokio::sync::Notify::new());
    let woken = wake.clone();
    tokio::spawn(async move {
        let mut changed = std::pin::pin!(changed);
        while changed.next().await.is_some() {
            woken.notify_one();
        }
    });
    if classes.wait_until_ready().await.is_err() {
        warn!("the StorageClass informer never became ready; nodes are not labelled warm");
        return;
    }
    let prefix = prefix(agent.driver());
    info!(node = %agent.node, %prefix, "labelling this node warm for the classes whose model it holds");
    let mut shown: Option<(BTreeSet<String>, Instant)> = None;
    let mut too_long = BTreeSet::new();
    loop {
        let step = async {
            let held = agent.provisioner.warm_classes().await?;
            let want = wanted(&held, &classes, agent.driver());
            for class in want.iter().filter(|c| !labelable(c)) {
                if too_long.insert(class.clone()) {
                    warn!(%class, "a StorageClass name longer than 63 characters cannot be a label name; this class's warm nodes are not labelled");
                }
            }
            let want: BTreeSet<String> = want.into_iter().filter(|c| labelable(c)).collect();
            let have = match shown.take() {
                Some((have, at)) if at.elapsed() < REREAD => have,
                _ => on_node(&agent, &prefix).await?,
            };
            if want != have {
                relabel(&agent, &prefix, &have, &want).await?;
                info!(warm = ?want, "labelled this node warm");
            }
            shown = Some((want, Instant::now()));
            Ok::<_, Error>(())
        };
        match step.await {
            Ok(()) => {}
            // Refused: nothing changes until an admin grants it and the
            // driver restarts; asking again would only repeat the refusal.
            Err(e @ Error::Precondition(_)) => {
                warn!(error = %e, "this node is not labelled warm");
                return;
            }
            Err(e) => {
                warn!(error = %e, "could not label this node warm; trying again");
                shown = None;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = wake.notified() => {}
        }
    }
}

/// The classes held here that still exist, are `driver`'s and name the
/// model that was pulled for them.
fn wanted(
    held: &BTreeMap<String, ClassModel>,
    classes: &Store<StorageClass>,
    driver: &str,
) -> BTreeSet<String> {
    held.iter()
        .filter(|(class, model)| {
            classes.get(&ObjectRef::new(class)).is_some_and(|sc| {
                sc.provisioner == driver
                    && sc.parameters.as_ref().and_then(|p| p.get(SOURCE)) == Some(&model.source)
            })
        })
        .map(|(class, _)| class.clone())
        .collect()
}

/// The classes the Node's warm labels name now.
async fn on_node(agent: &Agent, prefix: &str) -> Result<BTreeSet<String>> {
    Ok(agent
        .kube
        .node_labels(&agent.node)
        .await?
        .keys()
        .filter_map(|k| k.strip_prefix(prefix))
        .map(str::to_string)
        .collect())
}

/// Adds the labels of `want` not in `have`, and removes those of `have`
/// not in `want`.
async fn relabel(
    agent: &Agent,
    prefix: &str,
    have: &BTreeSet<String>,
    want: &BTreeSet<String>,
) -> Result<()> {
    let added = want.difference(have).map(|c| (c, Some("true".to_string())));
    let removed = have.difference(want).map(|c| (c, None));
    let labels = added
        .chain(removed)
        .map(|(c, v)| (format!("{prefix}{c}"), v))
        .collect();
    agent.kube.label_node(&agent.node, &labels).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_the_drivers() {
        assert_eq!(prefix("modelcache.csi.io"), "warm.modelcache.csi.io/");
        assert!(labelable(&"a".repeat(63)));
        assert!(!labelable(&"a".repeat(64)));
    }
}
