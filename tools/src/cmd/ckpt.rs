//! `ringzero ckpt`: check a checkpoint, or consolidate it into one file.

use std::process::ExitCode;

/// `ringzero ckpt`'s subcommand.
#[derive(clap::Args)]
pub(crate) struct CkptCli {
    #[command(subcommand)]
    pub(crate) cmd: CkptCmd,
}

#[derive(clap::Subcommand)]
pub(crate) enum CkptCmd {
    /// Print a checkpoint's layout and state, and check every shard's size, SHA-256 and tensors.
    /// Exit code 1 when a shard is bad.
    Inspect {
        /// The checkpoint directory (the one holding meta.json).
        dir: std::path::PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write every parameter as one safetensors file, named and shaped as declared, assembled
    /// shard by shard (one parameter in memory at a time). Every shard is checked first.
    Consolidate {
        /// The checkpoint directory.
        dir: std::path::PathBuf,
        /// The file to write (replaced atomically if it exists).
        #[arg(short = 'o', long)]
        out: std::path::PathBuf,
        /// fp32 (the masters as they are), bf16 or fp16 (their rounding).
        #[arg(long, default_value = "fp32")]
        dtype: ringzero_zero::Precision,
        /// Also write each parameter's optimizer states, as `<name>.<state>` (`exp_avg` and
        /// `exp_avg_sq` for Adam, `exp_avg` for Lion, `momentum_buffer` for SGD with momentum).
        #[arg(long)]
        optimizer: bool,
    },
}

/// Run the subcommand.
pub(crate) fn run(a: CkptCli) -> anyhow::Result<ExitCode> {
    ckpt(a.cmd)
}

fn ckpt(cmd: CkptCmd) -> anyhow::Result<ExitCode> {
    use ringzero_tools::ckpt;
    match cmd {
        CkptCmd::Inspect { dir, json } => {
            let i = ckpt::inspect(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&i)?);
            } else {
                print!("{}", ckpt::text(&dir, &i));
            }
            Ok(if i.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        CkptCmd::Consolidate {
            dir,
            out,
            dtype,
            optimizer,
        } => {
            let r = ringzero_zero::checkpoint::consolidate(&dir, &out, dtype, optimizer)?;
            println!(
                "wrote {}: {} tensors, {} parameter elements in {dtype}, {} bytes",
                out.display(),
                r.tensors,
                r.elements,
                r.bytes
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
