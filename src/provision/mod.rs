//! Provisioning: turning a request into a volume in a root — resolving what
//! it names (the API), planning (pure), executing, sealing, deleting — for
//! the controller's handlers and for the node's own agents alike.
//!
//! The API is `Provisioner`'s methods; its parts stay private so that the
//! controller service, inline volumes, prefetch and the modify agent all go
//! through the same calls and the same locks.

pub mod node_report;
pub mod params;
pub mod plan;
mod volumes;
mod wanted;

pub use plan::{CreateRequest, DEFAULT_CAPACITY, InlineSource};
pub use volumes::{Listed, Provisioner};

use std::sync::Arc;

use crate::context::Context;
use crate::kubeapi::KubeApi;

/// What a node's own agents (prefetch, the modify agent) work with: the
/// process's context, its API access, this node and its provisioner.
#[derive(Clone)]
pub struct Agent {
    pub ctx: Context,
    pub kube: KubeApi,
    pub node: String,
    pub provisioner: Arc<Provisioner>,
}

impl Agent {
    /// The agent for `flag`, or why the process cannot run it.
    pub fn new(
        flag: &str,
        ctx: &Context,
        provisioner: Option<&Arc<Provisioner>>,
    ) -> std::result::Result<Agent, String> {
        let (Some(p), Some(node)) = (provisioner, ctx.cfg.node_id.clone()) else {
            return Err(format!(
                "{flag} needs --node-id and the controller service (--mode controller or all)"
            ));
        };
        let Some(kube) = ctx.kube.clone() else {
            return Err(format!("{flag} needs Kubernetes API access (--kube-api)"));
        };
        Ok(Agent {
            ctx: ctx.clone(),
            kube,
            node,
            provisioner: p.clone(),
        })
    }

    /// The driver name its objects (classes, PVs) must carry.
    pub fn driver(&self) -> &str {
        &self.ctx.cfg.driver_name
    }
}
