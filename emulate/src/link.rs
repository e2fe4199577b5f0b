//! What each worker's link does: its rate each way, its one-way delay and jitter, the
//! share of frames it loses, and how long its queue is; the same for every rank unless
//! a rank overrides some of it (a straggler, an uneven network).
//!
//! Links come from the command line (`rate=200mbit,delay=5ms,loss=1%`, and
//! `3:rate=20mbit` for rank 3) or from a topology file in the INI format of netagg's
//! config files:
//!
//! ```ini
//! # every worker's link
//! [link]
//! rate = 200mbit
//! delay = 5ms
//! loss = 1%
//!
//! # rank 3's, over [link]
//! [rank.3]
//! rate = 20mbit
//!
//! # racks of contiguous ranks, each with a switch and an uplink
//! [racks]
//! count = 2
//! switches = ideal
//!
//! # each rack's link to the core: a rate of its own (oversubscription)
//! [uplink]
//! rate = 25mbit
//! ```
//!
//! (comments go on lines of their own: the INI reader takes none after a section or a
//! value).
//! `switches` says what each switch's own link is on a network of racks: `ideal` (the
//! switch is the network, its link never shaped) or `server` (a switch process behind a
//! link shaped like `[link]`'s rate).
//!
//! Links are symmetric: each direction gets the rate, the delay, the jitter and the
//! loss (so a round trip pays the delay twice and a packet survives it with
//! probability (1 − loss)²).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What is wrong with a link's settings or a topology file; each says where and what
/// was expected.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("unknown link setting '{0}' (expected one of {keys})", keys = key_names())]
    UnknownSetting(String),
    #[error("{key} = '{value}': expected {expected}")]
    InvalidValue { key: String, value: String, expected: &'static str },
    #[error("'{0}': expected KEY=VALUE, such as rate=200mbit")]
    NotKeyValue(String),
    #[error("'{0}': expected RANK:SETTINGS, such as 3:rate=20mbit")]
    NotRankSettings(String),
    #[error("'{text}': '{rank}' is not a rank number")]
    NotRankNumber { text: String, rank: String },
    #[error("'{0}': expected a rate such as 200mbit, 1gbit or 500kbit")]
    Rate(String),
    #[error("'{0}' is under 1 bit/s: a link carries at least 1bit")]
    RateUnderOneBit(String),
    #[error("'{0}': expected a delay such as 5ms, 250us or 0")]
    Delay(String),
    #[error("[{section}] {source}")]
    InSection { section: String, source: Box<LinkError> },
    #[error("'{name}' must be {expected}")]
    NotASection { name: String, expected: &'static str },
    #[error("unknown section [{0}] (expected [link], [rank.N], [racks] and [uplink])")]
    UnknownSection(String),
    #[error("[rank.{0}]: expected a rank number")]
    SectionRank(String),
    #[error("{0}")]
    Syntax(String),
    #[error("{path}: {source}")]
    File { path: PathBuf, source: Box<LinkError> },
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("an emulated network needs at least one worker")]
    NoWorkers,
    #[error("a link is set for rank {rank}, but the ranks are 0 to {last}")]
    RankOutOfRange { rank: u32, last: u32 },
    #[error("[racks] {key} = '{value}': expected {expected}")]
    Racks { key: String, value: String, expected: &'static str },
    #[error("{0} describes a network of racks, and this one is flat: give [racks] count (or --racks)")]
    RacksOnly(&'static str),
    #[error("[uplink] sets {0}: an uplink takes a rate, queue and burst only (delay and loss belong to the racks' links)")]
    UplinkImpaired(&'static str),
}

/// The keys of [`KEYS`], for messages.
fn key_names() -> String {
    KEYS.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ")
}

/// One worker's link, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bits per second each way; `None`: as fast as the host carries it.
    pub rate: Option<u64>,
    pub delay: Duration,
    /// Each frame's delay varies uniformly within ±jitter (never below zero).
    pub jitter: Duration,
    /// The probability that a frame is lost, each way.
    pub loss: f64,
    /// The longest a frame may wait in the rate limiter's queue, which sets the queue's
    /// length (rate × queue bytes beyond the burst): a sender that overfills it loses
    /// frames, as at a real bottleneck.
    pub queue: Duration,
    /// The rate limiter's bucket: how many bytes may leave back to back at line rate.
    pub burst: u64,
}

impl Default for Link {
    fn default() -> Link {
        Link {
            rate: None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            queue: Duration::from_millis(100),
            burst: 64 * 1024,
        }
    }
}

impl Link {
    /// Whether the link delays or loses frames, which a rate limiter alone cannot do.
    pub fn is_impaired(&self) -> bool {
        !self.delay.is_zero() || !self.jitter.is_zero() || self.loss > 0.0
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.rate {
            Some(rate) => write!(f, "{}", format_rate(rate))?,
            None => write!(f, "unlimited")?,
        }
        write!(f, ", delay {:?}", self.delay)?;
        if !self.jitter.is_zero() {
            write!(f, " ± {:?}", self.jitter)?;
        }
        if self.loss > 0.0 {
            write!(f, ", loss {}%", self.loss * 100.0)?;
        }
        Ok(())
    }
}

/// A rate as tc writes it: 200mbit, 1gbit, 64kbit.
pub fn format_rate(bits_per_second: u64) -> String {
    for (unit, scale) in [("gbit", 1_000_000_000), ("mbit", 1_000_000), ("kbit", 1_000)] {
        if bits_per_second >= scale && bits_per_second % scale == 0 {
            return format!("{}{unit}", bits_per_second / scale);
        }
    }
    format!("{bits_per_second}bit")
}

/// Some of a link's settings: those a `[link]` section, a `--link` option or a rank's
/// override gives; the rest come from below.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinkSettings {
    pub rate: Option<u64>,
    pub delay: Option<Duration>,
    pub jitter: Option<Duration>,
    pub loss: Option<f64>,
    pub queue: Option<Duration>,
    pub burst: Option<u64>,
}

/// The keys a link takes, with what each expects, for error messages.
pub const KEYS: &[(&str, &str)] = &[
    ("rate", "a rate such as 200mbit, 1gbit or 500kbit, at least 1bit"),
    ("delay", "a delay such as 5ms, 250us or 0"),
    ("jitter", "a delay such as 1ms, 100us or 0"),
    ("loss", "a share of frames such as 1%, 0.5% or 0.01"),
    ("queue", "a time such as 100ms (how long a frame may wait in the rate limiter)"),
    ("burst", "a size such as 64kb, 1mb or 16000 (bytes)"),
];

impl LinkSettings {
    /// Sets `key` from its text; the error names the key and what it expects.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), LinkError> {
        let expected = KEYS
            .iter()
            .find(|(name, _)| *name == key)
            .map(|(_, expected)| *expected)
            .ok_or_else(|| LinkError::UnknownSetting(key.to_string()))?;
        let invalid = || LinkError::InvalidValue { key: key.to_string(), value: value.to_string(), expected };
        match key {
            "rate" => self.rate = Some(parse_rate(value).map_err(|_| invalid())?.round() as u64),
            "delay" => self.delay = Some(parse_duration(value).map_err(|_| invalid())?),
            "jitter" => self.jitter = Some(parse_duration(value).map_err(|_| invalid())?),
            "loss" => self.loss = Some(parse_share(value).ok_or_else(invalid)?),
            "queue" => {
                self.queue =
                    Some(parse_duration(value).ok().filter(|queue| !queue.is_zero()).ok_or_else(invalid)?)
            }
            "burst" => self.burst = Some(parse_size(value).ok_or_else(invalid)?),
            _ => unreachable!("every key of KEYS is handled"),
        }
        Ok(())
    }

    /// `rate=200mbit,delay=5ms,loss=1%`.
    pub fn parse(text: &str) -> Result<LinkSettings, LinkError> {
        let mut settings = LinkSettings::default();
        for item in text.split(',').map(str::trim).filter(|item| !item.is_empty()) {
            let (key, value) =
                item.split_once('=').ok_or_else(|| LinkError::NotKeyValue(item.to_string()))?;
            settings.set(key.trim(), value.trim())?;
        }
        Ok(settings)
    }

    /// These settings over `below`'s.
    pub fn over(&self, below: &LinkSettings) -> LinkSettings {
        LinkSettings {
            rate: self.rate.or(below.rate),
            delay: self.delay.or(below.delay),
            jitter: self.jitter.or(below.jitter),
            loss: self.loss.or(below.loss),
            queue: self.queue.or(below.queue),
            burst: self.burst.or(below.burst),
        }
    }

    fn resolve(&self) -> Link {
        let default = Link::default();
        Link {
            rate: self.rate,
            delay: self.delay.unwrap_or(default.delay),
            jitter: self.jitter.unwrap_or(default.jitter),
            loss: self.loss.unwrap_or(default.loss),
            queue: self.queue.unwrap_or(default.queue),
            burst: self.burst.unwrap_or(default.burst),
        }
    }
}

/// What a switch's own link is on a network of racks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SwitchLinks {
    /// The switch is the network: its ports run at line rate, its link is never shaped.
    #[default]
    Ideal,
    /// The switch is a process on a server, behind a link shaped like the workers'
    /// (`[link]`, rate only): a server's NIC.
    Server,
}

impl std::str::FromStr for SwitchLinks {
    type Err = String;
    fn from_str(text: &str) -> Result<SwitchLinks, String> {
        match text.trim() {
            "ideal" => Ok(SwitchLinks::Ideal),
            "server" => Ok(SwitchLinks::Server),
            _ => Err(format!("'{text}': expected ideal or server")),
        }
    }
}

/// Every worker's link: one for all, and per-rank overrides; and, on a network of racks,
/// how many, what their switches' links are, and their uplinks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Topology {
    pub every: LinkSettings,
    pub ranks: BTreeMap<u32, LinkSettings>,
    /// Racks of contiguous ranks (`[racks] count`), each on a bridge of its own with its
    /// switch, joined to the core by an uplink; `None`: one flat network.
    pub racks: Option<u16>,
    /// `[racks] switches`; `None`: not set, [`SwitchLinks::Ideal`].
    pub switch_links: Option<SwitchLinks>,
    /// Each rack's uplink (`[uplink]`).
    pub uplink: LinkSettings,
}

impl Topology {
    /// Reads a topology file (see the module's documentation). Errors name the file,
    /// the section and the key.
    pub fn from_file(path: &Path) -> Result<Topology, LinkError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| LinkError::Read { path: path.to_path_buf(), source })?;
        Topology::from_ini(&text)
            .map_err(|error| LinkError::File { path: path.to_path_buf(), source: Box::new(error) })
    }

    fn from_ini(text: &str) -> Result<Topology, LinkError> {
        use config::{Config, File, FileFormat, Value};
        let tree: BTreeMap<String, Value> = Config::builder()
            .add_source(File::from_str(text, FileFormat::Ini))
            .build()
            .and_then(|config| config.try_deserialize())
            .map_err(|e| LinkError::Syntax(e.to_string()))?;
        // The INI reader nests `[rank.3]` as rank → 3.
        let section = |name: &str, value: Value| -> Result<LinkSettings, LinkError> {
            let table = value
                .into_table()
                .map_err(|_| LinkError::NotASection { name: name.to_string(), expected: "a section" })?;
            let mut settings = LinkSettings::default();
            for (key, value) in table {
                settings.set(&key, &value.to_string()).map_err(|error| LinkError::InSection {
                    section: name.to_string(),
                    source: Box::new(error),
                })?;
            }
            Ok(settings)
        };
        let mut topology = Topology::default();
        for (name, value) in tree {
            match name.as_str() {
                "link" => topology.every = section("link", value)?,
                "rank" => {
                    let ranks = value.into_table().map_err(|_| LinkError::NotASection {
                        name: "rank".into(),
                        expected: "sections [rank.N]",
                    })?;
                    for (rank, value) in ranks {
                        let number = rank.parse().map_err(|_| LinkError::SectionRank(rank.clone()))?;
                        topology.ranks.insert(number, section(&format!("rank.{rank}"), value)?);
                    }
                }
                "uplink" => topology.uplink = section("uplink", value)?,
                "racks" => {
                    let table = value.into_table().map_err(|_| LinkError::NotASection {
                        name: "racks".into(),
                        expected: "a section",
                    })?;
                    for (key, value) in table {
                        let text = value.to_string();
                        let invalid =
                            |expected| LinkError::Racks { key: key.clone(), value: text.clone(), expected };
                        match key.as_str() {
                            "count" => {
                                let count = text.trim().parse().ok().filter(|&count: &u16| count > 0);
                                topology.racks =
                                    Some(count.ok_or_else(|| invalid("a number of racks from 1"))?);
                            }
                            "switches" => {
                                topology.switch_links =
                                    Some(text.parse().map_err(|_| invalid("ideal or server"))?)
                            }
                            _ => return Err(invalid("a key count or switches")),
                        }
                    }
                }
                other => return Err(LinkError::UnknownSection(other.to_string())),
            }
        }
        Ok(topology)
    }

    /// Refuses, on a flat network, what only racks use (`[uplink]`, `[racks] switches`),
    /// which would otherwise be ignored without a word.
    pub fn check_flat(&self) -> Result<(), LinkError> {
        if self.racks.is_some() {
            Ok(())
        } else if self.uplink != LinkSettings::default() {
            Err(LinkError::RacksOnly("[uplink]"))
        } else if self.switch_links.is_some() {
            Err(LinkError::RacksOnly("[racks] switches"))
        } else {
            Ok(())
        }
    }

    /// Each rack's uplink: its rate, queue and burst; unlimited unless set.
    pub fn uplink_link(&self) -> Result<Link, LinkError> {
        let impairments = [
            ("delay", self.uplink.delay.is_some()),
            ("jitter", self.uplink.jitter.is_some()),
            ("loss", self.uplink.loss.is_some()),
        ];
        match impairments.iter().find(|(_, set)| *set) {
            Some((key, _)) => Err(LinkError::UplinkImpaired(key)),
            None => Ok(self.uplink.resolve()),
        }
    }

    /// Overrides from the command line: `--link` over the file's `[link]`, and `N:...`
    /// over rank N's.
    pub fn apply(&mut self, every: &LinkSettings, ranks: &[(u32, LinkSettings)]) {
        self.every = every.over(&self.every);
        for (rank, settings) in ranks {
            let below = self.ranks.get(rank).copied().unwrap_or_default();
            self.ranks.insert(*rank, settings.over(&below));
        }
    }

    /// The link every rank has unless overridden: what a switch host's link is shaped
    /// like (a server's NIC, as the workers').
    pub fn common_link(&self) -> Link {
        self.every.resolve()
    }

    /// Every rank's link, for `workers` workers.
    pub fn links(&self, workers: u32) -> Result<Vec<Link>, LinkError> {
        if workers == 0 {
            return Err(LinkError::NoWorkers);
        }
        if let Some((&rank, _)) = self.ranks.range(workers..).next() {
            return Err(LinkError::RankOutOfRange { rank, last: workers - 1 });
        }
        Ok((0..workers)
            .map(|rank| self.ranks.get(&rank).copied().unwrap_or_default().over(&self.every).resolve())
            .collect())
    }
}

/// `3:rate=20mbit`: rank 3's link settings.
pub fn parse_rank_settings(text: &str) -> Result<(u32, LinkSettings), LinkError> {
    let (rank, settings) =
        text.split_once(':').ok_or_else(|| LinkError::NotRankSettings(text.to_string()))?;
    let rank = rank
        .trim()
        .parse()
        .map_err(|_| LinkError::NotRankNumber { text: text.to_string(), rank: rank.to_string() })?;
    Ok((rank, LinkSettings::parse(settings)?))
}

/// Parses a rate in tc's units: `200mbit`, `1gbit`, `500kbit`, `100bit`, or a plain
/// number of bits per second, at least 1: a rate below would round to a link that
/// carries nothing, which no shaper or simulated link can pace.
pub fn parse_rate(text: &str) -> Result<f64, LinkError> {
    let lower = text.trim().to_ascii_lowercase();
    let (number, multiplier) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .iter()
        .find_map(|(unit, multiplier)| lower.strip_suffix(unit).map(|number| (number, *multiplier)))
        .unwrap_or((lower.as_str(), 1.0));
    match number.parse::<f64>().map(|value| value * multiplier) {
        Ok(rate) if rate >= 1.0 && rate.is_finite() => Ok(rate),
        Ok(rate) if (0.0..1.0).contains(&rate) => Err(LinkError::RateUnderOneBit(text.to_string())),
        _ => Err(LinkError::Rate(text.to_string())),
    }
}

/// Parses a delay: `5ms`, `250us`, `1s`, or a plain number of milliseconds.
pub fn parse_duration(text: &str) -> Result<Duration, LinkError> {
    let lower = text.trim().to_ascii_lowercase();
    let (number, seconds) = [("ms", 1e-3), ("us", 1e-6), ("s", 1.0)]
        .iter()
        .find_map(|(unit, seconds)| lower.strip_suffix(unit).map(|number| (number, *seconds)))
        .unwrap_or((lower.as_str(), 1e-3));
    let delay =
        number.parse::<f64>().ok().and_then(|value| Duration::try_from_secs_f64(value * seconds).ok());
    delay.ok_or_else(|| LinkError::Delay(text.to_string()))
}

/// `1%` or `0.01`: a probability.
fn parse_share(text: &str) -> Option<f64> {
    let share = match text.trim().strip_suffix('%') {
        Some(percent) => percent.trim().parse::<f64>().ok()? / 100.0,
        None => text.trim().parse::<f64>().ok()?,
    };
    (0.0..=1.0).contains(&share).then_some(share)
}

/// `64kb`, `1mb` or a number of bytes, as tc reads sizes (k = 1024).
fn parse_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let (number, scale) = [("kb", 1024), ("mb", 1024 * 1024), ("b", 1)]
        .iter()
        .find_map(|(unit, scale)| lower.strip_suffix(unit).map(|number| (number, *scale)))
        .unwrap_or((lower.as_str(), 1));
    number.trim().parse::<u64>().ok().filter(|&size| size > 0).and_then(|size| size.checked_mul(scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_delays_parse_in_tc_s_units() {
        assert_eq!(parse_rate("200mbit").unwrap(), 200e6);
        assert_eq!(parse_rate("1Gbit").unwrap(), 1e9);
        assert_eq!(parse_rate("500kbit").unwrap(), 500e3);
        assert_eq!(parse_rate("64000").unwrap(), 64000.0);
        assert!(parse_rate("fast").unwrap_err().to_string().contains("expected a rate such as 200mbit"));
        assert_eq!(
            parse_rate("0mbit").unwrap_err().to_string(),
            "'0mbit' is under 1 bit/s: a link carries at least 1bit"
        );
        assert!(parse_rate("0.4bit").unwrap_err().to_string().starts_with("'0.4bit' is under 1 bit/s"));
        assert_eq!(parse_rate("1bit").unwrap(), 1.0);
        assert!(parse_rate("-1mbit").unwrap_err().to_string().contains("expected a rate such as 200mbit"));
        assert_eq!(parse_duration("5ms").unwrap(), Duration::from_millis(5));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_millis(2));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("-1ms").unwrap_err().to_string().contains("expected a delay"));
        assert!(parse_duration("1e300s").unwrap_err().to_string().contains("expected a delay"));
        assert!(LinkSettings::parse("burst=99999999999999999999mb").is_err());
        assert!(LinkSettings::parse("burst=18014398509481984mb").is_err());
        assert_eq!(format_rate(200_000_000), "200mbit");
        assert_eq!(format_rate(1_500_000), "1500kbit");
        assert_eq!(format_rate(123), "123bit");
    }

    #[test]
    fn settings_parse_from_the_command_line_with_clear_errors() {
        let settings =
            LinkSettings::parse("rate=200mbit, delay=5ms,jitter=1ms,loss=1%,queue=50ms,burst=32kb").unwrap();
        assert_eq!(
            settings,
            LinkSettings {
                rate: Some(200_000_000),
                delay: Some(Duration::from_millis(5)),
                jitter: Some(Duration::from_millis(1)),
                loss: Some(0.01),
                queue: Some(Duration::from_millis(50)),
                burst: Some(32 * 1024),
            }
        );
        assert_eq!(LinkSettings::parse("loss=0.25").unwrap().loss, Some(0.25));
        assert_eq!(
            LinkSettings::parse("rate=0.4bit").unwrap_err().to_string(),
            "rate = '0.4bit': expected a rate such as 200mbit, 1gbit or 500kbit, at least 1bit"
        );
        assert_eq!(
            LinkSettings::parse("speed=1gbit").unwrap_err().to_string(),
            "unknown link setting 'speed' (expected one of rate, delay, jitter, loss, queue, burst)"
        );
        assert_eq!(
            LinkSettings::parse("loss=150%").unwrap_err().to_string(),
            "loss = '150%': expected a share of frames such as 1%, 0.5% or 0.01"
        );
        assert_eq!(
            LinkSettings::parse("rate").unwrap_err().to_string(),
            "'rate': expected KEY=VALUE, such as rate=200mbit"
        );
        assert!(LinkSettings::parse("queue=0")
            .unwrap_err()
            .to_string()
            .starts_with("queue = '0': expected a time"));
        assert_eq!(
            parse_rank_settings("x:rate=1mbit").unwrap_err().to_string(),
            "'x:rate=1mbit': 'x' is not a rank number"
        );
    }

    #[test]
    fn a_rank_overrides_only_what_it_sets() {
        let mut topology = Topology::default();
        topology.apply(
            &LinkSettings::parse("rate=200mbit,delay=5ms").unwrap(),
            &[parse_rank_settings("3:rate=20mbit").unwrap()],
        );
        let links = topology.links(4).unwrap();
        assert_eq!(links[0].rate, Some(200_000_000));
        assert_eq!(links[3].rate, Some(20_000_000));
        assert_eq!(links[3].delay, Duration::from_millis(5));
        assert_eq!(links[3].queue, Duration::from_millis(100));
        assert!(links[3].is_impaired());
        assert_eq!(
            topology.links(3).unwrap_err().to_string(),
            "a link is set for rank 3, but the ranks are 0 to 2"
        );
        assert!(!Link { rate: Some(1), ..Link::default() }.is_impaired());
    }

    #[test]
    fn a_topology_file_gives_the_same_and_the_command_line_wins() {
        let mut topology = Topology::from_ini(
            "[link]\nrate = 200mbit\ndelay = 2ms\nloss = 1%\n\n[rank.1]\nrate = 50mbit\njitter = 1ms\n",
        )
        .unwrap();
        topology
            .apply(&LinkSettings::parse("delay=3ms").unwrap(), &[parse_rank_settings("1:loss=0").unwrap()]);
        let links = topology.links(2).unwrap();
        assert_eq!(links[0].to_string(), "200mbit, delay 3ms, loss 1%");
        assert_eq!(links[1].to_string(), "50mbit, delay 3ms ± 1ms");
        assert_eq!(
            Topology::from_ini("[link]\nrat = 1mbit\n").unwrap_err().to_string(),
            "[link] unknown link setting 'rat' (expected one of rate, delay, jitter, loss, queue, burst)"
        );
        assert_eq!(
            Topology::from_ini("[links]\nrate = 1mbit\n").unwrap_err().to_string(),
            "unknown section [links] (expected [link], [rank.N], [racks] and [uplink])"
        );
        assert_eq!(
            Topology::from_ini("[rank.x]\nrate = 1mbit\n").unwrap_err().to_string(),
            "[rank.x]: expected a rank number"
        );
    }

    #[test]
    fn racks_their_switches_and_uplinks_parse_with_clear_errors() {
        let topology = Topology::from_ini(
            "[link]\nrate = 40mbit\n[racks]\ncount = 2\nswitches = server\n[uplink]\nrate = 20mbit\nqueue = 50ms\n",
        )
        .unwrap();
        assert_eq!(topology.racks, Some(2));
        assert_eq!(topology.switch_links, Some(SwitchLinks::Server));
        let uplink = topology.uplink_link().unwrap();
        assert_eq!((uplink.rate, uplink.queue), (Some(20_000_000), Duration::from_millis(50)));
        assert!(!uplink.is_impaired());
        assert_eq!(Topology::default().switch_links, None);
        assert_eq!(Topology::default().uplink_link().unwrap().rate, None);
        assert_eq!(
            Topology::from_ini("[racks]\ncount = 0\n").unwrap_err().to_string(),
            "[racks] count = '0': expected a number of racks from 1"
        );
        assert_eq!(
            Topology::from_ini("[racks]\nswitches = asic\n").unwrap_err().to_string(),
            "[racks] switches = 'asic': expected ideal or server"
        );
        assert_eq!(
            Topology::from_ini("[racks]\nsize = 4\n").unwrap_err().to_string(),
            "[racks] size = '4': expected a key count or switches"
        );
        let lossy = Topology::from_ini("[uplink]\nrate = 1mbit\nloss = 1%\n").unwrap();
        assert_eq!(
            lossy.uplink_link().unwrap_err().to_string(),
            "[uplink] sets loss: an uplink takes a rate, queue and burst only (delay and loss belong to the \
             racks' links)"
        );
    }

    #[test]
    fn a_flat_network_refuses_the_sections_of_racks() {
        let uplink = Topology::from_ini("[uplink]\nrate = 20mbit\n").unwrap();
        assert_eq!(
            uplink.check_flat().unwrap_err().to_string(),
            "[uplink] describes a network of racks, and this one is flat: give [racks] count (or --racks)"
        );
        let switches = Topology::from_ini("[racks]\nswitches = ideal\n").unwrap();
        assert_eq!(
            switches.check_flat().unwrap_err().to_string(),
            "[racks] switches describes a network of racks, and this one is flat: give [racks] count (or \
             --racks)"
        );
        // With a count, from the file or the command line, they are the racks' settings.
        Topology::from_ini("[racks]\ncount = 2\nswitches = server\n[uplink]\nrate = 20mbit\n")
            .unwrap()
            .check_flat()
            .unwrap();
        Topology { racks: Some(2), ..uplink }.check_flat().unwrap();
        Topology::from_ini("[link]\nrate = 20mbit\n").unwrap().check_flat().unwrap();
    }

    #[test]
    fn the_shipped_topology_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/topology-straggler.cfg");
        let links = Topology::from_file(&path).unwrap().links(4).unwrap();
        assert_eq!(links[0].to_string(), "100mbit, delay 2ms, loss 1%");
        assert_eq!(links[3].to_string(), "20mbit, delay 2ms, loss 1%");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/topology-racks.cfg");
        let racks = Topology::from_file(&path).unwrap();
        assert_eq!((racks.racks, racks.switch_links), (Some(2), Some(SwitchLinks::Ideal)));
        assert_eq!(racks.uplink_link().unwrap().rate, Some(20_000_000));
        assert_eq!(racks.links(4).unwrap()[3].to_string(), "40mbit, delay 0ns");
    }
}
