//! Gives libnetagg.so a soname, so that programs linked against it load only an
//! ABI-compatible version: libnetagg.so.<major>, or libnetagg.so.0.<minor> while the
//! major version is 0 (when every minor version may change the ABI). `scripts/install`
//! reads it from the library and makes the usual links.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets the version");
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").expect("cargo sets the version");
    let abi = if major == "0" { format!("0.{minor}") } else { major };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnetagg.so.{abi}");
}
