//! What the tests that build C and C++ programs against libnetagg share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`, where cargo put libnetagg.so and the binaries.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>-<hash>
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Whether these tests were built with `--release`.
pub fn is_release() -> bool {
    target_dir().file_name().is_some_and(|profile| profile == "release")
}

/// Runs `command` and returns its stdout and stderr; fails the test, showing both, if it
/// did not succeed.
pub fn run(command: &mut Command) -> (String, String) {
    let output = command.output().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{command:?}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", output.status);
    (stdout, stderr)
}

/// Runs `cargo build` of this package with `args`, in the profile of these tests.
pub fn cargo_build(args: &[&str]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(["build", "--quiet", "-p", "netagg"]).args(args);
    if is_release() {
        command.arg("--release");
    }
    run(command.current_dir(crate_dir()));
}

/// Builds libnetagg.so and .a as they are now: `cargo test` builds only the rlib its tests
/// link, so without this a C program would link a stale library.
pub fn build_c_library() {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        cargo_build(&["--lib"]);
        // Programs linked against libnetagg.so load it by its soname, as from an
        // installed tree: the link lets them run from the target directory.
        let library = target_dir().join("libnetagg.so");
        let soname = soname(&library);
        let link = target_dir().join(&soname);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libnetagg.so", &link).unwrap();
    });
}

/// The soname a shared library was linked with (`objdump -p`, as scripts/install reads it).
pub fn soname(library: &Path) -> String {
    let output = Command::new("objdump").arg("-p").arg(library).output().expect("objdump runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.trim().strip_prefix("SONAME").map(|name| name.trim().to_string()))
        .unwrap_or_else(|| panic!("{} has no soname", library.display()))
}

pub fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory of this test's own.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("netagg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles C sources (relative to the crate) against include/ and libnetagg.so with
/// every warning an error and the sanitizers on; returns the program.
pub fn compile_c(work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    compile("cc", &["-std=c11"], work, name, sources)
}

/// As [`compile_c`], for C++.
pub fn compile_cpp(work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    compile("c++", &["-std=c++17"], work, name, sources)
}

fn compile(compiler: &str, standard: &[&str], work: &Path, name: &str, sources: &[&str]) -> PathBuf {
    build_c_library();
    let program = work.join(name);
    let lib = target_dir();
    let output = Command::new(compiler)
        .args(standard)
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-g", "-pthread"])
        .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .args(sources.iter().map(|s| crate_dir().join(s)))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lnetagg", "-lm", "-o"])
        .arg(&program)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}"));
    assert!(
        output.status.success(),
        "{compiler} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    program
}
