//! modelcache-csi: parse flags, then serve CSI, run the demo, or seal a volume.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use modelcache_csi::cache::Backend;
use modelcache_csi::config::Config;
use modelcache_csi::server::{self, Mode};

#[derive(Parser)]
#[command(
    name = "modelcache-csi",
    version,
    about = "CSI driver serving sealed ML models as shared read-only volumes"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve CSI (the default when no subcommand is given).
    Serve(ServeArgs),
    /// Run the driver in-process on a temp dir and show three cache volumes sharing one model.
    Demo(modelcache_csi::demo::DemoArgs),
    /// Seal a source volume through a running controller (ControllerModifyVolume sealed=true).
    Seal {
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: String,
        #[arg(long)]
        volume_id: String,
    },
}

#[derive(Args, Clone)]
struct ServeArgs {
    /// CSI endpoint: unix:///path/to/csi.sock
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Which services this process runs.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// This node's name; required for the node service and node-local backends.
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,
    /// CSI driver name.
    #[arg(long, default_value = "modelcache.csi.io")]
    driver_name: String,
    /// Where node-local volumes and state live.
    #[arg(long, default_value = "/var/lib/modelcache-csi")]
    state_dir: PathBuf,
    /// A filesystem mounted at this same path on every node (repeatable; the first is the default).
    #[arg(long)]
    shared_path: Vec<PathBuf>,
    /// Backends to enable (comma-separated). Default: local and xfs, plus shared when --shared-path is set.
    #[arg(long, value_delimiter = ',')]
    backends: Vec<String>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

fn config(a: &ServeArgs) -> anyhow::Result<Config> {
    let backends = if a.backends.is_empty() {
        let mut b = vec![Backend::Local, Backend::Xfs];
        if !a.shared_path.is_empty() {
            b.push(Backend::Shared);
        }
        b
    } else {
        a.backends
            .iter()
            .map(|s| {
                Backend::parse(s.trim()).ok_or_else(|| {
                    anyhow::anyhow!("--backends: {s:?} is not one of local, shared, xfs")
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    for p in &a.shared_path {
        anyhow::ensure!(
            p.is_absolute(),
            "--shared-path {} must be absolute",
            p.display()
        );
    }
    anyhow::ensure!(!a.driver_name.is_empty(), "--driver-name must not be empty");
    Ok(Config {
        driver_name: a.driver_name.clone(),
        node_id: a.node_id.clone().filter(|n| !n.is_empty()),
        state_dir: a.state_dir.clone(),
        shared_paths: a.shared_path.clone(),
        backends,
    })
}

fn init_logging(format: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Demo(args)) => {
            init_logging("text");
            modelcache_csi::demo::run(args).await
        }
        Some(Command::Seal {
            endpoint,
            volume_id,
        }) => {
            let mut c =
                modelcache_csi::client::Client::connect(server::socket_path(&endpoint)?).await?;
            c.controller
                .controller_modify_volume(modelcache_csi::csi::ControllerModifyVolumeRequest {
                    volume_id: volume_id.clone(),
                    mutable_parameters: [("sealed".to_string(), "true".to_string())].into(),
                    ..Default::default()
                })
                .await
                .map_err(|s| anyhow::anyhow!("seal {volume_id}: {}: {}", s.code(), s.message()))?;
            println!("sealed {volume_id}");
            Ok(())
        }
        Some(Command::Serve(a)) => run_serve(a).await,
        None => run_serve(cli.serve).await,
    }
}

async fn run_serve(a: ServeArgs) -> anyhow::Result<()> {
    init_logging(&a.log_format);
    let cfg = Arc::new(config(&a)?);
    for p in modelcache_csi::identity::problems(&cfg) {
        tracing::warn!(problem = %p, "a backend is not usable; Probe will report not ready");
    }
    server::serve(cfg, a.mode, &a.endpoint, shutdown_signal()).await
}
