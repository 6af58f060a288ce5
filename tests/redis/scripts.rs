//! Every server-side script of replica mode (`state::redis::SCRIPTS`, the Lua of
//! `src/state/redis/`, preludes included, as the crate loads it) loaded with `SCRIPT
//! LOAD` on a real `redis-server`: a script that does not compile fails here, by name,
//! whether or not another test runs it.
//!
//! Needs `redis-server` on PATH (`.ci/run` installs it).

use crate::redis_support::Redis as RedisServer;
use backstop::state::redis::SCRIPTS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_compiles_on_redis() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    assert!(!SCRIPTS.is_empty());
    let mut refused = Vec::new();
    for (name, source) in SCRIPTS {
        let loaded: redis::RedisResult<String> = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(*source)
            .query_async(&mut conn)
            .await;
        match loaded {
            // The hash the replicas call it by (EVALSHA) is the one Redis keeps it under.
            Ok(sha) => assert_eq!(sha, redis::Script::new(source).get_hash(), "{name}"),
            Err(err) => refused.push(format!("{name}: {err}{}", at_line(source, &err))),
        }
    }
    assert!(
        refused.is_empty(),
        "scripts redis-server does not compile:\n{}",
        refused.join("\n")
    );
}

/// The line of `source` a compile error names (`user_script:N:`), counted in the script
/// as loaded (its preludes first), to find it in the `.lua` files.
fn at_line(source: &str, err: &redis::RedisError) -> String {
    let text = err.to_string();
    let line = text
        .split("user_script:")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse::<usize>().ok());
    match line.and_then(|n| Some((n, source.lines().nth(n.checked_sub(1)?)?))) {
        Some((n, line)) => format!("\n  line {n} of the script as loaded: {line}"),
        None => String::new(),
    }
}
