//! `netagg-softroce-vms`, which `scripts/softroce-vms` builds and runs: the command line
//! in, an exit status out (0 when both commands succeeded, 1 when anything failed, 128
//! plus the signal's number when a signal stopped the run).

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;
use netagg_vms::cli::Args;
use netagg_vms::run::{run, Outcome};
use netagg_vms::Error;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) => {
            let help = matches!(error.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
            // Printing to a closed terminal is nothing to report.
            let _ = error.print();
            return ExitCode::from(if help { 0 } else { 1 });
        }
    };
    // Returned rather than exited with, so that every guard (VMs, the initramfs) is dropped.
    match run(&args) {
        Ok(Outcome::Succeeded) => ExitCode::SUCCESS,
        Ok(Outcome::Failed) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("softroce-vms: {error}");
            match error {
                Error::Interrupted(signal) => ExitCode::from(128 + signal as u8),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
