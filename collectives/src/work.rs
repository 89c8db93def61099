//! Handles of asynchronous collectives, and the worker thread that runs them.

use std::sync::mpsc;
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

type Job = Box<dyn FnOnce() + Send>;

/// A communicator's worker (proxy) thread: runs submitted collectives one at a time, in the order
/// submitted, while the caller goes on. Started at the first submission.
pub(crate) struct Worker {
    name: String,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// Jobs submitted and not yet finished.
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Worker {
    pub(crate) fn new(name: String) -> Worker {
        Worker {
            name,
            jobs: Mutex::new(None),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
        }
    }

    /// Queue `f`; its result arrives in the returned [`Work`].
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let work = Work::new();
        let slot = work.slot.clone();
        let pending = self.pending.clone();
        *pending.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let job: Job = Box::new(move || {
            let r = f();
            *slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            slot.1.notify_all();
            let (count, cv) = &*pending;
            *count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
            cv.notify_all();
        });
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let sender = jobs.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || rx.into_iter().for_each(|job| job()))
                .expect("spawning a ringzero worker thread");
            tx
        });
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            job(); // the thread is gone (cannot happen while we hold the sender); run inline
        }
        work
    }

    /// Wait until every job submitted so far has finished (each is bounded by the engine's
    /// deadlines).
    pub(crate) fn wait_idle(&self) {
        let (count, cv) = &*self.pending;
        let mut c = count.lock().unwrap_or_else(|p| p.into_inner());
        while *c > 0 {
            c = cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Let the thread end after the jobs already queued, and wait for them.
    pub(crate) fn stop(&self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.wait_idle();
    }
}
