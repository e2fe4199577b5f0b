//! What the host provides: Debian's packages (installed when missing) and the version of
//! Debian's current stock kernel.

use std::process::{Command, Stdio};

use crate::process::{self, stdout_of};
use crate::{say, Error};

/// Debian packages the host needs: QEMU, the initramfs's contents and the tools to build it.
pub const PACKAGES: [&str; 11] = [
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "xz-utils",
    "iproute2",
    "libibverbs1",
    "librdmacm1",
    "ibverbs-providers",
    "ibverbs-utils",
    "rdmacm-utils",
];

/// A command run as root: directly when the runner is root, else through sudo.
pub fn as_root(program: &str) -> Command {
    if rustix::process::geteuid().is_root() {
        Command::new(program)
    } else {
        let mut command = Command::new("sudo");
        command.arg(program);
        command
    }
}

/// Installs the [`PACKAGES`] that are not installed.
pub fn install_packages() -> Result<(), Error> {
    let mut query = Command::new("dpkg-query");
    // dpkg-query fails when it knows a package not at all, and lists only the others.
    query.args(["-W", "--showformat=${Package} ${Status}\n"]).args(PACKAGES).stderr(Stdio::null());
    let listing =
        query.output().map_err(|source| Error::Spawn { command: process::describe(&query), source })?;
    let missing = missing_packages(&String::from_utf8_lossy(&listing.stdout), &PACKAGES);
    if missing.is_empty() {
        return Ok(());
    }
    say(format_args!("installing {}", missing.join(" ")));
    // On machines that have a newer qemu-utils from backports, installing Debian 12's
    // qemu-system-x86 (7.2) makes apt remove that qemu-utils; acceptable, as nothing here
    // uses qemu-img. `apt-get download` later also needs the package lists this fetches.
    process::run(as_root("apt-get").args(["update", "-q"]))?;
    process::run(
        as_root("env")
            .args([
                "DEBIAN_FRONTEND=noninteractive",
                "apt-get",
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
            ])
            .args(&missing),
    )
}

/// The packages of `wanted` that a `dpkg-query -f '${Package} ${Status}\n'` listing does
/// not show as installed.
fn missing_packages<'a>(listing: &str, wanted: &[&'a str]) -> Vec<&'a str> {
    let installed = |package: &str| {
        listing.lines().any(|line| {
            line.split_once(' ')
                .is_some_and(|(name, status)| name == package && status == "install ok installed")
        })
    };
    wanted.iter().copied().filter(|package| !installed(package)).collect()
}

/// The version of Debian's current stock kernel, e.g. 6.1.0-56-amd64, as named by the
/// linux-image-amd64 metapackage; fetches the package lists once if they are missing.
pub fn kernel_version() -> Result<String, Error> {
    let depends =
        || stdout_of(Command::new("apt-cache").args(["depends", "linux-image-amd64"]).stderr(Stdio::null()));
    if let Some(version) = depends().ok().as_deref().and_then(kernel_in_depends) {
        return Ok(version.to_string());
    }
    process::run(as_root("apt-get").args(["update", "-q"]).stdout(std::io::stderr()))?;
    kernel_in_depends(&depends()?).map(str::to_string).ok_or(Error::NoKernelPackage)
}

/// The kernel version in `apt-cache depends linux-image-amd64`'s first
/// `Depends: linux-image-<version>` line.
fn kernel_in_depends(listing: &str) -> Option<&str> {
    listing.lines().find_map(|line| line.trim_start().strip_prefix("Depends: linux-image-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packages_not_installed_or_not_known_are_missing() {
        let listing = "qemu-system-x86 install ok installed\ncpio deinstall ok config-files\n\
                       kmod install ok installed\n";
        assert_eq!(
            missing_packages(listing, &["qemu-system-x86", "cpio", "kmod", "xz-utils"]),
            ["cpio", "xz-utils"]
        );
        assert_eq!(missing_packages("", &["kmod"]), ["kmod"]);
    }

    #[test]
    fn the_kernel_version_is_the_metapackages_first_dependency() {
        let listing = "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n  Depends: linux-image-6.1.0-55-amd64\n";
        assert_eq!(kernel_in_depends(listing), Some("6.1.0-56-amd64"));
        assert_eq!(kernel_in_depends("linux-image-amd64\n  Recommends: firmware\n"), None);
    }
}
