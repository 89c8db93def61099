//! `ringzero check`: a quick checked all-reduce sweep.

use std::process::ExitCode;

use anyhow::Context;
use ringzero_collectives::Communicator;
use ringzero_tools::check;

/// `ringzero check`'s arguments.
#[derive(clap::Args)]
pub(crate) struct CheckCli {
    /// Smallest size (bytes; K/M/G suffixes).
    #[arg(short = 'b', long, default_value = "4K", value_parser = super::size)]
    pub(crate) min_bytes: usize,
    /// Largest size.
    #[arg(short = 'e', long, default_value = "16M", value_parser = super::size)]
    pub(crate) max_bytes: usize,
    /// Multiplier between sizes.
    #[arg(short = 'f', long, default_value_t = 4)]
    pub(crate) factor: usize,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 5)]
    pub(crate) iters: usize,
}

/// Run the sweep; fails if any result is wrong.
pub(crate) fn run(a: CheckCli) -> anyhow::Result<ExitCode> {
    let CheckCli {
        min_bytes,
        max_bytes,
        factor,
        iters,
    } = a;
    anyhow::ensure!(
        min_bytes <= max_bytes,
        "-b {min_bytes} is larger than -e {max_bytes}"
    );
    let comm = Communicator::from_env().context("joining the job")?;
    if comm.rank() == 0 {
        println!(
            "ringzero check: {} ranks, f32 sum all-reduce, out of place",
            comm.size()
        );
    }
    for e in comm.edges() {
        if e.to == comm.rank() {
            println!("edge {e}");
        }
    }
    let rows = check::run(
        &comm,
        check::CheckArgs {
            min_bytes,
            max_bytes,
            factor,
            iters,
        },
    )?;
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if comm.rank() == 0 {
        print!("{}", check::table(comm.size(), &rows));
        println!(
            "{}",
            if wrong == 0 {
                "all results exact"
            } else {
                "WRONG RESULTS"
            }
        );
    }
    Ok(if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
