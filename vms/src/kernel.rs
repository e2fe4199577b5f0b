//! Debian's stock kernel, unpacked once per version into what the VMs boot: the
//! uncompressed vmlinux and the few modules they load, with their dependencies.

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::process::{self, stdout_of};
use crate::{at, Error};

/// The modules each VM loads, in this order; their dependencies come from modules.dep.
/// crc32_pclmul and crc32_generic first because rdma_rxe asks the crypto API for crc32
/// (its ICRC), and loading one up front avoids depending on the kernel's request_module.
pub const MODULES: [&str; 9] = [
    "virtio_pci",
    "virtio_net",
    "crc32_pclmul",
    "crc32_generic",
    "rdma_rxe",
    "ib_uverbs",
    "rdma_ucm",
    "9pnet_virtio",
    "9p",
];

/// Folders of the kernel's module tree holding the wanted modules and everything they
/// need in Debian 12's kernels. Extracting only these keeps the 400 MB tree off the disk;
/// [`build`] checks that no wanted module needs one from anywhere else.
const MODULE_FOLDERS: [&str; 15] = [
    "drivers/virtio",
    "drivers/net/*.ko",
    "net/core",
    "net/ipv4/*.ko",
    "net/ipv6/*.ko",
    "drivers/infiniband/core",
    "drivers/infiniband/sw/rxe",
    "net/9p",
    "fs/9p",
    "fs/netfs",
    "fs/fscache",
    "fs/configfs",
    "crypto/*.ko",
    "arch/x86/crypto",
    "lib/*.ko",
];

/// The start of every XZ stream.
const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";

/// One kernel version's folder in the work folder: vmlinuz, vmlinux and
/// lib/modules/<version> with the wanted modules, their dependencies and modules.dep.
pub struct Kernel {
    pub version: String,
    pub folder: PathBuf,
    debs: PathBuf,
}

impl Kernel {
    pub fn new(work: &Path, version: &str) -> Self {
        Kernel {
            version: version.to_string(),
            folder: work.join(format!("kernel-{version}")),
            debs: work.join("debs"),
        }
    }

    /// The kernel the VMs boot; it exists once the folder is complete.
    pub fn vmlinux(&self) -> PathBuf {
        self.folder.join("vmlinux")
    }

    /// The kernel's package, once downloaded into the work folder.
    pub fn deb(&self) -> Option<PathBuf> {
        let prefix = format!("linux-image-{}_", self.version);
        fs::read_dir(&self.debs).ok()?.flatten().map(|entry| entry.path()).find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(&prefix) && name.ends_with(".deb"))
        })
    }

    /// Downloads the kernel's package into the work folder.
    pub fn download(&self) -> Result<PathBuf, Error> {
        fs::create_dir_all(&self.debs).map_err(at(&self.debs))?;
        // As root, apt hands downloads to its sandbox user, who may not be allowed to write
        // to the work folder; the file is checked against the signed lists either way.
        let user = stdout_of(Command::new("id").arg("-un"))?;
        let download = || {
            process::run(
                Command::new("apt-get")
                    .current_dir(&self.debs)
                    .args(["download", "-q", "-o", &format!("APT::Sandbox::User={}", user.trim())])
                    .arg(format!("linux-image-{}", self.version)),
            )
        };
        // Stale lists name a package the mirror has dropped: fetch them and try once more.
        if download().is_err() {
            process::run(crate::host::as_root("apt-get").args(["update", "-q"]))?;
            download()?;
        }
        self.deb().ok_or_else(|| Error::KernelNotDownloaded {
            version: self.version.clone(),
            folder: self.debs.clone(),
        })
    }

    /// Builds the kernel folder from the downloaded package, in a temporary folder renamed
    /// into place when complete, so that an interrupted build is redone rather than half
    /// used.
    pub fn build(&self, deb: &Path) -> Result<(), Error> {
        let version = &self.version;
        let mut tmp = self.folder.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = scratch_folder(Path::new(&tmp))?;
        let extract = tmp.path().join("extract");
        let extracted_tree = extract.join("lib/modules").join(version);
        let tree = tmp.path().join("lib/modules").join(version);
        fs::create_dir_all(&extract).map_err(at(&extract))?;
        fs::create_dir_all(&tree).map_err(at(&tree))?;
        let in_package = format!("./lib/modules/{version}");
        let members = [
            format!("./boot/vmlinuz-{version}"),
            format!("{in_package}/modules.order"),
            format!("{in_package}/modules.builtin"),
            format!("{in_package}/modules.builtin.modinfo"),
        ];
        // One pass through the package's data: it is a single XZ stream, and decompressing
        // it is what takes the time.
        process::pipe(
            Command::new("dpkg-deb").arg("--fsys-tarfile").arg(deb),
            Command::new("tar")
                .arg("-x")
                .arg("-C")
                .arg(&extract)
                .args(["--wildcards", "--no-wildcards-match-slash"])
                .args(members)
                .args(MODULE_FOLDERS.map(|folder| format!("{in_package}/kernel/{folder}"))),
            &[],
            Stdio::inherit(),
        )?;
        // The package ships no modules.dep.
        process::run(Command::new("depmod").arg("-b").arg(&extract).arg(version))?;
        let closure = stdout_of(
            Command::new("modprobe")
                .arg("-d")
                .arg(&extract)
                .args(["-S", version, "--show-depends", "-a"])
                .args(MODULES),
        )
        .map_err(|_| Error::ModulesNotFound {
            modules: MODULES.join(" "),
            version: version.clone(),
            folders: MODULE_FOLDERS.join(" "),
        })?;
        let closure = modules_to_insert(&closure);
        // depmod only sees the modules extracted: one that a wanted module needs but that
        // lies outside MODULE_FOLDERS would be missing without a word. Each module names
        // the ones it needs (modinfo's depends, from the kernel's build): they must all be
        // here.
        let mut needs = Vec::new();
        for module in &closure {
            let depends = stdout_of(Command::new("modinfo").args(["-F", "depends"]).arg(module))?;
            needs.push((module.as_path(), depends));
        }
        if let Some((module, dependency)) = first_unmet_dependency(&needs) {
            return Err(Error::ModuleOutsideFolders {
                module,
                dependency,
                version: version.clone(),
                folders: MODULE_FOLDERS.join(" "),
            });
        }
        for module in &closure {
            let relative = module.strip_prefix(&extracted_tree).unwrap_or(module);
            copy(module, &tree.join(relative))?;
        }
        for file in ["modules.order", "modules.builtin", "modules.builtin.modinfo"] {
            copy(&extracted_tree.join(file), &tree.join(file))?;
        }
        process::run(Command::new("depmod").arg("-b").arg(tmp.path()).arg(version))?;
        let vmlinuz = tmp.path().join("vmlinuz");
        fs::rename(extract.join(format!("boot/vmlinuz-{version}")), &vmlinuz).map_err(at(&vmlinuz))?;
        fs::remove_dir_all(&extract).map_err(at(&extract))?;
        if !extract_vmlinux(&vmlinuz, &tmp.path().join("vmlinux"))? {
            return Err(Error::NoVmlinux { version: version.clone() });
        }
        if self.folder.exists() {
            fs::remove_dir_all(&self.folder).map_err(at(&self.folder))?;
        }
        fs::rename(tmp.keep(), &self.folder).map_err(at(&self.folder))
    }
}

/// The module files that `modprobe --show-depends` would insert, in its order.
fn modules_to_insert(show_depends: &str) -> Vec<PathBuf> {
    show_depends
        .lines()
        .filter_map(|line| line.strip_prefix("insmod "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(PathBuf::from)
        .collect()
}

/// A module's name as the kernel knows it (`modinfo`'s depends lists these): the file's
/// name without `.ko`, dashes as underscores.
fn module_name(file: &Path) -> String {
    let name = file.file_name().map(|name| name.to_string_lossy()).unwrap_or_default();
    name.strip_suffix(".ko").unwrap_or(&name).replace('-', "_")
}

/// The first module of a closure, with what `modinfo -F depends` printed for it, that
/// needs a module outside the closure: the module's file name and the one it needs.
fn first_unmet_dependency(needs: &[(&Path, String)]) -> Option<(String, String)> {
    let present: Vec<String> = needs.iter().map(|(file, _)| module_name(file)).collect();
    needs.iter().find_map(|(file, depends)| {
        depends
            .split(',')
            .map(|dependency| dependency.trim().replace('-', "_"))
            .find(|dependency| !dependency.is_empty() && !present.contains(dependency))
            .map(|dependency| {
                (file.file_name().unwrap_or_default().to_string_lossy().into_owned(), dependency)
            })
    })
}

/// Where each XZ stream may start in a file: the offsets of XZ's magic.
fn xz_stream_offsets(bytes: &[u8]) -> Vec<usize> {
    memchr::memmem::find_iter(bytes, XZ_MAGIC).collect()
}

/// Writes the ELF vmlinux inside a bzImage to `vmlinux`; false if there is none.
///
/// The payload of Debian's vmlinuz is the ELF vmlinux, XZ-compressed. Booting that ELF
/// through PVH skips the decompressor, about 7 s per VM under TCG. The payload is the
/// first stream after an XZ magic that decompresses to an ELF file.
fn extract_vmlinux(vmlinuz: &Path, vmlinux: &Path) -> Result<bool, Error> {
    let bytes = fs::read(vmlinuz).map_err(at(vmlinuz))?;
    let folder = vmlinux.parent().expect("vmlinux is in the kernel folder");
    for offset in xz_stream_offsets(&bytes) {
        // Through a file rather than a pipe: xz stops reading at the end of the stream.
        let payload = tempfile::NamedTempFile::new_in(folder).map_err(at(folder))?;
        fs::write(payload.path(), &bytes[offset..]).map_err(at(payload.path()))?;
        let output = File::create(vmlinux).map_err(at(vmlinux))?;
        let decompressed = Command::new("xz")
            .args(["-dc", "--single-stream"])
            .arg(payload.path())
            .stdout(output)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if decompressed && starts_with_elf_magic(vmlinux) {
            return Ok(true);
        }
    }
    let _ = fs::remove_file(vmlinux);
    Ok(false)
}

fn starts_with_elf_magic(path: &Path) -> bool {
    let mut magic = [0; 4];
    File::open(path).and_then(|mut file| file.read_exact(&mut magic)).is_ok() && magic == *b"\x7fELF"
}

/// Copies a file, making the folders it goes in.
fn copy(from: &Path, to: &Path) -> Result<(), Error> {
    let folder = to.parent().expect("a file in a folder");
    fs::create_dir_all(folder).map_err(at(folder))?;
    fs::copy(from, to).map(drop).map_err(at(from))
}

/// A folder at a fixed path, emptied first (an earlier build may have been killed) and
/// removed again unless kept.
pub(crate) fn scratch_folder(path: &Path) -> Result<tempfile::TempDir, Error> {
    if path.exists() {
        fs::remove_dir_all(path).map_err(at(path))?;
    }
    let (parent, name) =
        (path.parent().expect("a folder in the work folder"), path.file_name().expect("a named folder"));
    tempfile::Builder::new().prefix(name).rand_bytes(0).tempdir_in(parent).map_err(at(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closure_is_every_insmod_of_modprobes_listing_in_order() {
        let listing = "insmod /k/lib/modules/6.1.0-56-amd64/kernel/drivers/virtio/virtio.ko \n\
                       insmod /k/lib/modules/6.1.0-56-amd64/kernel/drivers/net/virtio_net.ko \n\
                       builtin crc32_generic\n\
                       insmod /k/lib/modules/6.1.0-56-amd64/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko \n";
        let closure = modules_to_insert(listing);
        let names: Vec<String> = closure.iter().map(|file| module_name(file)).collect();
        assert_eq!(names, ["virtio", "virtio_net", "rdma_rxe"]);
        assert!(closure[2].ends_with("kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko"));
    }

    #[test]
    fn a_dependency_outside_the_closure_is_named_with_the_module_that_needs_it() {
        let (rxe, core, net) =
            (Path::new("/k/rdma_rxe.ko"), Path::new("/k/ib_core.ko"), Path::new("/k/ip6_udp_tunnel.ko"));
        let complete = [
            (core, "\n".to_string()),
            (net, "\n".to_string()),
            (rxe, "ib_core,ip6-udp-tunnel\n".to_string()),
        ];
        assert_eq!(first_unmet_dependency(&complete), None);
        let incomplete = [(core, String::new()), (rxe, "ib_core,ip6_udp_tunnel,udp_tunnel\n".to_string())];
        assert_eq!(
            first_unmet_dependency(&incomplete),
            Some(("rdma_rxe.ko".to_string(), "ip6_udp_tunnel".to_string()))
        );
    }

    #[test]
    fn xz_streams_are_found_wherever_their_magic_is() {
        let mut bytes = b"MZ boot code".to_vec();
        bytes.extend_from_slice(XZ_MAGIC);
        bytes.extend_from_slice(b"payload");
        bytes.extend_from_slice(XZ_MAGIC);
        assert_eq!(xz_stream_offsets(&bytes), [12, 25]);
        assert!(xz_stream_offsets(b"no stream here").is_empty());
    }

    #[test]
    fn the_vmlinux_is_the_stream_that_decompresses_to_an_elf_file() {
        let folder = tempfile::tempdir().unwrap();
        let compress = |data: &[u8]| {
            let source = folder.path().join("data");
            fs::write(&source, data).unwrap();
            let output = Command::new("xz").args(["-c", "--check=crc32"]).arg(&source).output().unwrap();
            assert!(output.status.success());
            output.stdout
        };
        // A stream that is not an ELF file first, then the kernel, then trailing bytes.
        let mut vmlinuz = b"setup code".to_vec();
        vmlinuz.extend(compress(b"not a kernel"));
        vmlinuz.extend(compress(b"\x7fELF the kernel"));
        vmlinuz.extend_from_slice(b"trailer");
        let (path, vmlinux) = (folder.path().join("vmlinuz"), folder.path().join("vmlinux"));
        fs::write(&path, &vmlinuz).unwrap();
        assert!(extract_vmlinux(&path, &vmlinux).unwrap());
        assert_eq!(fs::read(&vmlinux).unwrap(), b"\x7fELF the kernel");
        fs::write(&path, compress(b"no ELF here")).unwrap();
        assert!(!extract_vmlinux(&path, &vmlinux).unwrap());
        assert!(!vmlinux.exists());
    }

    #[test]
    fn a_scratch_folder_replaces_a_leftover_one_and_goes_when_dropped() {
        let work = tempfile::tempdir().unwrap();
        let path = work.path().join("kernel-1.tmp");
        fs::create_dir_all(path.join("extract")).unwrap();
        let scratch = scratch_folder(&path).unwrap();
        assert_eq!(scratch.path(), path);
        assert!(!path.join("extract").exists());
        drop(scratch);
        assert!(!path.exists());
    }
}
