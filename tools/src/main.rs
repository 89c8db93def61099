//! The `ringzero` binary.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ringzero_collectives::{config::parse_bytes, Communicator};
use ringzero_tools::{check, launch};

#[derive(Parser)]
#[command(
    name = "ringzero",
    version,
    about = "Ring collectives over shared memory and TCP, written from scratch"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run N local ranks of a command with the ringzero launcher environment.
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long = "ranks", default_value_t = 4)]
        ranks: usize,
        /// Split the ranks into this many fake nodes (TCP between them, shm inside).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        /// Seconds the other ranks get to stop by themselves after one fails.
        #[arg(long, default_value_t = 5.0)]
        grace: f64,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Checked all-reduce sweep (run it under `ringzero launch`): every result is verified exactly.
    Check {
        /// Smallest size (bytes; K/M/G suffixes).
        #[arg(short = 'b', long, default_value = "4K", value_parser = size)]
        min_bytes: usize,
        /// Largest size.
        #[arg(short = 'e', long, default_value = "16M", value_parser = size)]
        max_bytes: usize,
        /// Multiplier between sizes.
        #[arg(short = 'f', long, default_value_t = 4)]
        factor: usize,
        /// Timed iterations per size.
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
}

fn size(s: &str) -> Result<usize, String> {
    parse_bytes(s).ok_or_else(|| format!("`{s}` is not a size (e.g. 4096, 64K, 16M)"))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RINGZERO_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ringzero: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Launch {
            ranks,
            nodes,
            grace,
            cmd,
        } => {
            anyhow::ensure!(
                grace.is_finite() && grace >= 0.0,
                "--grace must be a non-negative number of seconds"
            );
            let spec = launch::LaunchSpec {
                ranks,
                nodes,
                program: cmd[0].clone(),
                args: cmd[1..].to_vec(),
                env: vec![],
                grace: Duration::from_secs_f64(grace),
            };
            let outcome = launch::launch(&spec, launch::Output::Inherit)?;
            Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
        }
        Cmd::Check {
            min_bytes,
            max_bytes,
            factor,
            iters,
        } => {
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
    }
}
