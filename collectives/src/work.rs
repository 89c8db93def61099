//! Handles of asynchronous collectives.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
#[cfg(doc)]
use crate::Communicator;

/// A pending asynchronous collective; [`Work::wait`] returns its buffer.
#[must_use = "a Work must be waited on to get its buffer (and its error)"]
pub struct Work<T> {
    pub(crate) slot: Arc<(Mutex<Option<Result<T>>>, Condvar)>,
}

impl<T> Work<T> {
    pub(crate) fn new() -> Work<T> {
        Work {
            slot: Arc::new((Mutex::new(None), Condvar::new())),
        }
    }

    pub(crate) fn failed(e: Error) -> Work<T> {
        let w = Work::new();
        *w.slot.0.lock().unwrap() = Some(Err(e));
        w
    }

    /// Block until the collective finishes; returns the buffer or the error. The engine's
    /// deadlines bound this wait.
    pub fn wait(self) -> Result<T> {
        let (m, cv) = &*self.slot;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether the collective has finished (then [`Work::wait`] returns at once).
    pub fn is_done(&self) -> bool {
        self.slot.0.lock().map(|g| g.is_some()).unwrap_or(true)
    }
}
