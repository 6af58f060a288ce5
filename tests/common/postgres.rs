//! A real PostgreSQL server per test: `initdb` once per machine into a template data
//! directory, then per test a copy of it started with `pg_ctl` on a free port (socket
//! in the data directory, TCP on 127.0.0.1 only), stopped and removed on drop. As root
//! the server runs as the `postgres` user (PostgreSQL refuses root).
//!
//! Without `initdb` the tests fail, not skip: `.ci/run` installs `postgresql`.
#![allow(dead_code)]

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::OnceLock,
};

use crate::common::free_port;

/// The directory holding `initdb`, `pg_ctl` and `psql`: `initdb` on PATH (symlinks
/// followed, since Debian links only some of the tools), else the newest
/// `/usr/lib/postgresql/*/bin`.
fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let on_path = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join("initdb"))
                .find(|p| p.is_file())
                .and_then(|p| std::fs::canonicalize(p).ok())
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .filter(|dir| dir.join("pg_ctl").is_file())
        });
        on_path
            .or_else(|| {
                let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|e| {
                        let version = e.file_name().to_str()?.parse::<u32>().ok()?;
                        let bin = e.path().join("bin");
                        bin.join("initdb").is_file().then_some((version, bin))
                    })
                    .collect();
                found.sort();
                found.pop().map(|(_, bin)| bin)
            })
            .unwrap_or_else(|| {
                panic!(
                    "initdb is not installed: the PostgreSQL tests need a real server \
                     (.ci/run installs it: apt-get install postgresql)"
                )
            })
    })
}

fn is_root() -> bool {
    static ROOT: OnceLock<bool> = OnceLock::new();
    *ROOT.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false)
    })
}

/// Runs a PostgreSQL tool, as `postgres` when we are root.
fn run(tool: &str, args: &[&str]) -> Output {
    let path = bin_dir().join(tool);
    let mut command = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&path);
        c
    } else {
        Command::new(&path)
    };
    command
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()))
}

fn check(what: &str, out: Output) {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The template data directory, made once per machine (and per PostgreSQL version).
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let version = bin_dir()
            .parent()
            .and_then(|p| p.file_name())
            .map_or("pg".into(), |n| n.to_string_lossy().into_owned());
        let dir = std::env::temp_dir().join(format!("backstop-pg-template-{version}"));
        if dir.join("PG_VERSION").is_file() {
            return dir;
        }
        // Made beside, then renamed: another test binary may be making it too.
        let making = std::env::temp_dir().join(format!(
            "backstop-pg-making-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let making_str = making.to_str().unwrap();
        check(
            "initdb",
            run(
                "initdb",
                &[
                    "-D",
                    making_str,
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ],
            ),
        );
        if std::fs::rename(&making, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&making);
        }
        dir
    })
}

/// One running server of the test's own.
pub struct Postgres {
    pub port: u16,
    dir: PathBuf,
    /// Whether it speaks TLS ([`Postgres::start_tls`]).
    tls: bool,
    /// Whether commits are flushed to disk ([`Postgres::start_durable`]); the tests'
    /// servers run with `fsync = off` otherwise.
    durable: bool,
}

impl Postgres {
    /// A fresh server (a copy of the template) on a free port, answering when this
    /// returns.
    pub fn start() -> Postgres {
        Self::start_with(false, false)
    }

    /// As [`Postgres::start`], with `fsync = on` (the server's default) as a production
    /// server runs, for measurements.
    pub fn start_durable() -> Postgres {
        Self::start_with(false, true)
    }

    /// As [`Postgres::start`], with `ssl = on`: a certificate for `127.0.0.1` signed by
    /// a CA of the test's own ([`Postgres::ca_file`]), both made by the `openssl`
    /// command line. Clients may still connect without TLS (`sslmode=disable`).
    pub fn start_tls() -> Postgres {
        Self::start_with(true, false)
    }

    fn start_with(tls: bool, durable: bool) -> Postgres {
        let dir =
            std::env::temp_dir().join(format!("backstop-pg-{}", uuid::Uuid::new_v4().simple()));
        // `cp -a` keeps the owner (postgres) and the data directory's 0700.
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template())
            .arg(&dir)
            .output()
            .expect("cp");
        check("copying the template data directory", copied);
        let pg = Postgres {
            port: free_port(),
            dir,
            tls,
            durable,
        };
        if tls {
            pg.make_certificates();
        }
        pg.start_again();
        pg
    }

    /// The CA that signed a TLS server's certificate (PEM).
    pub fn ca_file(&self) -> PathBuf {
        assert!(self.tls, "a server started with start_tls");
        self.dir.join("ca.crt")
    }

    /// `ca.crt` (CA:TRUE, self-signed) and `server.crt` / `server.key` (CA:FALSE,
    /// subjectAltName IP 127.0.0.1, as rustls requires) in the data directory, the
    /// key readable by the server only.
    fn make_certificates(&self) {
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .current_dir(&self.dir)
                .args(args)
                .output()
                .expect("openssl makes the test certificates");
            check(&format!("openssl {args:?}"), out);
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=backstop test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            self.dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            "server.crt",
            "-extfile",
            "server.ext",
        ]);
        let key = self.dir.join("server.key");
        if is_root() {
            let owned = Command::new("chown")
                .arg("postgres")
                .arg(&key)
                .arg(self.dir.join("server.crt"))
                .output()
                .expect("chown");
            check("chown the server's key", owned);
        }
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
    }

    fn dir_str(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    /// Starts the server again on its port, after [`Postgres::stop_now`].
    pub fn start_again(&self) {
        let mut options = format!(
            "-k {} -p {} -c listen_addresses=127.0.0.1 -c fsync={} -c max_connections=200",
            self.dir_str(),
            self.port,
            if self.durable { "on" } else { "off" }
        );
        if self.tls {
            options.push_str(" -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key");
        }
        let log = self.dir.join("server.log");
        check(
            "pg_ctl start",
            run(
                "pg_ctl",
                &[
                    "-D",
                    self.dir_str(),
                    "-l",
                    log.to_str().unwrap(),
                    "-o",
                    &options,
                    "-w",
                    "start",
                ],
            ),
        );
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`): connections cut,
    /// nothing flushed beyond what was committed.
    pub fn stop_now(&self) {
        check(
            "pg_ctl stop",
            run(
                "pg_ctl",
                &["-D", self.dir_str(), "-m", "immediate", "-w", "stop"],
            ),
        );
    }

    /// A URL for database `db` as the superuser.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs `sql` through `psql` on database `db`; its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let port = self.port.to_string();
        let out = run(
            "psql",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                db,
                "-XAtq",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        check(&format!("psql {sql}"), out);
        text
    }

    /// A new empty database, its name.
    pub fn create_database(&self) -> String {
        let name = format!("t{}", uuid::Uuid::new_v4().simple());
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        name
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = run(
            "pg_ctl",
            &["-D", self.dir_str(), "-m", "immediate", "-w", "stop"],
        );
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
