//! One direction of one posted point-to-point message, on the host's links: run what of its
//! plan can go now, check the health of the peer it still needs, name what it waits for at its
//! deadline. (The device engine's counterpart, which queues the ops on a stream, is
//! `device_engine::step_one_way`.)

use crate::error::{Error, Result};

use super::call::*;
use super::engine::*;

/// One direction of one message of a posted point-to-point call (the asynchronous forms, which
/// run as they can, each direction of each pair on its own: `crate::posted`): run whatever of
/// `call`'s plan, which only sends or only receives, can go now from op `at` on (a send while a
/// slot is free, a receive while its frame is there), moving `at` past each. Whether anything
/// moved (the link's earlier frames included); the message is done once `at` reaches the plan's
/// end. `what` names the call in errors.
pub(crate) fn step_one_way(
    links: &mut Links,
    call: &Call,
    bufs: &mut Bufs,
    at: &mut usize,
    what: &str,
) -> Result<bool> {
    let es = call.dtype.size();
    let (prev, next, rank) = (links.prev, links.next, call.rank);
    let mut moved = links
        .tx
        .progress()
        .map_err(|e| link_err(e, what, call.seq, next, rank, Some(&call.fp)))?;
    while let Some(op) = call.plan.ops.get(*at) {
        debug_assert!(
            op.send != op.recv,
            "a posted message's op only sends or receives"
        );
        let ready = if op.send {
            links
                .tx
                .reserve(op.elems * es)
                .map_err(|e| link_err(e, what, call.seq, next, rank, Some(&call.fp)))?
                .is_some()
        } else {
            let e = expect(call, op, es);
            links
                .rx
                .peek(&e)
                .map_err(|err| link_err(err, what, e.seq, prev, rank, Some(&e.fp)))?
                .is_some()
        };
        if !ready {
            break;
        }
        run_op(links, call, (op, Needs::BOTH), bufs, what, es)?;
        *at += 1;
        moved = true;
    }
    Ok(moved)
}

/// The timeout of a posted message waiting at op `at` (see [`step_one_way`]): a receive names
/// the frame and its sender, a send the slot at the receiver.
pub(crate) fn one_way_timeout(links: &Links, call: &Call, what: &str, at: usize) -> Error {
    let op = &call.plan.ops[at];
    let e = expect(call, op, call.dtype.size());
    op_timeout(call, what, &e, op.send, links.prev, links.next, "slot")
}
