//! How the engine waits when neither direction can move.
//!
//! It first spins (a few rounds without reading the clock, then until 20 µs after the last
//! progress), the engine trying its links again each round. When both halves of a rank's ring
//! are TCP, it then sleeps in `mio`'s poll on all their sockets at once (edge-triggered: the
//! engine only sleeps after a read or write returned `WouldBlock`, and an edge that came while it
//! spun is still queued, so no readiness is ever missed). Otherwise (shared memory on at least one
//! side) it backs off by time since the last progress: yield until 200 µs, then nap 50 µs at a time, so ranks sharing
//! a core give way to each other and an idle rank costs almost nothing. Waits paced by a device
//! ([`Waiter::device`]: a kernel, or peers finishing theirs) yield for 5 ms before napping, since a
//! nap's overshoot would land on every long kernel's collective.
//! Every sleep is short (≤ 10 ms) so the engine can check deadlines and peer health.

use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use super::{RecvLink, SendLink};

/// Spin this many rounds after the last progress before reading the clock at all (a clock read
/// costs tens of nanoseconds on some virtual machines, as much as the hand-off it waits for)...
const SPIN_ROUNDS: u32 = 64;
/// ...then spin until this long after it (a peer a few microseconds behind is caught at once)...
const SPIN_FOR: Duration = Duration::from_micros(20);
/// ...then yield the core this long (cheap when ranks outnumber cores: the yield runs them)...
const YIELD_FOR: Duration = Duration::from_micros(200);
/// ...then nap.
const NAP: Duration = Duration::from_micros(50);
const POLL_CAP: Duration = Duration::from_millis(10);

/// How long a [`Waiter::device`] yields before it naps: a kernel over hundreds of MiB runs for
/// hundreds of microseconds, and a nap overshoots by its timer slack (50 µs or more), which on a
/// one-kernel collective is time the caller sees. Yielding still gives the core to any rank
/// that shares it.
const DEVICE_YIELD_FOR: Duration = Duration::from_millis(5);

/// Sleeps between attempts; see the module docs.
pub struct Waiter {
    poll: Option<(Poll, Events)>,
    spins: u32,
    idle_since: Option<Instant>,
    yield_for: Duration,
}

impl Waiter {
    /// A waiter for this pair of links; registers their sockets when both have one.
    pub fn new(tx: &mut dyn SendLink, rx: &mut dyn RecvLink) -> std::io::Result<Waiter> {
        let mut poll = None;
        if !tx.sockets().is_empty() && !rx.sockets().is_empty() {
            let p = Poll::new()?;
            let both = Interest::READABLE | Interest::WRITABLE;
            let mut n = 0;
            for s in tx.sockets().into_iter().chain(rx.sockets()) {
                p.registry().register(s, Token(n), both)?;
                n += 1;
            }
            poll = Some((p, Events::with_capacity(n.max(8))));
        }
        Ok(Waiter {
            poll,
            spins: 0,
            idle_since: None,
            yield_for: YIELD_FOR,
        })
    }

    /// A waiter with nothing to poll: spin, yield, nap (the device engine's links are shared
    /// memory and device queues).
    pub fn backoff() -> Waiter {
        Waiter {
            poll: None,
            spins: 0,
            idle_since: None,
            yield_for: YIELD_FOR,
        }
    }

    /// A waiter for one piece of device work, or for peers finishing theirs (the direct step):
    /// as [`Waiter::backoff`], but yielding for milliseconds before it naps, so a wait on a
    /// kernel ends within microseconds of the kernel.
    pub fn device() -> Waiter {
        Waiter {
            yield_for: DEVICE_YIELD_FOR,
            ..Waiter::backoff()
        }
    }

    /// Something moved: the next wait starts with spinning again.
    pub fn progressed(&mut self) {
        self.spins = 0;
        self.idle_since = None;
    }

    /// Nothing moved: wait a little (never past `max`).
    pub fn idle(&mut self, max: Duration) {
        if self.spins < SPIN_ROUNDS {
            self.spins += 1;
            std::hint::spin_loop();
            return;
        }
        let idle = self.idle_since.get_or_insert_with(Instant::now).elapsed();
        if idle < SPIN_FOR {
            // Sockets too: the engine tries its reads again rather than sleep in the poll,
            // whose wake-up costs about a loopback hop (a peer a few microseconds behind is
            // caught without it).
            std::hint::spin_loop();
        } else if let Some((p, events)) = &mut self.poll {
            let _ = p.poll(events, Some(max.min(POLL_CAP)));
        } else if idle < self.yield_for {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP.min(max));
        }
    }
}
