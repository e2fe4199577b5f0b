//! The VMs' root file system: a base archive shared by every run of a kernel (busybox,
//! the modules, the verbs tools and the rxe provider), and a small one per run (the init
//! and the `--bin` programs) appended to it, as the kernel unpacks concatenated archives
//! in turn.

use std::fs::{self, File};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::host::PACKAGES;
use crate::kernel::{Kernel, MODULES};
use crate::process::{self, stdout_of};
use crate::{at, Error};

/// Programs every VM has besides busybox: `rdma` to create rxe0, and the verbs and
/// rdma_cm tools that check a link by hand.
const TOOLS: [&str; 5] = ["rdma", "ibv_devices", "ibv_devinfo", "ibv_rc_pingpong", "rping"];
/// libibverbs finds the rxe provider through its driver file, then dlopens it.
const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
const RXE_DRIVER: &str = "/etc/libibverbs.d/rxe.driver";
/// glibc dlopens libgcc_s.so.1 (thread cancellation), and Rust programs link it.
const LIBGCC: &str = "/lib/x86_64-linux-gnu/libgcc_s.so.1";
const LOADER: &str = "/lib64/ld-linux-x86-64.so.2";
const BUSYBOX: &str = "/bin/busybox";
/// What the base archive is built from besides the host's packages: a change to either
/// file rebuilds it.
const DEFINITIONS: [&str; 2] = [include_str!("initramfs.rs"), include_str!("kernel.rs")];

/// The base archive of a kernel's folder.
pub fn base_archive(kernel: &Kernel) -> PathBuf {
    kernel.folder.join("initramfs-base.cpio.gz")
}

/// What the base archive is built from: these definitions, the kernel and the host
/// packages it copies from. Kept beside the archive; a difference rebuilds it.
pub fn base_inputs(kernel: &Kernel) -> Result<String, Error> {
    let mut hasher = DefaultHasher::new();
    DEFINITIONS.hash(&mut hasher);
    let packages = stdout_of(Command::new("dpkg-query").arg("-W").args(PACKAGES))?;
    Ok(format!("definitions {:016x}\nkernel {}\n{packages}", hasher.finish(), kernel.version))
}

/// Whether the base archive was built from `inputs`.
pub fn base_is_current(kernel: &Kernel, inputs: &str) -> bool {
    let archive = base_archive(kernel);
    archive.is_file()
        && fs::read_to_string(inputs_file(&archive)).is_ok_and(|built_from| built_from == inputs)
}

/// Where the record of what an archive was built from is kept: beside it.
fn inputs_file(archive: &Path) -> PathBuf {
    archive.with_extension("gz.inputs")
}

/// Builds the base archive and records what it was built from.
pub fn build_base(kernel: &Kernel, inputs: &str) -> Result<(), Error> {
    let tree = Tree::at_fixed(&kernel.folder.join("initramfs-root"))?;
    let root = tree.root();
    for folder in
        ["usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "dev", "proc", "sys", "mnt", "tmp", "root", "etc"]
    {
        fs::create_dir_all(root.join(folder)).map_err(at(root))?;
    }
    // Merged /usr like the host: libibverbs looks for its providers under /usr/lib, while
    // ldd names libraries and the loader through /lib and /lib64.
    for folder in ["bin", "sbin", "lib", "lib64"] {
        symlink(format!("usr/{folder}"), root.join(folder)).map_err(at(root))?;
    }
    process::run(
        Command::new("cp").arg("-a").arg(kernel.folder.join("lib/modules")).arg(root.join("usr/lib")),
    )?;
    for tool in TOOLS {
        let path = which::which(tool)
            .map_err(|_| Error::ToolMissing { tool: tool.to_string(), packages: PACKAGES.join(" ") })?;
        tree.add_program(&path)?;
    }
    tree.add_file(Path::new(RXE_PROVIDER))?;
    tree.add_libraries(Path::new(RXE_PROVIDER))?;
    for file in [RXE_DRIVER, LIBGCC, LOADER] {
        tree.add_file(Path::new(file))?;
    }
    tree.copy(Path::new(BUSYBOX), "usr/bin/busybox")?;
    let busybox = root.join("usr/bin/busybox");
    for applet in stdout_of(Command::new(&busybox).arg("--list"))?.split_whitespace() {
        let link = root.join("usr/bin").join(applet);
        if !link.exists() {
            symlink("busybox", &link).map_err(at(&link))?;
        }
    }
    // The kernel itself runs /sbin/modprobe for modules it wants (crypto-crc32 ...).
    let modprobe = root.join("usr/sbin/modprobe");
    let _ = fs::remove_file(&modprobe);
    symlink("../bin/busybox", &modprobe).map_err(at(&modprobe))?;
    let archive = base_archive(kernel);
    let packed = tree.pack(&kernel.folder)?;
    packed.persist(&archive).map_err(|error| Error::File { path: archive.clone(), source: error.error })?;
    let record = inputs_file(&archive);
    fs::write(&record, inputs).map_err(at(&record))
}

/// Writes a run's initramfs, `initrd`: the base archive, then one with this run's init
/// and `bins`, each with the libraries it links, in /usr/bin.
pub fn write_run_initrd(kernel: &Kernel, run: &Path, bins: &[PathBuf], initrd: &Path) -> Result<(), Error> {
    let tree = Tree::new_in(run)?;
    let init = tree.root().join("init");
    fs::write(&init, init_script()).map_err(at(&init))?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755)).map_err(at(&init))?;
    for bin in bins {
        tree.add_program(bin)?;
    }
    // The lib → usr/lib symlinks are in the base archive; these paths never go through them.
    let overlay = tree.pack(run)?;
    let mut output = File::create(initrd).map_err(at(initrd))?;
    for part in [base_archive(kernel).as_path(), overlay.path()] {
        let mut input = File::open(part).map_err(at(part))?;
        std::io::copy(&mut input, &mut output).map_err(at(initrd))?;
    }
    Ok(())
}

/// The VM's init, which the kernel runs from the initramfs. VM_INDEX, VM_IP and PEER_IP
/// come from the kernel command line: the kernel passes the name=value words it does not
/// know to init's environment.
fn init_script() -> String {
    format!("#!/bin/sh\nmodules=\"{}\"\n{}", MODULES.join(" "), include_str!("init.sh"))
}

/// Where a host file goes in the initramfs: at the same path, laid out merged-/usr as on
/// the host (/lib is usr/lib ...).
fn path_in_initramfs(host: &Path) -> PathBuf {
    let relative = host.strip_prefix("/").unwrap_or(host);
    let merged = ["lib", "lib64", "bin", "sbin"].iter().any(|folder| relative.starts_with(folder));
    if merged {
        Path::new("usr").join(relative)
    } else {
        relative.to_path_buf()
    }
}

/// The libraries an `ldd` listing names by path, the loader included; or the lines of
/// those it did not find.
fn libraries_in_ldd(listing: &str) -> Result<Vec<PathBuf>, Vec<String>> {
    let missing: Vec<String> = listing
        .lines()
        .filter(|line| line.contains("not found"))
        .map(|line| line.trim().to_string())
        .collect();
    if !missing.is_empty() {
        return Err(missing);
    }
    let libraries = listing.lines().filter_map(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [_, "=>", path, ..] if path.starts_with('/') => Some(PathBuf::from(path)),
            [path, ..] if path.starts_with('/') => Some(PathBuf::from(path)),
            _ => None,
        }
    });
    Ok(libraries.collect())
}

/// A folder being filled with what an archive will hold, removed when dropped.
struct Tree(tempfile::TempDir);

impl Tree {
    /// A tree in a fresh folder under `parent`.
    fn new_in(parent: &Path) -> Result<Self, Error> {
        tempfile::Builder::new().prefix("initramfs-root").tempdir_in(parent).map(Tree).map_err(at(parent))
    }

    /// A tree at a fixed path (under the work folder's lock), replacing one an earlier
    /// build left.
    fn at_fixed(path: &Path) -> Result<Self, Error> {
        crate::kernel::scratch_folder(path).map(Tree)
    }

    fn root(&self) -> &Path {
        self.0.path()
    }

    /// Copies the file a path names (not a symlink) to `destination` in the tree.
    fn copy(&self, source: &Path, destination: impl AsRef<Path>) -> Result<(), Error> {
        let destination = self.root().join(destination);
        let folder = destination.parent().expect("a file in a folder");
        fs::create_dir_all(folder).map_err(at(folder))?;
        fs::copy(source, &destination).map(drop).map_err(at(source))
    }

    /// Copies a host file to where [`path_in_initramfs`] puts it.
    fn add_file(&self, source: &Path) -> Result<(), Error> {
        self.copy(source, path_in_initramfs(source))
    }

    /// The shared libraries that ldd lists for `file`, loader included.
    fn add_libraries(&self, file: &Path) -> Result<(), Error> {
        let listing = match Command::new("ldd").arg(file).stderr(Stdio::null()).output() {
            Ok(output) if output.status.success() => output.stdout,
            // ldd fails on a static program, which needs nothing.
            _ => return Ok(()),
        };
        let libraries = libraries_in_ldd(&String::from_utf8_lossy(&listing))
            .map_err(|missing| Error::LibrariesMissing { program: file.to_path_buf(), missing })?;
        libraries.iter().try_for_each(|library| self.add_file(library))
    }

    /// A program in usr/bin, with its libraries.
    fn add_program(&self, program: &Path) -> Result<(), Error> {
        let name = program.file_name().expect("a program is a file");
        self.copy(program, Path::new("usr/bin").join(name))?;
        self.add_libraries(program)
    }

    /// The tree as a gzip'd newc cpio in `folder`, everything owned by root, as the kernel
    /// unpacks it.
    fn pack(&self, folder: &Path) -> Result<tempfile::NamedTempFile, Error> {
        let archive = tempfile::NamedTempFile::new_in(folder).map_err(at(folder))?;
        let output = archive.reopen().map_err(at(archive.path()))?;
        process::pipe(
            Command::new("cpio")
                .current_dir(self.root())
                .args(["--null", "-o", "-H", "newc", "-R", "0:0", "--quiet"]),
            Command::new("gzip").arg("-6"),
            &self.archive_names()?,
            output,
        )?;
        Ok(archive)
    }

    /// What cpio packs: every path in the tree, relative to its root, each followed by a
    /// NUL, sorted by bytes so that parents come before what they hold.
    fn archive_names(&self) -> Result<Vec<u8>, Error> {
        let mut names = Vec::new();
        for entry in walkdir::WalkDir::new(self.root()).min_depth(1) {
            let entry = entry
                .map_err(|error| Error::File { path: self.root().to_path_buf(), source: error.into() })?;
            let relative = entry.path().strip_prefix(self.root()).expect("walked under the root");
            names.push([b"./", relative.as_os_str().as_bytes(), b"\0"].concat());
        }
        names.sort();
        Ok(names.concat())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_files_keep_their_paths_under_a_merged_usr() {
        for (host, inside) in [
            ("/lib/x86_64-linux-gnu/libc.so.6", "usr/lib/x86_64-linux-gnu/libc.so.6"),
            ("/lib64/ld-linux-x86-64.so.2", "usr/lib64/ld-linux-x86-64.so.2"),
            ("/bin/busybox", "usr/bin/busybox"),
            ("/sbin/rdma", "usr/sbin/rdma"),
            (
                "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so",
                "usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so",
            ),
            ("/etc/libibverbs.d/rxe.driver", "etc/libibverbs.d/rxe.driver"),
            ("/library/x", "library/x"),
        ] {
            assert_eq!(path_in_initramfs(Path::new(host)), Path::new(inside), "{host}");
        }
    }

    #[test]
    fn ldd_listings_give_each_library_by_path_and_the_loader() {
        let listing = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                       \tlibibverbs.so.1 => /lib/x86_64-linux-gnu/libibverbs.so.1 (0x00007f10)\n\
                       \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0f)\n\
                       \t/lib64/ld-linux-x86-64.so.2 (0x00007f11)\n";
        assert_eq!(
            libraries_in_ldd(listing).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libibverbs.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
        let missing = "\tlibnetagg.so => not found\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x1)\n";
        assert_eq!(libraries_in_ldd(missing).unwrap_err(), ["libnetagg.so => not found"]);
    }

    #[test]
    fn the_init_loads_every_module_and_ends_by_reporting_the_commands_exit() {
        let init = init_script();
        assert!(init
            .starts_with("#!/bin/sh\nmodules=\"virtio_pci virtio_net crc32_pclmul crc32_generic rdma_rxe"));
        assert!(init.contains("rdma link add rxe0 type rxe netdev eth0"));
        assert!(init.trim_end().ends_with("finish $?"));
    }

    #[test]
    fn a_program_goes_in_with_its_libraries_and_the_archive_lists_parents_first() {
        let folder = tempfile::tempdir().unwrap();
        let tree = Tree::new_in(folder.path()).unwrap();
        tree.add_program(Path::new("/bin/sh")).unwrap();
        let root = tree.root().to_path_buf();
        assert!(root.join("usr/bin/sh").is_file());
        let listing = Command::new("ldd").arg(fs::canonicalize("/bin/sh").unwrap()).output().unwrap();
        let libraries = libraries_in_ldd(&String::from_utf8_lossy(&listing.stdout)).unwrap();
        assert!(libraries.iter().any(|library| library.ends_with("ld-linux-x86-64.so.2")), "{libraries:?}");
        for library in libraries {
            assert!(root.join(path_in_initramfs(&library)).is_file(), "{}", library.display());
        }
        let names = tree.archive_names().unwrap();
        let names: Vec<&[u8]> = names.split(|&byte| byte == 0).filter(|name| !name.is_empty()).collect();
        let position = |name: &[u8]| names.iter().position(|&listed| listed == name).unwrap();
        assert!(position(b"./usr") < position(b"./usr/bin"));
        assert!(position(b"./usr/bin") < position(b"./usr/bin/sh"));
        assert!(names.iter().all(|name| name.starts_with(b"./")));
        drop(tree);
        assert!(!root.exists());
    }
}
