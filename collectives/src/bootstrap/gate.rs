//! A bound on the connections a listener authenticates at once. Every listener (the store, the
//! peer listener) runs each caller's handshake on a thread of its own, under a short deadline;
//! without a bound, a flood of idle connections to an open port would grow a rank by a thread
//! each until the process limit. Past [`MAX_HANDSHAKES`] callers in their handshake, a new
//! connection is closed at once (the ranks of a job connect a few at a time and retry a refused
//! connect until their deadline, so they get through once the flood's handshakes time out).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Handshakes a listener runs at once.
pub const MAX_HANDSHAKES: usize = 64;

/// The longest a caller may take to complete its handshake (ranks complete theirs in
/// milliseconds; a caller that sends nothing holds its thread this long).
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(3);

/// The handshakes in progress on one listener.
#[derive(Clone, Default)]
pub(crate) struct Gate {
    in_flight: Arc<AtomicUsize>,
}

/// One admitted handshake; its place is free again when dropped.
pub(crate) struct Permit {
    in_flight: Arc<AtomicUsize>,
}

impl Gate {
    /// A place for one more handshake, or `None` at [`MAX_HANDSHAKES`].
    pub(crate) fn admit(&self) -> Option<Permit> {
        let admitted = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_HANDSHAKES).then_some(n + 1)
            })
            .is_ok();
        admitted.then(|| Permit {
            in_flight: self.in_flight.clone(),
        })
    }

    /// Handshakes in progress.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Close a caller `from` that found every place taken, saying so at most once a second per
/// process (a flood would otherwise flood the log too).
pub(crate) fn refuse_flooded(from: std::net::SocketAddr, listener: &str) {
    use std::sync::Mutex;
    use std::time::Instant;
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
        *last = Some(Instant::now());
        tracing::warn!(
            target: "ringzero::bootstrap",
            "{listener}: {MAX_HANDSHAKES} callers are in their handshake already; closed a \
             connection from {from} (a flood of connections to this port?)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_bound_and_frees_places_on_drop() {
        let g = Gate::default();
        let permits: Vec<Permit> = (0..MAX_HANDSHAKES).map_while(|_| g.admit()).collect();
        assert_eq!(permits.len(), MAX_HANDSHAKES);
        assert!(g.admit().is_none());
        drop(permits);
        assert_eq!(g.in_flight(), 0);
        assert!(g.admit().is_some());
    }
}
