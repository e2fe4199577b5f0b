//! What a key accepts: how its text is checked and read, how its value is written back,
//! and what an error message says it expects. A field's Rust type only converts (`Field`);
//! every range and choice is the kind's.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// The longest time a timeout may be: 30 days.
const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 3600);

/// The unit a time is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    Seconds,
    Milliseconds,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Seconds => "seconds",
            Unit::Milliseconds => "milliseconds",
        }
    }

    fn per_second(self) -> f64 {
        match self {
            Unit::Seconds => 1.0,
            Unit::Milliseconds => 1e3,
        }
    }

    /// `time` in this unit, as text that reads back to the same time.
    fn show(self, time: Duration) -> String {
        (time.as_nanos() as f64 / (1e9 / self.per_second())).to_string()
    }

    /// The time `count` of this unit make, if it is one.
    fn time(self, count: f64) -> Option<Duration> {
        Duration::try_from_secs_f64(count / self.per_second()).ok()
    }
}

/// What a key accepts. Values are trimmed before they are read; messages show them as
/// written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    /// An integer from `min` to `max`.
    Integer { min: u64, max: u64 },
    /// A number of bytes from `min` to `max`, or of at least `min` where `max` is None.
    Bytes { min: u64, max: Option<u64> },
    /// A power of two from `min` to `max`.
    PowerOfTwo { min: u64, max: u64 },
    /// A TCP or UDP port, 1 to 65535.
    Port,
    /// A number of `unit`: 0, or from `min` to `max`.
    Real { unit: &'static str, min: f64, max: f64 },
    /// A probability from 0 to 1.
    Probability,
    /// A time in `unit`, above 0 and at most 30 days; where `zero` says what 0 means, 0
    /// too (written `0`).
    Timeout { unit: Unit, zero: Option<&'static str> },
    /// A time in `unit` from 0 to `max`.
    Delay { unit: Unit, max: Duration },
    /// true or false (also 1 or 0, yes or no, on or off, in any case).
    Bool,
    /// One of `choices`, quoted in messages where `quoted`.
    Choice { choices: &'static [&'static str], quoted: bool },
    /// An IP address.
    Ip,
    /// An IP address and a port.
    Address,
    /// An IP address and a port, or nothing (a service left off).
    OptionalAddress,
    /// A host name or IP address: any text but an empty one (resolved where it is used).
    Host,
    /// A name of 1 to `max` bytes.
    Name { max: usize },
    /// Any text, empty too.
    Text,
    /// IP networks (address/prefix length), comma-separated; none when empty.
    Networks,
    /// A MAC address, six hexadecimal bytes separated by colons, or nothing.
    Mac,
    /// Addresses HOST:PORT (a name, an IPv4 address, or an IPv6 one in brackets), comma-separated,
    /// each once; none when empty.
    HostPorts,
}

/// A key's value, as its kind reads it from text and its field holds it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Integer(u64),
    Real(f64),
    Time(Duration),
    Bool(bool),
    Text(String),
    Ip(IpAddr),
    Address(SocketAddr),
    OptionalAddress(Option<SocketAddr>),
    Mac(Option<[u8; 6]>),
    Networks(Vec<ipnet::IpNet>),
    HostPorts(Vec<String>),
}

impl Kind {
    /// Reads `text`, trimmed; None where this kind refuses it.
    pub(crate) fn parse(&self, text: &str) -> Option<Value> {
        let text = text.trim();
        let integer = |min: u64, max: u64| text.parse::<u64>().ok().filter(|n| (min..=max).contains(n));
        let real = || text.parse::<f64>().ok();
        match *self {
            Kind::Integer { min, max } => integer(min, max).map(Value::Integer),
            Kind::Bytes { min, max } => integer(min, max.unwrap_or(u64::MAX)).map(Value::Integer),
            Kind::PowerOfTwo { min, max } => {
                integer(min, max).filter(|n| n.is_power_of_two()).map(Value::Integer)
            }
            Kind::Port => integer(1, 65535).map(Value::Integer),
            Kind::Real { min, max, .. } => {
                real().filter(|x| *x == 0.0 || (min..=max).contains(x)).map(Value::Real)
            }
            Kind::Probability => real().filter(|x| (0.0..=1.0).contains(x)).map(Value::Real),
            Kind::Timeout { unit, zero } => {
                if zero.is_some() && text == "0" {
                    return Some(Value::Time(Duration::ZERO));
                }
                let time = unit.time(real().filter(|x| *x > 0.0)?)?;
                (time <= MAX_TIMEOUT).then_some(Value::Time(time))
            }
            Kind::Delay { unit, max } => {
                let count = real().filter(|x| (0.0..=max.as_secs_f64() * unit.per_second()).contains(x))?;
                unit.time(count).map(Value::Time)
            }
            Kind::Bool => match text.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Some(Value::Bool(true)),
                "false" | "0" | "no" | "off" => Some(Value::Bool(false)),
                _ => None,
            },
            Kind::Choice { choices, .. } => choices.contains(&text).then(|| Value::Text(text.into())),
            Kind::Ip => text.parse().ok().map(Value::Ip),
            Kind::Address => text.parse().ok().map(Value::Address),
            Kind::OptionalAddress if text.is_empty() => Some(Value::OptionalAddress(None)),
            Kind::OptionalAddress => text.parse().ok().map(|address| Value::OptionalAddress(Some(address))),
            Kind::Host => (!text.is_empty()).then(|| Value::Text(text.into())),
            Kind::Name { max } => (1..=max).contains(&text.len()).then(|| Value::Text(text.into())),
            Kind::Text => Some(Value::Text(text.into())),
            Kind::Networks => text
                .split(',')
                .map(str::trim)
                .filter(|network| !network.is_empty())
                .map(|network| network.parse().ok())
                .collect::<Option<Vec<_>>>()
                .map(Value::Networks),
            Kind::Mac if text.is_empty() => Some(Value::Mac(None)),
            Kind::Mac => parse_mac(text).map(|mac| Value::Mac(Some(mac))),
            Kind::HostPorts => {
                let addresses: Vec<String> = text
                    .split(',')
                    .map(str::trim)
                    .filter(|address| !address.is_empty())
                    .map(String::from)
                    .collect();
                let unique =
                    addresses.iter().collect::<std::collections::HashSet<_>>().len() == addresses.len();
                (unique && addresses.iter().all(|address| is_host_port(address)))
                    .then_some(Value::HostPorts(addresses))
            }
        }
    }

    /// `value` as text that [`Kind::parse`] reads back to it.
    pub(crate) fn show(&self, value: &Value) -> String {
        match value {
            Value::Integer(n) => n.to_string(),
            Value::Real(x) => x.to_string(),
            Value::Time(time) => match *self {
                Kind::Timeout { unit, .. } | Kind::Delay { unit, .. } => unit.show(*time),
                _ => Unit::Seconds.show(*time),
            },
            Value::Bool(b) => b.to_string(),
            Value::Text(text) => text.clone(),
            Value::Ip(ip) => ip.to_string(),
            Value::Address(address) => address.to_string(),
            Value::OptionalAddress(address) => address.map_or_else(String::new, |a| a.to_string()),
            Value::Networks(networks) => {
                networks.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
            }
            Value::HostPorts(addresses) => addresses.join(","),
            Value::Mac(None) => String::new(),
            Value::Mac(Some(mac)) => {
                mac.iter().map(|byte| format!("{byte:02x}")).collect::<Vec<_>>().join(":")
            }
        }
    }

    /// What this kind accepts, as error messages end: "expected {this}".
    pub(crate) fn expected(&self) -> String {
        match *self {
            Kind::Integer { min, max } => format!("an integer from {min} to {max}"),
            Kind::Bytes { min, max: Some(max) } => format!("bytes, an integer from {min} to {max}"),
            Kind::Bytes { min, max: None } => format!("bytes, an integer of at least {min}"),
            Kind::PowerOfTwo { min, max } => format!("a power of two from {min} to {max}"),
            Kind::Port => "a port from 1 to 65535".into(),
            Kind::Real { unit, min, max } => format!("{unit}: 0, or from {} to {}", number(min), number(max)),
            Kind::Probability => "a probability from 0 to 1".into(),
            Kind::Timeout { unit, zero: None } => format!("{}, above 0 and at most 30 days", unit.name()),
            Kind::Timeout { unit, zero: Some(meaning) } => {
                format!("{}, at most 30 days; 0 {meaning}", unit.name())
            }
            Kind::Delay { unit, max } => format!("{}, from 0 to {}", unit.name(), unit.show(max)),
            Kind::Bool => "true or false".into(),
            Kind::Choice { choices, quoted } => {
                let shown: Vec<String> =
                    choices.iter().map(|c| if quoted { format!("'{c}'") } else { c.to_string() }).collect();
                match shown.split_last() {
                    Some((last, [])) => last.clone(),
                    Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                    None => String::new(),
                }
            }
            Kind::Ip => "an IP address".into(),
            Kind::Address => "an address IP:PORT".into(),
            Kind::OptionalAddress => "an address IP:PORT, or nothing".into(),
            Kind::Host => "a host name or IP address".into(),
            Kind::Name { max } => format!("a name of 1 to {max} bytes"),
            Kind::Text => "text".into(),
            Kind::Networks => "IP networks, comma-separated (10.0.0.0/24,fd00::/64), or nothing".into(),
            Kind::Mac => "a MAC address (six hexadecimal bytes: 02:00:00:00:00:01) or nothing".into(),
            Kind::HostPorts => {
                "addresses HOST:PORT, comma-separated, each once (h1:50099,10.0.0.2:50099,[fd00::2]:50099), \
                 or nothing"
                    .into()
            }
        }
    }
}

/// Whether `address` is HOST:PORT: a host without white space or commas (an IPv6 address
/// in brackets) and a port from 1 to 65535.
fn is_host_port(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else { return false };
    let host_ok = match host.strip_prefix('[').and_then(|inner| inner.strip_suffix(']')) {
        Some(inner) => inner.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && !host.contains(|c: char| c.is_whitespace() || c == ':' || c == '[' || c == ']')
        }
    };
    host_ok && port.parse::<u16>().is_ok_and(|port| port > 0)
}

/// Six hexadecimal bytes separated by colons.
fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().filter(|part| (1..=2).contains(&part.len()))?;
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// A bound as messages write it: large ones in exponent notation (1e9).
fn number(x: f64) -> String {
    if x >= 1e6 {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

/// A field type a key can be stored in, converted from and to the value its kind reads.
pub(crate) trait Field: Sized {
    fn to_value(&self) -> Value;
    /// None where the value does not fit (a kind that does not suit the field).
    fn from_value(value: Value) -> Option<Self>;
}

macro_rules! integer_fields {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn to_value(&self) -> Value {
                Value::Integer(*self as u64)
            }
            fn from_value(value: Value) -> Option<Self> {
                let Value::Integer(n) = value else { return None };
                n.try_into().ok()
            }
        }
    )*};
}

integer_fields!(u8, u16, u32, u64, usize);

/// Fields that hold a value as it is, in the variant named.
macro_rules! plain_fields {
    ($($t:ty => $variant:ident),*) => {$(
        impl Field for $t {
            fn to_value(&self) -> Value {
                Value::$variant(self.clone())
            }
            fn from_value(value: Value) -> Option<Self> {
                let Value::$variant(v) = value else { return None };
                Some(v)
            }
        }
    )*};
}

plain_fields!(
    f64 => Real, Duration => Time, bool => Bool, String => Text, IpAddr => Ip, SocketAddr => Address,
    Option<SocketAddr> => OptionalAddress, Option<[u8; 6]> => Mac, Vec<ipnet::IpNet> => Networks,
    Vec<String> => HostPorts
);

/// Declares an enum whose values a key names, each variant with its name once:
/// `/// doc  pub enum Name { /// doc  Variant = "name", ... }`. Makes the enum, `NAMES`
/// (what the key accepts, in declaration order, which its `Kind::Choice` lists and error
/// messages show), `from_name`, `Display` and its `Field`.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $enum:ident {
            $(
                $(#[$variant_meta:meta])*
                $variant:ident = $name:literal,
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $enum {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $enum {
            /// Every value's name, in declaration order.
            pub(crate) const NAMES: &'static [&'static str] = &[$($name),+];

            /// The value named `name`.
            fn from_name(name: &str) -> Option<$enum> {
                match name {
                    $($name => Some($enum::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $enum {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(match self {
                    $($enum::$variant => $name,)+
                })
            }
        }

        impl $crate::kind::Field for $enum {
            fn to_value(&self) -> $crate::kind::Value {
                $crate::kind::Value::Text(self.to_string())
            }
            fn from_value(value: $crate::kind::Value) -> Option<Self> {
                let $crate::kind::Value::Text(name) = value else { return None };
                $enum::from_name(&name)
            }
        }
    };
}

pub(crate) use named_enum;

#[cfg(test)]
mod tests {
    use super::*;

    named_enum! {
        /// An enum declared as the sections' are.
        pub enum Fruit {
            Apple = "apple",
            BloodOrange = "blood_orange",
        }
    }

    #[test]
    fn a_named_enum_reads_and_writes_its_names_and_lists_them_in_order() {
        assert_eq!(Fruit::NAMES, ["apple", "blood_orange"]);
        assert_eq!(Fruit::from_name("blood_orange"), Some(Fruit::BloodOrange));
        assert_eq!(Fruit::from_name("Apple"), None, "names are matched exactly");
        assert_eq!(Fruit::from_name("pear"), None);
        assert_eq!(Fruit::BloodOrange.to_string(), "blood_orange");
        for fruit in [Fruit::Apple, Fruit::BloodOrange] {
            assert_eq!(fruit.to_value(), Value::Text(fruit.to_string()));
            assert_eq!(Fruit::from_value(fruit.to_value()), Some(fruit));
        }
        assert_eq!(Fruit::from_value(Value::Integer(0)), None);
        let kind = Kind::Choice { choices: Fruit::NAMES, quoted: true };
        assert_eq!(kind.expected(), "'apple' or 'blood_orange'");
        assert_eq!(kind.parse(" apple "), Some(Value::Text("apple".into())));
    }

    #[test]
    fn choices_are_listed_with_commas_and_a_final_or() {
        let choice = |choices, quoted| Kind::Choice { choices, quoted }.expected();
        assert_eq!(choice(&["a"], true), "'a'");
        assert_eq!(choice(&["a", "b"], true), "'a' or 'b'");
        assert_eq!(choice(&["a", "b", "c"], false), "a, b or c");
    }

    #[test]
    fn mac_addresses_read_back_as_shown() {
        for (text, mac) in [("02:00:0a:FF:00:01", Some([2, 0, 10, 255, 0, 1])), ("", None)] {
            let value = Kind::Mac.parse(text).unwrap();
            assert_eq!(value, Value::Mac(mac));
            assert_eq!(Kind::Mac.parse(&Kind::Mac.show(&value)), Some(value));
        }
        for bad in [
            "02:00:0a:ff:00",
            "02:00:0a:ff:00:01:02",
            "02:00:0a:ff:00:zz",
            "002:0:0:0:0:1",
            "02-00-0a-ff-00-01",
        ] {
            assert_eq!(Kind::Mac.parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn networks_read_back_as_shown() {
        let value = Kind::Networks.parse(" 10.0.0.0/24, fd00::/64 ").unwrap();
        let Value::Networks(networks) = &value else { panic!("{value:?}") };
        assert_eq!(networks.len(), 2);
        assert_eq!(Kind::Networks.show(&value), "10.0.0.0/24,fd00::/64");
        assert_eq!(Kind::Networks.parse(""), Some(Value::Networks(Vec::new())));
        for bad in ["10.0.0.0", "10.0.0.0/33", "10.0.0.0/24,x"] {
            assert_eq!(Kind::Networks.parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn times_read_back_as_shown() {
        let kinds = [
            Kind::Timeout { unit: Unit::Milliseconds, zero: None },
            Kind::Timeout { unit: Unit::Seconds, zero: Some("never") },
            Kind::Delay { unit: Unit::Milliseconds, max: Duration::from_secs(10) },
        ];
        for kind in kinds {
            for text in ["0.001", "2.5", "10", "0.25", "10000"] {
                let value = kind.parse(text).unwrap();
                assert_eq!(kind.parse(&kind.show(&value)), Some(value), "{kind:?} {text}");
            }
        }
        let zero = kinds[1];
        assert_eq!(zero.parse(" 0 "), Some(Value::Time(Duration::ZERO)));
        assert_eq!(zero.parse("0.0"), None, "only 0 itself means zero");
        assert_eq!(kinds[0].parse("0"), None);
        assert_eq!(kinds[0].parse("NaN"), None);
        assert_eq!(kinds[2].parse("10000.001"), None);
    }
}
