//! Byte counts of memory a stream hands out, now and at their peak: what a trainer sets beside
//! its own prediction of the memory ringzero holds (`cuda::allocated`, `host_scratch`).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes held now and the most held at once since the count was last restarted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// Held now.
    pub live: usize,
    /// The most held at once.
    pub peak: usize,
}

/// A count of bytes held now and the most held at once, shared by whatever allocates and frees
/// them (a stream's allocations, a ZeRO engine's kept buffers).
#[derive(Debug, Default)]
pub struct Held {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Held {
    /// Nothing held.
    pub const fn new() -> Held {
        Held {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// Held now and at most.
    pub fn read(&self) -> Allocated {
        Allocated {
            live: self.live.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
        }
    }

    /// `bytes` more held.
    pub fn add(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// `bytes` given back.
    pub fn sub(&self, bytes: usize) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Start the peak again from what is held now.
    pub fn restart(&self) {
        self.peak
            .store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}
