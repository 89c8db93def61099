//! The recursive-doubling all-reduce ([`crate::ring::doubling`]'s schedule) over the pairs' own
//! links: how a small all-reduce runs in `log2 n` exchanges instead of the ring's `2(n − 1)`
//! hops.
//!
//! It is the same collective as the ring's all-reduce (same checks, the communicator's next
//! sequence number, a flight record entry), with [`Fingerprint::DOUBLING`] in its fingerprint.
//! Each round is one exchange with one peer over the pair's links (`Inner::mesh`, shared with
//! the pairwise collectives and connected by the first call that needs them), the whole buffer
//! each way, sliced as `send_recv` slices it. With the first round an empty frame goes to the
//! next rank and one comes from the previous over the ring's links, as the pairwise collectives
//! announce themselves: a neighbour that called anything else (the ring's all-reduce included)
//! meets it and both fail at once with the two calls named.

use ringzero_kernels::{cpu, DType, ReduceOp};

use super::pairs::Watch;
use super::{refused, Inner, State};
use crate::error::Result;
use crate::ring::doubling::{self, Take};
use crate::ring::engine::{self, Bufs, Lane};
use crate::ring::{plan_p2p, Collective};
use crate::wire::{Expect, Fingerprint};

impl Inner {
    /// All-reduce of `count` elements of `dtype` by recursive doubling: `bufs` as the ring's
    /// all-reduce takes them (one buffer in place, or input and output of `count` elements).
    pub(super) fn all_reduce_doubling(
        &self,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        bufs: Bufs,
    ) -> Result<()> {
        let c = Collective::AllReduce;
        let fp = Fingerprint::new(c, Some(dtype), Some(op), count).doubling();
        let bytes = count * dtype.size();
        let (input, in_place) = match &bufs {
            Bufs::One(b) => (b.len(), true),
            Bufs::Split { input, output } => {
                if output.len() != input.len() {
                    return Err(refused(c, "send and recv differ in length".into()));
                }
                (input.len(), false)
            }
        };
        if input != bytes {
            return Err(refused(
                c,
                format!("the buffer does not hold {count} elements"),
            ));
        }
        let mut st = self.lock();
        let seq = st.seq;
        engine::refuse(st.failed.as_ref(), &self.abort, &fp, seq)?;
        self.recorded(&mut st, &fp, in_place, bytes as u64, |st| {
            let (mut acc, out) = match bufs {
                Bufs::One(b) => (Aligned::copy_of(b), b),
                Bufs::Split { input, output } => (Aligned::copy_of(input), output),
            };
            self.doubling_rounds(st, (seq, &fp, dtype, op), &mut acc)?;
            if op == ReduceOp::Avg {
                cpu::divide(dtype, acc.bytes_mut(), self.size)?;
            }
            out.copy_from_slice(acc.bytes());
            Ok(())
        })
    }

    /// This rank's rounds of the call (`seq`, `fp`) on `acc`, which ends holding the reduction
    /// (before an average's division).
    fn doubling_rounds(
        &self,
        st: &mut State,
        (seq, fp, dtype, op): (u64, &Fingerprint, DType, ReduceOp),
        acc: &mut Aligned,
    ) -> Result<()> {
        let (n, es) = (self.size, dtype.size());
        let count = acc.len / es;
        let rounds = doubling::rounds(n, self.rank);
        let mut peers: Vec<usize> = rounds.iter().map(|x| x.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let mut mesh = self.mesh_for(st, (seq, fp, dtype), || doubling::pairs(n))?;
        if mesh.connects {
            // The ring's next frame is this call's announcement (below): watch for it, and for
            // an abort in front of it.
            let next = Expect {
                seq,
                step: 0,
                slice: 0,
                fp: *fp,
                len: 0,
            };
            let watch = st.links.as_mut().map(|ring| Watch {
                ring,
                seq,
                next: Some(next),
            });
            mesh.connect(self, &peers, (seq, fp), watch)?;
        }
        let slice_elems = (self.cfg.slice_bytes / es).max(1);
        let whole = |_| *fp;
        let mut theirs = Aligned::zeroed(acc.len);
        // The announcement: an empty frame each way around the ring, with the first round (one
        // empty slice, whatever the slot size).
        let announce_plan = plan_p2p(Some(0), Some(0), 1);
        let mut announce = st.links.as_mut().map(|links| {
            let call = self.p2p_call(
                &announce_plan,
                (&whole, dtype),
                (Some(&[][..]), seq),
                (Some(&mut [][..]), seq),
            );
            (links, call)
        });
        for round in &rounds {
            let receives = round.take != Take::Nothing;
            let plan = plan_p2p(
                round.send.then_some(count),
                receives.then_some(count),
                slice_elems,
            );
            let links = mesh
                .links
                .get_mut(&round.peer)
                .expect("connected above: every peer of the rounds");
            let call = self.p2p_call(
                &plan,
                (&whole, dtype),
                (round.send.then_some(acc.bytes()), seq),
                (receives.then_some(theirs.bytes_mut()), seq),
            );
            let mut lanes = vec![Lane::new(links, vec![call])];
            if let Some((ring, call)) = announce.take() {
                lanes.push(Lane::new(ring, vec![call]));
            }
            engine::run_lanes(&mut lanes, self.cfg.timeout, &self.abort)?;
            drop(lanes);
            match round.take {
                Take::Nothing => {}
                Take::MineFirst => cpu::reduce_into(dtype, op, acc.bytes_mut(), theirs.bytes())?,
                Take::TheirsFirst => {
                    cpu::reduce_into(dtype, op, theirs.bytes_mut(), acc.bytes())?;
                    std::mem::swap(acc, &mut theirs);
                }
                Take::Replace => std::mem::swap(acc, &mut theirs),
            }
        }
        Ok(())
    }
}

/// Bytes in 8-byte-aligned storage, so the kernels may view them as any element type (a
/// `Vec<u8>` promises no alignment, and an empty one points at address 1).
struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    fn copy_of(b: &[u8]) -> Aligned {
        let mut a = Aligned::zeroed(b.len());
        a.bytes_mut().copy_from_slice(b);
        a
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}
