//! The egress guard: every connection a tenant-named pull makes goes through
//! an in-process HTTP proxy on loopback, which resolves the target itself
//! and connects only to addresses the pull's policy allows.
//!
//! Checking names before a request is not enough: a redirect, a `#manifest`
//! entry, a registry's blob redirect or a DNS answer that changes between
//! the check and the connect (rebinding) all reach addresses no check saw.
//! Here the check and the connect are one step on the resolved address, and
//! every client library we use (reqwest, object_store, oci-client) honours
//! a proxy, so no code path can bypass it. It must never be used for
//! sources an admin chose (they reach what the admin decided).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use tokio::net::{TcpListener, TcpStream};

use crate::error::{Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an address is closed to tenants, or None when it is open.
pub fn closed_reason(ip: IpAddr, cluster: &[IpNet]) -> Option<String> {
    // ::ffff:127.0.0.1 is loopback too.
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    let reason = match ip {
        IpAddr::V4(v4) if v4.is_loopback() => "loopback",
        IpAddr::V6(v6) if v6.is_loopback() => "loopback",
        IpAddr::V4(v4) if v4.is_link_local() => "link-local (where cloud metadata lives)",
        IpAddr::V6(v6) if v6.is_unicast_link_local() => "link-local",
        IpAddr::V4(v4) if v4.is_unspecified() || v4.octets()[0] == 0 => "unspecified",
        IpAddr::V6(v6) if v6.is_unspecified() => "unspecified",
        IpAddr::V4(v4) if v4.is_multicast() || v4.is_broadcast() => "multicast or broadcast",
        IpAddr::V6(v6) if v6.is_multicast() => "multicast",
        _ => {
            let net = cluster.iter().find(|n| n.contains(&ip))?;
            return Some(format!(
                "in the cluster network {net} (--tenant-blocked-networks)"
            ));
        }
    };
    Some(reason.to_string())
}

/// Link-local addresses hold cloud metadata services, which hand out the
/// node's own credentials: no pull reaches them, whoever chose its source,
/// because a compromised origin can redirect there or list them in a
/// manifest. (Tenants' pulls are narrowed further by `Policy`.)
pub fn metadata_refusal(ip: IpAddr) -> Option<String> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    link_local.then(|| {
        format!("{ip} is link-local, where cloud metadata lives; no model source may reach it")
    })
}

/// A refusal raised inside an HTTP client (resolver, redirect policy), found
/// again in its error chain so the pull fails with it, unretried.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The refusal in an error's source chain, if any.
pub fn refusal_in(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<Refused>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}

/// A URL whose host is a link-local address literal (no resolver sees it).
pub fn check_url(url: &url::Url) -> Result<()> {
    let ip = match url.host() {
        Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
        _ => return Ok(()),
    };
    match metadata_refusal(ip) {
        Some(why) => Err(Error::NotAllowed(why)),
        None => Ok(()),
    }
}

/// reqwest's resolver for sources an admin chose: the system's answers,
/// less link-local ones (a name pointed at the metadata service).
pub struct MetadataShield;

impl reqwest::dns::Resolve for MetadataShield {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(why) = addrs.iter().find_map(|a| metadata_refusal(a.ip())) {
                return Err(Box::new(Refused(format!("{host} resolves to {why}")))
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// What one tenant pull may reach.
#[derive(Debug)]
pub struct Policy {
    /// `host` or `host:port`, lowercase: named by the StorageClass (an
    /// allowedSources prefix or an endpoint parameter), so reachable even
    /// on closed addresses.
    admitted: Vec<String>,
    cluster: Vec<IpNet>,
    /// The first refusal, so the pull fails with it instead of a proxy error.
    refusal: Mutex<Option<String>>,
    /// Upstream connections made for this policy: proof that a client
    /// really went through the guard.
    connections: std::sync::atomic::AtomicUsize,
}

impl Policy {
    pub fn new(admitted: Vec<String>, cluster: Vec<IpNet>) -> Policy {
        Policy {
            admitted: admitted
                .into_iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            cluster,
            refusal: Mutex::new(None),
            connections: Default::default(),
        }
    }

    fn admits(&self, host: &str, port: u16) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.admitted.iter().any(|a| {
            let a = a.as_str();
            a == host
                || a == format!("{host}:{port}")
                || a == format!("[{host}]:{port}")
                || a.trim_start_matches('[').trim_end_matches(']') == host
        })
    }

    /// Resolves `host` and returns the addresses to connect to, or why not.
    pub async fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> std::result::Result<Vec<SocketAddr>, String> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| format!("cannot resolve {bare}: {e}"))?
                .collect(),
        };
        if self.admits(host, port) {
            return Ok(addrs);
        }
        // Every address must be open: a mixed answer is how rebinding hides.
        for a in &addrs {
            if let Some(why) = closed_reason(a.ip(), &self.cluster) {
                return Err(format!(
                    "{bare}:{port} resolves to {}, which is {why}; a PVC's source may not reach it \
                     unless the StorageClass's allowedSources names that host explicitly",
                    a.ip()
                ));
            }
        }
        if addrs.is_empty() {
            return Err(format!("{bare} resolves to no address"));
        }
        Ok(addrs)
    }

    fn refuse(&self, why: &str) {
        let mut r = self.refusal.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(|| why.to_string());
    }

    /// How many upstream connections the guard made for this policy.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The refusal that made a request fail, if any.
    pub fn refusal(&self) -> Option<String> {
        self.refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A policy registered with the proxy; unregistered on drop.
/// One tenant pull's guard: a proxy listener of its own on loopback, so the
/// port names the policy. (A header would not do: clients drop proxy
/// credentials when a plain-http redirect changes host.) No credential is
/// needed, because the guard only narrows what the node's own network
/// position reaches; a local process that finds the port gains nothing.
#[derive(Debug)]
pub struct Guard {
    pub policy: Arc<Policy>,
    url: String,
    task: tokio::task::AbortHandle,
}

impl Guard {
    /// Starts a listener for `policy`; it stops when the guard is dropped.
    pub async fn new(policy: Policy) -> Result<Guard> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| Error::Internal(format!("binding the egress guard on loopback: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Internal(format!("egress guard address: {e}")))?;
        let policy = Arc::new(policy);
        let task = tokio::spawn(serve(listener, policy.clone())).abort_handle();
        Ok(Guard {
            policy,
            url: format!("http://{addr}"),
            task,
        })
    }

    /// The proxy URL, for client configuration.
    pub fn proxy_url(&self) -> &str {
        &self.url
    }

    /// An error of a request through this guard, replaced by the refusal
    /// that caused it: a tenant gets told why, and the engine does not
    /// retry what will never be allowed.
    pub fn explain(&self, err: Error) -> Error {
        match self.policy.refusal() {
            Some(why) => Error::NotAllowed(why),
            None => err,
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, policy: Arc<Policy>) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "egress guard: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let policy = policy.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(policy.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "egress guard connection ended");
            }
        });
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn reply(status: StatusCode, text: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(text))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

async fn handle(
    policy: Arc<Policy>,
    req: Request<Incoming>,
) -> std::result::Result<Response<Body>, hyper::Error> {
    let (host, port) = match target(&req) {
        Some(t) => t,
        None => {
            return Ok(reply(
                StatusCode::BAD_REQUEST,
                "the egress guard needs CONNECT host:port or an absolute http:// URI".into(),
            ));
        }
    };
    let addrs = match policy.resolve(&host, port).await {
        Ok(a) => a,
        Err(why) => {
            tracing::warn!(host = %host, port, reason = %why, "egress refused");
            policy.refuse(&why);
            return Ok(reply(StatusCode::FORBIDDEN, why));
        }
    };
    let upstream = match connect(&addrs).await {
        Ok(s) => {
            policy
                .connections
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            s
        }
        Err(e) => {
            return Ok(reply(
                StatusCode::BAD_GATEWAY,
                format!("connecting to {host}:{port}: {e}"),
            ));
        }
    };
    if req.method() == Method::CONNECT {
        tokio::spawn(async move {
            match hyper::upgrade::on(req).await {
                Ok(up) => {
                    let mut client = TokioIo::new(up);
                    let mut upstream = upstream;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
                Err(e) => tracing::debug!(error = %e, "egress guard: upgrade failed"),
            }
        });
        return Ok(Response::new(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        ));
    }
    forward(req, upstream, &host, port).await
}

/// `CONNECT host:port`, or the host and port of an absolute `http://` URI.
fn target(req: &Request<Incoming>) -> Option<(String, u16)> {
    let uri = req.uri();
    if req.method() == Method::CONNECT {
        let a = uri.authority()?;
        return Some((a.host().to_string(), a.port_u16()?));
    }
    if uri.scheme_str() != Some("http") {
        return None;
    }
    Some((uri.host()?.to_string(), uri.port_u16().unwrap_or(80)))
}

async fn connect(addrs: &[SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for a in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = e,
            Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
        }
    }
    Err(last)
}

/// A plain-http request, sent in origin form on its own upstream connection.
async fn forward(
    req: Request<Incoming>,
    upstream: TcpStream,
    host: &str,
    port: u16,
) -> std::result::Result<Response<Body>, hyper::Error> {
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = match path.parse() {
        Ok(u) => u,
        Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, "bad request path".into())),
    };
    parts.headers.remove(hyper::header::PROXY_AUTHORIZATION);
    parts.headers.remove("proxy-connection");
    if !parts.headers.contains_key(hyper::header::HOST) {
        let h = if port == 80 {
            host.to_string()
        } else {
            format!("{host}:{port}")
        };
        if let Ok(v) = h.parse() {
            parts.headers.insert(hyper::header::HOST, v);
        }
    }
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(x) => x,
            Err(e) => {
                return Ok(reply(
                    StatusCode::BAD_GATEWAY,
                    format!("talking to {host}:{port}: {e}"),
                ));
            }
        };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => Ok(resp.map(|b| b.boxed())),
        Err(e) => Ok(reply(
            StatusCode::BAD_GATEWAY,
            format!("talking to {host}:{port}: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_addresses() {
        let cluster: Vec<IpNet> = vec!["10.96.0.0/12".parse().unwrap()];
        for (ip, word) in [
            ("127.0.0.1", "loopback"),
            ("127.8.9.10", "loopback"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("169.254.169.254", "link-local"),
            ("fe80::1", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("10.96.0.1", "cluster network"),
        ] {
            let why = closed_reason(ip.parse().unwrap(), &cluster);
            assert!(
                why.as_deref().is_some_and(|w| w.contains(word)),
                "{ip}: {why:?}"
            );
        }
        for ip in ["93.184.216.34", "10.0.0.1", "2606:4700::1"] {
            assert_eq!(closed_reason(ip.parse().unwrap(), &cluster), None, "{ip}");
        }
    }

    /// Sends `head` to the guard of `g` and returns its status line and the
    /// open stream.
    async fn ask(g: &Guard, head: String) -> (String, TcpStream) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let url = url::Url::parse(g.proxy_url()).unwrap();
        let mut s = TcpStream::connect((url.host_str().unwrap(), url.port().unwrap()))
            .await
            .unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            if s.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            buf.push(byte[0]);
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        (text.lines().next().unwrap_or_default().to_string(), s)
    }

    /// A one-shot upstream that answers any request with `hello`.
    async fn upstream() -> (u16, tokio::task::JoinHandle<usize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut served = 0;
            while let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(2), l.accept()).await
            {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                    )
                    .await;
                served += 1;
            }
            served
        });
        (port, task)
    }

    #[tokio::test]
    async fn tunnels_and_forwards_only_what_the_policy_admits() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (port, served) = upstream().await;
        let open = Guard::new(Policy::new(vec![format!("127.0.0.1:{port}")], vec![]))
            .await
            .unwrap();
        // CONNECT, then HTTP through the tunnel.
        let (status, mut s) = ask(
            &open,
            format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
        )
        .await;
        assert!(status.contains("200"), "{status}");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.ends_with("hello"), "{body}");
        // Plain http in absolute form.
        let (status, _) = ask(
            &open,
            format!("GET http://127.0.0.1:{port}/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
        )
        .await;
        assert!(status.contains("200"), "{status}");

        // A policy that does not name the host reaches nothing, and says why.
        let closed = Guard::new(Policy::new(vec![], vec![])).await.unwrap();
        for head in [
            format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
            format!("GET http://localhost:{port}/x HTTP/1.1\r\nHost: localhost\r\n\r\n"),
        ] {
            let (status, _) = ask(&closed, head).await;
            assert!(status.contains("403"), "{status}");
        }
        let why = closed.policy.refusal().unwrap();
        assert!(why.contains("loopback"), "{why}");
        let e = closed.explain(Error::Transient("proxy said 403".into()));
        assert!(matches!(e, Error::NotAllowed(_)), "{e:?}");
        // A dropped guard serves no one.
        let gone = url::Url::parse(open.proxy_url()).unwrap();
        drop(open);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect((gone.host_str().unwrap(), gone.port().unwrap()))
                .await
                .is_err(),
            "the guard of a finished pull still listens"
        );
        assert_eq!(
            served.await.unwrap(),
            2,
            "only the admitted requests arrived"
        );
    }

    #[tokio::test]
    async fn admitted_hosts_pass_closed_ones_do_not() {
        let p = Policy::new(vec!["127.0.0.1:9000".into()], vec![]);
        assert!(p.resolve("127.0.0.1", 9000).await.is_ok());
        let e = p.resolve("127.0.0.1", 9001).await.unwrap_err();
        assert!(
            e.contains("loopback") && e.contains("allowedSources"),
            "{e}"
        );
        let e = p.resolve("localhost", 80).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
        let e = p.resolve("[::1]", 80).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
    }
}
