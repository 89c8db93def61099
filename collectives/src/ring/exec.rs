//! The one op loop of both engines: a call's ops in plan order, each run by an [`Executor`] once
//! its incoming frame and outgoing slot are there ([`super::op_wait`]), then whatever the call
//! has left in flight finished. The host executor (`engine.rs`) applies an op at once, between
//! the user's buffers and the slots, and ends by flushing its link; the device executor
//! (`device_engine.rs`) queues it on a stream and ends once every marker has completed, every
//! frame is published and every slot released.

use super::call::{Call, LastOps, Needs};
use crate::error::Result;

/// What runs one call's ops on one kind of links.
pub(crate) trait Executor {
    /// Run op `i` (waiting for its frame and slot; a peer gone from a direction it no longer
    /// `needs` is no failure), or op `i` and those after it that it runs as one; how many ops it
    /// ran (at least one).
    fn op(&mut self, i: usize, needs: Needs) -> Result<usize>;
    /// After the last op: end what is still in flight.
    fn finish(&mut self) -> Result<()>;
}

/// Run every op of `call` on `ex`, then [`Executor::finish`].
pub(crate) fn run_ops(call: &Call, ex: &mut impl Executor) -> Result<()> {
    let last = LastOps::of(call.plan);
    let mut i = 0;
    while i < call.plan.ops.len() {
        i += ex.op(i, last.needs(i))?;
    }
    ex.finish()
}
