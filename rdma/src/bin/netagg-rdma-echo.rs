//! `netagg-rdma-echo`: the RDMA crate's connections end to end, for tests between two
//! hosts or VMs. `netagg-rdma-echo serve ADDRESS:PORT` accepts one connection and sends
//! every message back until the peer leaves; `netagg-rdma-echo send ADDRESS:PORT COUNT
//! SIZE` connects (retrying for 60 s, as the peer may still be starting), sends COUNT
//! messages of SIZE bytes, a window of 16 at a time, and checks every echo byte for byte.
//! `netagg-rdma-echo overflow ADDRESS:PORT` connects likewise, has one message echoed,
//! then sends one longer than the server's buffers, which fails the connection on both
//! sides, as a peer's bug would; both print how every request they had posted came back.
//! The server sleeps on its completion channel ([`Wait::Event`]), the sender busy-polls
//! ([`Wait::Busy`]) and writes its messages straight into the registered send buffers,
//! so that one run exercises both waits and both ways of sending.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use netagg_rdma::{Connection, Listener, Options, Wait};

const SLOT_SIZE: usize = 4096;
const WINDOW: usize = 16;

fn options(wait: Wait) -> Options {
    Options { depth: 2 * WINDOW, message_size: SLOT_SIZE, wait }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve", address] => serve(address),
        ["send", address, count, size] => send(address, count, size),
        ["overflow", address] => overflow(address),
        _ => Err("usage: netagg-rdma-echo serve ADDRESS:PORT | send ADDRESS:PORT COUNT SIZE \
                  | overflow ADDRESS:PORT"
            .into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("netagg-rdma-echo: {error}");
            ExitCode::FAILURE
        }
    }
}

fn serve(address: &str) -> Result<(), String> {
    let address: SocketAddr = address.parse().map_err(|e| format!("{address}: {e}"))?;
    let listener = Listener::bind(address).map_err(|e| e.to_string())?;
    let (mut connection, private) =
        listener.accept(Duration::from_secs(120), options(Wait::Event)).map_err(|e| e.to_string())?;
    println!("accepted a connection, private data {:?}", String::from_utf8_lossy(&private));
    let mut echoed = 0u64;
    loop {
        let mut messages = Vec::new();
        match connection.recv(Duration::from_secs(5), &mut |message| messages.push(message.to_vec())) {
            Ok(0) => break,
            Ok(_) => {}
            // The peer leaving flushes the queue pair.
            Err(error) => {
                println!("connection ended: {error}");
                break;
            }
        }
        for message in messages {
            connection.send(&message, Duration::from_secs(10)).map_err(|e| e.to_string())?;
            echoed += 1;
        }
    }
    println!("echoed {echoed} messages");
    Ok(())
}

fn send(address: &str, count: &str, size: &str) -> Result<(), String> {
    let address: SocketAddr = address.parse().map_err(|e| format!("{address}: {e}"))?;
    let count: u64 = count.parse().map_err(|e| format!("{count}: {e}"))?;
    let size: usize = size.parse().map_err(|e| format!("{size}: {e}"))?;
    if !(8..=SLOT_SIZE).contains(&size) {
        return Err(format!("SIZE {size}: from 8 to {SLOT_SIZE}"));
    }
    let mut connection = connect(address, options(Wait::Busy))?;
    let message = |sequence: u64| {
        let mut bytes = vec![0u8; size];
        bytes[..8].copy_from_slice(&sequence.to_le_bytes());
        for (index, byte) in bytes[8..].iter_mut().enumerate() {
            *byte = (sequence as usize).wrapping_add(index) as u8;
        }
        bytes
    };
    let started = Instant::now();
    let (mut sent, mut received) = (0u64, 0u64);
    while received < count {
        while sent < count && sent - received < WINDOW as u64 {
            let buffer = connection.send_buffer(Duration::from_secs(10)).map_err(|e| e.to_string())?;
            buffer[..size].copy_from_slice(&message(sent));
            connection.queue(size).map_err(|e| e.to_string())?;
            sent += 1;
        }
        connection.flush().map_err(|e| e.to_string())?;
        let mut wrong = None;
        let got = connection
            .recv(Duration::from_secs(10), &mut |echo| {
                if echo != message(received).as_slice() {
                    wrong = Some(received);
                }
                received += 1;
            })
            .map_err(|e| e.to_string())?;
        if let Some(sequence) = wrong {
            return Err(format!("echo {sequence} differs from what was sent"));
        }
        if got == 0 {
            return Err(format!("no echo within 10 s after {received} of {count}"));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{count} messages of {size} bytes echoed and checked in {seconds:.2} s ({:.1} MB/s each way)",
        (count as f64 * size as f64) / seconds / 1e6
    );
    Ok(())
}

/// Connects to the server at `address`, retrying for 60 s while it starts.
fn connect(address: SocketAddr, options: Options) -> Result<Connection, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Connection::connect(address, None, b"netagg-rdma-echo", Duration::from_secs(5), options) {
            Ok(connection) => return Ok(connection),
            Err(error) if Instant::now() < deadline => {
                eprintln!("not yet: {error}");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// Has one message echoed, then sends one a byte longer than the server's buffers (its
/// own are twice as long): the server's receive fails, and with it both queue pairs.
fn overflow(address: &str) -> Result<(), String> {
    let address: SocketAddr = address.parse().map_err(|e| format!("{address}: {e}"))?;
    let long = Options { message_size: 2 * SLOT_SIZE, ..options(Wait::Busy) };
    let mut connection = connect(address, long)?;
    connection.send(&[7; 64], Duration::from_secs(10)).map_err(|e| e.to_string())?;
    let mut echoed = 0;
    connection.recv(Duration::from_secs(10), &mut |_| echoed += 1).map_err(|e| e.to_string())?;
    if echoed != 1 {
        return Err(format!("{echoed} echoes of one message within 10 s"));
    }
    connection.send(&[7; SLOT_SIZE + 1], Duration::from_secs(10)).map_err(|e| e.to_string())?;
    match connection.recv(Duration::from_secs(10), &mut |_| {}) {
        Err(error) => {
            println!("the overlong message ended the connection: {error}");
            Ok(())
        }
        Ok(count) => Err(format!("the overlong message did not end the connection ({count} received)")),
    }
}
