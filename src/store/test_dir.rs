//! A private directory in the temp dir for a unit test, removed with its guard.

use std::path::{Path, PathBuf};

pub(crate) struct TestDir(PathBuf);

impl TestDir {
    /// `{temp}/backstop-{name}-{uuid}`, made empty.
    pub(crate) fn new(name: &str) -> TestDir {
        let dir =
            std::env::temp_dir().join(format!("backstop-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
