//! EAL that fails to start: an error with EAL's reason, and the process lives on. In a
//! binary of its own, since EAL does not start again in a process where it failed.

use netagg_dpdk::{DpdkError, Eal};

#[test]
fn a_failed_start_is_an_error_with_eals_reason_and_stays_one() {
    // Each option is one netagg passes, but EAL refuses the two together.
    let args: Vec<String> = ["--no-huge", "--no-shconf", "--in-memory"].map(String::from).to_vec();
    let error = Eal::start(&args).unwrap_err();
    let DpdkError::Eal { reason, .. } = &error else { panic!("{error:?}") };
    assert!(error.to_string().contains("--in-memory"), "{error}");
    assert!(reason.contains("not compatible with --in-memory") && reason.contains("Invalid"), "{reason}");
    // Asking again gets the same answer, not a crash of an EAL half started.
    assert_eq!(Eal::start(&args).unwrap_err(), error);
}
