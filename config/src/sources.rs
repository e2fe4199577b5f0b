//! Where values come from, later ones winning: the defaults; one config file (named, in
//! `$NETAGG_CONFIG`, or the first found); the launcher's rank and world size; and
//! `NETAGG_<SECTION>__<KEY>` variables. Each key set is recorded with its origin, for the
//! errors about combinations.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::{table, Config, ConfigError};

/// Where a value came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    Environment(String),
    /// [`Config::set`], called by a program (or the C API's `netagg_config_set`).
    Program,
    /// A command-line flag.
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "{}", path.display()),
            Origin::Environment(variable) => write!(f, "environment variable {variable}"),
            Origin::Program => write!(f, "configuration"),
            Origin::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// Where keys were set, by key. Two configurations with the same values are equal
/// wherever their values came from.
#[derive(Debug, Clone, Default)]
pub(crate) struct Origins(BTreeMap<String, Origin>);

impl Origins {
    /// Records that `key` was last set in `origin`.
    pub(crate) fn record(&mut self, key: &str, origin: &Origin) {
        self.0.insert(key.to_string(), origin.clone());
    }

    /// Where `key` was last set; None where it is at its default.
    pub(crate) fn of(&self, key: &str) -> Option<&Origin> {
        self.0.get(key)
    }
}

impl PartialEq for Origins {
    fn eq(&self, _: &Origins) -> bool {
        true
    }
}

/// Launcher variables for rank and world size, in the order they are tried.
const LAUNCHER_VARIABLES: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("RANK", "WORLD_SIZE"),
];
impl Config {
    /// Loads the configuration from the file named, or the first one found, then the
    /// environment of this process.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = std::env::vars().collect();
        Config::load_with_environment(path, &vars)
    }

    /// [`Config::load`] with an explicit environment, for callers and tests that must not
    /// read the process's own.
    pub fn load_with_environment(
        path: Option<&Path>,
        vars: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let lookup = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let mut config = Config::default();
        let file = match path {
            Some(path) => Some(path.to_path_buf()),
            None => lookup("NETAGG_CONFIG").map(PathBuf::from).or_else(find_config_file),
        };
        if let Some(file) = &file {
            config.apply_file(file)?;
        }
        for (rank_variable, size_variable) in LAUNCHER_VARIABLES {
            if let (Some(rank), Some(size)) = (lookup(rank_variable), lookup(size_variable)) {
                config.set_from(&Origin::Environment(rank_variable.to_string()), "general.rank", &rank)?;
                config.set_from(
                    &Origin::Environment(size_variable.to_string()),
                    "general.num_workers",
                    &size,
                )?;
                break;
            }
        }
        for (name, value) in vars {
            let Some(rest) = name.strip_prefix("NETAGG_") else { continue };
            if name == "NETAGG_CONFIG" {
                continue;
            }
            let origin = Origin::Environment(name.clone());
            // A variable that is no key's is named in the error as the key it would be.
            let key = match table::key_of_variable(name) {
                Some(key) => key,
                None => match rest.split_once("__") {
                    Some((section, key)) => format!(
                        "{}.{}",
                        section.to_ascii_lowercase().replace('_', "."),
                        key.to_ascii_lowercase()
                    ),
                    None => return Err(ConfigError::UnknownKey {
                        origin,
                        key: rest.to_ascii_lowercase(),
                        known:
                            "NETAGG_<SECTION>__<KEY>, e.g. NETAGG_GENERAL__RANK, NETAGG_BACKEND_UDP__BIND_IP"
                                .into(),
                    }),
                },
            };
            config.set_from(&origin, &key, value)?;
        }
        config.validated()
    }

    /// Parses config-file text in SwitchML's INI format, without looking at the
    /// environment; `origin` names it in errors.
    pub fn from_ini(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        config.apply_ini(text, origin)?;
        config.validated()
    }

    fn apply_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), reason: e.to_string() })?;
        self.apply_ini(&text, path)
    }

    fn apply_ini(&mut self, text: &str, path: &Path) -> Result<(), ConfigError> {
        let parsed = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Ini))
            .build()
            .and_then(|c| c.try_deserialize::<BTreeMap<String, config::Value>>())
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), reason: e.to_string() })?;
        let mut values = Vec::new();
        flatten("", parsed, &mut values);
        let origin = Origin::File(path.to_path_buf());
        for (key, value) in values {
            self.set_from(&origin, &key, &value)?;
        }
        Ok(())
    }
}

fn flatten(prefix: &str, table: BTreeMap<String, config::Value>, out: &mut Vec<(String, String)>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name } else { format!("{prefix}.{name}") };
        match value.clone().into_table() {
            Ok(inner) => flatten(&key, inner.into_iter().collect(), out),
            Err(_) => out.push((key, value.to_string())),
        }
    }
}

fn find_config_file() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from("netagg.cfg")];
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        candidates.push(PathBuf::from(format!("netagg-{}.cfg", host.trim())));
    }
    candidates.push(PathBuf::from("/etc/netagg.cfg"));
    candidates.into_iter().find(|path| path.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::takes_empty;

    #[test]
    fn every_key_is_set_by_its_environment_variable() {
        assert_eq!(table::variable("switch.faults", "send_drop"), "NETAGG_SWITCH_FAULTS__SEND_DROP");
        for (key, expected) in Config::keys() {
            let (section, name) = key.rsplit_once('.').unwrap();
            let variable = table::variable(section, name);
            assert_eq!(table::key_of_variable(&variable.to_ascii_lowercase()).as_deref(), Some(key.as_str()));
            if takes_empty(&expected) {
                continue;
            }
            // No other key takes an empty value.
            let error =
                Config::load_with_environment(None, &[(variable.clone(), String::new())]).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("environment variable {variable}: key '{key}' = '': expected {expected}")
            );
        }
    }

    #[test]
    fn the_large_packets_file_loads_and_changes_only_the_packets() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/large-packets.cfg");
        let config = Config::from_ini(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
        let mut expected = Config::default();
        (expected.general.packet_numel, expected.general.max_outstanding_packets) = (4096, 16);
        assert_eq!(config, expected);
    }

    #[test]
    fn environment_overrides_file_and_launcher_variables_set_rank() {
        let dir = std::env::temp_dir().join(format!("netagg-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("netagg.cfg");
        std::fs::write(&file, "[general]\nnum_workers = 2\npacket_numel = 64\n").unwrap();
        let vars = |pairs: &[(&str, &str)]| {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>()
        };

        let config = Config::load_with_environment(
            Some(&file),
            &vars(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "3"),
                ("NETAGG_GENERAL__PACKET_NUMEL", "1024"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (config.general.rank, config.general.num_workers, config.general.packet_numel),
            (2, 3, 1024)
        );

        let config = Config::load_with_environment(
            None,
            &vars(&[("NETAGG_CONFIG", file.to_str().unwrap()), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]),
        )
        .unwrap();
        assert_eq!((config.general.rank, config.general.num_workers), (1, 2));

        let config = Config::load_with_environment(
            Some(&file),
            &vars(&[("NETAGG_GENERAL__SWITCHES", "10.0.0.1:50099, s2:50100,[fd00::3]:50099")]),
        )
        .unwrap();
        assert_eq!(config.switch_addresses(), ["10.0.0.1:50099", "s2:50100", "[fd00::3]:50099"]);
        assert_eq!(Config::default().switch_addresses(), ["127.0.0.1:50099"]);

        let error =
            Config::load_with_environment(Some(&file), &vars(&[("NETAGG_BACKEND_UDP__BIND_IP", "nowhere")]))
                .unwrap_err();
        assert_eq!(
            error.to_string(),
            "environment variable NETAGG_BACKEND_UDP__BIND_IP: key 'backend.udp.bind_ip' = 'nowhere': expected an IP address"
        );
        let error = Config::load_with_environment(Some(&dir.join("missing.cfg")), &[]).unwrap_err();
        assert!(matches!(error, ConfigError::File { .. }), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
