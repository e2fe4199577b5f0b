//! External programs (apt, dpkg, depmod, cpio, xz, QEMU ...): started so that a failure
//! names the command line that failed.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::Error;

/// A command line as a person would type it, for messages.
pub fn describe(command: &Command) -> String {
    let mut words = vec![command.get_program().to_string_lossy().into_owned()];
    words.extend(command.get_args().map(|arg| arg.to_string_lossy().into_owned()));
    words.join(" ")
}

/// Runs a command to its end, its output going where the runner's goes.
pub fn run(command: &mut Command) -> Result<(), Error> {
    let status = command.status().map_err(|source| Error::Spawn { command: describe(command), source })?;
    if !status.success() {
        return Err(Error::Failed { command: describe(command), status });
    }
    Ok(())
}

/// Runs a command to its end and returns what it printed on its standard output.
pub fn stdout_of(command: &mut Command) -> Result<String, Error> {
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| Error::Spawn { command: describe(command), source })?;
    if !output.status.success() {
        return Err(Error::Failed { command: describe(command), status: output.status });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `first | second`, feeding `input` to `first` and `second`'s output to `output`;
/// fails if either fails.
pub fn pipe(
    first: &mut Command,
    second: &mut Command,
    input: &[u8],
    output: impl Into<Stdio>,
) -> Result<(), Error> {
    let spawn_error = |command: &Command| {
        let command = describe(command);
        move |source| Error::Spawn { command, source }
    };
    let mut upstream =
        first.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().map_err(spawn_error(first))?;
    // Both ends belong to the children now: dropping ours lets each see the other's end.
    let between = upstream.stdout.take().expect("stdout was piped");
    let downstream = second.stdin(between).stdout(output).spawn();
    let mut stdin = upstream.stdin.take().expect("stdin was piped");
    // A first command that stops reading early fails on its own; its status says so.
    let _ = stdin.write_all(input);
    drop(stdin);
    let upstream_status = upstream.wait().map_err(spawn_error(first))?;
    let downstream_status = downstream.and_then(|mut child| child.wait()).map_err(spawn_error(second))?;
    for (command, status) in [(&*first, upstream_status), (&*second, downstream_status)] {
        if !status.success() {
            return Err(Error::Failed { command: describe(command), status });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    #[test]
    fn a_pipe_carries_the_input_through_both_commands_into_the_file() {
        let folder = tempfile::tempdir().unwrap();
        let path = folder.path().join("out");
        let file = File::create(&path).unwrap();
        pipe(&mut Command::new("tr"), &mut Command::new("sort"), b"b\na\n", file).unwrap_err();
        let file = File::create(&path).unwrap();
        pipe(Command::new("tr").args(["a-z", "A-Z"]), &mut Command::new("sort"), b"b\na\n", file).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "A\nB\n");
    }

    #[test]
    fn a_failing_command_is_named_with_its_arguments() {
        let error = run(Command::new("sh").args(["-c", "exit 3"])).unwrap_err();
        assert_eq!(error.to_string(), "sh -c exit 3 failed (exit status: 3)");
        let error = stdout_of(&mut Command::new("/nonexistent/program")).unwrap_err();
        assert!(error.to_string().starts_with("could not start /nonexistent/program: "), "{error}");
    }
}
