//! The fault sections: one struct for `[faults]` (a worker's transport) and
//! `[switch.faults]` (the switch's data path), whose keys `netagg-switch --faults` takes
//! too.

use netagg_faults::FaultRates;

use crate::{keys, table, ConfigError, Origin};

/// `[faults]` and `[switch.faults]`: faults injected into one process's datagrams, for
/// testing recovery; all zero (the default) injects nothing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    /// What happens to the datagrams this process sends (a worker's to the switch, the
    /// switch's results to the workers).
    pub send: FaultRates,
    /// What happens to the datagrams it receives, before it reads them.
    pub receive: FaultRates,
    /// Seed of the random choices; a worker thread or direction mixes in its own index.
    pub seed: u64,
    /// After this many datagrams received, the connection that carried the last one
    /// fails, once (RDMA's: its queue pair moved to the error state); 0 never.
    pub sever_after: u64,
}

impl Faults {
    /// Whether any fault is configured.
    pub fn is_active(&self) -> bool {
        self.send.is_active() || self.receive.is_active() || self.sever_after > 0
    }

    /// Whether this process's datagrams may reach their receiver with bytes other than
    /// those sent, either way: the dummy backend, whose link is this process's memory,
    /// seals and checks its packets only then.
    pub fn may_alter_bytes(&self) -> bool {
        self.send.may_alter_bytes() || self.receive.may_alter_bytes()
    }

    /// Applies `KEY=VALUE,KEY=VALUE` (the keys of a `[faults]` section), as given to the
    /// flag `flag`; errors name the flag, the key and what is allowed.
    pub fn apply_assignments(&mut self, flag: &str, text: &str) -> Result<(), ConfigError> {
        let origin = Origin::Flag(flag.to_string());
        for assignment in text.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let Some((key, value)) = assignment.split_once('=') else {
                return Err(ConfigError::refused(&origin, assignment, "", "KEY=VALUE".into()));
            };
            let key = key.trim();
            let Some(found) = table::find(keys::FAULT_KEYS, key) else {
                let known = table::names(keys::FAULT_KEYS.iter().map(|key| &key.about));
                return Err(ConfigError::UnknownKey { origin, key: key.to_string(), known });
            };
            found.set(self, value).map_err(|expected| ConfigError::refused(&origin, key, value, expected))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::tests::ini;
    use crate::Config;

    #[test]
    fn only_corruption_either_way_may_alter_bytes() {
        let faults = |text: &str| ini(text).unwrap().faults;
        assert!(!Config::default().faults.may_alter_bytes());
        let moving = "[faults]\nsend_drop = 0.1\nsend_duplicate = 0.1\nsend_reorder = 0.1\nsend_delay = 1\n\
                      receive_drop = 0.1\nreceive_duplicate = 0.1\nreceive_reorder = 0.1\nreceive_delay = 1\n";
        assert!(!faults(moving).may_alter_bytes());
        assert!(faults("[faults]\nsend_corrupt = 0.001\n").may_alter_bytes());
        assert!(faults("[faults]\nreceive_corrupt = 0.001\n").may_alter_bytes());
    }

    #[test]
    fn fault_sections_set_each_direction_and_reject_what_is_not_allowed() {
        let config = ini("[faults]\nsend_drop = 0.01\nreceive_duplicate = 0.5\nsend_delay = 2.5\nseed = 9\n\
             [switch.faults]\nreceive_drop = 0.05\nsend_reorder = 1\nsend_corrupt = 0.001\n")
        .unwrap();
        assert_eq!(config.faults.send.drop, 0.01);
        assert_eq!(config.faults.receive.duplicate, 0.5);
        assert_eq!(config.faults.send.delay, Duration::from_micros(2500));
        assert_eq!(config.faults.seed, 9);
        assert_eq!(config.switch.faults.receive.drop, 0.05);
        assert_eq!(config.switch.faults.send.reorder, 1.0);
        assert_eq!(config.switch.faults.send.corrupt, 0.001);
        assert!(!config.switch.faults.receive.is_active() || config.switch.faults.receive.drop > 0.0);
        assert!(!Config::default().faults.is_active());

        let bad = [
            (
                "[faults]\nsend_drop = 1.5\n",
                "key 'faults.send_drop' = '1.5': expected a probability from 0 to 1",
            ),
            (
                "[faults]\nreceive_reorder = -0.1\n",
                "key 'faults.receive_reorder' = '-0.1': expected a probability",
            ),
            (
                "[faults]\nsend_duplicate = often\n",
                "key 'faults.send_duplicate' = 'often': expected a probability",
            ),
            (
                "[faults]\nreceive_corrupt = NaN\n",
                "key 'faults.receive_corrupt' = 'NaN': expected a probability",
            ),
            (
                "[faults]\nsend_delay = 10001\n",
                "key 'faults.send_delay' = '10001': expected milliseconds, from 0 to 10000",
            ),
            ("[faults]\nreceive_delay = -1\n", "key 'faults.receive_delay' = '-1': expected milliseconds"),
            (
                "[faults]\nseed = -3\n",
                "key 'faults.seed' = '-3': expected an integer from 0 to 18446744073709551615",
            ),
            (
                "[switch.faults]\nsend_drop = 2\n",
                "key 'switch.faults.send_drop' = '2': expected a probability",
            ),
            (
                "[switch.faults]\nreceive_delay = x\n",
                "key 'switch.faults.receive_delay' = 'x': expected milliseconds",
            ),
        ];
        for (text, expected) in bad {
            let message = ini(text).unwrap_err().to_string();
            assert!(message.starts_with("test.cfg: "), "{message}");
            assert!(message.contains(expected), "{message} lacks {expected}");
        }
        let message = ini("[faults]\ndrop = 0.1\n").unwrap_err().to_string();
        assert_eq!(
            message,
            "test.cfg: unknown key 'faults.drop'; known keys: send_drop, send_duplicate, send_reorder, \
             send_corrupt, send_delay, receive_drop, receive_duplicate, receive_reorder, receive_corrupt, \
             receive_delay, seed, sever_after"
        );
        let error = Config::load_with_environment(
            None,
            &[("NETAGG_SWITCH_FAULTS__RECEIVE_DROP".to_string(), "5%".to_string())],
        )
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "environment variable NETAGG_SWITCH_FAULTS__RECEIVE_DROP: key 'switch.faults.receive_drop' = '5%': expected a probability from 0 to 1"
        );

        let mut faults = Faults::default();
        faults.apply_assignments("--faults", "receive_drop=0.01, send_drop=0.02,seed=4").unwrap();
        assert_eq!((faults.receive.drop, faults.send.drop, faults.seed), (0.01, 0.02, 4));
        assert_eq!(
            faults.apply_assignments("--faults", "send_drop=3").unwrap_err().to_string(),
            "flag --faults: key 'send_drop' = '3': expected a probability from 0 to 1"
        );
        assert_eq!(
            faults.apply_assignments("--faults", "drop").unwrap_err().to_string(),
            "flag --faults: key 'drop' = '': expected KEY=VALUE"
        );
        assert!(faults
            .apply_assignments("--faults", "jitter=1")
            .unwrap_err()
            .to_string()
            .starts_with("flag --faults: unknown key 'jitter'; known keys: send_drop,"));
    }
}
