//! netagg's hello world in Rust: every rank sums an int32 tensor (in place) and a float32
//! tensor (asynchronously) with every other rank, and checks the sums.
//!
//! `netagg-run -n 2 -- target/release/examples/hello_world`

use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("hello_world: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let config = netagg::Config::load(None)?;
    let workers = config.general.num_workers;
    println!("Starting the context: waiting for {workers} workers");
    let context = netagg::Context::start(config)?;

    let numel = 1 << 16;
    let floats: Vec<f32> = (0..numel).map(|i| (i % 100) as f32 * 0.5).collect();
    let float_job = context.allreduce_async(floats)?;
    let mut integers: Vec<i32> = (0..numel).map(|i| (i % 1000) as i32 - 500).collect();
    context.allreduce(&mut integers)?;
    let float_sums = float_job.wait()?;

    for i in 0..numel {
        let expected = workers as i32 * ((i % 1000) as i32 - 500);
        if integers[i] != expected {
            return Err(format!("int32 element {i}: {} instead of {expected}", integers[i]).into());
        }
        let expected = workers as f32 * ((i % 100) as f32 * 0.5);
        if float_sums[i] != expected {
            return Err(format!("float32 element {i}: {} instead of {expected}", float_sums[i]).into());
        }
    }
    let stats = context.stop();
    print!("{stats}");
    println!("All {numel} int32 and {numel} float32 sums verified");
    Ok(())
}
