//! Frame headers: what travels in front of every slice on every transport.
//!
//! A header carries the collective's fingerprint (collective, dtype, reduce op, root, count) and
//! its sequence number, so a rank that receives a frame from a neighbour that called something
//! else fails at once with both calls in the message. The payload length is checked against what
//! the receiver expects before a single payload byte is read or copied.
//!
//! Headers are plain `#[repr(C)]` structs in native byte order: ranks of one job share an
//! architecture (the magic number catches a mismatch).

use bytemuck::{Pod, Zeroable};
use ringzero_kernels::{DType, ReduceOp};
use std::fmt;

use crate::ring::doubling::Schedule;
use crate::ring::Collective;

/// `RZF1` — start of every data frame.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"RZF1");
/// Version of the frame format; bumped on any incompatible change.
pub const WIRE_VERSION: u16 = 1;
/// Bytes of an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = std::mem::size_of::<FrameHeader>();
/// Longest abort reason carried in an abort frame.
pub const MAX_ABORT_REASON: usize = 1024;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A slice of a collective.
    Data = 1,
    /// The sender is aborting; the payload is its reason (UTF-8, at most [`MAX_ABORT_REASON`]).
    Abort = 2,
}

/// What a collective call was: enough to tell two different calls apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Fingerprint {
    /// Total element count (`u64::MAX` where it differs by rank: `all_to_all_v` as a whole;
    /// each of its messages carries its own).
    pub count: u64,
    /// Root rank; for [`Collective::ReduceScatterV`], a digest of its counts
    /// ([`Fingerprint::with_counts`]), so ranks that split the same total differently fail at
    /// the first frame. `u32::MAX` when neither.
    pub root: u32,
    /// [`Collective::code`].
    pub coll: u8,
    /// [`DType`] code (0 for a barrier).
    pub dtype: u8,
    /// [`ReduceOp`] code (0 when the collective does not reduce).
    pub redop: u8,
    /// The algorithm, where a collective has more than one: 0 for the ring (and every
    /// collective with one algorithm), [`Fingerprint::DOUBLING`] and
    /// [`Fingerprint::HALVING_DOUBLING`] for the doubling schedules (`ring::doubling`). Ranks
    /// that chose differently fail at the first frame, both calls named.
    pub algo: u8,
}

impl Fingerprint {
    /// The fingerprint of a call.
    pub fn new(
        coll: Collective,
        dtype: Option<DType>,
        op: Option<ReduceOp>,
        count: usize,
    ) -> Fingerprint {
        Fingerprint {
            count: count as u64,
            root: coll.root().map_or(u32::MAX, |r| r as u32),
            coll: coll.code(),
            dtype: dtype.map_or(0, |d| d as u8),
            redop: if coll.reduces() {
                op.map_or(0, |o| o as u8)
            } else {
                0
            },
            algo: 0,
        }
    }

    /// [`Fingerprint::algo`] of the whole-buffer doubling schedules ([`Schedule::Doubling`]).
    pub const DOUBLING: u8 = 1;
    /// [`Fingerprint::algo`] of [`Schedule::HalvingDoubling`].
    pub const HALVING_DOUBLING: u8 = 2;

    /// [`Fingerprint::algo`] of the single-copy all-gather (`comm/direct.rs`).
    pub const SINGLE_COPY: u8 = 3;

    /// This fingerprint, for the single-copy all-gather.
    pub fn single_copy(mut self) -> Fingerprint {
        self.algo = Fingerprint::SINGLE_COPY;
        self
    }

    /// This fingerprint, for the collective's schedule `sched`.
    pub fn by(mut self, sched: Schedule) -> Fingerprint {
        self.algo = match sched {
            Schedule::Doubling => Fingerprint::DOUBLING,
            Schedule::HalvingDoubling => Fingerprint::HALVING_DOUBLING,
        };
        self
    }

    /// This fingerprint with a digest of a v-collective's per-rank `counts` in place of the
    /// root (64-bit FNV-1a over the counts, folded to 32 bits; never `u32::MAX`).
    pub fn with_counts(mut self, counts: &[usize]) -> Fingerprint {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &k in counts {
            for b in (k as u64).to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        let folded = (h ^ (h >> 32)) as u32;
        self.root = if folded == u32::MAX { 0 } else { folded };
        self
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let root = if self.root == u32::MAX {
            0
        } else {
            self.root as usize
        };
        let Some(coll) = Collective::from_code(self.coll, root) else {
            return write!(f, "<unknown collective {}>", self.coll);
        };
        // What each collective's doubling schedule is called.
        let doubling = match coll {
            Collective::Broadcast { .. } | Collective::Reduce { .. } => ", by binomial tree",
            Collective::Barrier => "by dissemination",
            _ => ", by doubling",
        };
        if coll == Collective::Barrier {
            return match self.algo {
                Fingerprint::DOUBLING => write!(f, "barrier({doubling})"),
                _ => f.write_str("barrier()"),
            };
        }
        write!(f, "{}(", coll.name())?;
        match DType::from_code(self.dtype) {
            Some(d) => write!(f, "{d}")?,
            None => write!(f, "dtype#{}", self.dtype)?,
        }
        if let Some(op) = ReduceOp::from_code(self.redop) {
            write!(f, ", {op}")?;
        }
        if self.count != u64::MAX {
            write!(f, ", count={}", self.count)?;
        }
        if let Some(r) = coll.root() {
            write!(f, ", root={r}")?;
        }
        let v = matches!(coll, Collective::ReduceScatterV | Collective::AllGatherV);
        if v && self.root != u32::MAX {
            write!(f, ", counts#{:08x}", self.root)?;
        }
        match self.algo {
            0 => {}
            Fingerprint::DOUBLING => f.write_str(doubling)?,
            Fingerprint::HALVING_DOUBLING => f.write_str(", by halving-doubling")?,
            Fingerprint::SINGLE_COPY => f.write_str(", single copy")?,
            a => write!(f, ", algo#{a}")?,
        }
        f.write_str(")")
    }
}

/// The header in front of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct FrameHeader {
    /// [`FRAME_MAGIC`].
    pub magic: u32,
    /// [`WIRE_VERSION`].
    pub version: u16,
    /// [`Kind`] code.
    pub kind: u8,
    /// Zero.
    pub _pad: u8,
    /// Sequence number of the collective on the sender's communicator.
    pub seq: u64,
    /// Ring step of this frame.
    pub step: u32,
    /// Slice index of this frame.
    pub slice: u32,
    /// The call this frame belongs to.
    pub fp: Fingerprint,
    /// Payload bytes that follow.
    pub len: u64,
}

const _: () = assert!(HEADER_LEN == 48, "frame header layout changed");

/// What a receiver expects of the next frame.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// Sequence number.
    pub seq: u64,
    /// Step.
    pub step: u32,
    /// Slice.
    pub slice: u32,
    /// Fingerprint of the local call.
    pub fp: Fingerprint,
    /// Payload bytes.
    pub len: usize,
}

impl FrameHeader {
    /// A data frame header.
    pub fn data(seq: u64, step: u32, slice: u32, fp: Fingerprint, len: usize) -> FrameHeader {
        FrameHeader {
            magic: FRAME_MAGIC,
            version: WIRE_VERSION,
            kind: Kind::Data as u8,
            _pad: 0,
            seq,
            step,
            slice,
            fp,
            len: len as u64,
        }
    }

    /// An abort frame header for a reason of `len` bytes.
    pub fn abort(len: usize) -> FrameHeader {
        FrameHeader {
            kind: Kind::Abort as u8,
            ..FrameHeader::data(0, 0, 0, Fingerprint::zeroed(), len)
        }
    }

    /// The expected header for a data frame.
    pub fn expected(e: &Expect) -> FrameHeader {
        FrameHeader::data(e.seq, e.step, e.slice, e.fp, e.len)
    }

    /// Decode and sanity-check a header (magic, version, kind, abort length).
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<FrameHeader, WireError> {
        let h: FrameHeader = bytemuck::pod_read_unaligned(bytes);
        if h.magic != FRAME_MAGIC {
            return Err(WireError::Garbage(format!(
                "bad frame magic {:#010x}",
                h.magic
            )));
        }
        if h.version != WIRE_VERSION {
            return Err(WireError::Garbage(format!(
                "frame version {} but this build speaks {WIRE_VERSION}",
                h.version
            )));
        }
        match h.kind {
            k if k == Kind::Data as u8 => {}
            k if k == Kind::Abort as u8 => {
                if h.len as usize > MAX_ABORT_REASON {
                    return Err(WireError::Garbage(format!(
                        "abort reason of {} bytes",
                        h.len
                    )));
                }
            }
            k => return Err(WireError::Garbage(format!("unknown frame kind {k}"))),
        }
        Ok(h)
    }

    /// Whether this is an abort frame.
    pub fn is_abort(&self) -> bool {
        self.kind == Kind::Abort as u8
    }

    /// Check a data frame against what the receiver expects; call before touching the payload.
    pub fn check(&self, want: &Expect) -> Result<(), WireError> {
        if self.fp != want.fp || self.seq != want.seq {
            return Err(WireError::Mismatch {
                theirs: format!("{} (its seq {})", self.fp, self.seq),
            });
        }
        if (self.step, self.slice, self.len) != (want.step, want.slice, want.len as u64) {
            return Err(WireError::Garbage(format!(
                "frame (step {}, slice {}, {} bytes) where (step {}, slice {}, {} bytes) was expected \
                 — do the ranks use the same RINGZERO_SLICE_BYTES?",
                self.step, self.slice, self.len, want.step, want.slice, want.len
            )));
        }
        Ok(())
    }
}

/// Why a header was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Not a valid frame for this protocol.
    Garbage(String),
    /// A valid frame of another call.
    Mismatch {
        /// The peer's call, for the message.
        theirs: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint::new(
            Collective::AllReduce,
            Some(DType::F32),
            Some(ReduceOp::Sum),
            1000,
        )
    }

    #[test]
    fn header_round_trips_and_checks() {
        let h = FrameHeader::data(7, 2, 3, fp(), 400);
        let bytes: [u8; HEADER_LEN] = bytemuck::cast(h);
        let d = FrameHeader::decode(&bytes).unwrap();
        assert_eq!(d, h);
        let want = Expect {
            seq: 7,
            step: 2,
            slice: 3,
            fp: fp(),
            len: 400,
        };
        d.check(&want).unwrap();
        let other = Fingerprint::new(Collective::AllGather, Some(DType::F32), None, 1000);
        let e = FrameHeader::data(7, 2, 3, other, 400)
            .check(&want)
            .unwrap_err();
        assert_eq!(
            e,
            WireError::Mismatch {
                theirs: "all_gather(f32, count=1000) (its seq 7)".into()
            }
        );
        let e = FrameHeader::data(7, 2, 3, fp(), 401)
            .check(&want)
            .unwrap_err();
        assert!(matches!(e, WireError::Garbage(m) if m.contains("401 bytes")));
    }

    #[test]
    fn garbage_is_rejected_before_any_length_is_trusted() {
        let mut bytes = [0xAB; HEADER_LEN];
        assert!(
            matches!(FrameHeader::decode(&bytes), Err(WireError::Garbage(m)) if m.contains("magic"))
        );
        let mut h = FrameHeader::abort(MAX_ABORT_REASON + 1);
        bytes = bytemuck::cast(h);
        assert!(FrameHeader::decode(&bytes).is_err());
        h.version = 9;
        bytes = bytemuck::cast(h);
        assert!(
            matches!(FrameHeader::decode(&bytes), Err(WireError::Garbage(m)) if m.contains("version 9"))
        );
    }

    #[test]
    fn fingerprint_reads_like_the_call() {
        let f = Fingerprint::new(
            Collective::Reduce { root: 2 },
            Some(DType::BF16),
            Some(ReduceOp::Max),
            5,
        );
        assert_eq!(f.to_string(), "reduce(bf16, max, count=5, root=2)");
        assert_eq!(
            f.by(Schedule::Doubling).to_string(),
            "reduce(bf16, max, count=5, root=2, by binomial tree)"
        );
        let b = Fingerprint::new(Collective::Barrier, None, None, 0);
        assert_eq!(b.to_string(), "barrier()");
        assert_eq!(
            b.by(Schedule::Doubling).to_string(),
            "barrier(by dissemination)"
        );
    }

    #[test]
    fn the_algorithm_is_part_of_the_fingerprint() {
        let d = fp().by(Schedule::Doubling);
        assert_eq!(
            d.to_string(),
            "all_reduce(f32, sum, count=1000, by doubling)"
        );
        let hd = fp().by(Schedule::HalvingDoubling);
        assert_eq!(
            hd.to_string(),
            "all_reduce(f32, sum, count=1000, by halving-doubling)"
        );
        assert_ne!(hd, d);
        let want = Expect {
            seq: 3,
            step: 0,
            slice: 0,
            fp: fp(),
            len: 0,
        };
        let e = FrameHeader::data(3, 0, 0, d, 0).check(&want).unwrap_err();
        assert_eq!(
            e,
            WireError::Mismatch {
                theirs: "all_reduce(f32, sum, count=1000, by doubling) (its seq 3)".into()
            }
        );
    }

    #[test]
    fn a_v_collectives_counts_are_part_of_its_fingerprint() {
        let rsv = |counts: &[usize]| {
            Fingerprint::new(
                Collective::ReduceScatterV,
                Some(DType::F32),
                Some(ReduceOp::Sum),
                counts.iter().sum(),
            )
            .with_counts(counts)
        };
        let (a, b) = (rsv(&[3, 5]), rsv(&[4, 4]));
        assert_ne!(a, b, "same total, split differently");
        assert_eq!(a, rsv(&[3, 5]));
        assert_ne!(rsv(&[0, 8]), rsv(&[8, 0]));
        let s = a.to_string();
        assert!(
            s.starts_with("reduce_scatter_v(f32, sum, count=8, counts#"),
            "{s}"
        );
        assert_ne!(s, b.to_string());
    }
}
