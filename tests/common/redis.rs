//! Processes for the replica tests: a real `redis-server` and the mock upstream as its
//! own process, both killed on drop, so several gateway binaries can share them.
#![allow(dead_code)]

use std::{
    io::{Read, Write},
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub use crate::common::{free_port, MockUpstream};

/// A port for a cluster node: it and its cluster bus port (10000 above it) both free.
fn free_cluster_port() -> u16 {
    loop {
        let port = 20_000 + (uuid::Uuid::new_v4().as_u128() % 20_000) as u16;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

/// A `redis-server` child with nothing persisted: killing it loses its data, which is
/// what the restart test wants.
pub struct Redis {
    pub port: u16,
    child: Child,
    /// Serving TLS only (`rediss://`), with a self-signed certificate.
    tls: bool,
    /// The other masters of a Redis Cluster this one belongs to (started with it).
    peers: Vec<Child>,
    /// Where a cluster keeps its node files.
    _dir: Option<TempCluster>,
}

/// A cluster's node files, removed on drop.
struct TempCluster(std::path::PathBuf);

impl Drop for TempCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Redis {
    /// Starts an empty `redis-server` on a free port and waits until it answers PING.
    pub fn start() -> Redis {
        Redis::start_on(free_port())
    }

    /// As [`Redis::start`], on `port` (a restart on the port of a killed server).
    pub fn start_on(port: u16) -> Redis {
        let spawned = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed: the replica tests need a real Redis \
                 (.ci/run installs it: apt-get install redis-server)"
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        let redis = Redis {
            port,
            child,
            tls: false,
            peers: Vec::new(),
            _dir: None,
        };
        redis.wait_ready();
        redis
    }

    /// A Redis Cluster of three masters on free ports (`redis-cli --cluster create`),
    /// returned once every node reports `cluster_state:ok`. [`Redis::url`] names the
    /// first node; clients discover the rest from it.
    pub fn start_cluster() -> Redis {
        let dir = std::env::temp_dir().join(format!(
            "backstop-redis-cluster-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ports: Vec<u16> = (0..3).map(|_| free_cluster_port()).collect();
        let mut children: Vec<Child> = ports
            .iter()
            .map(|port| {
                Command::new("redis-server")
                    .args(["--port", &port.to_string()])
                    .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                    .arg(dir.join(format!("nodes-{port}.conf")))
                    .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                    .current_dir(&dir)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("redis-server (.ci/run installs it)")
            })
            .collect();
        let child = children.remove(0);
        let redis = Redis {
            port: ports[0],
            child,
            tls: false,
            peers: children,
            _dir: Some(TempCluster(dir)),
        };
        for port in &ports {
            Redis::wait_port(*port);
        }
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli (installed with redis-server)");
        assert!(created.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        for port in &ports {
            loop {
                let info = Redis::command_on(*port, &["CLUSTER", "INFO"]);
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster not ok on {port}: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        redis
    }

    /// Whether this is a Redis Cluster (its replicas need `cluster = true`).
    pub fn is_cluster(&self) -> bool {
        !self.peers.is_empty()
    }

    fn wait_port(port: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server on {port} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A `redis-server` that speaks TLS only, with a self-signed certificate made in
    /// `dir` by the `openssl` command line (clients are not asked for certificates).
    pub fn start_tls(dir: &std::path::Path) -> Redis {
        let (cert, key) = (dir.join("redis.crt"), dir.join("redis.key"));
        let made = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=127.0.0.1", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl makes the test certificate");
        assert!(made.success(), "openssl req failed");
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .arg("--tls-ca-cert-file")
            .arg(&cert)
            .args(["--tls-auth-clients", "no"])
            .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (.ci/run installs it)");
        let redis = Redis {
            port,
            child,
            tls: true,
            peers: Vec::new(),
            _dir: None,
        };
        redis.wait_ready();
        redis
    }

    pub fn url(&self) -> String {
        if self.tls {
            // The certificate is self-signed: the test checks the transport, not trust.
            return format!("rediss://127.0.0.1:{}/0#insecure", self.port);
        }
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not answer PING", self.port);
    }

    /// True when the server answers `PING` with `+PONG` within 500 ms.
    pub fn ping(&self) -> bool {
        let Ok(mut conn) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if self.tls {
            // Listening is all a plain socket can tell of a TLS server.
            return true;
        }
        let timeout = Some(Duration::from_millis(500));
        conn.set_read_timeout(timeout).unwrap();
        conn.set_write_timeout(timeout).unwrap();
        let mut reply = [0u8; 7];
        conn.write_all(b"PING\r\n").is_ok()
            && conn.read_exact(&mut reply).is_ok()
            && &reply == b"+PONG\r\n"
    }

    /// Runs one command (RESP, plain TCP) and returns its reply's first line (a bulk
    /// reply: the whole of it). On a cluster, `redis-cli -c` sends it to the node that
    /// holds its key.
    pub fn command(&self, args: &[&str]) -> String {
        if self.is_cluster() {
            let out = Command::new("redis-cli")
                .args(["-c", "-p", &self.port.to_string()])
                .args(args)
                .output()
                .expect("redis-cli (installed with redis-server)");
            return String::from_utf8_lossy(&out.stdout).trim_end().to_string();
        }
        Redis::command_on(self.port, args)
    }

    fn command_on(port: u16, args: &[&str]) -> String {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("redis answers");
        conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        conn.write_all(req.as_bytes()).unwrap();
        let mut line = || {
            let mut reply = Vec::new();
            let mut byte = [0u8; 1];
            while conn.read_exact(&mut byte).is_ok() && byte[0] != b'\n' {
                reply.push(byte[0]);
            }
            String::from_utf8_lossy(&reply).trim_end().to_string()
        };
        let first = line();
        let Some(len) = first
            .strip_prefix('$')
            .and_then(|n| n.parse::<usize>().ok())
        else {
            return first;
        };
        let mut body = vec![0u8; len];
        conn.read_exact(&mut body).unwrap();
        String::from_utf8_lossy(&body).to_string()
    }

    /// A tenant's reservations under key prefix `prefix`: how many are held, and how
    /// many of them are still leased on the server's clock (the others, a dead
    /// replica's, are charged by the tenant's next admission).
    pub fn reservations(&self, prefix: &str, tenant: &str) -> (u64, u64) {
        const HELD_AND_LEASED: &str = "local t = redis.call('TIME')
            local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
            return redis.call('ZCARD', KEYS[1]) .. ' '
                .. redis.call('ZCOUNT', KEYS[1], string.format('(%d', now), '+inf')";
        let key = format!("{prefix}:{{{tenant}}}:reservations");
        let reply = self.command(&["EVAL", HELD_AND_LEASED, "1", &key]);
        let counts = reply
            .split_once(' ')
            .and_then(|(held, leased)| Some((held.parse().ok()?, leased.parse().ok()?)));
        counts.unwrap_or_else(|| panic!("reservations of {key}: {reply}"))
    }

    /// Waits until no reservation of `tenant` (under `prefix`) is leased any more on
    /// the server's clock, and returns how many are held: a poll, so a test waits for a
    /// lease no longer than it runs (a live call's reservation is settled or renewed,
    /// so this waits for it to end).
    pub async fn until_leases_run_out(&self, prefix: &str, tenant: &str) -> u64 {
        crate::common::until_some("the reservations' leases to run out", || async {
            let (held, leased) = self.reservations(prefix, tenant);
            (leased == 0).then_some(held)
        })
        .await
    }

    /// SIGSTOP: the server keeps its sockets open and answers nothing.
    pub fn pause(&self) {
        signal("STOP", self.pid());
        for peer in &self.peers {
            signal("STOP", peer.id());
        }
    }

    /// SIGCONT after [`Redis::pause`].
    pub fn resume(&self) {
        signal("CONT", self.pid());
        for peer in &self.peers {
            signal("CONT", peer.id());
        }
    }

    /// SIGKILL: the data is gone (nothing is saved); returns the port for a restart.
    pub fn kill(mut self) -> u16 {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.port
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped process.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for peer in &mut self.peers {
            let _ = peer.kill();
            let _ = peer.wait();
        }
    }
}

fn signal(name: &str, pid: u32) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}
