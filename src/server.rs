//! Binds the CSI endpoint and serves the chosen services on it (through
//! the `uds` shim, so any gRPC client is answered).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::Config;
use crate::context::Context;
use crate::controller::ControllerService;
use crate::csi::controller_server::ControllerServer;
use crate::csi::identity_server::IdentityServer;
use crate::csi::node_server::NodeServer;
use crate::identity::IdentityService;
use crate::metrics::Metrics;
use crate::node::absent::AbsentNode;
use crate::node::inline::Inline;
use crate::node::{NodeOps, NodeService};
use crate::provision::{Agent, Provisioner};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Controller,
    Node,
    All,
}

/// `unix:///path`, `unix:/path` or a bare absolute path.
pub fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let p = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    anyhow::ensure!(
        p.starts_with('/'),
        "--endpoint {endpoint:?} must be unix:///absolute/path.sock"
    );
    Ok(PathBuf::from(p))
}

pub async fn serve(
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    mode: Mode,
    endpoint: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let path = socket_path(endpoint)?;
    let listener = crate::uds::bind_hidden(&path)?;
    serve_on(cfg, metrics, mode, listener, shutdown).await
}

/// Serves the chosen services on `listener`, counting into `metrics` (the
/// handle the process's metrics endpoint renders). The socket is put in
/// place once the services answer, so no client dials it while they start
/// (reading the peer token, the Kubernetes client).
pub async fn serve_on(
    cfg: Arc<Config>,
    metrics: Arc<Metrics>,
    mode: Mode,
    listener: crate::uds::Bound,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let controller = matches!(mode, Mode::Controller | Mode::All);
    let node = matches!(mode, Mode::Node | Mode::All);
    anyhow::ensure!(
        cfg.peer.is_none() || controller,
        "--peer-listen fills models this process pulls: it needs the controller service (--mode all, or --node-deployment)"
    );
    anyhow::ensure!(
        !node || cfg.node_id.is_some(),
        "--node-id is required to serve the node service"
    );
    if cfg.node_id.is_some() {
        let dir = cfg.state_dir.clone();
        crate::offload::blocking(move || crate::cache::keep_private(&dir)).await?;
    }
    let mut ctx = Context::new(cfg.clone(), metrics.clone());
    let client = match controller && cfg.kube_api {
        false => None,
        true => Some(kube_client(cfg.kubeconfig.as_deref()).await?),
    };
    if let Some(client) = &client {
        ctx = ctx.with_kube(crate::kubeapi::KubeApi::new(
            client.clone(),
            &cfg.driver_name,
            cfg.node_id.as_deref(),
        ));
        tracing::info!("using the Kubernetes API for per-PVC sources, pvc:// and events");
    }
    let provisioner = match controller {
        false => None,
        true => {
            let mut p = Provisioner::new(&ctx);
            if let (Some(peer), Some(node), Some(client)) =
                (cfg.peer.clone(), cfg.node_id.clone(), client.clone())
            {
                p = p.with_fill(crate::peer::start(peer, node, &ctx, client).await?);
            }
            anyhow::ensure!(
                !cfg.shared_central || cfg.node_id.is_some(),
                "--shared-by-central-controller is a node driver's flag: it needs --node-id"
            );
            anyhow::ensure!(
                cfg.peer.is_none() || (cfg.kube_api && cfg.node_id.is_some()),
                "--peer-listen needs --node-id and Kubernetes API access (--kube-api, --kubeconfig)"
            );
            Some(Arc::new(p))
        }
    };
    spawn_agents(&ctx, provisioner.as_ref(), client.as_ref())?;
    metrics.watch_roots(
        ctx.roots
            .roots
            .iter()
            .map(|r| Arc::new(r.clone()) as Arc<dyn crate::metrics::GaugedRoot>),
    );
    let router = tonic::transport::Server::builder()
        .layer(tower::layer::layer_fn(move |inner| Observe {
            inner,
            metrics: metrics.clone(),
        }))
        .add_service(IdentityServer::new(IdentityService::new(
            cfg.clone(),
            controller,
        )))
        .add_optional_service(provisioner.clone().map(|p| {
            let resume = p.clone();
            tokio::spawn(async move { resume.resume_wanted().await });
            ControllerServer::new(ControllerService::new(p))
        }))
        .add_optional_service(node.then(|| {
            let ops = Arc::new(NodeOps::new(&ctx));
            let o = ops.clone();
            tokio::spawn(async move { o.take_over_views().await });
            let mut svc = NodeService::new(ops.clone());
            if let Some(p) = &provisioner {
                svc = svc.with_inline(Arc::new(Inline::new(&ctx, p.clone(), ops)));
            }
            NodeServer::new(svc)
        }))
        .add_optional_service((!node).then(|| NodeServer::new(AbsentNode)));
    tracing::info!(driver = %cfg.driver_name, ?mode, node = ?cfg.node_id, "serving CSI");
    // Through the shim, so gRPC clients that send their own :authority for
    // a Unix socket (C-core: Python, C++) are served too.
    let listener = listener.publish()?;
    router
        .serve_with_incoming_shutdown(crate::uds::incoming(listener), shutdown)
        .await?;
    Ok(())
}

/// Starts the agents and sweeps the settings ask for, beside the services.
fn spawn_agents(
    ctx: &Context,
    provisioner: Option<&Arc<Provisioner>>,
    client: Option<&kube::Client>,
) -> anyhow::Result<()> {
    let cfg = &ctx.cfg;
    if cfg.modify_node_local {
        let agent = Agent::new("--modify-node-local-volumes", ctx, provisioner)
            .map_err(anyhow::Error::msg)?;
        tokio::spawn(crate::modify_agent::run(agent));
    }
    if cfg.summarize_prefetches {
        let Some(client) = client else {
            anyhow::bail!(
                "--summarize-prefetches needs the controller service and Kubernetes API access (--kube-api, --kubeconfig)"
            );
        };
        tokio::spawn(crate::prefetch::summary::run(
            client.clone(),
            cfg.driver_name.clone(),
        ));
    }
    // A prefetching node says it holds a model through its warm label.
    if cfg.label_warm_nodes || cfg.prefetch {
        let agent =
            Agent::new("--label-warm-nodes", ctx, provisioner).map_err(anyhow::Error::msg)?;
        tokio::spawn(crate::prefetch::labels::run(agent));
    }
    if cfg.prefetch {
        let agent = Agent::new("--prefetch", ctx, provisioner).map_err(anyhow::Error::msg)?;
        tokio::spawn(crate::prefetch::run(agent));
    }
    if let Some(p) = provisioner.filter(|_| ctx.kube.is_some()).cloned() {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(15));
            loop {
                tick.tick().await;
                p.sweep_jobs().await;
            }
        });
    }
    if let (Some(p), Some(idle)) = (provisioner, cfg.evict_idle) {
        let p = p.clone();
        tokio::spawn(async move {
            // Often enough that a model goes soon after its idle time ends.
            let mut tick = tokio::time::interval((idle / 4).clamp(
                std::time::Duration::from_secs(10),
                std::time::Duration::from_secs(300),
            ));
            loop {
                tick.tick().await;
                let p = p.clone();
                let _ = tokio::task::spawn_blocking(move || p.evict_idle(idle)).await;
            }
        });
    }
    Ok(())
}

/// A client from a kubeconfig file, else the usual inference ($KUBECONFIG,
/// ~/.kube/config, in-cluster).
pub async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// Records every call's latency, and its gRPC code when it failed, by
/// method. Errors come back as trailers-only responses, so the status is in
/// the response headers; a success has none there.
#[derive(Clone)]
struct Observe<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, ReqBody, ResBody> tower::Service<tonic::codegen::http::Request<ReqBody>> for Observe<S>
where
    S: tower::Service<
            tonic::codegen::http::Request<ReqBody>,
            Response = tonic::codegen::http::Response<ResBody>,
        >,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<ReqBody>) -> Self::Future {
        let method = req
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let started = std::time::Instant::now();
        let fut = self.inner.call(req);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let res = fut.await;
            if let Ok(r) = &res {
                let code = r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map(tonic::Code::from);
                metrics.rpc(&method, started, code);
            }
            res
        })
    }
}
