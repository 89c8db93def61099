//! `ringzero launch`: N local ranks of a command.

use std::process::ExitCode;
use std::time::Duration;

use ringzero_tools::launch;

use super::dump_dir_for_launch;

/// `ringzero launch`'s arguments.
#[derive(clap::Args)]
pub(crate) struct LaunchCli {
    /// Number of ranks.
    #[arg(short = 'n', long = "ranks", default_value_t = 4)]
    pub(crate) ranks: usize,
    /// Split the ranks into this many fake nodes (TCP between them, shm inside).
    #[arg(long, default_value_t = 1)]
    pub(crate) nodes: usize,
    /// Seconds the other ranks get to stop by themselves after one fails.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) grace: f64,
    /// Where the ranks write their flight records (`RINGZERO_DUMP_DIR`). Default: that
    /// variable if set, else a new directory under the temporary directory, removed when the
    /// job succeeds and named when it fails.
    #[arg(long, value_name = "DIR")]
    pub(crate) dump_dir: Option<std::path::PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub(crate) cmd: Vec<std::ffi::OsString>,
}

/// Run the job; its exit code is the first failed rank's.
pub(crate) fn run(a: LaunchCli) -> anyhow::Result<ExitCode> {
    let LaunchCli {
        ranks,
        nodes,
        grace,
        dump_dir,
        cmd,
    } = a;
    anyhow::ensure!(
        (0.0..=86_400.0).contains(&grace),
        "--grace {grace}: give the ranks between 0 and 86400 seconds (a day) to stop"
    );
    let spec = launch::LaunchSpec {
        ranks,
        nodes,
        program: cmd[0].clone(),
        args: cmd[1..].to_vec(),
        env: vec![],
        grace: Duration::from_secs_f64(grace),
        dump_dir: Some(dump_dir_for_launch(dump_dir)),
    };
    let outcome = launch::launch_interruptible(&spec, launch::Output::Inherit)?;
    Ok(ExitCode::from(outcome.exit_code().clamp(0, 255) as u8))
}
