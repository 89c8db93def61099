//! Handles of asynchronous collectives, and the worker thread that runs them.

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

/// What a posted call's session runs on: the first call, its ticket, and the queue behind it.
type Session<P> = Box<dyn FnOnce(P, Ticket, &Feed<'_, P>) + Send>;

/// One entry of a worker's queue.
enum Task<P> {
    /// Run the job.
    Run(Job),
    /// A posted call (`P`): the first of a run of them starts a session, which takes the ones
    /// queued right behind it through a [`Feed`] as it goes (their own sessions are dropped).
    Post(P, Session<P>),
}

/// The queue of a worker and whether it is closed.
struct Queue<P> {
    tasks: std::collections::VecDeque<Task<P>>,
    closed: bool,
}

/// A communicator's worker (proxy) thread: runs submitted collectives one at a time, in the order
/// submitted, while the caller goes on. Started at the first submission.
///
/// Posted calls (`P`; the host communicator's asynchronous point-to-point calls) are the
/// exception: a run of them in the queue is one session, which starts with the first and takes
/// each one queued right behind it as it comes, even while the earlier ones still move, so they
/// complete in whatever order their peers allow. A job queued after them waits for the session
/// to end, and the session ends only once none is queued behind it.
pub(crate) struct Worker<P: Send + 'static = std::convert::Infallible> {
    name: String,
    queue: Arc<(Mutex<Queue<P>>, Condvar)>,
    started: std::sync::Once,
    /// Jobs and posted calls submitted and not yet finished.
    pending: Arc<(Mutex<usize>, Condvar)>,
}

/// A posted call's share of [`Worker::wait_idle`]'s count: the session drops it once the call
/// has finished (its `Work` filled).
pub(crate) struct Ticket(Arc<(Mutex<usize>, Condvar)>);

impl Drop for Ticket {
    fn drop(&mut self) {
        let (count, cv) = &*self.0;
        *count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        cv.notify_all();
    }
}

/// A posted call in a session: how many of its messages are still moving, what fills its
/// `Work` (taken when it does) and its ticket (dropped then).
pub(crate) struct PostedJob {
    left: usize,
    fill: Option<Box<dyn FnOnce(Result<()>) + Send>>,
    ticket: Option<Ticket>,
}

impl PostedJob {
    /// A call of `left` messages (one of none is done at once).
    pub(crate) fn new(
        left: usize,
        fill: Box<dyn FnOnce(Result<()>) + Send>,
        ticket: Ticket,
    ) -> PostedJob {
        let mut j = PostedJob {
            left,
            fill: Some(fill),
            ticket: Some(ticket),
        };
        if left == 0 {
            j.finish(Ok(()));
        }
        j
    }

    /// One more of its messages has moved; the last finishes the call.
    pub(crate) fn one_done(&mut self) {
        self.left = self.left.saturating_sub(1);
        if self.left == 0 {
            self.finish(Ok(()));
        }
    }

    /// Fill the call's `Work` with `r`, then count it done; a no-op once done.
    pub(crate) fn finish(&mut self, r: Result<()>) {
        if let Some(fill) = self.fill.take() {
            fill(r);
        }
        self.ticket.take();
    }
}

impl Drop for PostedJob {
    /// A job dropped unfinished (its session panicked) fails its `Work`, so no caller waits
    /// forever.
    fn drop(&mut self) {
        if self.fill.is_some() {
            self.finish(Err(Error::Io {
                context: "running a posted point-to-point call".into(),
                detail: "its session ended without finishing it (a bug in ringzero)".into(),
            }));
        }
    }
}

/// A session's view of the queue behind it.
pub(crate) struct Feed<'w, P> {
    queue: &'w (Mutex<Queue<P>>, Condvar),
    pending: &'w Arc<(Mutex<usize>, Condvar)>,
}

impl<P> Feed<'_, P> {
    /// The posted call at the front of the queue, taken off it; `None` when the queue is empty
    /// or a job comes first.
    pub(crate) fn next(&self) -> Option<(P, Ticket)> {
        let mut q = self.queue.0.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(q.tasks.front(), Some(Task::Post(..))) {
            return None;
        }
        match q.tasks.pop_front() {
            Some(Task::Post(p, _)) => Some((p, Ticket(self.pending.clone()))),
            _ => unreachable!("the front is a posted call"),
        }
    }
}

impl<P: Send + 'static> Worker<P> {
    pub(crate) fn new(name: String) -> Worker<P> {
        Worker {
            name,
            queue: Arc::new((
                Mutex::new(Queue {
                    tasks: Default::default(),
                    closed: false,
                }),
                Condvar::new(),
            )),
            started: std::sync::Once::new(),
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
        let ticket = self.ticket();
        let job: Job = Box::new(move || {
            // A panic is a bug, but the caller waiting on the `Work` hears of it as an error
            // (and the thread lives on for the calls queued behind).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|p| Err(panicked(p.as_ref())));
            *slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            slot.1.notify_all();
            drop(ticket);
        });
        self.push(Task::Run(job));
        work
    }

    /// Queue posted call `p`, made by `make` from the function that fills the returned
    /// [`Work`]; a session runs it (with those queued right behind it) through `session`,
    /// which must call that function once `p` has finished, then drop its ticket.
    pub(crate) fn post<R: Send + 'static>(
        &self,
        make: impl FnOnce(Box<dyn FnOnce(Result<R>) + Send>) -> P,
        session: impl FnOnce(P, Ticket, &Feed<'_, P>) + Send + 'static,
    ) -> Work<R> {
        let work = Work::new();
        let slot = work.slot.clone();
        let fill: Box<dyn FnOnce(Result<R>) + Send> = Box::new(move |r| {
            *slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            slot.1.notify_all();
        });
        let p = make(fill);
        *self.pending.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.push(Task::Post(p, Box::new(session)));
        work
    }

    /// Count one more task pending: dropped, the ticket counts it done.
    fn ticket(&self) -> Ticket {
        *self.pending.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Ticket(self.pending.clone())
    }

    fn push(&self, task: Task<P>) {
        self.started.call_once(|| {
            let (queue, pending) = (self.queue.clone(), self.pending.clone());
            std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || run_queue(&queue, &pending))
                .expect("spawning a ringzero worker thread");
        });
        let (q, cv) = &*self.queue;
        q.lock()
            .unwrap_or_else(|p| p.into_inner())
            .tasks
            .push_back(task);
        cv.notify_all();
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
        self.close();
        self.wait_idle();
    }

    fn close(&self) {
        let (q, cv) = &*self.queue;
        q.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        cv.notify_all();
    }
}

impl<P: Send + 'static> Drop for Worker<P> {
    /// The thread ends once the queue is empty.
    fn drop(&mut self) {
        self.close();
    }
}

/// The worker thread: take the queue's tasks in order until it is closed and empty.
fn run_queue<P>(queue: &(Mutex<Queue<P>>, Condvar), pending: &Arc<(Mutex<usize>, Condvar)>) {
    loop {
        let task = {
            let mut q = queue.0.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.closed {
                    return;
                }
                q = queue.1.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        match task {
            Task::Run(job) => job(),
            Task::Post(p, session) => {
                let feed = Feed { queue, pending };
                // A session that panics drops its calls, which then fail their `Work`s
                // (`Posted`'s owner sees to that); the thread lives on.
                let run =
                    std::panic::AssertUnwindSafe(|| session(p, Ticket(pending.clone()), &feed));
                if let Err(p) = std::panic::catch_unwind(run) {
                    tracing::error!(target: "ringzero::comm", "{}", panicked(p.as_ref()));
                }
            }
        }
    }
}

/// The error a panicking asynchronous call returns.
pub(crate) fn panicked(p: &(dyn std::any::Any + Send)) -> Error {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    Error::Io {
        context: "running an asynchronous call on the worker thread".into(),
        detail: format!("it panicked (a bug in ringzero): {msg}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_panicking_job_fails_its_work_and_the_worker_goes_on() {
        let w: Worker = Worker::new("test-worker".into());
        let bad = w.submit(|| -> Result<u32> { panic!("boom") });
        let good = w.submit(|| Ok(7u32));
        let e = bad.wait().unwrap_err().to_string();
        assert!(e.contains("panicked") && e.contains("boom"), "{e}");
        assert_eq!(good.wait().unwrap(), 7);
        w.stop();
    }

    #[test]
    fn a_session_takes_the_posts_queued_right_behind_it_and_no_further() {
        // Posts carry a number; a session records what it took, and finishes them in reverse.
        type Numbered = (u32, Box<dyn FnOnce(Result<u32>) + Send>);
        let w: Worker<Numbered> = Worker::new("t".into());
        let (gate_tx, gate) = mpsc::channel::<()>();
        let (seen_tx, seen) = mpsc::channel::<Vec<u32>>();
        // Hold the worker until everything is queued.
        let held = w.submit(move || {
            gate.recv().unwrap();
            Ok(())
        });
        let post = |k: u32| {
            let seen_tx = seen_tx.clone();
            w.post(
                move |fill| (k, fill),
                move |first, ticket, feed| {
                    let mut took = vec![(first, ticket)];
                    while let Some(more) = feed.next() {
                        took.push(more);
                    }
                    seen_tx
                        .send(took.iter().map(|((k, _), _)| *k).collect())
                        .unwrap();
                    for ((k, fill), ticket) in took.into_iter().rev() {
                        fill(Ok(k * 10));
                        drop(ticket);
                    }
                },
            )
        };
        let (a, b) = (post(1), post(2));
        let job = w.submit(|| Ok(0u32));
        let c = post(3);
        gate_tx.send(()).unwrap();
        held.wait().unwrap();
        assert_eq!(
            seen.recv().unwrap(),
            [1, 2],
            "the job behind them ends the run"
        );
        assert_eq!(seen.recv().unwrap(), [3]);
        assert_eq!([a, b, job, c].map(|w| w.wait().unwrap()), [10, 20, 0, 30]);
        w.wait_idle();
        w.stop();
    }
}
