//! EAL's arguments, checked against what netagg supports before EAL sees them.
//!
//! EAL does not return from every bad argument: it prints its usage and exits for `-h`,
//! `--log-level=help` and some misspellings, and it calls `rte_panic` (an abort) when it
//! cannot start or pin the worker threads that several lcores ask for. A library must
//! never end its host process, so only what netagg needs passes: memory, device and log
//! options written in full, and one lcore on a core the calling thread may run on.

use crate::DpdkError;

/// Options that take a value (in the next argument, after `=`, or attached to a short
/// option): memory, files, devices and logs.
const WITH_VALUE: &[&str] = &[
    "-m",
    "--socket-mem",
    "--socket-limit",
    "-n",
    "-r",
    "--vdev",
    "-a",
    "--allow",
    "-b",
    "--block",
    "-d",
    "--log-level",
    "--file-prefix",
    "--huge-dir",
    "--iova-mode",
    "--mbuf-pool-ops-name",
];

/// Options that take none.
const FLAGS: &[&str] = &[
    "--no-huge",
    "--no-shconf",
    "--no-pci",
    "--no-hpet",
    "--in-memory",
    "--no-telemetry",
    "--legacy-mem",
    "--single-file-segments",
    "--match-allocations",
];

/// Options that name EAL's lcores, each of which must name exactly one.
const CORE_OPTIONS: &[&str] = &["-l", "-c", "--lcores"];

/// The lcore EAL's arguments name, and the core it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lcore {
    pub lcore: usize,
    pub core: usize,
}

/// Checks `args` against what netagg supports; returns the lcore they name, if any. An
/// error names the first argument refused and why.
pub(crate) fn check(args: &[String]) -> Result<Option<Lcore>, DpdkError> {
    let allowed = allowed_cores();
    let mut named: Option<(String, Lcore)> = None;
    let mut main_lcore: Option<(String, usize)> = None;
    let mut index = 0;
    while index < args.len() {
        let arg = &args[index];
        let refused = |why: String| DpdkError::RefusedArgument { argument: arg.clone(), why };
        let (name, attached) = split(arg);
        if arg == "-h" || arg == "--help" || arg == "-v" || arg == "--version" {
            return Err(refused("EAL would print it and end this process".into()));
        }
        if FLAGS.contains(&name) {
            if attached.is_some() {
                return Err(refused(format!("{name} takes no value")));
            }
            index += 1;
            continue;
        }
        let takes_value =
            WITH_VALUE.contains(&name) || CORE_OPTIONS.contains(&name) || name == "--main-lcore";
        if !takes_value {
            let why = match name.starts_with('-') {
                true => format!(
                    "netagg passes EAL only options it supports, written in full: {}, {}, {}, --main-lcore",
                    FLAGS.join(", "),
                    WITH_VALUE.join(", "),
                    CORE_OPTIONS.join(", ")
                ),
                false => "EAL's arguments are options; EAL would ignore this and what follows".into(),
            };
            return Err(refused(why));
        }
        let value = match attached {
            Some(value) => value,
            None => {
                index += 1;
                args.get(index).map(String::as_str).ok_or_else(|| refused(format!("{name} needs a value")))?
            }
        };
        index += 1;
        if name == "--log-level" && value == "help" {
            return Err(refused("EAL would list its log types and end this process".into()));
        }
        if name == "--main-lcore" {
            let lcore = value.parse().map_err(|_| refused(format!("'{value}' is not an lcore number")))?;
            main_lcore = Some((arg.clone(), lcore));
            continue;
        }
        if !CORE_OPTIONS.contains(&name) {
            continue;
        }
        if let Some((first, _)) = &named {
            return Err(refused(format!("the lcore is named already, by '{first}': name it once")));
        }
        let lcore = one_lcore(name, value).map_err(refused)?;
        if !allowed.contains(&lcore.core) {
            return Err(refused(format!(
                "core {} is not one this process may run on ({}): EAL would abort pinning its thread there",
                lcore.core,
                ranges(&allowed)
            )));
        }
        named = Some((arg.clone(), lcore));
    }
    // Without a core option, EAL runs on lcore 0 (`Eal::start` adds it).
    let lcore = named.as_ref().map_or(0, |(_, named)| named.lcore);
    if let Some((argument, main)) = main_lcore.filter(|&(_, main)| main != lcore) {
        let why = format!("EAL's one lcore is {lcore}, so its main lcore cannot be {main}");
        return Err(DpdkError::RefusedArgument { argument, why });
    }
    Ok(named.map(|(_, lcore)| lcore))
}

/// An option's name and the value attached to it (`--vdev=x`, `-l1`), if any.
fn split(arg: &str) -> (&str, Option<&str>) {
    if arg.starts_with("--") {
        return match arg.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (arg, None),
        };
    }
    match (arg.get(..2), arg.get(2..)) {
        (Some(name), Some(value)) if name.starts_with('-') && !value.is_empty() => (name, Some(value)),
        _ => (arg, None),
    }
}

/// The one lcore a core option's `value` names, or why it names none or several.
fn one_lcore(option: &str, value: &str) -> Result<Lcore, String> {
    let several = || {
        format!(
            "'{value}' names several lcores or a group of cores: netagg runs EAL on one lcore, and EAL \
             aborts the process when it cannot start or pin the threads of the others"
        )
    };
    let number = |text: &str| -> Result<usize, String> {
        match text.parse() {
            Ok(number) => Ok(number),
            Err(_) if text.contains([',', '-', '(', ')', '@']) => Err(several()),
            Err(_) => Err(format!("'{text}' is not a core number")),
        }
    };
    match option {
        "-l" => number(value).map(|lcore| Lcore { lcore, core: lcore }),
        "--lcores" => match value.split_once('@') {
            Some((lcore, core)) => Ok(Lcore { lcore: number(lcore)?, core: number(core)? }),
            None => number(value).map(|lcore| Lcore { lcore, core: lcore }),
        },
        // -c: a hexadecimal mask of cores.
        _ => {
            let digits = value.trim_start_matches("0x").trim_start_matches("0X");
            let mask =
                u128::from_str_radix(digits, 16).map_err(|_| format!("'{value}' is not a core mask"))?;
            match mask.count_ones() {
                1 => {
                    let core = mask.trailing_zeros() as usize;
                    Ok(Lcore { lcore: core, core })
                }
                0 => Err(format!("'{value}' names no core")),
                _ => Err(several()),
            }
        }
    }
}

/// The cores of the calling thread's affinity mask; core 0 alone if it cannot be read.
pub(crate) fn allowed_cores() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data, for which all zeroes is a valid (empty) set;
    // sched_getaffinity writes at most the size it is given, that of the set it points to;
    // CPU_ISSET reads the set at a core below CPU_SETSIZE, inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![0];
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&core| libc::CPU_ISSET(core, &set)).collect()
    }
}

/// Cores as ranges, for people: `0-3,6`.
fn ranges(cores: &[usize]) -> String {
    let mut text = Vec::new();
    let mut index = 0;
    while index < cores.len() {
        let start = cores[index];
        while index + 1 < cores.len() && cores[index + 1] == cores[index] + 1 {
            index += 1;
        }
        text.push(match cores[index] {
            end if end == start => start.to_string(),
            end => format!("{start}-{end}"),
        });
        index += 1;
    }
    text.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| arg.to_string()).collect()
    }

    fn refusal(args: &[&str]) -> (String, String) {
        match check(&strings(args)) {
            Err(DpdkError::RefusedArgument { argument, why }) => (argument, why),
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn first_core() -> usize {
        allowed_cores()[0]
    }

    #[test]
    fn what_netagg_documents_passes() {
        let core = first_core().to_string();
        for args in [
            &[
                "--no-huge",
                "--no-shconf",
                "-m",
                "128",
                "--no-pci",
                "--no-telemetry",
                "--log-level=lib.eal:warning",
            ][..],
            &["--in-memory", "-l", &core, "-a", "0000:3b:00.0"],
            &["--no-huge", "--vdev=net_af_packet0,iface=eth0", "--file-prefix", "netagg1", "-m64"],
            &["--huge-dir", "/x", "--log-level", "lib.eal:warning", "--iova-mode=va"],
        ] {
            assert!(check(&strings(args)).is_ok(), "{args:?}: {:?}", check(&strings(args)));
        }
        assert_eq!(check(&strings(&["--no-huge"])).unwrap(), None);
    }

    #[test]
    fn one_lcore_passes_in_each_form_on_a_core_this_thread_may_use() {
        let core = first_core();
        let one = Some(Lcore { lcore: core, core });
        let mask = format!("0x{:x}", 1u128 << core);
        for args in [
            vec!["-l".to_string(), core.to_string()],
            vec![format!("-l{core}")],
            vec!["-c".into(), mask],
            vec![format!("--lcores={core}")],
        ] {
            assert_eq!(check(&args).unwrap(), one, "{args:?}");
        }
        let pinned = check(&strings(&["--lcores", &format!("3@{core}"), "--main-lcore", "3"])).unwrap();
        assert_eq!(pinned, Some(Lcore { lcore: 3, core }));
    }

    #[test]
    fn several_lcores_are_refused_in_every_form() {
        for args in [
            &["-l", "0-1"][..],
            &["-l", "0,1"],
            &["-l0,1"],
            &["-c", "0x3"],
            &["-c", "f"],
            &["--lcores", "0@0,1@1"],
            &["--lcores=(0-1)@0"],
            &["--lcores", "0-1"],
        ] {
            let (argument, why) = refusal(args);
            assert!(args.iter().any(|arg| argument.contains(arg)), "{args:?}: {argument}");
            assert!(why.contains("names several lcores or a group of cores"), "{args:?}: {why}");
            let error = check(&strings(args)).unwrap_err().to_string();
            assert!(error.starts_with(&format!("EAL argument '{argument}' is refused: ")), "{error}");
        }
    }

    #[test]
    fn bad_core_lists_and_cores_outside_the_affinity_are_refused() {
        let (_, why) = refusal(&["-l", "x"]);
        assert_eq!(why, "'x' is not a core number");
        let (_, why) = refusal(&["-c", "0xzz"]);
        assert_eq!(why, "'0xzz' is not a core mask");
        let (_, why) = refusal(&["-c", "0"]);
        assert_eq!(why, "'0' names no core");
        // A core beyond any this machine has is outside every affinity mask.
        let (argument, why) = refusal(&["--lcores", "0@1000"]);
        assert_eq!(argument, "--lcores");
        assert!(why.starts_with("core 1000 is not one this process may run on ("), "{why}");
        assert!(why.ends_with("EAL would abort pinning its thread there"), "{why}");
        // Named twice, or a main lcore other than the one.
        let core = first_core().to_string();
        let (argument, why) = refusal(&["-l", &core, "-c", "1"]);
        assert_eq!(argument, "-c");
        assert!(why.contains("the lcore is named already, by '-l'"), "{why}");
        let (argument, why) = refusal(&["--main-lcore", "1"]);
        assert_eq!(
            (argument.as_str(), why.as_str()),
            ("--main-lcore", "EAL's one lcore is 0, so its main lcore cannot be 1")
        );
    }

    #[test]
    fn unknown_options_abbreviations_and_stray_words_are_refused() {
        for args in
            [&["--no-such-option"][..], &["--proc-type", "secondary"], &["--no-h"], &["--vdev"], &["-x"]]
        {
            let (argument, why) = refusal(args);
            assert_eq!(argument, args[0]);
            assert!(why.contains("written in full") || why.ends_with("needs a value"), "{args:?}: {why}");
        }
        let (argument, why) = refusal(&["--no-huge", "stray"]);
        assert_eq!(argument, "stray");
        assert!(why.contains("EAL would ignore this"), "{why}");
        let (_, why) = refusal(&["--no-huge=1"]);
        assert_eq!(why, "--no-huge takes no value");
    }

    #[test]
    fn arguments_that_make_eal_exit_are_refused() {
        for args in [&["-h"][..], &["--help"], &["-v"], &["--log-level=help"], &["--log-level", "help"]] {
            let (_, why) = refusal(args);
            assert!(why.contains("end this process"), "{args:?}: {why}");
        }
    }

    #[test]
    fn cores_print_as_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(ranges(&[5]), "5");
    }
}
