//! Peer transport security: each run of a node's driver makes a key and a
//! self-signed certificate of its own and publishes the certificate's
//! digest in its peer Lease; a peer dials it over TLS and accepts exactly
//! that certificate, so the token and the bytes cross the network
//! encrypted, and only to the process the Lease names.
//!
//! The Lease is the trust anchor: only that node's driver may write it
//! (the admission policy), so no CA, no certificate Secret and no rotation
//! are needed; a restart makes a new key and publishes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use sha2::Digest;

/// The SHA-256 of a peer's certificate (DER), as its Lease publishes it.
pub type Pin = [u8; 32];

/// The name in every peer certificate. Peers are dialled by address and
/// checked by pin; the name is only there because X.509 wants one.
const NAME: &str = "peer.modelcache.csi.io";

/// How many peers' clients are kept (each holds its connection pool): a
/// cluster's nodes, each restart giving a new pin.
const MAX_CLIENTS: usize = 4096;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The pin of `cert`.
pub fn pin_of(cert: &[u8]) -> Pin {
    sha2::Sha256::digest(cert).into()
}

/// A pin as a Lease carries it: lowercase hex.
pub fn parse_pin(s: &str) -> Option<Pin> {
    let bytes = hex::decode(s.trim()).ok()?;
    bytes.try_into().ok()
}

/// This run's key and certificate, and the TLS acceptor serving them.
pub struct Identity {
    pin: Pin,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl Identity {
    /// A new P-256 key and a self-signed certificate for it.
    pub fn generate() -> anyhow::Result<Identity> {
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec![NAME.to_string()])?.self_signed(&key)?;
        let der = cert.der().clone();
        let pin = pin_of(&der);
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![der], key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Identity {
            pin,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// What this node's Lease publishes.
    pub fn pin_hex(&self) -> String {
        hex::encode(self.pin)
    }

    pub fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }
}

/// Accepts exactly the certificate a peer's Lease names, whatever the
/// address it answers at or the time says.
#[derive(Debug)]
struct Pinned {
    pin: Pin,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if intermediates.is_empty() && pin_of(end_entity) == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A TLS client configuration that accepts only the certificate `pin`
/// names.
pub fn client_config(pin: Pin) -> rustls::ClientConfig {
    let provider = provider();
    let verifier = Pinned {
        pin,
        algorithms: provider.signature_verification_algorithms,
    };
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("aws-lc-rs offers TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    tls
}

/// An HTTP client that talks only to the holder of `pin`'s key, sends
/// nothing in the clear and follows no redirect (a redirect would send
/// the token wherever it points).
pub fn pinned_client(pin: Pin, connect_timeout: Duration) -> reqwest::Client {
    let tls = client_config(pin);
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(connect_timeout)
        .tls_backend_preconfigured(tls)
        .build()
        .expect("a pinned TLS client builds")
}

/// One pinned client per peer certificate, kept for its connections.
pub struct Clients {
    connect_timeout: Duration,
    by_pin: Mutex<HashMap<Pin, reqwest::Client>>,
}

impl Clients {
    pub fn new(connect_timeout: Duration) -> Clients {
        Clients {
            connect_timeout,
            by_pin: Mutex::default(),
        }
    }

    /// The client for the peer whose Lease names `pin`.
    pub fn of(&self, pin: &Pin) -> reqwest::Client {
        let mut by_pin = self.by_pin.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = by_pin.get(pin) {
            return c.clone();
        }
        if by_pin.len() >= MAX_CLIENTS {
            by_pin.clear();
        }
        let c = pinned_client(*pin, self.connect_timeout);
        by_pin.insert(*pin, c.clone());
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves one TLS connection with `id`, answering any request with 200
    /// and a body naming what it received.
    async fn serve_once(id: Identity) -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let acceptor = id.acceptor().clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut buf = [0u8; 4096];
                    let _ = tls.read(&mut buf).await;
                    let _ = tls
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_client_talks_to_the_pinned_key_only() {
        let id = Identity::generate().unwrap();
        let pin = parse_pin(&id.pin_hex()).unwrap();
        let addr = serve_once(id).await;
        let url = format!("https://{addr}/");
        let right = pinned_client(pin, Duration::from_secs(2));
        let r = right.get(&url).send().await.unwrap();
        assert_eq!(r.text().await.unwrap(), "ok");

        let other = parse_pin(&Identity::generate().unwrap().pin_hex()).unwrap();
        let wrong = pinned_client(other, Duration::from_secs(2));
        let e = wrong
            .get(&url)
            .bearer_auth("secret")
            .send()
            .await
            .unwrap_err();
        assert!(e.is_connect(), "{e:?}");
    }

    #[test]
    fn pins_are_64_hex_digits() {
        assert!(parse_pin(&"ab".repeat(32)).is_some());
        assert!(parse_pin(&"ab".repeat(31)).is_none());
        assert!(parse_pin("not hex").is_none());
        let id = Identity::generate().unwrap();
        assert_eq!(id.pin_hex().len(), 64);
    }
}
