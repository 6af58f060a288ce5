//! A `":memory:"` store's database: a private file in the temp dir, in WAL mode like any
//! other. SQLite's shared-cache in-memory databases lock whole tables between their
//! connections, and `busy_timeout` does not cover those locks: under concurrent calls a
//! session read failed with "database table is locked" while the writer committed
//! (found by the k6 steady smoke).
//!
//! The files go with the store. A process killed with `kill -9` cannot remove them, so
//! each scratch database has a lock file beside it, held with an exclusive `flock` for
//! the store's life; the kernel releases it when the process dies, however it dies. A
//! new scratch store removes the files of every scratch database whose lock it can take:
//! their process is gone.
//!
//! The lock is taken before the database exists, so a lock file that can be taken while
//! its database does not exist belongs to a store being made (its maker blocks on the
//! lock until the sweeper lets go, and only then makes the database): it is left alone.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

const PREFIX: &str = "backstop-memory-";

pub(super) struct Scratch {
    db: PathBuf,
    /// Held (locked) while the store lives; `None` if it could not be made, in which case
    /// the files are still removed with the store, only not after a crash.
    lock: Option<(PathBuf, File)>,
}

impl Scratch {
    /// A new scratch database's path in the temp dir, locked as its own, after removing
    /// what dead processes left there.
    pub(super) fn create() -> Scratch {
        Scratch::create_in(&std::env::temp_dir())
    }

    fn create_in(dir: &Path) -> Scratch {
        let stem = format!("{PREFIX}{}", uuid::Uuid::new_v4().simple());
        let lock_path = dir.join(format!("{stem}.lock"));
        let lock = File::options()
            .write(true)
            .create_new(true)
            .open(&lock_path)
            // Blocking: a sweeper may hold it for a moment, and lets go on seeing no database.
            .and_then(|file| file.lock().map(|()| file));
        let lock = match lock {
            Ok(file) => Some((lock_path, file)),
            Err(err) => {
                tracing::warn!(
                    path = %lock_path.display(),
                    error = %err,
                    "cannot lock the scratch store's file: a crash would leave it behind"
                );
                None
            }
        };
        let swept = sweep(dir);
        if swept > 0 {
            tracing::info!(
                stores = swept,
                dir = %dir.display(),
                "removed the scratch stores of processes that are gone"
            );
        }
        Scratch {
            db: dir.join(format!("{stem}.db")),
            lock,
        }
    }

    /// The database file.
    pub(super) fn path(&self) -> &Path {
        &self.db
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove_database(&self.db);
        // The lock file last, still locked: a sweeper never sees it free with files left.
        if let Some((path, _)) = &self.lock {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn remove_database(db: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = db.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// Removes the scratch databases in `dir` whose lock is free (their process is gone);
/// returns how many. Files it cannot open or remove (another user's) are left.
fn sweep(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(PREFIX) && n.ends_with(".lock"))
        })
        .filter(|lock_path| sweep_one(lock_path))
        .count()
}

fn sweep_one(lock_path: &Path) -> bool {
    let Ok(file) = File::options().write(true).open(lock_path) else {
        return false;
    };
    if file.try_lock().is_err() {
        // Held: its store is alive.
        return false;
    }
    let db = lock_path.with_extension("db");
    if !db.exists() {
        // Being made: its maker takes the lock once this one lets go.
        return false;
    }
    remove_database(&db);
    let _ = std::fs::remove_file(lock_path);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::store::test_dir::TestDir;

    fn touch(dir: &TestDir, name: &str) {
        std::fs::write(dir.path().join(name), b"x").unwrap();
    }

    fn names(dir: &TestDir) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// What a store leaves when its process is killed: the database, its WAL and shared
    /// memory, and a lock file nobody holds.
    fn left_by_a_killed_process(dir: &TestDir, id: &str) {
        for suffix in [".db", ".db-wal", ".db-shm", ".lock"] {
            touch(dir, &format!("{PREFIX}{id}{suffix}"));
        }
    }

    #[test]
    fn a_new_scratch_store_removes_what_dead_processes_left_and_nothing_else() {
        let dir = TestDir::new("scratch-test");
        left_by_a_killed_process(&dir, "dead1");
        left_by_a_killed_process(&dir, "dead2");
        // Alive: its lock is held (by another open file: `flock` locks are per open file).
        left_by_a_killed_process(&dir, "alive");
        let held = File::options()
            .write(true)
            .open(dir.path().join(format!("{PREFIX}alive.lock")))
            .unwrap();
        held.lock().unwrap();
        // Being made: its lock file exists, its database not yet.
        touch(&dir, &format!("{PREFIX}making.lock"));
        // A database from before lock files, and someone else's file: not ours to judge.
        touch(&dir, &format!("{PREFIX}older.db"));
        touch(&dir, "other.db");

        let scratch = Scratch::create_in(dir.path());
        let own = scratch
            .path()
            .file_stem()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();

        let mut expected: Vec<String> = [
            "alive.db",
            "alive.db-shm",
            "alive.db-wal",
            "alive.lock",
            "making.lock",
            "older.db",
        ]
        .iter()
        .map(|n| format!("{PREFIX}{n}"))
        .chain([format!("{own}.lock"), "other.db".to_string()])
        .collect();
        expected.sort();
        assert_eq!(names(&dir), expected);
    }

    #[test]
    fn a_live_scratch_store_is_never_swept_and_goes_with_its_store() {
        let dir = TestDir::new("scratch-test");
        let first = Scratch::create_in(dir.path());
        for suffix in ["", "-wal", "-shm"] {
            let mut file = first.path().as_os_str().to_owned();
            file.push(suffix);
            std::fs::write(file, b"x").unwrap();
        }
        let second = Scratch::create_in(dir.path());
        assert_eq!(
            names(&dir).len(),
            5,
            "the first's four files and the second's lock"
        );
        drop(second);
        assert_eq!(names(&dir).len(), 4);
        drop(first);
        assert_eq!(names(&dir), Vec::<String>::new());
    }

    #[test]
    fn a_store_killed_before_it_let_go_is_swept_by_the_next() {
        let dir = TestDir::new("scratch-test");
        let killed = Scratch::create_in(dir.path());
        std::fs::write(killed.path(), b"x").unwrap();
        // What the kernel does for a killed process: its lock goes, its files stay.
        killed.lock.as_ref().unwrap().1.unlock().unwrap();
        std::mem::forget(killed);

        let next = Scratch::create_in(dir.path());
        let own = format!(
            "{}.lock",
            next.path().file_stem().unwrap().to_str().unwrap()
        );
        assert_eq!(names(&dir), vec![own]);
    }
}
