//! Compiles the C shim over DPDK 22.11 with every flag `pkg-config --cflags libdpdk` gives
//! (DPDK's headers need its `-include rte_config.h` and `-march`), and links DPDK's
//! libraries as pkg-config lists them.

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.c");
    let dpdk = match pkg_config::Config::new().atleast_version("22.11").probe("libdpdk") {
        Ok(library) => library,
        Err(error) => {
            eprintln!(
                "netagg-dpdk needs DPDK 22.11 or later with its pkg-config file (Debian 12: \
                 apt-get install libdpdk-dev pkg-config; scripts/install-deps does it): {error}"
            );
            std::process::exit(1);
        }
    };
    let mut build = cc::Build::new();
    build.file("shim/shim.c").warnings(true).extra_warnings(true).flag_if_supported("-Wno-unused-parameter");
    for path in &dpdk.include_paths {
        build.include(path);
    }
    // The flags that are not include paths: `-include rte_config.h`, `-march=...`.
    let cflags = std::process::Command::new("pkg-config")
        .args(["--cflags-only-other", "libdpdk"])
        .output()
        .expect("pkg-config ran a moment ago");
    for flag in String::from_utf8_lossy(&cflags.stdout).split_whitespace() {
        build.flag(flag);
    }
    build.compile("netagg_dpdk_shim");
}
