//! What no single key can check: combinations of values, with messages that name where
//! each value came from.

use crate::{BackendKind, Config, ConfigError, Origin, SwitchTransport, WirePrecision};

impl Config {
    /// Checks what no single key can: combinations. The message names every value it
    /// speaks of, and where each came from.
    pub fn validate(&self) -> Result<(), String> {
        let g = &self.general;
        if g.rank >= g.num_workers {
            return Err(format!(
                "{} must be below {}",
                self.described("general.rank"),
                self.described("general.num_workers")
            ));
        }
        if g.max_outstanding_packets < g.num_worker_threads {
            return Err(format!(
                "{} must be at least {}: every thread needs a slot",
                self.described("general.max_outstanding_packets"),
                self.described("general.num_worker_threads")
            ));
        }
        let slots = self.slots_per_thread() * g.num_worker_threads;
        if g.switches.len() > usize::from(slots) {
            return Err(format!(
                "{} lists {} switches, more than the {slots} slots of general.max_outstanding_packets {} \
                 over general.num_worker_threads {}: every switch needs a slot",
                self.described("general.switches"),
                g.switches.len(),
                g.max_outstanding_packets,
                g.num_worker_threads
            ));
        }
        if g.wire_precision != WirePrecision::Float32 && g.prepostprocessor != "native" {
            return Err(format!(
                "{} needs general.prepostprocessor native, not {}: block floating point sends \
                 float32 as int32",
                self.described("general.wire_precision"),
                self.described("general.prepostprocessor")
            ));
        }
        // Only RDMA keeps a connection per worker thread that a fault can fail; elsewhere
        // the key would turn fault injection on and inject nothing.
        if self.faults.sever_after > 0 && g.backend != BackendKind::Rdma {
            return Err(format!(
                "{} needs general.backend rdma, not {}: only RDMA has connections to sever",
                self.described("faults.sever_after"),
                self.described("general.backend")
            ));
        }
        let s = &self.switch;
        if s.faults.sever_after > 0 && s.transport != SwitchTransport::Rdma {
            // Not `described`: `--faults` sets the fault keys without recording where from.
            return Err(format!(
                "switch.faults.sever_after {} needs switch.transport rdma, not {}: only RDMA has \
                 connections to sever",
                s.faults.sever_after,
                self.described("switch.transport")
            ));
        }
        // An RDMA port only accepts connections, so a rack's switch on one could not reach
        // its upper switch; refused here, before the switch touches any device.
        if !s.upstream.is_empty() && s.transport == SwitchTransport::Rdma {
            return Err(format!(
                "{} needs switch.transport udp or dpdk, not {}: the rdma data path only accepts \
                 connections, so it cannot send to the upper switch",
                self.described("switch.upstream"),
                self.described("switch.transport")
            ));
        }
        if !s.upstream.is_empty() && s.rack >= s.racks {
            return Err(format!(
                "{} must be below {}",
                self.described("switch.rack"),
                self.described("switch.racks")
            ));
        }
        Ok(())
    }

    /// This configuration, once [`Config::validate`] accepts it: what loading returns.
    pub(crate) fn validated(self) -> Result<Config, ConfigError> {
        self.validate().map_err(|message| ConfigError::Combination { message })?;
        Ok(self)
    }

    /// `key value (from where)`, for messages about combinations.
    fn described(&self, key: &str) -> String {
        let value = self.get(key).unwrap_or_default();
        match self.origins.of(key) {
            None => format!("{key} {value} (the default)"),
            Some(Origin::Program) => format!("{key} {value} (set by the program)"),
            Some(origin) => format!("{key} {value} (from {origin})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::tests::ini;
    use crate::Config;

    #[test]
    fn impossible_combinations_are_rejected() {
        let message = ini("[general]\nrank = 4\nnum_workers = 4\n").unwrap_err().to_string();
        assert_eq!(
            message,
            "general.rank 4 (from test.cfg) must be below general.num_workers 4 (from test.cfg)"
        );
        let message =
            ini("[general]\nnum_worker_threads = 8\nmax_outstanding_packets = 4\n").unwrap_err().to_string();
        assert!(message.contains("every thread needs a slot"), "{message}");
        let message =
            ini("[general]\nnum_worker_threads = 2\nmax_outstanding_packets = 2\nswitches = a:1,b:1,c:1\n")
                .unwrap_err()
                .to_string();
        assert_eq!(
            message,
            "general.switches a:1,b:1,c:1 (from test.cfg) lists 3 switches, more than the 2 slots of \
             general.max_outstanding_packets 2 over general.num_worker_threads 2: every switch needs a slot"
        );
        let message =
            ini("[general]\nprepostprocessor = cpu_exponent_quantizer\nwire_precision = bfloat16\n")
                .unwrap_err()
                .to_string();
        assert_eq!(
            message,
            "general.wire_precision bfloat16 (from test.cfg) needs general.prepostprocessor native, not \
             general.prepostprocessor cpu_exponent_quantizer (from test.cfg): block floating point sends \
             float32 as int32"
        );
        let message = ini("[faults]\nsever_after = 10\n").unwrap_err().to_string();
        assert_eq!(
            message,
            "faults.sever_after 10 (from test.cfg) needs general.backend rdma, not general.backend udp \
             (the default): only RDMA has connections to sever"
        );
        let message =
            ini("[switch]\ntransport = dpdk\n[switch.faults]\nsever_after = 10\n").unwrap_err().to_string();
        assert_eq!(
            message,
            "switch.faults.sever_after 10 needs switch.transport rdma, not switch.transport dpdk (from \
             test.cfg): only RDMA has connections to sever"
        );
        ini("[general]\nbackend = rdma\n[faults]\nsever_after = 10\n[switch]\ntransport = rdma\n\
             [switch.faults]\nsever_after = 10\n")
        .expect("RDMA has connections to sever");
    }

    #[test]
    fn a_rack_switch_on_rdma_is_refused_by_name() {
        let message = ini("[switch]\ntransport = rdma\nupstream = 10.0.0.1:50099\nracks = 2\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "switch.upstream 10.0.0.1:50099 (from test.cfg) needs switch.transport udp or dpdk, not \
             switch.transport rdma (from test.cfg): the rdma data path only accepts connections, so it \
             cannot send to the upper switch"
        );
        for transport in ["udp", "dpdk"] {
            ini(&format!("[switch]\ntransport = {transport}\nupstream = 10.0.0.1:50099\nracks = 2\n"))
                .expect("a rack's switch sends up from a udp or dpdk port");
        }
        ini("[switch]\ntransport = rdma\n").expect("an RDMA switch with no upper switch");
    }

    #[test]
    fn combination_errors_name_where_each_value_came_from() {
        let dir = std::env::temp_dir().join(format!("netagg-config-origins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("valid.cfg");
        std::fs::write(&file, "[general]\npacket_numel = 64\n").unwrap();
        let load = |pairs: &[(&str, &str)]| {
            let vars: Vec<_> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Config::load_with_environment(Some(&file), &vars).unwrap_err().to_string()
        };
        assert_eq!(
            load(&[("NETAGG_GENERAL__RANK", "5")]),
            "general.rank 5 (from environment variable NETAGG_GENERAL__RANK) must be below \
             general.num_workers 1 (the default)"
        );
        assert_eq!(
            load(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            "general.rank 3 (from environment variable OMPI_COMM_WORLD_RANK) must be below \
             general.num_workers 2 (from environment variable OMPI_COMM_WORLD_SIZE)"
        );
        std::fs::write(&file, "[general]\nnum_worker_threads = 8\n").unwrap();
        assert_eq!(
            load(&[("NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS", "4")]),
            format!(
                "general.max_outstanding_packets 4 (from environment variable \
                 NETAGG_GENERAL__MAX_OUTSTANDING_PACKETS) must be at least general.num_worker_threads 8 \
                 (from {}): every thread needs a slot",
                file.display()
            )
        );
        let mut config = Config::default();
        config.set("general.rank", "1").unwrap();
        assert_eq!(
            config.validate().unwrap_err(),
            "general.rank 1 (set by the program) must be below general.num_workers 1 (the default)"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
