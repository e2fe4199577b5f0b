//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows. The
//! issue's target, 1.5 times, is met by most later dense jobs, not by every case, and by
//! no sparse case behind a 1 KB queue.

mod support;

use support::collapse::Case;

/// The median of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Every case's jobs end exact, on two seeds of the links' losses. Bounds, against the
/// largest ratio measured on four seeds (`examples/collapse_matrix.rs`, with the pacer
/// that follows the delivery rate, issue 31 item 4): dense, first jobs within 25 times
/// the time the busiest link allows (measured up to 12.2, with 1 % loss at 10 Mbit/s),
/// later ones within 4.5 (2.94), their median within 1.6 (1.42 on the test's seeds);
/// behind an 8 KB bucket and a 2 KB queue, which the standing delay paces as before,
/// first jobs within 45 (22.2), later ones within 60 (30.6) at 10 Mbit/s and 10 (6.6)
/// at 2; sparse, every job behind a bucket
/// within 8 (3.4), later jobs behind 2 KB queues within 45 (22.7) and behind 1 KB ones
/// within 90 (53.2). Sparse jobs behind 1 KB queues lose their results on the way down:
/// first jobs take up to 170 times the model, unbounded here.
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
                    (false, true, 2000, 0) => 45.0,
                    (false, _, _, 0) => 25.0,
                    (false, true, 2000, _) if case.limit.bits_per_second > 2_000_000 => 60.0,
                    (false, true, _, _) => 10.0,
                    (false, false, _, _) => 4.5,
                    (true, true, _, _) => 8.0,
                    (true, false, 2000, 1 | 2) => 45.0,
                    (true, false, _, 1 | 2) => 90.0,
                    _ => f64::INFINITY,
                };
                assert!(ratio < bound, "{}, seed {seed}, job {job}: {ratio:.2} of the model", case.name());
            }
        }
    }
    let median = median(dense_later);
    assert!(median < 1.6, "dense later jobs: median {median:.2} of the model");
}
