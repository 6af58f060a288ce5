//! The memory budget of large request bodies, all clients together. A body over
//! [`LARGE_BODY_BYTES`] is charged twice, from two pools: its bytes (its
//! `Content-Length`, before it is read) and then the estimated size of its parsed form
//! (after the pre-scan counted it, before it is parsed). It holds both until its
//! response ends. A body waits for room until a deadline, then is refused (`Busy`).
//!
//! Two pools, taken in one order (bytes, then parsed), so the holders of parsed memory
//! never wait for anything and the waiters always make progress: with one pool, bodies
//! holding their bytes while waiting for their parse could hold it all between them.
//! A charge larger than its whole pool is cut to the pool: such a body runs alone.

use std::{sync::Arc, time::Duration};

use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

/// Bodies up to this size are not charged: the everyday path stays free of the budget.
pub const LARGE_BODY_BYTES: usize = 1024 * 1024;

/// The budget could not make room before the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// One pool, counted in KiB (a semaphore takes at most `u32` permits at once).
#[derive(Debug)]
struct Pool {
    permits: Arc<Semaphore>,
    kib: u32,
    /// The `pool` label of `backstop_body_memory_bytes`.
    name: &'static str,
}

/// What a pool has charged, in bytes, on the `backstop_body_memory_bytes{pool}` gauge.
fn gauge(pool: &'static str, kib: usize, charged: bool) {
    let gauge = metrics::gauge!("backstop_body_memory_bytes", "pool" => pool);
    let bytes = (kib * 1024) as f64;
    if charged {
        gauge.increment(bytes);
    } else {
        gauge.decrement(bytes);
    }
}

impl Pool {
    fn new(name: &'static str, bytes: usize) -> Pool {
        let kib = bytes.div_ceil(1024).clamp(1, u32::MAX as usize) as u32;
        Pool {
            permits: Arc::new(Semaphore::new(kib as usize)),
            kib,
            name,
        }
    }

    fn kib(&self, bytes: u64) -> u32 {
        bytes.div_ceil(1024).min(u64::from(self.kib)) as u32
    }

    async fn charge(&self, bytes: u64, until: Instant) -> Result<OwnedSemaphorePermit, Busy> {
        let want = self.kib(bytes);
        match tokio::time::timeout_at(until, self.permits.clone().acquire_many_owned(want)).await {
            Ok(Ok(permit)) => {
                gauge(self.name, permit.num_permits(), true);
                Ok(permit)
            }
            _ => Err(Busy),
        }
    }
}

/// What one large body holds of the budget; given back when it is dropped.
#[derive(Debug, Default)]
pub struct Charge {
    body: Option<OwnedSemaphorePermit>,
    parsed: Option<OwnedSemaphorePermit>,
}

impl Charge {
    pub fn is_empty(&self) -> bool {
        self.body.is_none() && self.parsed.is_none()
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        for (pool, permit) in [(BODY, &self.body), (PARSED, &self.parsed)] {
            if let Some(permit) = permit {
                gauge(pool, permit.num_permits(), false);
            }
        }
    }
}

const BODY: &str = "body";
const PARSED: &str = "parsed";

/// `server.max_body_bytes_in_flight`, `max_parsed_bytes_in_flight`, `in_flight_wait`.
#[derive(Debug)]
pub struct BodyMemory {
    body: Pool,
    parsed: Pool,
    wait: Duration,
}

impl BodyMemory {
    pub fn new(body_bytes: usize, parsed_bytes: usize, wait: Duration) -> Self {
        BodyMemory {
            body: Pool::new(BODY, body_bytes),
            parsed: Pool::new(PARSED, parsed_bytes),
            wait,
        }
    }

    pub fn from_config(server: &crate::config::ServerConfig) -> Self {
        Self::new(
            server.max_body_bytes_in_flight,
            server.max_parsed_bytes_in_flight,
            server.in_flight_wait,
        )
    }

    /// Whether `other` has the same pools and wait (a reload keeps the running one).
    pub fn same_budget(&self, other: &BodyMemory) -> bool {
        (self.body.kib, self.parsed.kib, self.wait)
            == (other.body.kib, other.parsed.kib, other.wait)
    }

    /// The deadline of a charge asked for at `asked`.
    pub fn deadline(&self, asked: Instant) -> Instant {
        asked + self.wait
    }

    /// Charges `bytes` of body (at most one pool's worth; nothing for a small body).
    pub async fn charge_body(
        &self,
        charge: &mut Charge,
        bytes: usize,
        until: Instant,
    ) -> Result<(), Busy> {
        if bytes > LARGE_BODY_BYTES && charge.body.is_none() {
            charge.body = Some(self.body.charge(bytes as u64, until).await?);
        }
        Ok(())
    }

    /// Gives back what a body was charged beyond its `len` bytes (a body of unknown
    /// length is charged the limit while it arrives).
    pub fn settle_body(&self, charge: &mut Charge, len: usize) {
        if let Some(permit) = &mut charge.body {
            let keep = self.body.kib(len as u64).max(1) as usize;
            if permit.num_permits() > keep {
                let unused = permit.num_permits() - keep;
                drop(permit.split(unused));
                gauge(BODY, unused, false);
            }
        }
    }

    /// Charges the parsed form of a body of `len` bytes, estimated at `bytes`.
    pub async fn charge_parsed(
        &self,
        charge: &mut Charge,
        len: usize,
        bytes: u64,
        until: Instant,
    ) -> Result<(), Busy> {
        if len > LARGE_BODY_BYTES && charge.parsed.is_none() {
            charge.parsed = Some(self.parsed.charge(bytes, until).await?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    #[tokio::test(start_paused = true)]
    async fn large_bodies_wait_for_room_then_are_refused() {
        let memory = BodyMemory::new(4 * MIB, 8 * MIB, Duration::from_secs(1));
        let until = memory.deadline(Instant::now());
        let mut small = Charge::default();
        memory.charge_body(&mut small, MIB, until).await.unwrap();
        memory
            .charge_parsed(&mut small, MIB, 100 * MIB as u64, until)
            .await
            .unwrap();
        assert!(small.is_empty(), "small bodies are never charged");

        let mut a = Charge::default();
        memory.charge_body(&mut a, 3 * MIB, until).await.unwrap();
        let mut b = Charge::default();
        // 2 MiB more do not fit in 4: b waits out the deadline.
        assert_eq!(memory.charge_body(&mut b, 2 * MIB, until).await, Err(Busy));
        drop(a);
        let until = memory.deadline(Instant::now());
        memory.charge_body(&mut b, 2 * MIB, until).await.unwrap();
        // Larger than the whole pool: cut to the pool, so it runs alone.
        memory
            .charge_parsed(&mut b, 2 * MIB, 100 * MIB as u64, until)
            .await
            .unwrap();
        let mut c = Charge::default();
        memory.charge_body(&mut c, 2 * MIB, until).await.unwrap();
        assert_eq!(
            memory
                .charge_parsed(&mut c, 2 * MIB, 2 * MIB as u64, until)
                .await,
            Err(Busy)
        );
        drop(b);
        let until = memory.deadline(Instant::now());
        memory
            .charge_parsed(&mut c, 2 * MIB, 2 * MIB as u64, until)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_of_unknown_length_gives_back_what_it_did_not_use() {
        let memory = BodyMemory::new(4 * MIB, 8 * MIB, Duration::from_secs(1));
        let until = memory.deadline(Instant::now());
        let mut a = Charge::default();
        memory.charge_body(&mut a, 10 * MIB, until).await.unwrap();
        memory.settle_body(&mut a, 2 * MIB);
        let mut b = Charge::default();
        memory.charge_body(&mut b, 2 * MIB, until).await.unwrap();
    }
}
