//! How the engine waits when neither direction can move.
//!
//! When both halves of a rank's ring are TCP sockets, it sleeps in `mio`'s poll on both at once
//! (edge-triggered: the engine only sleeps after a read or write returned `WouldBlock`, so no
//! readiness is ever missed). Otherwise (shared memory on at least one side) it backs off: spin
//! briefly, then yield, then sleep in short naps, so ranks sharing a core give way to each other.
//! Every sleep is short (≤ 10 ms) so the engine can check deadlines and peer health.

use std::time::Duration;

use mio::{Events, Interest, Poll, Token};

use super::{RecvLink, SendLink};

const SPINS: u32 = 64;
const YIELDS: u32 = 256;
const NAP: Duration = Duration::from_micros(50);
const POLL_CAP: Duration = Duration::from_millis(10);

/// Sleeps between attempts; see the module docs.
pub struct Waiter {
    poll: Option<(Poll, Events)>,
    idle: u32,
}

impl Waiter {
    /// A waiter for this pair of links; registers their sockets when both have one.
    pub fn new(tx: &mut dyn SendLink, rx: &mut dyn RecvLink) -> std::io::Result<Waiter> {
        let mut poll = None;
        if let (Some(_), Some(_)) = (tx.pollable(), rx.pollable()) {
            let p = Poll::new()?;
            let both = Interest::READABLE | Interest::WRITABLE;
            if let Some(s) = tx.pollable() {
                p.registry().register(s, Token(0), both)?;
            }
            if let Some(s) = rx.pollable() {
                p.registry().register(s, Token(1), both)?;
            }
            poll = Some((p, Events::with_capacity(8)));
        }
        Ok(Waiter { poll, idle: 0 })
    }

    /// Something moved: the next wait starts with spinning again.
    pub fn progressed(&mut self) {
        self.idle = 0;
    }

    /// Nothing moved: wait a little (never past `max`).
    pub fn idle(&mut self, max: Duration) {
        self.idle = self.idle.saturating_add(1);
        if let Some((p, events)) = &mut self.poll {
            let _ = p.poll(events, Some(max.min(POLL_CAP)));
            return;
        }
        if self.idle < SPINS {
            std::hint::spin_loop();
        } else if self.idle < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP.min(max));
        }
    }
}
