//! Deadlines, with time as an argument.
//!
//! Every wait in ringzero has a deadline, and every deadline is one of the two shapes here:
//! - [`Deadline`]: a fixed limit from a start (a local copy, a connect, a join);
//! - [`Patience`]: a limit that progress restarts (a collective waits as long as its peers keep
//!   moving, and fails once nothing moved for the whole timeout), with the periodic health checks
//!   ([`HEALTH_EVERY`]) that let a waiting rank see an abort or a dead peer before its deadline.
//!
//! Neither reads the clock: the caller passes `now` (as quinn-proto's state machines take it),
//! so the rules are tested on a virtual clock, and a wait loop reads the clock once per round.

use std::time::{Duration, Instant};

/// How often a waiting call checks the abort flag and its peers' health.
pub(crate) const HEALTH_EVERY: Duration = Duration::from_millis(20);

/// A fixed limit from a start.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    /// `limit` from `now`.
    pub(crate) fn after(now: Instant, limit: Duration) -> Deadline {
        Deadline { start: now, limit }
    }

    /// Whether the limit has passed at `now`.
    pub(crate) fn passed(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.start) >= self.limit
    }

    /// The time left at `now` (zero once passed).
    pub(crate) fn left(&self, now: Instant) -> Duration {
        self.limit
            .saturating_sub(now.saturating_duration_since(self.start))
    }
}

/// What a wait does after one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tick {
    /// Something moved: the deadline restarts; go round at once.
    Moved,
    /// Nothing moved for the whole timeout: fail.
    TimedOut,
    /// Time for the health checks, then idle.
    Check,
    /// Idle, then go round.
    Idle,
}

/// The clock of one wait on a call's links: progress restarts the deadline.
pub(crate) struct Patience {
    last: Instant,
    last_health: Instant,
}

impl Patience {
    /// A wait starting at `now`.
    pub(crate) fn new(now: Instant) -> Patience {
        Patience {
            last: now,
            last_health: now,
        }
    }

    /// After a round at `now` that `moved` something or not: progress restarts the deadline;
    /// with none for `timeout` the wait fails; every [`HEALTH_EVERY`] the health checks are due.
    pub(crate) fn tick(&mut self, now: Instant, moved: bool, timeout: Duration) -> Tick {
        if moved {
            self.last = now;
            return Tick::Moved;
        }
        if now.saturating_duration_since(self.last) >= timeout {
            return Tick::TimedOut;
        }
        if now.saturating_duration_since(self.last_health) >= HEALTH_EVERY {
            self.last_health = now;
            return Tick::Check;
        }
        Tick::Idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_deadline_passes_at_its_limit_and_counts_down_to_zero() {
        let t0 = Instant::now();
        let d = Deadline::after(t0, 100 * MS);
        assert!(!d.passed(t0));
        assert!(!d.passed(t0 + 99 * MS));
        assert!(d.passed(t0 + 100 * MS));
        assert_eq!(d.left(t0 + 30 * MS), 70 * MS);
        assert_eq!(d.left(t0 + 500 * MS), Duration::ZERO);
        // A `now` read before the start (a clock read on another thread) is not past it.
        let late = Deadline::after(t0 + 10 * MS, 5 * MS);
        assert!(!late.passed(t0));
    }

    #[test]
    fn patience_restarts_on_progress_and_checks_health_between() {
        let t0 = Instant::now();
        let timeout = 100 * MS;
        let mut p = Patience::new(t0);
        assert_eq!(p.tick(t0 + MS, false, timeout), Tick::Idle);
        assert_eq!(p.tick(t0 + HEALTH_EVERY, false, timeout), Tick::Check);
        // The check is due once per HEALTH_EVERY, not on every round after it.
        assert_eq!(p.tick(t0 + HEALTH_EVERY + MS, false, timeout), Tick::Idle);
        // Progress at 90 ms moves the deadline to 190 ms.
        assert_eq!(p.tick(t0 + 90 * MS, true, timeout), Tick::Moved);
        assert_ne!(p.tick(t0 + 189 * MS, false, timeout), Tick::TimedOut);
        assert_eq!(p.tick(t0 + 190 * MS, false, timeout), Tick::TimedOut);
    }

    #[test]
    fn a_wait_with_no_progress_times_out_exactly_once_the_timeout_has_passed() {
        let t0 = Instant::now();
        let mut p = Patience::new(t0);
        let mut now = t0;
        let mut checks = 0;
        loop {
            now += 5 * MS;
            match p.tick(now, false, Duration::from_secs(1)) {
                Tick::TimedOut => break,
                Tick::Check => checks += 1,
                Tick::Idle => {}
                Tick::Moved => unreachable!(),
            }
        }
        assert_eq!(now - t0, Duration::from_secs(1));
        assert_eq!(checks, 1000 / 20 - 1);
    }
}
