//! The C++ headers (netagg.hpp and SwitchML's API in switchml/) compiled with the
//! strictest warnings and the sanitizers, and run on the dummy backend.

mod common;

use std::process::Command;

#[test]
fn the_switchml_and_cpp_apis_work_and_report_misuse() {
    let scratch = common::scratch_dir("cpp-api");
    let work = scratch.path();
    let program = common::compile_cpp(work, "switchml_api", &["tests/cpp/switchml_api.cc"]);
    let (stdout, stderr) = common::run(
        Command::new(&program)
            .env_remove("NETAGG_CONFIG")
            .env("NETAGG_GENERAL__BACKEND", "dummy")
            .env("NETAGG_GENERAL__NUM_WORKERS", "3")
            .env("NETAGG_BACKEND_DUMMY__BANDWIDTH", "0")
            .current_dir(work),
    );
    assert!(stdout.contains("all C++ API checks passed"), "{stdout}");
    // Misuse is reported on stderr, where SwitchML would abort.
    assert!(stderr.contains("netagg: Stop: the context is not running"), "{stderr}");
    assert!(
        stderr.contains("key 'general.backend' = 'tcp': expected 'udp', 'dpdk', 'rdma' or 'dummy'"),
        "{stderr}"
    );
    // This host's kernel has no RDMA, as CI's.
    if !std::path::Path::new("/sys/class/infiniband").exists() {
        assert!(stderr.contains("backend.rdma: no RDMA device: this kernel has no RDMA support"), "{stderr}");
    }
}

#[test]
fn the_cpp_headers_compile_cleanly_from_cpp11_to_cpp20() {
    for standard in ["c++11", "c++14", "c++20"] {
        let output = Command::new("c++")
            .arg(format!("-std={standard}"))
            .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
            .arg(common::crate_dir().join("include"))
            .arg(common::crate_dir().join("tests/cpp/switchml_api.cc"))
            .output()
            .unwrap();
        assert!(output.status.success(), "-std={standard}:\n{}", String::from_utf8_lossy(&output.stderr));
    }
}
