//! Ports for the processes a test or a bench starts. Shared by the tests' and the
//! examples' `common` modules.

/// A free port for a process to listen on. The kernel may hand a port just released
/// straight back, so none is given twice in one process (tests run in parallel, and two
/// servers given one port leave one measuring or testing the other).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap().insert(port) {
            return port;
        }
    }
}
