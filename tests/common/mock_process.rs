//! `backstop mock-upstream` run as a process of its own, for tests of real binaries.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use super::free_port;

/// `backstop mock-upstream` as its own process: every replica sends to it, and its
/// `/mock/stats` counts the attempts of all of them together.
pub struct MockUpstream {
    pub port: u16,
    child: Child,
}

impl MockUpstream {
    pub async fn start() -> MockUpstream {
        Self::start_with(&[]).await
    }

    /// As [`MockUpstream::start`], with more of `mock-upstream`'s options (`--workers 1`).
    pub async fn start_with(options: &[&str]) -> MockUpstream {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_backstop"))
            .args(["mock-upstream", "--listen", &format!("127.0.0.1:{port}")])
            .args(options)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mock = MockUpstream { port, child };
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if http.get(mock.stats_url()).send().await.is_ok() {
                return mock;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the mock upstream did not start");
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn stats_url(&self) -> String {
        format!("{}/mock/stats", self.base_url())
    }

    /// Attempts the mock has seen for `scenario`, from every replica.
    pub async fn attempts(&self, scenario: &str) -> u64 {
        let text = reqwest::get(self.stats_url())
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let stats: Value = serde_json::from_str(&text).unwrap();
        stats["scenarios"][scenario].as_u64().unwrap_or(0)
    }

    /// Lets the attempts scripted `hold=NAME` go on (and later ones at once).
    pub async fn release(&self, hold: &str) {
        let resp = reqwest::Client::new()
            .post(format!("{}/mock/release?hold={hold}", self.base_url()))
            .send()
            .await
            .unwrap();
        assert!(
            resp.status().is_success(),
            "release {hold}: {}",
            resp.status()
        );
    }

    /// Waits until the mock has seen `n` attempts for `scenario`.
    pub async fn wait_for(&self, scenario: &str, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = self.attempts(scenario).await;
            if seen >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the mock saw {seen} of {n} attempts for {scenario}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
