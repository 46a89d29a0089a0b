//! A CSI client over a Unix socket, for the CLI, the demo and the tests.

use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::csi::controller_client::ControllerClient;
use crate::csi::identity_client::IdentityClient;
use crate::csi::node_client::NodeClient;

#[derive(Clone)]
pub struct Client {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

pub async fn channel(socket: PathBuf) -> anyhow::Result<Channel> {
    // The URI is required by the API but unused: every connection goes to the socket.
    let channel = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await?;
    Ok(channel)
}

impl Client {
    pub async fn connect(socket: PathBuf) -> anyhow::Result<Client> {
        let ch = channel(socket).await?;
        Ok(Client {
            identity: IdentityClient::new(ch.clone()),
            controller: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
        })
    }
}
