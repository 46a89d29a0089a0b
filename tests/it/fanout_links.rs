//! A rollout of one model over links of a known rate (issue #46, item 3):
//! driver processes, each in a network namespace of its own behind a veth
//! whose two directions `tc` caps, on one bridge with the apiserver and
//! the origin, so that a node's upload and download are bounded as a real
//! NIC bounds them and a leader cannot serve its followers faster than its
//! link. The suite runs a small rollout (three nodes on 25 MB/s links) as a
//! regression test, alone at the end; the benchmark (run alone, as root):
//!
//! ```sh
//! FANOUT_NODES=16 FANOUT_MBPS=25 FANOUT_MIB=512 [FANOUT_ORIGIN_MBPS=25 FANOUT_SLOTS=16] \
//!   unshare -m --propagation private cargo test --test it -- \
//!   --ignored --exact fanout_links::bench --nocapture
//! ```
//!
//! `FANOUT_KILL=4 FANOUT_KILL_AT_S=20` kills four followers still pulling
//! 20 s into the rollout; `FANOUT_JOIN=4 FANOUT_JOIN_AT_S=10` starts four
//! more nodes 10 s in. Every other node must seal the model.
//!
//! It prints one CSV row (`FANOUT_CSV` appends it to a file): one node
//! alone, then every node at once, the last and the median node's time,
//! the copies of the model the origin sent, the most any node uploaded
//! (its link's own byte count), and the CPU the machine spent; the same
//! inputs go to the rollout model (`tests/bench/fanout_sim.py`) to compare.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::peer_fill::write_large_model;
use crate::support::apiserver::ApiServer;
use crate::support::fixtures::{self, FileServer};
use crate::support::harness::*;

const BRIDGE: &str = "mcfan0";
const HOST_IP: &str = "10.78.0.1";
const PEER_PORT: u16 = 7420;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ip(args: &[&str]) {
    run("ip", args);
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().expect(cmd);
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The bridge and one namespace a node, each behind a veth capped at
/// `mbps` MB/s both ways; gone on drop.
struct Links {
    nodes: usize,
}

impl Links {
    fn netns(i: usize) -> String {
        format!("mcfan{i}")
    }

    fn address(i: usize) -> String {
        format!("10.78.1.{}", i + 1)
    }

    /// `origin_mbps` caps what the host sends onto the bridge: the
    /// origin's bytes (and the apiserver's answers); nodes' bytes to each
    /// other are bridged, not sent by the host.
    fn up(nodes: usize, mbps: u64, origin_mbps: u64) -> Links {
        Links::clean(nodes);
        let links = Links { nodes };
        ip(&["link", "add", BRIDGE, "type", "bridge"]);
        ip(&["addr", "add", &format!("{HOST_IP}/16"), "dev", BRIDGE]);
        ip(&["link", "set", BRIDGE, "up"]);
        // tbf at the link's rate; a burst of 1 MB and a 4 MB queue let TCP
        // find the rate without the cap's own stalls showing.
        let cap = |ns: Option<&str>, dev: &str, mbps: u64| {
            let rate = format!("{}mbit", mbps * 8);
            let mut args = Vec::new();
            if let Some(ns) = ns {
                args.extend(["-n", ns]);
            }
            args.extend([
                "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst", "1mb",
                "limit", "4mb",
            ]);
            run("tc", &args);
        };
        cap(None, BRIDGE, origin_mbps);
        for i in 0..nodes {
            let ns = Links::netns(i);
            let host = format!("{ns}h");
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &host, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            ip(&["link", "set", &host, "master", BRIDGE, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/16", Links::address(i)),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            // The node's upload leaves by its eth0; its download by the
            // host's end of the pair.
            cap(Some(&ns), "eth0", mbps);
            cap(None, &host, mbps);
        }
        links
    }

    /// Bytes node `i` has sent on its link (TCP and TLS included).
    fn sent(&self, i: usize) -> u64 {
        let out = Command::new("tc")
            .args(["-n", &Links::netns(i), "-s", "qdisc", "show", "dev", "eth0"])
            .output()
            .expect("tc");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|w| *w != "Sent")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no byte count in {text}"))
    }

    fn clean(nodes: usize) {
        for i in 0..nodes.max(64) {
            let _ = Command::new("ip")
                .args(["netns", "del", &Links::netns(i)])
                .output();
        }
        let _ = Command::new("ip").args(["link", "del", BRIDGE]).output();
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        Links::clean(self.nodes);
    }
}

/// Busy and total jiffies of the whole machine.
fn cpu() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let f: Vec<u64> = stat
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .skip(1)
        .filter_map(|n| n.parse().ok())
        .collect();
    let idle = f[3] + f[4];
    (f.iter().sum::<u64>() - idle, f.iter().sum())
}

async fn node_in(i: usize, api: &ApiServer, tokens: &Path, slots: &str) -> Driver {
    let listen = format!("{}:{PEER_PORT}", Links::address(i));
    let kubeconfig = api.kubeconfig_path();
    let args = [
        "--kube-api",
        "on",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--peer-listen",
        &listen,
        "--peer-networks",
        "10.78.0.0/16",
        "--peer-token-file",
        tokens.to_str().unwrap(),
        // The link is the bound being measured, not the driver's own.
        "--peer-upload-mib-per-second",
        "0",
        "--peer-max-uploads",
        slots,
        "--pull-chunk-mib",
        "8",
    ];
    Driver::start_node_in(&Links::netns(i), &format!("node-{i}"), &args).await
}

async fn pull(d: &Driver, name: &str, uri: &str) {
    let req = create_req(name, &[("backend", "local"), ("source", uri)], READER);
    d.create(req)
        .await
        .unwrap_or_else(|s| panic!("CreateVolume on {name}: {:?}: {}", s.code(), s.message()));
}

/// Nodes killed and nodes joining during a rollout.
#[derive(Clone, Copy, Default)]
struct Chaos {
    /// Followers still pulling at `kill_at` that are killed (SIGKILL).
    kill: usize,
    kill_at: Duration,
    /// Nodes that start the model `join_at` into the rollout.
    join: usize,
    join_at: Duration,
}

/// What one rollout measured.
struct Rollout {
    /// One node alone, when asked for.
    alone: Option<Duration>,
    /// Each surviving node's time, sorted (a joining node's from the
    /// rollout's start).
    took: Vec<Duration>,
    /// The nodes killed.
    killed: Vec<String>,
    /// Nodes whose CreateVolume had to be tried again.
    retried: usize,
    total: u64,
    /// Model bytes the origin sent during the rollout.
    from_origin: u64,
    /// Bytes each node sent on its link during the rollout.
    uploads: Vec<u64>,
    /// The machine's CPU busy over the rollout (0 to 1).
    busy: f64,
    /// Per node: chunks the origin served instead of a peer, and the
    /// first such line of its log.
    instead: Vec<(String, usize, String)>,
}

/// `nodes` nodes behind `mbps` links start one model of `mib` MiB at once
/// (after one node alone, if `alone`), the origin sending at
/// `origin_mbps`, each node serving `slots` uploads at once, while
/// `chaos` kills some and others join. Every node that is not killed must
/// seal the model (its pull checks every file's sha256). Driver logs are
/// kept under `$FANOUT_LOGS` when set.
async fn roll_out(
    nodes: usize,
    mbps: u64,
    origin_mbps: u64,
    mib: usize,
    slots: &str,
    alone: bool,
    chaos: Chaos,
) -> Rollout {
    // Node 0 pulls alone; nodes 1..=N roll out together, then the joiners.
    let links = Links::up(nodes + chaos.join + 1, mbps, origin_mbps);
    let api = ApiServer::start_at(HOST_IP).expect("start apiserver");
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let files = 4;
    let total = write_large_model(&model, files, mib / files);
    let tokens = work.path().join("peer-token");
    std::fs::write(&tokens, "peer-token-for-the-links-bench-0123456789\n").unwrap();
    let origin = FileServer::start_at(&model, HOST_IP).await;
    let manifest = fixtures::manifest_for(&model, true);
    origin.put("alone.json", manifest.clone());
    origin.put("fanout.json", manifest);

    let alone = if alone {
        let solo = node_in(0, &api, &tokens, slots).await;
        let started = Instant::now();
        pull(
            &solo,
            "pvc-solo",
            &format!("{}#manifest", origin.url("alone.json")),
        )
        .await;
        Some(started.elapsed())
    } else {
        None
    };
    let before = fixtures::requested_bytes(&origin.requests(), &model);

    let all = nodes + chaos.join;
    let mut drivers = Vec::new();
    for i in 1..=all {
        drivers.push(node_in(i, &api, &tokens, slots).await);
    }
    let sent_before: Vec<u64> = (1..=all).map(|i| links.sent(i)).collect();
    let uri = format!("{}#manifest", origin.url("fanout.json"));
    let cpu_before = cpu();
    let started = Instant::now();
    let pulls = futures::future::join_all(drivers.iter().enumerate().map(|(i, d)| {
        let uri = uri.clone();
        async move {
            if i >= nodes {
                tokio::time::sleep(chaos.join_at).await;
            }
            let req = create_req(
                &format!("pvc-fan-{i}"),
                &[("backend", "local"), ("source", &uri)],
                READER,
            );
            // Tried again on Unavailable, as external-provisioner does (a
            // stalled pull fails so, and resumes what it verified); each
            // try is counted.
            let mut tries = 0;
            loop {
                tries += 1;
                match d.create(req.clone()).await {
                    Err(s) if s.code() == tonic::Code::Unavailable && tries < 5 => {
                        println!("{} tries again: {}", d.node_id, s.message());
                    }
                    r => break r.map(|_| (started.elapsed(), tries)),
                }
            }
        }
    }));
    // Followers, not the leader: the ones whose log says they fill from
    // peers and have not sealed yet.
    let killer = async {
        if chaos.kill == 0 {
            return Vec::new();
        }
        tokio::time::sleep(chaos.kill_at).await;
        let victims: Vec<usize> = (0..nodes)
            .filter(|&i| {
                let log = drivers[i].log_text();
                log.contains("filling from peers") && !log.contains("volume ready")
            })
            .take(chaos.kill)
            .collect();
        for &i in &victims {
            // It may have sealed since it was chosen.
            let _ = Command::new("kill")
                .args(["-9", &drivers[i].pid().to_string()])
                .status();
        }
        victims
    };
    let (results, victims) = tokio::join!(pulls, killer);
    let cpu_after = cpu();
    keep_logs(&drivers);
    let mut took = Vec::new();
    let mut retried = 0;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok((t, tries)) => {
                took.push(t);
                retried += usize::from(tries > 1);
            }
            Err(_) if victims.contains(&i) => {}
            Err(s) => panic!(
                "{} did not seal the model: {:?}: {}",
                drivers[i].node_id,
                s.code(),
                s.message()
            ),
        }
    }
    took.sort();
    let killed = victims
        .iter()
        .map(|&i| drivers[i].node_id.clone())
        .collect();
    let from_origin = fixtures::requested_bytes(&origin.requests(), &model) - before;
    let uploads = (1..=all)
        .map(|i| links.sent(i) - sent_before[i - 1])
        .collect();
    let busy = (cpu_after.0 - cpu_before.0) as f64 / (cpu_after.1 - cpu_before.1) as f64;
    let instead = drivers
        .iter()
        .filter_map(|d| {
            let log = std::fs::read_to_string(d.dir.join("driver.log")).unwrap_or_default();
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("the origin serves it"))
                .collect();
            let first = lines.first()?.to_string();
            Some((d.node_id.clone(), lines.len(), first))
        })
        .collect();
    drop(drivers);
    drop(links);
    Rollout {
        alone,
        took,
        killed,
        retried,
        total,
        from_origin,
        uploads,
        busy,
        instead,
    }
}

/// Driver logs, kept under `$FANOUT_LOGS` when set.
fn keep_logs(drivers: &[Driver]) {
    if let Ok(dir) = std::env::var("FANOUT_LOGS") {
        std::fs::create_dir_all(&dir).unwrap();
        for d in drivers {
            let _ = std::fs::copy(
                d.dir.join("driver.log"),
                Path::new(&dir).join(format!("{}.log", d.node_id)),
            );
        }
    }
}

/// Three nodes on 25 MB/s links (a leader and two followers) take a
/// model from the origin once: the chunks a node receives at once share
/// the slow-peer floor. Held to it one by one, the followers judged every
/// peer slow on such a downlink and the origin sent 3.5 to 4.4 copies to
/// four nodes. And no node uploads much more than one copy: the
/// followers relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_slow_links_take_the_model_from_the_origin_once() {
    let r = roll_out(3, 25, 25, 128, "16", false, Chaos::default()).await;
    let copies = r.from_origin as f64 / r.total as f64;
    println!(
        "3 nodes at 25 MB/s: origin {copies:.3} copies, last {:.1}s, uploads {:?}",
        r.took.last().unwrap().as_secs_f64(),
        r.uploads
    );
    assert!(
        copies <= 1.10,
        "the origin sent {copies:.3} copies of the model to 3 nodes; {:?}",
        r.instead
    );
    // Each follower relays the chunks it ranks lowest for, so the leader
    // uploads one copy (1.05 measured twice), not the 1.5 that dealing
    // round the pulls started earlier gives (1.57 to 1.97 measured).
    assert_eq!(r.retried, 0, "a node's pull failed and was tried again");
    let busiest = *r.uploads.iter().max().unwrap() as f64 / r.total as f64;
    assert!(
        busiest <= 1.35,
        "a node uploaded {busiest:.2} copies of the model to 2 followers; uploads {:?}",
        r.uploads
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run alone, as root"]
async fn bench() {
    let nodes: usize = env_or("FANOUT_NODES", 16);
    let mbps: u64 = env_or("FANOUT_MBPS", 25);
    let mib: usize = env_or("FANOUT_MIB", 512);
    let origin_mbps: u64 = env_or("FANOUT_ORIGIN_MBPS", mbps);
    // The driver's default.
    let slots: String = env_or("FANOUT_SLOTS", "16".to_string());
    let chaos = Chaos {
        kill: env_or("FANOUT_KILL", 0),
        kill_at: Duration::from_secs(env_or("FANOUT_KILL_AT_S", 20)),
        join: env_or("FANOUT_JOIN", 0),
        join_at: Duration::from_secs(env_or("FANOUT_JOIN_AT_S", 10)),
    };
    let r = roll_out(nodes, mbps, origin_mbps, mib, &slots, true, chaos).await;
    let alone = r.alone.expect("timed alone").as_secs_f64();
    let last = r.took[r.took.len() - 1].as_secs_f64();
    let p50 = r.took[r.took.len() / 2].as_secs_f64();
    let total = r.total as f64;
    let header = "nodes,mbps,origin_mbps,slots,model_mib,alone_s,last_s,p50_s,last_over_alone,origin_copies,max_upload_copies,cpu_busy,killed,joined,retried";
    let row = format!(
        "{nodes},{mbps},{origin_mbps},{slots},{mib},{alone:.1},{last:.1},{p50:.1},{:.2},{:.3},{:.2},{:.2},{},{},{}",
        last / alone,
        r.from_origin as f64 / total,
        *r.uploads.iter().max().unwrap() as f64 / total,
        r.busy,
        r.killed.len(),
        chaos.join,
        r.retried,
    );
    println!("{header}\n{row}");
    println!(
        "each node's time: {:?}; uploads (copies): {:?}",
        r.took
            .iter()
            .map(|t| format!("{:.1}", t.as_secs_f64()))
            .collect::<Vec<_>>(),
        r.uploads
            .iter()
            .map(|u| format!("{:.2}", *u as f64 / total))
            .collect::<Vec<_>>()
    );
    if !r.killed.is_empty() {
        println!(
            "killed at {:?}: {:?}; every other node sealed the model",
            chaos.kill_at, r.killed
        );
    }
    for (node, n, first) in &r.instead {
        println!("{node}: {n} chunks from the origin instead of a peer; first: {first}");
    }
    if let Ok(path) = std::env::var("FANOUT_CSV") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        if f.metadata().unwrap().len() == 0 {
            writeln!(f, "{header}").unwrap();
        }
        writeln!(f, "{row}").unwrap();
    }
}
