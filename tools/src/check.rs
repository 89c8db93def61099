//! `ringzero check`: the main job until the full benchmark lands — every rank runs a sweep of
//! f32 sum all-reduces over growing sizes, checks every result exactly, and rank 0 prints a table
//! with nccl-tests' definitions (algbw = bytes / time, busbw = algbw · 2(n−1)/n).
//!
//! Inputs are small integers, so the sum is exact in any order and a correct result is compared
//! with zero tolerance.

use std::time::Instant;

use ringzero_collectives::{Collectives, Communicator, InPlace, ReduceOp, Result};

/// Sweep parameters.
#[derive(Clone, Copy, Debug)]
pub struct CheckArgs {
    /// Smallest buffer in bytes.
    pub min_bytes: usize,
    /// Largest buffer in bytes.
    pub max_bytes: usize,
    /// Size multiplier between rows.
    pub factor: usize,
    /// Timed iterations per size.
    pub iters: usize,
}

/// One row of the sweep.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Buffer bytes.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// Mean time per call in µs (slowest rank).
    pub time_us: f64,
    /// Elements that differed from the exact answer, summed over ranks.
    pub wrong: u64,
}

fn input(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 3) % 11) as f32 - 5.0
}

/// Run the sweep on `comm`; every rank returns the same rows.
pub fn run(comm: &Communicator, a: CheckArgs) -> Result<Vec<Row>> {
    let n = comm.size();
    let mut rows = Vec::new();
    let mut bytes = a.min_bytes.max(4);
    while bytes <= a.max_bytes {
        let count = bytes / 4;
        let send: Vec<f32> = (0..count).map(|i| input(comm.rank(), i)).collect();
        let mut recv = vec![0f32; count];
        // Checked (untimed) call.
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        let wrong = (0..count)
            .filter(|&i| recv[i] != (0..n).map(|r| input(r, i)).sum::<f32>())
            .count();
        let iters = a.iters.max(1);
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        }
        let mut us = vec![t.elapsed().as_secs_f64() * 1e6 / iters as f64];
        comm.all_reduce(InPlace, &mut us, ReduceOp::Max)?;
        let mut w = vec![wrong as i64];
        comm.all_reduce(InPlace, &mut w, ReduceOp::Sum)?;
        rows.push(Row {
            bytes,
            count,
            time_us: us[0],
            wrong: w[0] as u64,
        });
        bytes = bytes.saturating_mul(a.factor.max(2));
    }
    Ok(rows)
}

/// Format the table rank 0 prints.
pub fn table(n: usize, rows: &[Row]) -> String {
    let mut s = format!(
        "{:>12} {:>10} {:>12} {:>10} {:>10} {:>7}\n",
        "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
    );
    for r in rows {
        let algbw = r.bytes as f64 / (r.time_us * 1e-6) / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        s += &format!(
            "{:>12} {:>10} {:>12.1} {:>10.3} {:>10.3} {:>7}\n",
            r.bytes, r.count, r.time_us, algbw, busbw, r.wrong
        );
    }
    s
}
