//! C programs against the built libnetagg: compiled with the strictest warnings and the
//! address and undefined-behaviour sanitizers, then run.

mod common;

use std::process::Command;

#[test]
fn every_c_api_error_path_and_a_dummy_run() {
    let scratch = common::scratch_dir("c-api");
    let work = scratch.path();
    let program = common::compile_c(work, "api", &["tests/c/api.c"]);
    let config = work.join("unknown-key.cfg");
    std::fs::write(&config, "[general]\nnum_wokers = 2\n").unwrap();
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let (stdout, _) = common::run(
        Command::new(&program)
            .arg(&config)
            .arg(closed_port.to_string())
            .env_remove("NETAGG_CONFIG")
            .current_dir(work),
    );
    assert!(stdout.contains("all C API checks passed"), "{stdout}");
}

/// A DPDK backend that cannot start, from C: codes and messages, and the process lives
/// on. EAL starts in the program without hugepages (root, as in CI); its allocations
/// live until the process exits, which the leak checker is told.
#[test]
fn a_dpdk_backend_that_cannot_start_is_an_error_from_c() {
    let scratch = common::scratch_dir("c-api-dpdk");
    let work = scratch.path();
    let program = common::compile_c(work, "dpdk", &["tests/c/dpdk.c"]);
    let (stdout, _) = common::run(
        Command::new(&program)
            .env_remove("NETAGG_CONFIG")
            .env("ASAN_OPTIONS", "detect_leaks=0")
            .current_dir(work),
    );
    assert!(stdout.contains("all DPDK C API checks passed"), "{stdout}");
}
