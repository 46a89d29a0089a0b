//! What one process's handlers and reconcilers share: its settings, the
//! roots it serves, API access when it has any, and its metrics.
//!
//! Built once in `server` and handed down, so nothing reads a process-wide
//! global and a test can run several drivers side by side in one process.

use std::sync::Arc;

use crate::cache::Roots;
use crate::config::Config;
use crate::kubeapi::KubeApi;
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct Context {
    pub cfg: Arc<Config>,
    pub roots: Roots,
    /// For per-PVC sources, `pvc://`, events and the node's own agents.
    pub kube: Option<KubeApi>,
    pub metrics: Arc<Metrics>,
}

impl Context {
    /// A context without API access, counting into `metrics`.
    pub fn new(cfg: Arc<Config>, metrics: Arc<Metrics>) -> Context {
        Context {
            roots: crate::cache::Roots::of(&cfg),
            cfg,
            kube: None,
            metrics,
        }
    }

    /// A context for tests and tools: its own metrics, which nothing serves.
    pub fn standalone(cfg: Arc<Config>) -> Context {
        Context::new(cfg, Arc::new(Metrics::new()))
    }

    pub fn with_kube(mut self, kube: KubeApi) -> Context {
        self.kube = Some(kube);
        self
    }
}
