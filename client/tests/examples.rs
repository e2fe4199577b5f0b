//! The examples, built the way users build them: netagg installed by `scripts/install`,
//! then the C and C++ examples with make (pkg-config) and with CMake (find_package), the C
//! one also linked statically, and every example run under `netagg-run` with 2 workers
//! and a real switch, checking its sums; the C one also over DPDK in namespaces, and
//! the C one and the C++ one on SwitchML's API over RDMA between two Soft-RoCE VMs.

mod common;

use std::path::Path;
use std::process::Command;

/// Runs `command`, which must succeed; returns all it printed.
fn run(command: &mut Command) -> String {
    let (stdout, stderr) = common::run(command);
    format!("{stdout}{stderr}")
}

/// Runs `program` as 2 ranks under the installed launcher; returns their output.
fn run_two_ranks(launcher: &Path, program: &Path) -> String {
    run(Command::new(launcher)
        .args(["-n", "2", "--"])
        .arg(program)
        .env_remove("NETAGG_CONFIG")
        .current_dir(program.parent().unwrap()))
}

fn assert_both_ranks_say(output: &str, line: &str) {
    let count = output.lines().filter(|l| l.contains(line)).count();
    assert_eq!(count, 2, "expected '{line}' from both ranks in:\n{output}");
}

#[test]
fn c_and_cpp_examples_build_against_the_installed_package_and_sum_across_two_workers() {
    let scratch = common::scratch_dir("examples");
    let work = scratch.path();
    let prefix = work.join("prefix");
    let repository = common::crate_dir().parent().unwrap();
    let mut install = Command::new(repository.join("scripts/install"));
    install.arg("--prefix").arg(&prefix);
    if !common::is_release() {
        install.arg("--debug");
    }
    run(&mut install);
    for file in ["lib/libnetagg.so", "lib/libnetagg.a", "include/switchml/context.h", "bin/netagg-switch"] {
        assert!(prefix.join(file).is_file(), "{file} was not installed");
    }

    let make_build = work.join("make");
    run(Command::new("make")
        .arg("-C")
        .arg(repository.join("examples"))
        .arg(format!("BUILD={}", make_build.display()))
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    let cmake_build = work.join("cmake");
    run(Command::new("cmake")
        .arg("-S")
        .arg(repository.join("examples"))
        .arg("-B")
        .arg(&cmake_build)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display())));
    run(Command::new("cmake").arg("--build").arg(&cmake_build));

    // Linked statically, with what `pkg-config --static` says libnetagg.a needs besides.
    let libraries = run(Command::new("pkg-config")
        .args(["--static", "--libs-only-l", "netagg"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    run(Command::new("cc")
        .arg("-I")
        .arg(prefix.join("include"))
        .arg(repository.join("examples/c/hello_world.c"))
        .arg(prefix.join("lib/libnetagg.a"))
        .args(libraries.split_whitespace().filter(|library| *library != "-lnetagg"))
        .arg("-o")
        .arg(make_build.join("hello_world_static")));

    let launcher = prefix.join("bin/netagg-run");
    let output = run_two_ranks(&launcher, &make_build.join("hello_world_static"));
    assert_both_ranks_say(&output, "All 65536 int32, 65536 float32 and 65536 bfloat16 sums verified");
    // The same C program with its data on DPDK ports, the workers' and the switch's, in
    // network namespaces (root, as CI has): only the configuration differs, which the
    // launcher sets (backend = dpdk; there is no fallback to sockets).
    let output = run(Command::new(&launcher)
        .args(["-n", "2", "--link", "rate=1gbit", "--dpdk", "both", "--"])
        .arg(make_build.join("hello_world_c"))
        .env_remove("NETAGG_CONFIG"));
    assert_both_ranks_say(&output, "All 65536 int32, 65536 float32 and 65536 bfloat16 sums verified");
    assert!(output.contains("data path on a DPDK port"), "{output}");
    c_and_cpp_examples_over_rdma_between_two_vms(&prefix, &make_build);
    for build in [&make_build, &cmake_build] {
        let output = run_two_ranks(&launcher, &build.join("hello_world_c"));
        assert_both_ranks_say(&output, "All 65536 int32, 65536 float32 and 65536 bfloat16 sums verified");
        let output = run_two_ranks(&launcher, &build.join("hello_world_cpp"));
        assert_both_ranks_say(&output, "Data verified: 8 tensors of 32768 floats summed over 2 workers");
        assert_both_ranks_say(&output, "Submitted jobs: #8#");
        let output = run_two_ranks(&launcher, &build.join("tutorial"));
        assert_both_ranks_say(&output, "Asynchronous allreduce waiting for the job took");
        assert_both_ranks_say(&output, "Verified 16777216 sums.");
    }
}

/// The C example and the C++ one on SwitchML's API, unchanged, over RDMA: a switch with
/// an RDMA data path in one QEMU VM and a rank in each of two, joined by Soft-RoCE
/// (`scripts/softroce-vms`, which needs root and installs QEMU). Only the environment
/// differs; the switch serves RDMA alone, so nothing else can carry the data.
fn c_and_cpp_examples_over_rdma_between_two_vms(prefix: &Path, build: &Path) {
    // The programs' run path is pkg-config's libdir, PREFIX/lib/pkgconfig/../../lib: the
    // VMs have the library at its path, but no pkgconfig folder to pass through.
    let pkgconfig = prefix.join("lib/pkgconfig");
    let rank = |rank| {
        let environment = format!(
            "NETAGG_GENERAL__BACKEND=rdma NETAGG_GENERAL__NUM_WORKERS=2 NETAGG_GENERAL__RANK={rank} \
             NETAGG_GENERAL__CONTROLLER_IP=10.77.0.1"
        );
        format!(
            "mkdir -p {}\n{environment} hello_world_c || exit 1\n{environment} hello_world_cpp || exit 1",
            pkgconfig.display()
        )
    };
    let vm0 = format!(
        "netagg-switch --transport rdma --control 10.77.0.1:50099 --data 10.77.0.1:48864 > switch.log 2>&1 & \
         switch=$!\n{}\nkill -INT $switch; wait $switch; status=$?; cat switch.log; exit $status",
        rank(0)
    );
    let repository = common::crate_dir().parent().unwrap().to_path_buf();
    let output = run(Command::new(repository.join("scripts/softroce-vms"))
        .args(["--timeout", "240", "--bin"])
        .arg(prefix.join("bin/netagg-switch"))
        .arg("--bin")
        .arg(build.join("hello_world_c"))
        .arg("--bin")
        .arg(build.join("hello_world_cpp"))
        .args(["--vm0", &vm0, "--vm1", &rank(1)])
        // Cargo's, naming its own folders: the script's ldd must see what a user's sees.
        .env_remove("LD_LIBRARY_PATH"));
    for vm in ["vm0", "vm1"] {
        let says =
            |line: &str| output.lines().any(|l| l.starts_with(&format!("[{vm}] ")) && l.contains(line));
        assert!(says("All 65536 int32, 65536 float32 and 65536 bfloat16 sums verified"), "{vm}:\n{output}");
        assert!(says("Data verified: 8 tensors of 32768 floats summed over 2 workers"), "{vm}:\n{output}");
    }
    assert!(output.contains("[vm0] netagg-switch: control 10.77.0.1:50099 data 10.77.0.1:48864"), "{output}");
    assert!(output.contains("data path on RDMA"), "{output}");
}

#[test]
fn the_rust_examples_sum_across_two_workers() {
    common::cargo_build(&["--example", "hello_world", "--example", "async_allreduce"]);
    let target = common::target_dir();
    let output = run_two_ranks(&target.join("netagg-run"), &target.join("examples/hello_world"));
    assert_both_ranks_say(&output, "All 65536 int32 and 65536 float32 sums verified");
    let output = run_two_ranks(&target.join("netagg-run"), &target.join("examples/async_allreduce"));
    assert_both_ranks_say(&output, "Tensor 2: 262144 sums verified");
    assert_both_ranks_say(&output, "All 4 tensors summed concurrently and verified");
}
