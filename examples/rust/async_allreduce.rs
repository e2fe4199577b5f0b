//! Several allreduces at once under tokio: every rank submits four int32 tensors of
//! different sizes, awaits them in tasks of their own, and checks each sum as it arrives.
//!
//! `netagg-run -n 2 -- target/release/examples/async_allreduce`
//!
//! A job handle is a `Future`, woken by the worker thread that ends the job, so it works
//! under any executor; the library depends on none. Jobs must be submitted in the same
//! order on every rank (that order numbers them); they may be awaited in any order.

use std::process::ExitCode;

use tokio::task::JoinSet;

/// What rank `rank` holds at element `i` of tensor `tensor`.
fn value(rank: u16, tensor: usize, i: usize) -> i32 {
    (i % 1000) as i32 * (tensor as i32 + 1) + i32::from(rank)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("async_allreduce: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let config = netagg::Config::load(None)?;
    let (rank, workers) = (config.general.rank, config.general.num_workers);
    println!("Starting the context: waiting for {workers} workers");
    // Starting waits for every rank to register: off the executor's threads.
    let context = tokio::task::spawn_blocking(move || netagg::Context::start(config)).await??;

    let sizes = [1 << 16, 1000, 1 << 18, 5];
    let mut tasks = JoinSet::new();
    for (tensor, &numel) in sizes.iter().enumerate() {
        let data: Vec<i32> = (0..numel).map(|i| value(rank, tensor, i)).collect();
        // Submitting returns at once; the worker threads run the jobs in the background.
        let job = context.allreduce_async(data)?;
        tasks.spawn(async move { (tensor, job.await) });
    }
    while let Some(finished) = tasks.join_next().await {
        let (tensor, sums) = finished?;
        let sums = sums?;
        for (i, &sum) in sums.iter().enumerate() {
            let expected: i32 = (0..workers).map(|r| value(r, tensor, i)).sum();
            if sum != expected {
                return Err(format!("tensor {tensor}, element {i}: {sum} instead of {expected}").into());
            }
        }
        println!("Tensor {tensor}: {} sums verified", sums.len());
    }
    let stats = tokio::task::spawn_blocking(move || context.stop()).await?;
    print!("{stats}");
    println!("All {} tensors summed concurrently and verified", sizes.len());
    Ok(())
}
