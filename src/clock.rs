//! The one injected clock (of the live state and the store). Durations (cool-downs, rate limits, idle times) are
//! tokio [`Instant`]s; calendar things (the UTC day of a tenant's budget, ledger
//! timestamps, when a kept trip ends) are wall-clock milliseconds derived from a
//! [`SystemTime`] read once, at start, plus tokio's elapsed time. So a paused tokio clock
//! (`#[tokio::test(start_paused = true)]` + `tokio::time::advance`) moves the calendar
//! too, and a test can cross midnight without waiting for it.
//!
//! The wall clock does not follow later changes to the system clock (an NTP step): the
//! process keeps the calendar it started with, advanced at the monotonic rate.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::time::Instant;

const DAY_MS: i64 = 86_400_000;

#[derive(Clone, Debug)]
pub struct Clock {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    origin: Instant,
    /// Wall clock at `origin`, in ms since the Unix epoch.
    wall_at_origin_ms: i64,
    /// How far [`Clock::skip`] has moved this clock ahead of tokio's, in ns.
    skipped_ns: AtomicU64,
}

impl Clock {
    /// The system's calendar as of now, advancing with tokio time.
    pub fn system() -> Clock {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Clock::starting_at(wall)
    }

    /// A clock whose calendar reads `wall_ms` (ms since the Unix epoch) now.
    pub fn starting_at(wall_ms: i64) -> Clock {
        Clock {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                wall_at_origin_ms: wall_ms,
                skipped_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Now, for durations.
    pub fn now(&self) -> Instant {
        Instant::now() + self.skipped()
    }

    /// Time since this clock started (governor's instant).
    pub fn elapsed(&self) -> Duration {
        self.now().saturating_duration_since(self.inner.origin)
    }

    /// Now on the calendar: ms since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        let elapsed = i64::try_from(self.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.inner.wall_at_origin_ms.saturating_add(elapsed)
    }

    /// Today as days since the Unix epoch (UTC): the tenant budget window.
    pub fn today(&self) -> i64 {
        self.now_ms().div_euclid(DAY_MS)
    }

    /// Moves this clock (and every clone of it) `by` ahead of tokio's. For tests that
    /// cannot pause tokio's clock, because real sockets and the store's threads run
    /// beside it: the state under test sees the time pass, tokio's timers do not.
    pub fn skip(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.inner.skipped_ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn skipped(&self) -> Duration {
        Duration::from_nanos(self.inner.skipped_ns.load(Ordering::Relaxed))
    }
}

/// A UTC calendar day, held as days since the Unix epoch (the ledger's `day`), written
/// and read as `YYYY-MM-DD`. The conversions are Howard Hinnant's `civil_from_days` and
/// `days_from_civil`: exact for every day in years 0 to 9999, with no clock involved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Date(pub i64);

/// Why a text is not a [`Date`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DateError {
    #[error("`{0}` is not a date: expected YYYY-MM-DD")]
    Format(String),
    #[error("`{0}` is not a day of the calendar")]
    NoSuchDay(String),
}

impl Date {
    /// Year, month (1-12) and day of the month (1-31).
    pub fn ymd(self) -> (i64, u32, u32) {
        let z = self.0 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let y = yoe + era * 400 + i64::from(m <= 2);
        (y, m, d)
    }

    /// The day of `year-month-day`, which must exist.
    fn from_ymd(year: i64, month: u32, day: u32) -> Date {
        let y = year - i64::from(month <= 2);
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let m = i64::from(month);
        let mp = if m > 2 { m - 3 } else { m + 9 };
        let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        Date(era * 146_097 + doe - 719_468)
    }
}

fn days_in_month(year: i64, month: u32) -> u32 {
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl std::str::FromStr for Date {
    type Err = DateError;

    /// Exactly `YYYY-MM-DD`, a day that exists (2024-02-29 does, 2025-02-29 does not).
    fn from_str(text: &str) -> Result<Date, DateError> {
        let bad = || DateError::Format(text.to_string());
        let b = text.as_bytes();
        let digits = |r: std::ops::Range<usize>| -> Result<u32, DateError> {
            let part = &b[r];
            if !part.iter().all(u8::is_ascii_digit) {
                return Err(bad());
            }
            Ok(part.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
        };
        if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
            return Err(bad());
        }
        let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
        let year = i64::from(year);
        if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
            return Err(DateError::NoSuchDay(text.to_string()));
        }
        Ok(Date::from_ymd(year, month, day))
    }
}

impl std::fmt::Display for Date {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (y, m, d) = self.ymd();
        write!(f, "{y:04}-{m:02}-{d:02}")
    }
}

/// Governor's clock, so the rate limits run on the same time as everything else.
impl governor::clock::Clock for Clock {
    type Instant = Duration;
    fn now(&self) -> Duration {
        self.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_calendar_advances_with_tokio_time() {
        let clock = Clock::starting_at(3 * DAY_MS - 1);
        assert_eq!(clock.today(), 2);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!((clock.now_ms(), clock.today()), (3 * DAY_MS, 3));
        let before = clock.now();
        clock.clone().skip(Duration::from_secs(5));
        assert_eq!(clock.now() - before, Duration::from_secs(5));
        assert_eq!(clock.now_ms(), 3 * DAY_MS + 5000);
    }

    #[test]
    fn dates_read_and_write_as_the_utc_calendar_has_them() {
        // humantime's RFC 3339 calendar is the oracle, every day of 1970 to 2100.
        for day in 0..47_482 {
            let at = UNIX_EPOCH + Duration::from_secs(day as u64 * 86_400);
            let rfc3339 = humantime::format_rfc3339_seconds(at).to_string();
            let date = Date(day);
            assert_eq!(date.to_string(), rfc3339[..10], "day {day}");
            assert_eq!(rfc3339[..10].parse::<Date>(), Ok(date));
        }
        assert_eq!("1969-12-31".parse::<Date>(), Ok(Date(-1)));
        assert_eq!("2024-02-29".parse::<Date>().map(|d| d.0), Ok(19_782));
    }

    #[test]
    fn what_is_not_a_date_is_refused_by_name() {
        for text in [
            "2025-13-01",
            "2025-02-29",
            "2100-02-29",
            "2025-04-31",
            "2025-00-10",
            "2025-01-00",
        ] {
            assert_eq!(
                text.parse::<Date>(),
                Err(DateError::NoSuchDay(text.into())),
                "{text}"
            );
        }
        for text in [
            "",
            "2025-1-01",
            "2025/01/01",
            "20250101",
            "2025-01-01T00:00:00Z",
            "２０２５-01-01",
            "+025-01-01",
            "2025-01-0a",
        ] {
            assert_eq!(
                text.parse::<Date>(),
                Err(DateError::Format(text.into())),
                "{text}"
            );
        }
    }
}
