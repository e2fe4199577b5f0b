//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows. The
//! issue's target, 1.5 times, is met by most later dense jobs, not by every case.

mod support;

use support::collapse::Case;

/// The median of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Every case's jobs end exact, on two seeds of the links' losses. Bounds, against the
/// largest ratio measured on four seeds (`examples/collapse_matrix.rs`; before the probe
/// paced by delivery, issue 31 item 4, later dense jobs reached 157 times the model):
/// dense, every first job within 125 times the time the busiest link allows (measured up
/// to 61: with 1 % loss, a probe's seed from a burst's few results is no capacity, and
/// random loss ends probes below the path), second jobs within 30 (15), third jobs
/// within 12 (10.2), the later jobs' median within 2.5 (1.8); behind an 8 KB bucket and
/// a 2 KB queue at 10 Mbit/s every job takes 22 to 31, with or without this pacer's
/// seed rule (every later job there within 60); sparse, every third job within 30 (16),
/// the later jobs behind 2 KB queues within 25 (22), every job behind a bucket within 8
/// (3.4). Sparse first jobs behind 1 KB queues still take up to 156 times the model:
/// their losses are mostly results on the way down, which no first sending's run shows.
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
                    (false, _, _, 0) => 125.0,
                    (false, true, 2000, _) => 60.0,
                    (false, _, _, 1) => 30.0,
                    (false, _, _, _) => 12.0,
                    (true, true, _, _) => 8.0,
                    (true, _, 2000, 1 | 2) => 25.0,
                    (true, _, _, 2) => 30.0,
                    _ => f64::INFINITY,
                };
                assert!(ratio < bound, "{}, seed {seed}, job {job}: {ratio:.2} of the model", case.name());
            }
        }
    }
    let median = median(dense_later);
    assert!(median < 2.5, "dense later jobs: median {median:.2} of the model");
}
