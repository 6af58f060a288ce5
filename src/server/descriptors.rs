//! File descriptors and the connection cap.
//!
//! Every client connection is a descriptor, and so is the upstream connection it may
//! hold. A process that runs out gets EMFILE at accept: the new client then waits in the
//! listen backlog until it gives up, where it should have had the 503 of
//! `max_connections`. So, at start:
//! 1. the soft `RLIMIT_NOFILE` is raised to the hard limit, as Go's runtime and nginx's
//!    `worker_rlimit_nofile` do (the usual soft 1024 is there for select(2), which
//!    nothing here uses);
//! 2. the connection cap is `max_connections`, lowered if need be so that its
//!    descriptors and a fixed [`RESERVE`] fit under that limit: the cap refuses with a
//!    503 before accept can fail.

/// Descriptors kept for all but client connections and their upstream ones: the
/// listeners, the runtime's epoll and eventfd, the store's SQLite files, log files,
/// connections to Redis and the OTLP collector, and twice [`REFUSAL_SLOTS`].
pub const RESERVE: u64 = 64;

/// Connections refused over the cap that may stay open at once while their 503 waits
/// for the request head (and as many again cut short, not yet closed: at most twice
/// this many refused connections hold a descriptor).
pub const REFUSAL_SLOTS: usize = 16;

/// Descriptors one client connection may need at worst: its own and one upstream
/// connection; a third with the built-in mock, which holds the upstream's other end.
pub fn per_connection(builtin_mock: bool) -> u64 {
    if builtin_mock {
        3
    } else {
        2
    }
}

/// The connection cap: `configured`, or fewer when `open_files` (the soft limit; `None`
/// when unlimited or unknown) cannot hold that many beside the [`RESERVE`]. Never 0, so
/// a tiny limit still serves one connection at a time rather than refusing all.
pub fn connection_cap(configured: usize, open_files: Option<u64>, per_connection: u64) -> usize {
    let Some(open_files) = open_files else {
        return configured;
    };
    let fits = open_files.saturating_sub(RESERVE) / per_connection.max(1);
    configured
        .min(usize::try_from(fits).unwrap_or(usize::MAX))
        .max(1)
}

/// Raises the soft open files limit to the hard one and returns the soft limit now in
/// force (`None`: unlimited or unknown). Where raising is refused (macOS caps it below an
/// unlimited hard limit), the soft limit stays as it was.
#[cfg(unix)]
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(err) = setrlimit(Resource::Nofile, raised) {
            tracing::debug!(error = %err, soft = limit.current, hard = limit.maximum, "could not raise the open files limit");
        }
    }
    getrlimit(Resource::Nofile).current
}

#[cfg(not(unix))]
pub fn raise_open_files_limit() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_cap_stands_when_the_limit_holds_it() {
        assert_eq!(connection_cap(4096, Some(1_048_576), 2), 4096);
        assert_eq!(connection_cap(4096, None, 2), 4096);
        // Exactly enough: 64 reserved + 2 × 4096.
        assert_eq!(connection_cap(4096, Some(64 + 2 * 4096), 2), 4096);
    }

    #[test]
    fn the_cap_is_lowered_to_what_the_limit_can_hold() {
        // `ulimit -n 1024`: (1024 - 64) / 2.
        assert_eq!(connection_cap(4096, Some(1024), 2), 480);
        assert_eq!(connection_cap(4096, Some(64 + 2 * 4096 - 1), 2), 4095);
        // The built-in mock holds a third descriptor per connection.
        assert_eq!(connection_cap(4096, Some(256), 3), 64);
    }

    #[test]
    fn a_limit_below_the_reserve_still_serves_one_connection() {
        assert_eq!(connection_cap(4096, Some(64), 2), 1);
        assert_eq!(connection_cap(4096, Some(10), 2), 1);
        assert_eq!(connection_cap(4096, Some(0), 0), 1);
    }
}
