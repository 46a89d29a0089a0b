//! A driver killed at each phase of a pull, and a new one over the same
//! node: the new one takes the pull up from its record with no call and
//! runs it to the seal, and the provisioner's retry then gets the volume.
//!
//! Each driver runs on a runtime of its own, its "process": killing it is
//! shutting that runtime down, which drops every task it runs (its pull
//! jobs, their followers) wherever they were, as `kill -9` stops a process
//! between two steps. Blocking work it had started runs to its end and
//! holds what it holds meanwhile (the pull area's flock), as another
//! process sharing the root would. The origin runs on the test's runtime and holds the
//! second half of the model until the test opens it, so each phase is
//! reached for certain, not by timing.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use tokio::sync::watch;

use super::*;
use crate::provision::Phase;

/// The model: one file, `LEN` bytes, byte `i` is `i % 251`.
const LEN: usize = 2 << 20;
/// What the origin sends before its gate opens.
const BEFORE_GATE: usize = 1 << 20;

fn byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// The origin: HEAD and (ranged) GET of `/model.bin`. Bytes from
/// `BEFORE_GATE` on wait until `gate` is true.
async fn origin(gate: watch::Receiver<bool>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let gate = gate.clone();
            tokio::spawn(async move {
                let serve = hyper::service::service_fn(move |req| answer(req, gate.clone()));
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, serve)
                    .await;
            });
        }
    });
    format!("http://{addr}/model.bin")
}

type Body = BoxBody<Bytes, Infallible>;

async fn answer(
    req: http::Request<hyper::body::Incoming>,
    gate: watch::Receiver<bool>,
) -> Result<http::Response<Body>, Infallible> {
    let range = req
        .headers()
        .get(http::header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.split_once('-'))
        .map(|(a, b)| {
            let start: usize = a.parse().unwrap_or(0);
            let end = b.parse::<usize>().map_or(LEN, |e| (e + 1).min(LEN));
            (start, end)
        });
    let (start, end) = range.unwrap_or((0, LEN));
    let mut resp = http::Response::builder()
        .header(http::header::CONTENT_LENGTH, end - start)
        .header(http::header::ACCEPT_RANGES, "bytes")
        .header(http::header::ETAG, "\"model-v1\"");
    if range.is_some() {
        resp = resp.status(206).header(
            http::header::CONTENT_RANGE,
            format!("bytes {start}-{}/{LEN}", end - 1),
        );
    }
    if req.method() == http::Method::HEAD {
        return Ok(resp.body(http_body_util::Empty::new().boxed()).unwrap());
    }
    let chunks = futures::stream::unfold((start, gate), move |(pos, mut gate)| async move {
        if pos >= end {
            return None;
        }
        if pos >= BEFORE_GATE {
            let _ = gate.wait_for(|open| *open).await;
        }
        let upto = (pos + (64 << 10)).min(end);
        let upto = if pos < BEFORE_GATE {
            upto.min(BEFORE_GATE)
        } else {
            upto
        };
        let bytes: Vec<u8> = (pos..upto).map(byte).collect();
        Some((Ok(Frame::data(Bytes::from(bytes))), (upto, gate)))
    });
    Ok(resp.body(StreamBody::new(chunks).boxed()).unwrap())
}

/// A driver's "process".
fn process() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// CreateVolume as external-provisioner sends it, with a deadline of
/// `secs` seconds.
async fn create_within(
    d: &Arc<Driver>,
    req: CreateVolumeRequest,
    secs: u32,
) -> Result<Volume, Status> {
    let mut r = Request::new(req);
    r.metadata_mut()
        .insert("grpc-timeout", format!("{secs}S").parse().unwrap());
    let v = d.ctl.create_volume(r).await?;
    Ok(v.into_inner().volume.expect("a created volume"))
}

/// Waits up to `bound` for `done`, which is asked every 50 ms.
async fn until<F, Fut>(what: &str, bound: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + bound;
    while !done().await {
        assert!(Instant::now() < end, "not within {bound:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn set_mode(dir: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// How a phase is reached by the first driver, before it is killed.
#[derive(Clone, Copy, Debug)]
enum Reach {
    /// A create whose deadline passes while the model is held back.
    Requested,
    /// A progressive create, answered once the listing is known.
    Listed,
    /// A create answered once every file is verified, whose seal is then
    /// refused until the kill.
    Verified,
}

/// Another process holding the model's pull area (its flock) while the
/// next driver resumes: a node sharing the root, pulling the same model.
struct OtherPuller {
    _flock: std::fs::File,
}

impl OtherPuller {
    /// Takes the area's flock, once whatever still holds it lets go.
    async fn hold(lock: std::path::PathBuf) -> OtherPuller {
        tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock)
                .unwrap();
            f.lock().unwrap();
            OtherPuller { _flock: f }
        })
        .await
        .unwrap()
    }
}

async fn killed_at(reach: Reach, other: bool) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (gate, held) = watch::channel(false);
    let uri = origin(held).await;
    let name = format!("pvc-killed-at-{reach:?}").to_lowercase();
    let mut params = vec![("source", uri.as_str()), ("backend", "local")];
    if let Reach::Listed = reach {
        params.push(("progressive", "true"));
    }
    let req = create_req(&name, &params, READER);

    // The first driver, killed at its phase.
    let first = process();
    let a = Arc::new(Driver::start_with(dir.clone(), None));
    let sources = a.roots.roots[0].sources_dir();
    let asked = {
        let (a, req) = (a.clone(), req.clone());
        let secs = if let Reach::Verified = reach { 30 } else { 2 };
        first.spawn(async move { create_within(&a, req, secs).await })
    };
    if let Reach::Verified = reach {
        // The seal's rename into place is refused (the sources directory
        // made read-only once the pull's area is in it): the driver is
        // killed between its answer and its seal, for certain.
        until("the pull's area exists", Duration::from_secs(10), || {
            let sources = sources.clone();
            async move {
                std::fs::read_dir(&sources).is_ok_and(|d| {
                    d.flatten().any(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .starts_with(crate::cache::layout::PULL_PREFIX)
                    })
                })
            }
        })
        .await;
        set_mode(&sources, 0o555);
        gate.send_replace(true);
    }
    let answer = asked.await.unwrap();
    let mut area_lock = None;
    let phase = match reach {
        Reach::Requested => {
            assert_code(answer, Code::Unavailable, "still pulling");
            Some(Phase::Requested)
        }
        Reach::Listed => {
            let v = answer.expect("a progressive volume is answered once listed");
            let id = crate::cache::VolumeId::parse(&v.volume_id).unwrap();
            let sid = crate::cache::SourceId::parse_model(&v.volume_context["source"]).unwrap();
            area_lock = Some(
                a.roots
                    .for_id(&id)
                    .unwrap()
                    .pull_area(&sid)
                    .dir
                    .join("lock"),
            );
            Some(Phase::Listed)
        }
        Reach::Verified => {
            answer.expect("answered once verified");
            Some(Phase::Verified)
        }
    };
    if let Some(phase) = phase {
        let p = a.provisioner.clone();
        until(
            &format!("the record says {phase:?}"),
            Duration::from_secs(10),
            || {
                let p = p.clone();
                async move { p.wanted().await.iter().any(|w| w.phase == phase) }
            },
        )
        .await;
    }
    first.shutdown_background();
    drop(a);
    set_mode(&sources, 0o755);
    let held = match (other, area_lock) {
        (true, Some(lock)) => Some(OtherPuller::hold(lock).await),
        (true, None) => panic!("{reach:?}: no pull area to hold"),
        (false, _) => None,
    };
    gate.send_replace(true);

    // The node's next driver: no call until its resume has run the pull
    // to its end, which its record's going says. While another process
    // holds the model's pull, the resume is told Busy, and asks again
    // after it lets go.
    let b = Arc::new(Driver::start_with(dir.clone(), None));
    b.provisioner.resume_wanted().await;
    if let Some(held) = held {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !b.provisioner.wanted().await.is_empty(),
            "the resume forgot a pull another process holds"
        );
        drop(held);
    }
    until(
        "the resume ends the pull with no call",
        Duration::from_secs(60),
        || {
            let p = b.provisioner.clone();
            async move { p.wanted().await.is_empty() }
        },
    )
    .await;
    // The provisioner's retry gets the volume; the resume's own create
    // may hold the name a moment longer.
    let end = Instant::now() + Duration::from_secs(10);
    let volume = loop {
        match create_within(&b, req.clone(), 2).await {
            Ok(v) => break v,
            Err(e) if e.code() == Code::Aborted && Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{reach:?}: the provisioner's retry did not get the volume: {e:?}"),
        }
    };
    let id = crate::cache::VolumeId::parse(&volume.volume_id).unwrap();
    let root = b.roots.for_id(&id).unwrap().clone();
    let sid = crate::cache::SourceId::parse(&volume.volume_context["source"]).unwrap();
    until("the model is sealed", Duration::from_secs(60), || {
        let (r, s) = (root.clone(), sid.clone());
        async move { crate::cache::read_seal(&r, &s).unwrap().is_some() }
    })
    .await;
    until(
        "the volume references the sealed model",
        Duration::from_secs(10),
        || {
            let (r, s, u) = (root.clone(), sid.clone(), id.uuid.clone());
            async move { crate::cache::refs(&r, &s).unwrap().contains(&u) }
        },
    )
    .await;
    let got = std::fs::read(root.source(&sid).data().join("model.bin")).unwrap();
    let want: Vec<u8> = (0..LEN).map(byte).collect();
    assert!(
        got == want,
        "{reach:?}: the sealed model differs from the origin's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_killed_while_its_create_waits_resumes_the_pull() {
    killed_at(Reach::Requested, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_killed_after_a_progressive_answer_sees_its_pull_to_the_seal() {
    killed_at(Reach::Listed, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_waits_out_another_process_pulling_the_same_model() {
    killed_at(Reach::Listed, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_killed_after_answering_once_verified_leaves_a_sealed_model() {
    killed_at(Reach::Verified, false).await;
}
