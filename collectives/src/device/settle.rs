//! Waiting on a [`Stream`]'s markers under the collectives' deadlines: [`settle`] (the work a
//! failed call queued ends before its memory may go) and [`wait_local`] (a rank's own queued
//! work, as a timeout that names the call).

use ringzero_kernels::device::Stream;

/// Wait until the work queued on `stream` before `m` has ended (completed or failed). On a
/// stream whose memory outlives its work ([`Stream::memory_outlives_work`]) the wait gives up at
/// `deadline`; on any other the caller's memory is still in use, so it goes on (saying so once)
/// until the work ends, which such a stream's work always does. Whether it ended.
pub(crate) fn settle<S: Stream>(stream: &S, m: &S::Marker, deadline: std::time::Duration) -> bool {
    let until = crate::deadline::Deadline::after(std::time::Instant::now(), deadline);
    let bounded = stream.memory_outlives_work();
    let mut waiter = crate::transport::wait::Waiter::backoff();
    let mut said = false;
    while let Ok(false) = stream.done(m) {
        if until.passed(std::time::Instant::now()) {
            if bounded {
                return false;
            }
            if !said {
                said = true;
                tracing::warn!(target: "ringzero::device",
                    "{}: work queued before a failure is still running after {:.1}s; waiting for \
                     it to end before returning, since it reads and writes the caller's memory",
                    stream.name(), deadline.as_secs_f64());
            }
        }
        waiter.idle(deadline);
    }
    true
}

/// Wait, within `timeout`, for this rank's own work queued on `stream` before `m` (a local copy
/// of the call fingerprinted `fp`, number `seq`, on `rank`). At the deadline the work first ends where the caller's
/// memory would not outlive it ([`settle`]), then the timeout names `what` was waited for.
pub(crate) fn wait_local<S: Stream>(
    stream: &S,
    m: &S::Marker,
    timeout: std::time::Duration,
    (fp, seq, rank): (&crate::wire::Fingerprint, u64, usize),
    what: &str,
) -> crate::error::Result<()> {
    let until = crate::deadline::Deadline::after(std::time::Instant::now(), timeout);
    let mut wait = crate::transport::wait::Waiter::backoff();
    let dev = |e| crate::error::Error::Device {
        context: format!("{fp}: {what}"),
        source: e,
    };
    while !stream.done(m).map_err(dev)? {
        if until.passed(std::time::Instant::now()) {
            settle(stream, m, std::time::Duration::ZERO);
            return Err(crate::error::Error::Timeout {
                op: fp.to_string(),
                seq,
                peer: rank,
                waiting: format!("{what} on {}", stream.name()),
                after: timeout,
            });
        }
        wait.idle(timeout);
    }
    Ok(())
}
