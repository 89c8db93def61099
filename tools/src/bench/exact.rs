//! Inputs that reduce exactly in any order, and the serial reference they must reduce to, so a
//! result check can demand zero error (nccl-tests' `#wrong`).
//!
//! Inputs are small integers (sum/avg: −3..3, prod: 1, 2, −1, min/max: −4..4; non-negative for
//! `u8`), exact in every dtype including bf16. The reference is computed independently of the
//! library: integers in i128 then wrapped to the type, floats in f64, and `Avg` as the library
//! documents it — the sum, then one division in f32 (f64 for f64).

use std::ops::Range;

use half::{bf16, f16};
use ringzero_collectives::{chunk, Collective, DType, Element, ReduceOp};

/// Input of `rank` at element `i`.
pub fn value(dtype: DType, op: ReduceOp, rank: usize, i: usize, seed: usize) -> f64 {
    let h = i
        .wrapping_mul(31)
        .wrapping_add(rank * 17)
        .wrapping_add(seed);
    let unsigned = dtype == DType::U8;
    match op {
        ReduceOp::Sum | ReduceOp::Avg if unsigned => (h % 4) as f64,
        ReduceOp::Sum | ReduceOp::Avg => (h % 7) as f64 - 3.0,
        ReduceOp::Prod if unsigned => (1 + h % 2) as f64,
        ReduceOp::Prod => [1.0, 2.0, -1.0][h % 3],
        ReduceOp::Min | ReduceOp::Max if unsigned => (h % 9) as f64,
        ReduceOp::Min | ReduceOp::Max => (h % 9) as f64 - 4.0,
    }
}

/// The reduction of element `i` over `n` ranks, as the dtype represents it.
pub fn reference(dtype: DType, op: ReduceOp, n: usize, i: usize, seed: usize) -> f64 {
    let vals = (0..n).map(|r| value(dtype, op, r, i, seed));
    let combined: f64 = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    };
    let wrap = |v: f64| -> f64 {
        let v = v as i128;
        match dtype {
            DType::U8 => v.rem_euclid(256) as f64,
            DType::I32 => v as i32 as f64,
            _ => v as i64 as f64,
        }
    };
    let cast = |v: f64| -> f64 {
        match dtype {
            DType::F32 => v as f32 as f64,
            DType::F64 => v,
            DType::F16 => f16::from_f64(v).to_f64(),
            DType::BF16 => bf16::from_f64(v).to_f64(),
            _ => wrap(v),
        }
    };
    match (op, dtype.is_float()) {
        (ReduceOp::Avg, false) => (wrap(combined) as i128 / n as i128) as f64,
        (ReduceOp::Avg, true) if dtype == DType::F64 => combined / n as f64,
        (ReduceOp::Avg, true) => cast((cast(combined) as f32 / n as f32) as f64),
        _ => cast(combined),
    }
}

/// The element count a sweep runs `op` on for a buffer of `count` elements: all-to-all, gather
/// and scatter move equal blocks, so their count is rounded down to a multiple of `n` (as
/// nccl-tests does).
pub fn round_count(op: Collective, n: usize, count: usize) -> usize {
    match op {
        Collective::AllToAll
        | Collective::AllToAllV
        | Collective::Gather { .. }
        | Collective::Scatter { .. } => count - count % n.max(1),
        _ => count,
    }
}

/// The rank that rank `r` of `n` exchanges with in the send-recv sweep: ranks pair up as 0↔1,
/// 2↔3, ... (the bench refuses an odd `n`; its last rank would have none).
pub fn partner(r: usize, n: usize) -> Option<usize> {
    Some(r ^ 1).filter(|&p| p < n)
}

/// Send and receive lengths of one call of `op` on `count` elements at rank `r` of `n` (in place,
/// the send buffer is the whole buffer, except for all-gather, which works in `recv`). The sweep
/// runs the `-v` forms on the balanced counts of their ring forms; gather and scatter move blocks
/// of `count / n` (`count` a multiple of `n`).
pub fn lens(op: Collective, n: usize, r: usize, count: usize) -> (usize, usize) {
    let own = chunk(count, n, r).len();
    let at_root = |root: usize| if r == root { count } else { 0 };
    match op {
        Collective::ReduceScatter | Collective::ReduceScatterV => (count, own),
        Collective::AllGather | Collective::AllGatherV => (own, count),
        Collective::Reduce { root } => (count, at_root(root)),
        Collective::Gather { root } => (count / n.max(1), at_root(root)),
        Collective::Scatter { root } => (at_root(root), count / n.max(1)),
        Collective::Barrier => (0, 0),
        _ => (count, count),
    }
}

/// The input buffers of an exact check: `send` holds this rank's inputs, `recv` poison (99) —
/// except in place all-gather, whose `recv` already holds this rank's chunk.
pub fn inputs(
    op: Collective,
    inplace: bool,
    n: usize,
    r: usize,
    count: usize,
    mine: impl Fn(usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let own = chunk(count, n, r);
    let (s, rl) = lens(op, n, r, count);
    let mut recv = vec![99.0; rl];
    let send: Vec<f64> = match op {
        // Rank r gathers its block r of the buffer.
        Collective::Gather { .. } => (r * s..(r + 1) * s).map(mine).collect(),
        Collective::AllGather | Collective::AllGatherV => {
            if inplace {
                own.clone().for_each(|i| recv[i] = mine(i));
            }
            own.map(mine).collect()
        }
        _ => (0..s).map(mine).collect(),
    };
    (send, recv)
}

/// Which buffer of a call holds a rank's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lands {
    /// The send buffer (in place).
    Send,
    /// The receive buffer.
    Recv,
}

/// Where rank `r`'s result of `op` on inputs from [`value`] lands (buffer and range) and what it
/// must be; `None` where the rank ends with nothing to check (barrier, reduce off the root out of
/// place).
pub fn landing(
    op: Collective,
    inplace: bool,
    n: usize,
    r: usize,
    count: usize,
    (dtype, redop, seed): (DType, ReduceOp, usize),
) -> Option<(Lands, Range<usize>, Vec<f64>)> {
    let red = |i: usize| reference(dtype, redop, n, i, seed);
    let input = |rank: usize, i: usize| value(dtype, redop, rank, i, seed);
    let own = chunk(count, n, r);
    let home = if inplace { Lands::Send } else { Lands::Recv };
    Some(match op {
        Collective::AllReduce => (home, 0..count, (0..count).map(red).collect()),
        Collective::ReduceScatter | Collective::ReduceScatterV if inplace => {
            (Lands::Send, own.clone(), own.map(red).collect())
        }
        Collective::ReduceScatter | Collective::ReduceScatterV => {
            (Lands::Recv, 0..own.len(), own.map(red).collect())
        }
        Collective::AllGather | Collective::AllGatherV => {
            let owner = |i: usize| {
                (0..n)
                    .find(|&q| chunk(count, n, q).contains(&i))
                    .unwrap_or(0)
            };
            let want = (0..count).map(|i| input(owner(i), i)).collect();
            (Lands::Recv, 0..count, want)
        }
        Collective::Broadcast { root } => {
            (home, 0..count, (0..count).map(|i| input(root, i)).collect())
        }
        Collective::Reduce { root } if r == root => (home, 0..count, (0..count).map(red).collect()),
        Collective::RingShift => (
            home,
            0..count,
            (0..count).map(|i| input((r + n - 1) % n, i)).collect(),
        ),
        Collective::AllToAll | Collective::AllToAllV => {
            // Block q of the result is block r of rank q's input.
            let b = count / n;
            let want = (0..count).map(|i| input(i / b, r * b + i % b)).collect();
            (home, 0..count, want)
        }
        Collective::SendRecv => {
            let p = partner(r, n)?;
            (home, 0..count, (0..count).map(|i| input(p, i)).collect())
        }
        Collective::Gather { root } if r == root => {
            // Block q is rank q's block q.
            (
                Lands::Recv,
                0..count,
                (0..count)
                    .map(|i| input(i / (count / n).max(1), i))
                    .collect(),
            )
        }
        Collective::Scatter { root } => {
            let b = count / n;
            let want = (r * b..(r + 1) * b).map(|i| input(root, i)).collect();
            (Lands::Recv, 0..b, want)
        }
        Collective::Reduce { .. } | Collective::Gather { .. } | Collective::Barrier => return None,
    })
}

/// `vals` as `d`'s bytes (native endian).
pub fn encode(d: DType, vals: &[f64]) -> Vec<u8> {
    fn go<T: Element>(v: &[f64]) -> Vec<u8> {
        let t: Vec<T> = v.iter().map(|&x| T::from_f64(x)).collect();
        bytemuck::cast_slice(&t).to_vec()
    }
    match d {
        DType::F32 => go::<f32>(vals),
        DType::F64 => go::<f64>(vals),
        DType::F16 => go::<half::f16>(vals),
        DType::BF16 => go::<half::bf16>(vals),
        DType::I32 => go::<i32>(vals),
        DType::I64 => go::<i64>(vals),
        DType::U8 => go::<u8>(vals),
    }
}

/// `d`'s bytes as values.
pub fn decode(d: DType, b: &[u8]) -> Vec<f64> {
    fn go<T: Element>(b: &[u8]) -> Vec<f64> {
        let mut t = vec![<T as bytemuck::Zeroable>::zeroed(); b.len() / std::mem::size_of::<T>()];
        bytemuck::cast_slice_mut::<T, u8>(&mut t).copy_from_slice(b);
        t.into_iter().map(T::to_f64).collect()
    }
    match d {
        DType::F32 => go::<f32>(b),
        DType::F64 => go::<f64>(b),
        DType::F16 => go::<half::f16>(b),
        DType::BF16 => go::<half::bf16>(b),
        DType::I32 => go::<i32>(b),
        DType::I64 => go::<i64>(b),
        DType::U8 => go::<u8>(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_by_hand() {
        // Ranks 0..3 at element 0, seed 0: h = 0, 17, 34 → sum inputs (h % 7) − 3 = −3, 0, 3.
        assert_eq!(reference(DType::F32, ReduceOp::Sum, 3, 0, 0), 0.0);
        assert_eq!(
            reference(DType::I32, ReduceOp::Max, 3, 0, 0),
            [0usize, 17, 34]
                .map(|h| (h % 9) as f64 - 4.0)
                .into_iter()
                .fold(f64::MIN, f64::max)
        );
        // u8 products wrap: 2^8 = 0 mod 256.
        let n = 8;
        let all_two = (0..n).all(|r| value(DType::U8, ReduceOp::Prod, r, 1, 1) == 2.0);
        if all_two {
            assert_eq!(reference(DType::U8, ReduceOp::Prod, n, 1, 1), 0.0);
        }
        // i32 avg truncates toward zero: (−3 + 0) / 2 = −1.
        assert_eq!(reference(DType::I32, ReduceOp::Avg, 2, 0, 0), -1.0);
    }
}
