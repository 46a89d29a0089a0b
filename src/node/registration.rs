//! Registers the node plugin with kubelet, as node-driver-registrar would:
//! a `pluginregistration.Registration` server on a socket in kubelet's
//! plugins_registry directory. Kubelet's plugin watcher finds the socket,
//! asks for the CSI endpoint, calls NodeGetInfo on it, writes the CSINode
//! entry, and reports back. Serving this in-process removes a sidecar and a
//! failure mode: the registration lives and dies with the driver itself.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tonic::{Request, Response, Status};

use crate::csi::pluginregistration::registration_server::{Registration, RegistrationServer};
use crate::csi::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

/// What kubelet last said about our registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not yet reported (kubelet has not found the socket, or is still registering).
    Pending,
    Registered,
    /// Kubelet refused the plugin; the error is kubelet's own words.
    Rejected(String),
}

/// The registration's state, shared with the health endpoint.
#[derive(Clone)]
pub struct RegistrationState(Arc<Mutex<Outcome>>);

impl Default for RegistrationState {
    fn default() -> Self {
        RegistrationState(Arc::new(Mutex::new(Outcome::Pending)))
    }
}

impl RegistrationState {
    pub fn get(&self) -> Outcome {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, s: Outcome) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }
}

/// Where and what to register.
#[derive(Clone, Debug)]
pub struct Registrar {
    pub driver_name: String,
    /// The directory kubelet watches (its plugins_registry, as mounted here).
    pub registration_dir: PathBuf,
    /// The CSI socket's path as kubelet sees it on the host.
    pub kubelet_endpoint: PathBuf,
}

impl Registrar {
    /// The socket kubelet finds; named after the driver, as the registrar names it.
    pub fn socket(&self) -> PathBuf {
        self.registration_dir
            .join(format!("{}-reg.sock", self.driver_name))
    }
}

struct Service {
    info: PluginInfo,
    state: RegistrationState,
}

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        tracing::info!(endpoint = %self.info.endpoint, "kubelet asked for plugin info");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let r = req.into_inner();
        if r.plugin_registered {
            tracing::info!("kubelet registered the plugin");
            self.state.set(Outcome::Registered);
        } else {
            // The registrar exits here so its container restarts; the driver
            // instead stays up and fails /healthz, which restarts it the same
            // way under a liveness probe without dropping in-flight RPCs.
            tracing::error!(error = %r.error, "kubelet refused the plugin registration");
            self.state.set(Outcome::Rejected(r.error));
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Serves the registration socket until the process ends. If the socket
/// file disappears (kubelet restarted with a fresh plugins_registry, or
/// someone cleaned the directory), it is bound again so kubelet finds it.
pub async fn run(reg: Registrar, state: RegistrationState) -> anyhow::Result<()> {
    let info = PluginInfo {
        r#type: "CSIPlugin".into(),
        name: reg.driver_name.clone(),
        endpoint: reg.kubelet_endpoint.to_string_lossy().into_owned(),
        supported_versions: vec!["1.0.0".into()],
    };
    let path = reg.socket();
    loop {
        let listener = bind(&path)?;
        tracing::info!(socket = %path.display(), "serving kubelet plugin registration");
        state.set(Outcome::Pending);
        let svc = Service {
            info: info.clone(),
            state: state.clone(),
        };
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(svc))
            .serve_with_incoming_shutdown(crate::uds::incoming(listener), gone(path.clone()))
            .await?;
        tracing::warn!(socket = %path.display(), "registration socket removed; binding it again");
    }
}

fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    anyhow::ensure!(
        dir.is_dir(),
        "--registration-dir {} does not exist: mount kubelet's plugins_registry directory there",
        dir.display()
    );
    crate::uds::bind(path)
}

/// Resolves once the socket file is gone.
async fn gone(path: PathBuf) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        if std::fs::symlink_metadata(&path).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_is_named_after_the_driver() {
        let r = Registrar {
            driver_name: "modelcache.csi.io".into(),
            registration_dir: "/registration".into(),
            kubelet_endpoint: "/var/lib/kubelet/plugins/modelcache.csi.io/csi.sock".into(),
        };
        assert_eq!(
            r.socket(),
            PathBuf::from("/registration/modelcache.csi.io-reg.sock")
        );
    }
}
