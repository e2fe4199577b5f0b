//! RDMA end to end: `netagg-switch --transport rdma` in one QEMU VM, a worker in each of
//! two VMs joined by a Soft-RoCE link (`scripts/softroce-vms`), `allreduce_benchmark
//! --verify` between them with `backend = rdma`; and kernel UDP between the same VMs. Every datagram crosses an RC queue
//! pair: each worker prints what carried its packets, and the switch that it ran its
//! data path on RDMA. Needs root and QEMU, as CI has (the script installs QEMU);
//! ignored in a plain `cargo test`, run by `scripts/test` in its own stage.

use std::path::{Path, PathBuf};
use std::process::Command;

const SWITCH: &str = env!("CARGO_BIN_EXE_netagg-switch");

/// Starts the switch in the background in vm0, its log in switch.log.
const START_SWITCH: &str = "netagg-switch --transport rdma --control 10.77.0.1:50099 \
     --data 10.77.0.1:48864 --log-level debug > switch.log 2>&1 & switch=$!";

/// What every rank's environment holds: two workers over RDMA, the switch in vm0.
fn worker_environment(rank: usize) -> String {
    format!(
        "NETAGG_GENERAL__BACKEND=rdma NETAGG_GENERAL__NUM_WORKERS=2 NETAGG_GENERAL__RANK={rank} \
         NETAGG_GENERAL__CONTROLLER_IP=10.77.0.1"
    )
}

// Lines the tests look for start with a line feed: the benchmark's progress bar ends
// without one.

/// A line of a VM's script that says in the share that its command has ended, the switch
/// included where it runs one.
fn mark_ended(rank: usize) -> String {
    format!(": > rank{rank}.ended")
}

/// A line of a VM's script that waits, up to 120 s, until rank `rank`'s VM has marked
/// its command ended: the VM of a killed process stays up, as its host would, so that its
/// kernel's notices (TCP's FIN, rdma_cm's disconnect) and their retransmissions reach the
/// other VM, and the other VM's switch tears its connections down with a live peer. A VM
/// that powered off at once would test a vanished host instead: there a queue pair's
/// destruction can wait about 50 s in the kernel (Soft-RoCE, Linux 6.1): netagg's reaper
/// threads keep that wait off the data path, `Context::stop` and the switch's shutdown,
/// but a process's exit may still wait for it.
fn await_ended(rank: usize) -> String {
    format!("for i in $(seq 600); do [ -e rank{rank}.ended ] && break; sleep 0.2; done")
}

/// A program of another package of the workspace, built into the folder of
/// `netagg-switch` (cargo names only this package's programs to its tests).
fn beside_switch(name: &str) -> PathBuf {
    let path = Path::new(SWITCH).with_file_name(name);
    assert!(path.is_file(), "{} is missing: build the workspace's binaries first", path.display());
    path
}

/// Runs `vm0` and `vm1` in the two VMs with the switch and the benchmark at hand;
/// returns whether both succeeded, and everything printed.
fn softroce_vms(vm0: &str, vm1: &str) -> (bool, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/softroce-vms");
    let output = Command::new(script)
        .args(["--timeout", "240", "--bin", SWITCH, "--bin"])
        .arg(beside_switch("allreduce_benchmark"))
        .arg("--bin")
        .arg(beside_switch("netagg-rdma-echo"))
        .args(["--vm0", vm0, "--vm1", vm1])
        .output()
        .expect("scripts/softroce-vms runs");
    let all =
        format!("{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), all)
}

/// A counter of the switch whose log lines start with `switch`, from the stats it prints
/// on exit: the number after `label` on the line that starts with `stats`.
fn switch_counter(all: &str, switch: &str, stats: &str, label: &str) -> u64 {
    all.lines()
        .filter(|line| line.strip_prefix(switch).is_some_and(|line| line.starts_with(stats)))
        .find_map(|line| line.split_once(&format!("{label} ")))
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or_else(|| panic!("no '{stats}' '{label}' of {switch}:\n{all}"))
}

/// How many datagrams the switch whose log lines start with `switch` received.
fn switch_datagrams(all: &str, switch: &str) -> u64 {
    switch_counter(all, switch, "stats: datagrams", "datagrams")
}

/// `scripts/softroce-allreduce`, the one command the README gives: int32 and float32,
/// dense and sparse, float16 dense and bfloat16 sparse, between the VMs.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn allreduces_over_rdma_between_two_vms_are_exact_dense_and_sparse() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/softroce-allreduce");
    let bin_dir = Path::new(SWITCH).parent().unwrap();
    let output = Command::new(script).arg("--bin-dir").arg(bin_dir).output().expect("the script runs");
    let all =
        format!("{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{all}");
    let runs = 6;
    for vm in ["vm0", "vm1"] {
        let verified = all.matches(&format!("[{vm}] Data verified successfully")).count();
        assert_eq!(verified, runs, "{vm}:\n{all}");
        // Every run of every rank on a queue pair of the Soft-RoCE device, nothing else.
        let on_rdma = all.matches(&format!("[{vm}] Transport: rdma: an RC queue pair on rxe0")).count();
        assert_eq!(on_rdma, runs, "{vm}:\n{all}");
        assert!(!all.contains(&format!("[{vm}] Transport: udp")), "{all}");
    }
    assert!(all.contains("[vm0] netagg-switch: control 10.77.0.1:50099 data 10.77.0.1:48864"), "{all}");
    assert!(all.contains("data path on RDMA"), "{all}");
    // Two threads per rank, two ranks, each run: each thread connected its own queue pair.
    assert_eq!(all.matches("worker thread connected").count(), 4 * runs, "{all}");
    assert!(switch_datagrams(&all, "[vm0] ") > 0, "{all}");
}

/// The same script with `--transport udp`: kernel UDP between the same VMs, whose
/// virtio NICs offload no checksums, so the kernel refuses segmentation offload (EIO)
/// and the sockets fall back to one datagram per send, still exact.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn kernel_udp_between_the_vms_does_without_segmentation_offload() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/softroce-allreduce");
    let bin_dir = Path::new(SWITCH).parent().unwrap();
    let output = Command::new(script)
        .arg("--bin-dir")
        .arg(bin_dir)
        .args(["--transport", "udp", "--dense-only", "--jobs", "2"])
        .output()
        .expect("the script runs");
    let all =
        format!("{}\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{all}");
    for vm in ["vm0", "vm1"] {
        assert_eq!(all.matches(&format!("[{vm}] Data verified successfully")).count(), 2, "{all}");
        assert_eq!(all.matches(&format!("[{vm}] Transport: udp: a kernel socket")).count(), 2, "{all}");
    }
    // quinn-udp's word that the kernel refused a GSO send, in the switch's log.
    assert!(all.contains("halting segmentation offload"), "{all}");
}

/// Both ranks with `poll = busy` (the other tests wait on completion channels), exact;
/// and first, a rank with `backend = udp`, which the RDMA switch refuses at
/// registration with a message naming both transports: a session mixes none; and an
/// RDMA connection that is not a netagg worker's (`netagg-rdma-echo`), which the
/// switch's listener refuses, saying why.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn busy_polling_ranks_are_exact_and_a_udp_rank_is_refused_by_an_rdma_switch() {
    let benchmark = |rank| {
        format!(
            "NETAGG_BACKEND_RDMA__POLL=busy {} allreduce_benchmark --tensor-numel 64Ki --tensor-type float32 \
             --density 0.1 --num-jobs 3 --num-warmup-jobs 1 --verify || exit 1",
            worker_environment(rank)
        )
    };
    let vm0 = format!(
        "{START_SWITCH}\n{}\nkill -INT $switch; wait $switch; status=$?; cat switch.log; exit $status",
        benchmark(0)
    );
    let udp_rank = worker_environment(1).replace("BACKEND=rdma", "BACKEND=udp");
    // The echo retries while refused; its first refusal with a reason is enough.
    let stranger =
        "timeout 20 netagg-rdma-echo send 10.77.0.1:48864 1 64 2>&1 | grep -m1 'not a netagg worker'";
    let vm1 = format!("{udp_rank} allreduce_benchmark --num-jobs 1 && exit 1\n{stranger}\n{}", benchmark(1));
    let (success, all) = softroce_vms(&vm0, &vm1);
    assert!(success, "{all}");
    assert!(
        all.contains("[vm1] allreduce_benchmark: ")
            && all.contains("this switch's data path speaks rdma; rank 1 registered a udp endpoint"),
        "{all}"
    );
    assert!(
        all.contains("[vm1] not yet: rdma_cm said RDMA_CM_EVENT_REJECTED")
            && all
                .contains("where RDMA_CM_EVENT_ESTABLISHED was awaited: not a netagg worker of this version"),
        "{all}"
    );
    for vm in ["vm0", "vm1"] {
        assert_eq!(all.matches(&format!("[{vm}] Data verified successfully")).count(), 1, "{all}");
        assert_eq!(
            all.matches(&format!("[{vm}] Transport: rdma: an RC queue pair on rxe0")).count(),
            1,
            "{all}"
        );
    }
}

/// One rank killed mid-job (`kill -KILL`): the other's job fails within its job timeout,
/// with an error, and the switch carries on.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn a_worker_killed_mid_job_fails_the_other_s_job_within_the_job_timeout() {
    let endless = "allreduce_benchmark --tensor-numel 64Ki --num-jobs 100000 --num-warmup-jobs 0";
    let vm0 = format!(
        "{START_SWITCH}\nstart=$(date +%s)\nNETAGG_GENERAL__JOB_TIMEOUT=5 {} {endless} && exit 1\n\
         printf '\\nrank 0 failed after %d s\\n' $(( $(date +%s) - start ))\nkill -INT $switch; \
         wait $switch; status=$?; cat switch.log\n{}\nexit $status",
        worker_environment(0),
        mark_ended(0)
    );
    // Rank 1 joins, runs jobs a few seconds, and dies without a word.
    let vm1 = format!(
        "{} {endless} & worker=$!\nsleep 8\nkill -KILL $worker\nprintf '\\nkilled rank 1\\n'\n{}",
        worker_environment(1),
        await_ended(0)
    );
    let (success, all) = softroce_vms(&vm0, &vm1);
    assert!(success, "{all}");
    assert!(all.contains("[vm1] killed rank 1"), "{all}");
    let seconds: u64 = all
        .lines()
        .find_map(|line| line.strip_prefix("[vm0] rank 0 failed after "))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("rank 0 did not fail:\n{all}"));
    // Started before rank 1, ran with it for 8 s, then at most the job timeout (5 s);
    // boot skew between the VMs is the rest.
    assert!(seconds < 60, "{seconds} s:\n{all}");
    assert!(all.contains("[vm0] allreduce_benchmark: "), "{all}");
}

/// The switch killed mid-job: both ranks' jobs fail within their job timeout.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn a_switch_killed_mid_job_fails_both_ranks_within_the_job_timeout() {
    let endless = "NETAGG_GENERAL__JOB_TIMEOUT=5 allreduce_benchmark --tensor-numel 64Ki --num-jobs 100000 \
                   --num-warmup-jobs 0";
    let rank = |rank| {
        format!(
            "start=$(date +%s)\n{} {endless} && exit 1\nprintf '\\nrank {rank} failed after %d s\\n' $(( $(date +%s) - start ))",
            worker_environment(rank)
        )
    };
    // The switch dies once both ranks have run jobs together for some seconds.
    let vm0 = format!(
        "{START_SWITCH}\n(while ! grep -q 'worker thread connected' switch.log; do sleep 1; done; sleep 10; \
         kill -KILL $switch; printf '\\nkilled the switch\\n') &\n{}\n{}",
        rank(0),
        await_ended(1)
    );
    let vm1 = format!("{}\n{}", rank(1), mark_ended(1));
    let (success, all) = softroce_vms(&vm0, &vm1);
    assert!(success, "{all}");
    assert!(all.contains("[vm0] killed the switch"), "{all}");
    for (vm, rank) in [("vm0", 0), ("vm1", 1)] {
        let seconds: u64 = all
            .lines()
            .find_map(|line| line.strip_prefix(&format!("[{vm}] rank {rank} failed after ")))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("rank {rank} did not fail:\n{all}"));
        // Jobs for 10 s with the other rank, then at most the job timeout (5 s); boot
        // skew between the VMs is the rest.
        assert!(seconds < 60, "rank {rank}: {seconds} s:\n{all}");
        assert!(all.contains(&format!("[{vm}] allreduce_benchmark: ")), "{all}");
    }
}

/// One worker thread's queue pair at the switch fails mid-job (`sever_after` of the
/// switch's faults moves the one that brought its 1500th datagram to the error state, as
/// a failing device would), while every rank's control connection stays open: the switch
/// closes the session at once, and both ranks' jobs fail within a few seconds (on a
/// quiet machine, the same second), far within their job timeout (60 s), with the cause.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn a_failed_data_connection_fails_every_rank_s_job_at_once_with_the_cause() {
    let endless = "NETAGG_GENERAL__JOB_TIMEOUT=60 allreduce_benchmark --tensor-numel 64Ki --num-jobs 100000 \
                   --num-warmup-jobs 0";
    let rank = |rank| {
        format!(
            "{} {endless} && exit 1\nprintf '\\nrank {rank} failed at %d\\n' $(date +%s)",
            worker_environment(rank)
        )
    };
    let switch = START_SWITCH.replace("--log-level debug", "--log-level debug --faults sever_after=1500");
    // The switch's clock is vm0's: when it saw the connection fail, to a fifth of a second.
    let watch =
        "(for i in $(seq 1500); do grep -q \"worker thread's connection failed\" switch.log && break; \
                 sleep 0.2; done; printf '\\nsevered at %d\\n' $(date +%s)) & watcher=$!";
    let vm0 = format!(
        "{switch}\n{watch}\n{}\nwait $watcher\nkill -INT $switch; wait $switch; status=$?; cat switch.log; exit $status",
        rank(0)
    );
    let (success, all) = softroce_vms(&vm0, &rank(1));
    assert!(success, "{all}");
    let time = |prefix: &str| -> u64 {
        all.lines()
            .find_map(|line| line.strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no '{prefix}':\n{all}"))
    };
    let severed = time("[vm0] severed at ");
    // Rank 0 shares vm0's clock with the switch; rank 1's is vm1's, set from the same
    // host clock at boot.
    for (vm, rank, bound) in [("vm0", 0, 5), ("vm1", 1, 10)] {
        let failed = time(&format!("[{vm}] rank {rank} failed at "));
        assert!(
            failed.abs_diff(severed) <= bound,
            "rank {rank}: failed at {failed}, severed at {severed}:\n{all}"
        );
        assert!(all.contains(&format!("[{vm}] allreduce_benchmark: ")), "{all}");
    }
    // The switch closes the session's other connections too; a job whose connection ends
    // so reports the switch's reason, which names the failed connection and its cause
    // (the queue pair's requests flushed, every one back).
    let reason = "failed: session lost: session 'default' is closed: rank ";
    assert!(all.contains(reason), "{all}");
    assert!(all.contains("'s data connection to the switch failed, worker thread "), "{all}");
    assert!(all.contains("an RDMA completion failed: Work Request Flushed Error; "), "{all}");
    // Receives that completed whole before the flush are delivered, not flushed: how many
    // depends on timing, so only the flushed ones' status is fixed.
    assert!(all.contains("512 receives came back ("), "{all}");
    assert!(all.contains(" Work Request Flushed Error), "), "{all}");
    assert!(all.contains("every request posted"), "{all}");
}

/// A session sharded over two switches (two `netagg-switch --transport rdma` in vm0, on
/// ports of their own), a rank of three threads in each VM: each worker thread holds a
/// queue pair to each switch and sends each slot's packets to the one owning it. int32
/// exact and float32 within the benchmark's bound, dense and sparse, with 1 % of the
/// datagrams each rank and each switch sends dropped (`[faults]`), which the protocol
/// core's retransmissions recover. Each switch drops packets of slots not its own session's token, so a verified
/// sum was routed right.
#[test]
#[ignore = "needs root and boots QEMU VMs: scripts/test runs it in its own stage"]
fn a_session_sharded_over_two_rdma_switches_is_exact_dense_and_sparse_with_loss() {
    let switch = |index: usize| {
        format!(
            "netagg-switch --transport rdma --control 10.77.0.1:{} --data 10.77.0.1:{} \
             --faults send_drop=0.01,seed={index} --log-level debug > switch{index}.log 2>&1 & switch{index}=$!",
            50099 + index,
            48864 + index
        )
    };
    let runs = [("int32", "1"), ("float32", "1"), ("int32", "0.1"), ("float32", "0.1")];
    // Three threads per rank: the middle one's slots straddle the two switches, so its
    // datagrams alternate between its queue pairs.
    const THREADS: usize = 3;
    let rank = |rank: usize| {
        let environment = format!(
            "{} NETAGG_GENERAL__SWITCHES=10.77.0.1:50099,10.77.0.1:50100 NETAGG_FAULTS__SEND_DROP=0.01 \
             NETAGG_FAULTS__SEED={} NETAGG_GENERAL__NUM_WORKER_THREADS={THREADS}",
            worker_environment(rank),
            rank + 7
        );
        // A session of its own for each run: a rank that finishes first registers for the
        // next while the loaded switches may not yet have closed the last.
        let benchmarks: Vec<String> = runs
            .iter()
            .enumerate()
            .map(|(run, (tensor_type, density))| {
                format!(
                    "{environment} NETAGG_GENERAL__SESSION=run{run} allreduce_benchmark --tensor-numel 32Ki \
                     --tensor-type {tensor_type} --density {density} --num-jobs 2 --num-warmup-jobs 1 --verify \
                     || return 1"
                )
            })
            .collect();
        format!("runs() {{\n{}\n}}\nruns", benchmarks.join("\n"))
    };
    // The switches' logs, each line naming its switch, whatever the rank's outcome.
    let vm0 = format!(
        "{}\n{}\n{}\nranks=$?\nkill -INT $switch0 $switch1\nwait $switch0; first=$?\nwait $switch1; second=$?\n\
         sed 's/^/switch0: /' switch0.log\nsed 's/^/switch1: /' switch1.log\nexit $((ranks | first | second))",
        switch(0),
        switch(1),
        rank(0)
    );
    let (success, all) = softroce_vms(&vm0, &rank(1));
    assert!(success, "{all}");
    for vm in ["vm0", "vm1"] {
        let verified = all.matches(&format!("[{vm}] Data verified successfully")).count();
        assert_eq!(verified, runs.len(), "{vm}:\n{all}");
        let transport = format!("[{vm}] Transport: rdma: 2 RC queue pairs (one per switch) on rxe0");
        assert_eq!(all.matches(&transport).count(), runs.len(), "{vm}:\n{all}");
    }
    for switch in ["[vm0] switch0: ", "[vm0] switch1: "] {
        // Every thread of every rank connected to both switches, in every run.
        let connected = all
            .lines()
            .filter(|line| line.starts_with(switch) && line.contains("worker thread connected"))
            .count();
        assert_eq!(connected, 2 * THREADS * runs.len(), "{switch}:\n{all}");
        assert!(switch_datagrams(&all, switch) > 0, "{all}");
        assert!(switch_counter(&all, switch, "stats: faults injected", "send dropped") > 0, "{all}");
    }
}
