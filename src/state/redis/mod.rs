//! The server-side scripts of replica mode, as Lua files beside this module: one file
//! per operation (its header says what it does, its KEYS, ARGV and replies), and the
//! preludes (`prelude_*.lua`) some of them share, concatenated before the operation at
//! compile time. The budget scripts run in [`crate::state::shared`], the fleet's in
//! [`crate::state::fleet`], the store's in [`crate::store::RedisStore`].
//!
//! The text is static: the few Rust constants it depends on (the guard's window cap, the
//! quiet and admitting prefixes of a guard state, the counts' marker field) are written
//! into it as literals, pinned to the Rust constants by the tests below. What the
//! scripts read and write (keys, values, JSON shapes, format versions) is shared by
//! replicas of different builds during a rolling upgrade: a change to a script must
//! keep it.
//!
//! [`SCRIPTS`] lists every script as it is loaded; the Redis tier loads each on a real
//! `redis-server` (`tests/redis/scripts.rs`), so one that does not compile fails there.

/// Helpers of the budget scripts: the reservation record, the books.
pub const BUDGET_PRELUDE: &str = include_str!("prelude_budget.lua");
/// The admission as a function of its keys and arguments (`admit`: admit and gate).
pub const ADMIT_PRELUDE: &str = include_str!("prelude_admit.lua");
/// A guard snapshot's brief (`brief`, `read_brief`).
pub const BRIEF_PRELUDE: &str = include_str!("prelude_brief.lua");
/// A guard's window kept beside its state (`window_*`).
pub const WINDOW_PRELUDE: &str = include_str!("prelude_window.lua");
/// The fleet scripts' common arguments and helpers.
pub const FLEET_PRELUDE: &str = include_str!("prelude_fleet.lua");
/// A failure counted into the fleet view, as a function (`count`).
pub const FLEET_FAILED_PRELUDE: &str = include_str!("prelude_fleet_failed.lua");

/// `admit.lua`: checks and reserves a call's worst case on the day and the session.
pub const ADMIT: &str = concat!(
    include_str!("prelude_budget.lua"),
    include_str!("prelude_admit.lua"),
    include_str!("admit.lua"),
);

/// `settle.lua`: settles a reservation once, with the session's books in the reply.
pub const SETTLE: &str = concat!(
    include_str!("prelude_budget.lua"),
    include_str!("prelude_brief.lua"),
    include_str!("settle.lua"),
);

/// `gate.lua`: rate limits, a concurrency slot, the guard's write-back and the first
/// reservation, in one round trip.
pub const GATE: &str = concat!(
    include_str!("prelude_brief.lua"),
    include_str!("prelude_window.lua"),
    include_str!("prelude_budget.lua"),
    include_str!("prelude_admit.lua"),
    include_str!("gate.lua"),
);

/// `renew.lua`: pushes out the leases of held reservations or slots.
pub const RENEW: &str = include_str!("renew.lua");

/// `fleet_failed.lua`: a failure counted into the fleet view.
pub const FLEET_FAILED: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("prelude_fleet_failed.lua"),
    include_str!("fleet_failed.lua"),
);

/// `fleet_failed_and_save.lua`: a failure counted and the guard's write-back.
pub const FLEET_FAILED_AND_SAVE: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("prelude_brief.lua"),
    include_str!("prelude_window.lua"),
    include_str!("prelude_fleet_failed.lua"),
    include_str!("fleet_failed_and_save.lua"),
);

/// `fleet_check.lua`: the preemptive check of a watched shape.
pub const FLEET_CHECK: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("fleet_check.lua"),
);

/// `fleet_succeeded.lua`: a request of a watched shape succeeded.
pub const FLEET_SUCCEEDED: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("fleet_succeeded.lua"),
);

/// `fleet_avoided.lua`: refusals credited to a signature.
pub const FLEET_AVOIDED: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("fleet_avoided.lua"),
);

/// `fleet_report.lua`: the admin report of the fleet view.
pub const FLEET_REPORT: &str = concat!(
    include_str!("prelude_fleet.lua"),
    include_str!("fleet_report.lua"),
);

// The store's scripts are the store's (it imports nothing of the state tier): it
// includes their files from here, and they are listed below from there.
use crate::store::redis_scripts::{READ_WINDOW, RELEASE_CLAIM, SAVE_WINDOW};

/// Every script, by the name of its file (without `.lua`), as it is loaded (preludes
/// included). A new script goes here: a unit test fails for a `.lua` file that is in
/// no script, and the Redis tier loads each of these.
pub const SCRIPTS: &[(&str, &str)] = &[
    ("admit", ADMIT),
    ("settle", SETTLE),
    ("gate", GATE),
    ("renew", RENEW),
    ("fleet_failed", FLEET_FAILED),
    ("fleet_failed_and_save", FLEET_FAILED_AND_SAVE),
    ("fleet_check", FLEET_CHECK),
    ("fleet_succeeded", FLEET_SUCCEEDED),
    ("fleet_avoided", FLEET_AVOIDED),
    ("fleet_report", FLEET_REPORT),
    ("save_window", SAVE_WINDOW),
    ("read_window", READ_WINDOW),
    ("release_claim", RELEASE_CLAIM),
];

/// The preludes, by the name of their file.
pub const PRELUDES: &[(&str, &str)] = &[
    ("prelude_budget", BUDGET_PRELUDE),
    ("prelude_admit", ADMIT_PRELUDE),
    ("prelude_brief", BRIEF_PRELUDE),
    ("prelude_window", WINDOW_PRELUDE),
    ("prelude_fleet", FLEET_PRELUDE),
    ("prelude_fleet_failed", FLEET_FAILED_PRELUDE),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        policy::guard::RECENT_CAP,
        store::format::{
            beside_prefix, ADMITTING_PREFIXES, HASHED_FIELD, HASHED_VALUE_LEN, QUIET_PREFIX,
        },
    };

    /// The `.lua` files of this folder: (name without `.lua`, text).
    fn lua_files() -> Vec<(String, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/state/redis");
        let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "lua"))
            .map(|path| {
                let name = path.file_stem().unwrap().to_str().unwrap().to_string();
                (name, std::fs::read_to_string(&path).unwrap())
            })
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no .lua file in {}", dir.display());
        files
    }

    /// Every `.lua` file is loaded: an operation's file ends the script of its name, a
    /// prelude is in [`PRELUDES`] and in some script. Nothing is listed without a file.
    #[test]
    fn every_lua_file_is_a_script_or_a_prelude_of_one() {
        let files = lua_files();
        for (name, text) in &files {
            if name.starts_with("prelude_") {
                let prelude = PRELUDES.iter().find(|(n, _)| n == name);
                assert_eq!(
                    prelude.map(|(_, t)| *t),
                    Some(text.as_str()),
                    "{name}.lua is not in PRELUDES"
                );
                assert!(
                    SCRIPTS
                        .iter()
                        .any(|(_, source)| source.contains(text.as_str())),
                    "{name}.lua is in no script"
                );
            } else {
                let script = SCRIPTS.iter().find(|(n, _)| n == name);
                assert!(
                    script.is_some_and(|(_, source)| source.ends_with(text.as_str())),
                    "{name}.lua is not in SCRIPTS (as the end of the script named {name})"
                );
            }
        }
        for (name, _) in SCRIPTS.iter().chain(PRELUDES) {
            assert!(
                files.iter().any(|(n, _)| n == name),
                "{name} is listed but src/state/redis/{name}.lua does not exist"
            );
            let listed = SCRIPTS.iter().chain(PRELUDES).filter(|(n, _)| n == name);
            assert_eq!(listed.count(), 1, "{name} is listed twice");
        }
    }

    /// Each file opens with its header; an operation's says what it takes and replies.
    #[test]
    fn every_lua_file_has_a_header() {
        for (name, text) in lua_files() {
            let header: Vec<&str> = text.lines().take_while(|l| l.starts_with("--")).collect();
            assert!(header.len() >= 3, "{name}.lua opens with no header comment");
            if !name.starts_with("prelude_") {
                assert!(
                    header[0].starts_with(&format!("-- {name}: ")),
                    "{name}.lua's header does not open with `-- {name}: `"
                );
                for section in ["-- KEYS", "-- ARGV", "-- Replies"] {
                    assert!(
                        header.contains(&section),
                        "{name}.lua's header has no `{section}` section"
                    );
                }
            }
        }
    }

    /// The constants written into the Lua are the Rust ones.
    #[test]
    fn the_lua_constants_are_the_rust_ones() {
        let quiet = format!("local QUIET = '{}'\n", beside_prefix(QUIET_PREFIX));
        assert!(BRIEF_PRELUDE.contains(&quiet), "prelude_brief.lua: {quiet}");
        let admitting: Vec<String> = ADMITTING_PREFIXES
            .iter()
            .map(|p| format!("'{}'", beside_prefix(p)))
            .collect();
        let admitting = format!("ipairs({{{}}})", admitting.join(", "));
        assert!(GATE.contains(&admitting), "gate.lua: {admitting}");
        let cap = format!("if len > {RECENT_CAP} then");
        assert!(WINDOW_PRELUDE.contains(&cap), "prelude_window.lua: {cap}");
        let hashed = format!(
            "redis.call('HSET', seen, '{HASHED_FIELD}', '{}')",
            "h".repeat(HASHED_VALUE_LEN)
        );
        assert!(
            WINDOW_PRELUDE.contains(&hashed),
            "prelude_window.lua: {hashed}"
        );
        // Written into single-quoted Lua strings as they are.
        let literals = std::iter::once(QUIET_PREFIX)
            .chain(ADMITTING_PREFIXES)
            .map(beside_prefix)
            .chain([HASHED_FIELD.to_string()]);
        for text in literals {
            assert!(
                !text.contains(['\'', '\\', '\n']),
                "not a plain Lua literal: {text}"
            );
        }
    }
}
