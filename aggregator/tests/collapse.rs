//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows. The
//! issue's target, 1.5 times, is met by most later dense jobs, not by every case, and by
//! no sparse case.

mod support;

use support::collapse::Case;

/// The median of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Every case's jobs end exact, on two seeds of the links' losses. Bounds, against the
/// largest ratio measured on four seeds (`examples/collapse_matrix.rs`, once a measured
/// pacer spreads the timers that backed off together, issue 31 item 4): dense, first jobs
/// within 15 times the time the busiest link allows (measured up to 10.2, with 1 % loss at
/// 10 Mbit/s behind 1 KB; 11.9 before the spread), 3 behind an 8 KB bucket (1.83; 4.4
/// before), later ones within 5 (3.79; 2.54 before), 2.5 behind a bucket (2.00; 1.89
/// before), their median within 1.45 (1.35 on the test's seeds; 1.25 before); sparse,
/// every job behind a bucket within 4.5 (3.24; 5.1 before), first jobs behind 2 KB queues
/// within 20 (12.0; 8.3 before) and behind 1 KB ones within 30 (19.0; 59.6 before), later
/// jobs within 25 (17.1; 32.6 before) and 70 (52.7; 69.4 before). Sparse jobs behind 1 KB
/// queues lose their results on the way down, which their workers' rates do not see.
#[test]
fn windows_far_above_tiny_queues_converge_instead_of_collapsing() {
    let mut dense_later = Vec::new();
    for case in [false, true].into_iter().flat_map(Case::all) {
        for seed in [0, 1] {
            for (job, (_, ratio)) in case.run(seed, 3).into_iter().enumerate() {
                if !case.sparse && job > 0 {
                    dense_later.push(ratio);
                }
                let bucket = case.limit.burst_bytes > 0;
                let bound = match (case.sparse, bucket, case.limit.queue_bytes, job) {
                    (false, true, _, 0) => 3.0,
                    (false, false, _, 0) => 15.0,
                    (false, true, _, _) => 2.5,
                    (false, false, _, _) => 5.0,
                    (true, true, _, _) => 4.5,
                    (true, false, 2000, 0) => 20.0,
                    (true, false, _, 0) => 30.0,
                    (true, false, 2000, _) => 25.0,
                    (true, false, _, _) => 70.0,
                };
                assert!(ratio < bound, "{}, seed {seed}, job {job}: {ratio:.2} of the model", case.name());
            }
        }
    }
    let median = median(dense_later);
    assert!(median < 1.45, "dense later jobs: median {median:.2} of the model");
}
