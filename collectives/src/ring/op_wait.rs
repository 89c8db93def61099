//! The one wait both engines make before an op: until its incoming frame has arrived (if it
//! receives) and a slot at the next rank is free (if it sends), under the call's deadline, with
//! the health checks between. The host engine waits on its links' slices, the device engine on
//! device addresses while it retires finished work; each implements [`OpWait`] for its links.

use std::time::Instant;

use super::call::{op_timeout, Call};
use super::schedule::Op;
use crate::deadline::{Patience, Tick};
use crate::error::Result;
use crate::wire::Expect;

/// [`frame_and_slot`] reads the clock once in this many rounds without progress.
const CLOCK_EVERY: u32 = 16;

/// One engine's links as an op waits on them.
pub(crate) trait OpWait {
    /// Move what can move without the op (frames already posted; on a device, finished work
    /// retired). Whether anything did.
    fn progress(&mut self) -> Result<bool>;
    /// Whether the op's incoming frame is there, and whether it arrived since the last look.
    fn frame(&mut self, expect: &Expect) -> Result<(bool, bool)>;
    /// Whether a slot at the next rank is held for the op, and whether it was taken just now.
    fn slot(&mut self, bytes: usize) -> Result<(bool, bool)>;
    /// The abort flag and the health of the peers the call still needs.
    fn health(&mut self) -> Result<()>;
    /// Something moved: the next wait starts short again.
    fn progressed(&mut self);
    /// Nothing moved: back off (never past `timeout`).
    fn idle(&mut self, timeout: std::time::Duration);
}

/// Wait until `op` of `call` has its incoming frame (`expect`) and its outgoing slot. Anything
/// moving restarts the deadline; with nothing moving for the call's timeout the error names
/// what was awaited (the frame and its sender, or the `slot_word` at the next rank).
pub(crate) fn frame_and_slot(
    w: &mut impl OpWait,
    call: &Call,
    op: &Op,
    expect: &Expect,
    (what, prev, next, slot_word): (&str, usize, usize, &str),
) -> Result<()> {
    let bytes = expect.len;
    // The clock is read only once the op has to wait.
    let mut patience: Option<Patience> = None;
    let mut rounds = 0u32;
    loop {
        let mut moved = w.progress()?;
        let have_in = !op.recv || {
            let (there, new) = w.frame(expect)?;
            moved |= new;
            there
        };
        let have_out = !op.send
            || (have_in && {
                let (held, new) = w.slot(bytes)?;
                moved |= new;
                held
            });
        if have_in && have_out {
            w.progressed();
            return Ok(());
        }
        // The clock only every few rounds without progress: reading it costs about what a
        // round does, and a frame a round late is a frame late.
        rounds += 1;
        if !moved && patience.is_some() && !rounds.is_multiple_of(CLOCK_EVERY) {
            w.idle(call.timeout);
            continue;
        }
        let now = Instant::now();
        let patience = patience.get_or_insert_with(|| Patience::new(now));
        match patience.tick(now, moved, call.timeout) {
            Tick::Moved => {
                w.progressed();
                continue;
            }
            Tick::TimedOut => {
                return Err(op_timeout(
                    call, what, expect, have_in, prev, next, slot_word,
                ))
            }
            Tick::Check => w.health()?,
            Tick::Idle => {}
        }
        w.idle(call.timeout);
    }
}
